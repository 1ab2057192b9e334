// pretrain from a Hugging Face directory (PretrainOptions::hf_dir, kiln pretrain --hf; issue 20):
// the run takes the directory's config and weights (step 1's loss is the loaded model's loss on
// the first batch), tokenises text with its tokenizer.json, refuses shards of another tokenizer,
// records the directory in its checkpoints, and resumes bit for bit.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "models/data.h"
#include "models/hf.h"
#include "models/hf_test_util.h"
#include "models/run_config.h"
#include "models/trainer.h"
#include "nn/safetensors.h"
#include "pretrain/prepare.h"
#include "tensor/ops.h"
#include "test_util.h"
#include "text/bpe_trainer.h"
#include "text/tokenizer.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using hftest::TempDir;
using hftest::write_text;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The first 24 KB of the bundled corpus.
std::string corpus() {
  return read_text(fs::path(KILN_SOURCE_DIR) / "data" / "tinyshakespeare.txt").substr(0, 24'000);
}

// A tiny Llama checkpoint as transformers writes one: config.json, shards and their index, and a
// tokenizer.json (a 300-id BPE trained on the corpus; the model has 320 ids).
class TrainerHfTest : public ::testing::Test {
 protected:
  void SetUp() override {
    hf_ = (tmp_ / "tiny-llama-hf").string();
    manual_seed(7);
    GPT model(ModelConfig::from_name("tiny-llama"));
    save_hf_checkpoint(*model, hf_, /*max_shard_bytes=*/100'000);
    text::BpeTrainerOptions bpe;
    bpe.vocab_size = 300;
    tokenizer_json_ = text::train_bpe({corpus()}, bpe);
    write_text(fs::path(hf_) / "tokenizer.json", tokenizer_json_);
    data_ = (tmp_ / "corpus.txt").string();
    write_text(data_, corpus());
  }

  PretrainOptions options(const std::string& out) const {
    PretrainOptions o;
    o.hf_dir = hf_;
    o.data_path = data_;
    o.batch_size = 2;
    o.seq_len = 32;
    o.max_steps = 4;
    o.lr = 1e-3;
    o.min_lr = 1e-4;
    o.warmup_steps = 1;
    o.eval_interval = 0;
    o.eval_batches = 1;
    o.log_interval = 1;
    o.device = Device(kCPU);
    o.progress_bar = false;
    o.out_dir = out.empty() ? "" : (tmp_ / out).string();
    return o;
  }

  TempDir tmp_;
  std::string hf_, data_, tokenizer_json_;
};

TEST_F(TrainerHfTest, StepOneLossIsTheLoadedModelsLoss) {
  std::ostringstream log;
  const PretrainSummary s = pretrain(options("out"), log);
  ASSERT_EQ(s.train_losses.size(), 4u) << log.str();
  EXPECT_NE(log.str().find("initial weights: " + hf_), std::string::npos) << log.str();

  // The same first batch, from the text tokenised by the directory's tokenizer, through the
  // model loaded eagerly.
  const auto tok = text::Tokenizer::from_json(tokenizer_json_, "tokenizer.json");
  const std::vector<int64_t> ids = tok.encode(corpus(), /*add_special_tokens=*/false);
  const TokenDataset ds =
      TokenDataset::from_tokens(std::vector<uint32_t>(ids.begin(), ids.end()), 0.1, data_);
  const auto [x, y] = ds.batch(Split::kTrain, 2, 32, Device(kCPU), 1337, 0);
  GPT loaded = load_hf_checkpoint(hf_);
  const double expected = loaded->loss(x, y).item<double>();
  EXPECT_EQ(s.train_losses[0], expected);
  // The loss of random weights on 320 ids is about log(320) = 5.77: this must be that model's.
  EXPECT_GT(s.train_losses[0], 4.0);

  // The checkpoint names the directory and loads with its config.
  const auto info = read_checkpoint_info((tmp_ / "out").string());
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->hf_dir.value_or(""), hf_);
  EXPECT_EQ(info->config, "tiny-llama-hf");
  GPT reloaded = load_checkpoint((tmp_ / "out").string(), Device(kCPU));
  EXPECT_EQ(reloaded->config().n_layer, loaded->config().n_layer);
  // run.toml says model.hf (not a name that is not registered) and reads back.
  const std::string toml = read_text(tmp_ / "out" / kRunConfigFile);
  EXPECT_NE(toml.find("hf = \"" + hf_ + "\""), std::string::npos) << toml;
  EXPECT_NE(toml.find("# name unset"), std::string::npos) << toml;
  EXPECT_EQ(read_run_config((tmp_ / "out" / kRunConfigFile).string()).options.hf_dir, hf_);
}

TEST_F(TrainerHfTest, ResumeIsExact) {
  std::ostringstream log;
  const PretrainSummary whole = pretrain(options("whole"), log);
  PretrainOptions first = options("parts");
  first.max_steps = 2;
  first.lr_decay_steps = 4;
  pretrain(first, log);
  PretrainOptions rest = options("parts");
  rest.resume = true;
  const PretrainSummary resumed = pretrain(rest, log);
  EXPECT_EQ(resumed.start_step, 2);
  ASSERT_EQ(resumed.train_losses.size(), 2u);
  EXPECT_EQ(resumed.train_losses[1], whole.train_losses[3]);
  EXPECT_EQ(read_text(tmp_ / "parts" / "model-00000004.safetensors"),
            read_text(tmp_ / "whole" / "model-00000004.safetensors"));

  // A resume must be from the same model: not a registered config, not another directory.
  PretrainOptions registered = options("parts");
  registered.hf_dir.clear();
  registered.config_name = "tiny-llama";
  registered.resume = true;
  registered.max_steps = 6;
  registered.lr_decay_steps = 4;
  EXPECT_KILN_ERROR(pretrain(registered, log), "was started from the Hugging Face directory " +
                                                   hf_ +
                                                   ", not from the registered config tiny-llama");
}

TEST_F(TrainerHfTest, ShardsMustBeOfTheModelsTokenizer) {
  std::ostringstream log;
  pretrain::PrepareOptions p;
  p.inputs = {data_};
  p.progress_bar = false;
  p.out_dir = (tmp_ / "byte-shards").string();
  pretrain::prepare(p, log);
  PretrainOptions o = options("");
  o.data_path = p.out_dir;
  EXPECT_KILN_ERROR(pretrain(o, log),
                    "the shards were made with another tokenizer (kiln's byte tokenizer) than the "
                    "model's " +
                        hf_ + "/tokenizer.json");

  p.tokenizer = hf_ + "/tokenizer.json";
  p.out_dir = (tmp_ / "shards").string();
  pretrain::prepare(p, log);
  o.data_path = p.out_dir;
  o.max_steps = 1;
  EXPECT_EQ(pretrain(o, log).steps, 1);
}

TEST_F(TrainerHfTest, BadDirectoriesAndOptions) {
  std::ostringstream log;
  PretrainOptions both = options("");
  both.config = ModelConfig::from_name("tiny-llama");
  EXPECT_KILN_ERROR(pretrain(both, log), "both config (tiny-llama) and hf_dir");

  PretrainOptions missing = options("");
  missing.hf_dir = (tmp_ / "nowhere").string();
  EXPECT_KILN_ERROR(pretrain(missing, log), "nowhere: is not a directory");

  // Text without a tokenizer.json to read it with.
  fs::remove(fs::path(hf_) / "tokenizer.json");
  EXPECT_KILN_ERROR(pretrain(options(""), log), "has no tokenizer.json to tokenise it with");

  // Another model's tokenizer: more ids than the model's vocabulary.
  text::BpeTrainerOptions big;
  big.vocab_size = 400;
  write_text(fs::path(hf_) / "tokenizer.json", text::train_bpe({corpus()}, big));
  EXPECT_KILN_ERROR(pretrain(options(""), log), "ids, more than the vocab_size 320");

  // Integer weights are no weights.
  const ModelConfig cfg = ModelConfig::from_name("tiny-llama");
  GPT model(cfg);
  TensorMap hf = to_hf_state_dict(*model);
  for (auto& [name, t] : hf) t = t.contiguous();
  hf["model.norm.weight"] = hf["model.norm.weight"].to(kInt32);
  TempDir ints;
  write_text(ints / "config.json", to_hf_config_json(cfg));
  save_safetensors(hf, (ints / "model.safetensors").string());
  PretrainOptions o = options("");
  o.hf_dir = ints.str();
  o.data_path = (tmp_ / "tokens.u16").string();
  write_text(o.data_path, std::string(4000, '\1'));
  EXPECT_KILN_ERROR(pretrain(o, log), "weights that are not floating point: model.norm.weight (");
}

}  // namespace
}  // namespace kiln::models
