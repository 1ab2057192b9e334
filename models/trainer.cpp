// `kiln pretrain` (models/trainer.h): the training loop, its data, progress and evaluation.
// Siblings: trainer_step.cpp (the step), trainer_checkpoint.cpp (checkpoint files),
// trainer_bench.cpp (`kiln bench`), trainer_internal.h (what they share).
#include "models/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>

#include "autograd/grad_mode.h"
#include "kernels/cuda.h"
#include "models/data.h"
#include "models/hf.h"
#include "models/run_config.h"
#include "models/trainer_internal.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "pretrain/metrics.h"
#include "pretrain/progress.h"
#include "pretrain/shard.h"
#include "tensor/deterministic.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "text/tokenizer.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using internal::check_output_dir;
using internal::check_precision;
using internal::DataParallel;
using internal::format_number;
using internal::log_compile_stats;
using internal::make_optimizer;
using internal::MatmulAutotuneScope;
using internal::param_dtype;
using internal::precision_loss;
using internal::remove_stale_temporaries;
using internal::save_checkpoint;
using internal::TrainStep;

// The validation batches are drawn from their own Philox stream, the same at every evaluation.
constexpr uint64_t kEvalSeedSalt = 0x9E3779B97F4A7C15ull;

// A loss or a norm for a message: "nan" and "inf" whatever their sign bit or the platform.
std::string format_value(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return format_number(v, 4);
}

// Whether two data paths name the same data: the same string, or the same existing file.
bool same_data(const std::string& a, const std::string& b) {
  if (a == b) return true;
  std::error_code ec;
  return fs::equivalent(a, b, ec) && !ec;
}

// A resume runs as the checkpoint's run did, unless the options allow changes: compares what
// the state file stores with the options and errors listing every difference; the schedule the
// run continues on goes into `o` (the stored one, or with allow_resume_changes the options').
// lr_decay_steps 0 means the stored schedule's length.
// With dist the batch compared is the global one (batch_size x world): a run may resume at another
// world size with the same global batch.
void check_resume_settings(const CheckpointInfo& info, PretrainOptions& o, int world,
                           std::ostream& log) {
  std::vector<std::string> changes;
  auto compare = [&](const char* what, const auto& stored, const auto& asked) {
    if (stored == asked) return;
    std::ostringstream s;
    s << what << " " << stored << " -> " << asked;
    changes.push_back(s.str());
  };
  if (info.data && !same_data(*info.data, o.data_path)) {
    changes.push_back("data " + *info.data + " -> " + o.data_path);
  }
  if (info.batch_size) {
    compare(world > 1 ? "batch_size (x world_size)" : "batch_size", *info.batch_size,
            o.batch_size * world);
  }
  if (info.seq_len) compare("seq_len", *info.seq_len, o.seq_len);
  if (info.grad_accum_steps)
    compare("grad_accum_steps", *info.grad_accum_steps, o.grad_accum_steps);
  if (info.seed) compare("seed", *info.seed, o.seed);
  const auto& sc = info.schedule;
  const int64_t asked_decay =
      o.lr_decay_steps > 0 ? o.lr_decay_steps : (sc ? sc->lr_decay_steps : o.max_steps);
  const int64_t asked_warmup = std::min(o.warmup_steps, asked_decay);
  if (sc) {
    compare("lr", sc->lr, o.lr);
    compare("min_lr", sc->min_lr, o.min_lr);
    compare("warmup_steps", sc->warmup_steps, asked_warmup);
    compare("lr_decay_steps", sc->lr_decay_steps, asked_decay);
  }
  std::string list;
  for (const std::string& c : changes) list += (list.empty() ? "" : ", ") + c;
  KILN_CHECK(changes.empty() || o.allow_resume_changes, "[pretrain] resume: the checkpoint in ",
             o.out_dir, " (step ", info.step,
             ") was trained with other settings than asked: ", list,
             "; resume with the checkpoint's settings, or allow the changes "
             "(allow_resume_changes; kiln pretrain --allow-resume-changes)");
  if (!changes.empty()) log << "resume with changes (allowed): " << list << "\n";
  if (sc && !o.allow_resume_changes) {
    o.lr = sc->lr;
    o.min_lr = sc->min_lr;
    o.warmup_steps = sc->warmup_steps;
  }
  o.lr_decay_steps = o.allow_resume_changes || !sc ? asked_decay : sc->lr_decay_steps;
  if (o.allow_resume_changes) o.warmup_steps = asked_warmup;
}

// What data_path names, checked before anything opens it: a FIFO would block the read, and a
// directory is read as token shards, so one without any is reported as a directory.
void check_data_path(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    bool has_shards = false;
    for (const auto& e : fs::directory_iterator(path, ec)) {
      has_shards = has_shards || e.path().extension() == pretrain::kShardExtension;
    }
    KILN_CHECK(has_shards, "[pretrain] data ", path, ": is a directory without token shards (*",
               pretrain::kShardExtension,
               " files, written by kiln prepare); give a text or token file, or a directory of "
               "shards");
    return;
  }
  std::vector<std::string> parts;
  if (is_shard_data(path)) {
    std::stringstream list(path);
    for (std::string part; std::getline(list, part, ',');) parts.push_back(part);
  } else {
    parts.push_back(path);
  }
  for (const std::string& part : parts) {
    // A missing file is the reader's error, which says how it would have read it.
    const fs::file_type type = fs::status(part, ec).type();
    if (type == fs::file_type::not_found) continue;
    KILN_CHECK(type != fs::file_type::directory, "[pretrain] data ", part,
               ": is a directory, not a file");
    KILN_CHECK(type != fs::file_type::fifo, "[pretrain] data ", part,
               ": is a FIFO, not a regular file (reading it would wait for a writer)");
    KILN_CHECK(type == fs::file_type::regular, "[pretrain] data ", part, ": is not a regular file");
  }
}

// The model of a run started from a Hugging Face directory (PretrainOptions::hf_dir): its
// config.json, named after the directory.
ModelConfig hf_model_config(const std::string& dir) {
  std::error_code ec;
  KILN_CHECK(fs::is_directory(dir, ec), "[pretrain] hf_dir ", dir,
             ": is not a directory (a Hugging Face checkpoint: config.json, model.safetensors or "
             "shards, tokenizer.json)");
  return ModelConfig::from_hf_config((fs::path(dir) / "config.json").string());
}

// The tokenizer.json of a Hugging Face directory, and its fingerprint (what kiln prepare writes
// into the shards it makes with it).
struct RunTokenizer {
  std::string path;
  text::Tokenizer tokenizer;
  uint64_t fingerprint = 0;
};
std::optional<RunTokenizer> hf_tokenizer(const std::string& dir) {
  if (dir.empty()) return std::nullopt;
  const std::string path = (fs::path(dir) / "tokenizer.json").string();
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  const std::string json = read_file(path, "pretrain");
  return RunTokenizer{path, text::Tokenizer::from_json(json, path),
                      pretrain::tokenizer_fingerprint(json)};
}

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << std::hex << std::setw(16) << std::setfill('0') << v;
  return s.str();
}

// Whether two hf_dir values name the same directory ("" names none).
bool same_dir(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return a == b;
  return same_data(a, b);
}

// The run's data: a text or token file (TokenDataset, batches a pure function of the step), or
// token shards (a ShardLoader, whose position goes into checkpoints).
class TrainData {
 public:
  // rank and world: this rank's part of every training batch (PretrainOptions::dist).
  // `tok`: the tokenizer of a run from a Hugging Face directory (its text is tokenised by it,
  // its shards must be of it).
  TrainData(const PretrainOptions& o, const ModelConfig& cfg, const RunTokenizer* tok, int rank = 0,
            int world = 1)
      : o_(o), rank_(rank), world_(world) {
    check_data_path(o.data_path);
    if (is_shard_data(o.data_path)) {
      auto set = std::make_shared<pretrain::ShardSet>(pretrain::ShardSet::open(o.data_path));
      KILN_CHECK(set->vocab_size() <= cfg.vocab_size, "[pretrain] ", o.data_path,
                 ": the shards come from a tokenizer of ", set->vocab_size(),
                 " ids, more than the vocab_size ", cfg.vocab_size, " of ", cfg.name);
      if (tok != nullptr) {
        const uint64_t theirs = set->tokenizer_fingerprint();
        KILN_CHECK(theirs == tok->fingerprint, "[pretrain] ", o.data_path,
                   ": the shards were made with another tokenizer (",
                   theirs == pretrain::kByteTokenizerFingerprint
                       ? std::string("kiln's byte tokenizer")
                       : "fingerprint " + hex(theirs),
                   ") than the model's ", tok->path, " (fingerprint ", hex(tok->fingerprint),
                   "): make them with kiln prepare --tokenizer ", tok->path);
      }
      pretrain::LoaderOptions lo;
      lo.seq_len = o.seq_len;
      lo.batch_size = o.batch_size;
      lo.rank = rank;
      lo.world_size = world;
      lo.seed = o.seed;
      lo.val_fraction = 0.1;
      lo.max_val_sequences = 1024;
      loader_.emplace(std::move(set), lo);
      return;
    }
    if (!o.hf_dir.empty() && resolve_token_format(o.data_path) == TokenFormat::kText) {
      KILN_CHECK(tok != nullptr, "[pretrain] ", o.data_path, ": a text file, and hf_dir ", o.hf_dir,
                 " has no tokenizer.json to tokenise it with; add the model's tokenizer.json, or "
                 "give token shards (kiln prepare) or a .bin/.u16/.u32 token file");
      KILN_CHECK(tok->tokenizer.vocab_size() <= cfg.vocab_size, "[pretrain] the tokenizer ",
                 tok->path, " has ", tok->tokenizer.vocab_size(), " ids, more than the vocab_size ",
                 cfg.vocab_size, " of the model (", cfg.name, "): it is another model's tokenizer");
      // One document without special tokens, as kiln prepare encodes each one.
      const std::vector<int64_t> ids =
          tok->tokenizer.encode(read_file(o.data_path, "pretrain"), /*add_special_tokens=*/false);
      text_.emplace(TokenDataset::from_tokens(std::vector<uint32_t>(ids.begin(), ids.end()), 0.1,
                                              o.data_path));
    } else {
      text_.emplace(TokenDataset::from_file(o.data_path));
    }
    KILN_CHECK(text_->max_token() < cfg.vocab_size, "[pretrain] ", o.data_path, " holds token id ",
               text_->max_token(), ", outside the vocabulary of ", cfg.name, " (vocab_size ",
               cfg.vocab_size, ")");
    KILN_CHECK(text_->size(Split::kTrain) >= o.seq_len + 1, "[pretrain] ", o.data_path,
               " is too short: ", text_->size(Split::kTrain),
               " training tokens for windows of seq_len + 1 = ", o.seq_len + 1);
  }

  std::string describe() const {
    std::ostringstream s;
    if (loader_) {
      s << loader_->shards().describe() << ": " << loader_->num_train_sequences()
        << " training and " << loader_->num_val_sequences() << " validation sequences";
    } else {
      s << o_.data_path << " (" << text_->size(Split::kTrain) << " training, "
        << text_->size(Split::kValidation) << " validation tokens)";
    }
    return s.str();
  }

  std::pair<Tensor, Tensor> train_batch(int64_t step, int64_t micro, Device device) {
    if (loader_) return loader_->next(device);
    const auto index = static_cast<uint64_t>((step - 1) * o_.grad_accum_steps + micro);
    if (world_ == 1) {
      return text_->batch(Split::kTrain, o_.batch_size, o_.seq_len, device, o_.seed, index);
    }
    // The global batch one process would draw, and this rank's rows of it.
    auto [x, y] =
        text_->batch(Split::kTrain, o_.batch_size * world_, o_.seq_len, device, o_.seed, index);
    return {x.narrow(0, rank_ * o_.batch_size, o_.batch_size).contiguous(),
            y.narrow(0, rank_ * o_.batch_size, o_.batch_size).contiguous()};
  }

  bool has_validation() const {
    return loader_ ? loader_->num_val_sequences() > 0
                   : text_->size(Split::kValidation) >= o_.seq_len + 1;
  }
  // The same fixed batches at every evaluation.
  std::pair<Tensor, Tensor> validation_batch(int64_t i, Device device) const {
    if (loader_) return loader_->validation_batch(i, o_.batch_size, device);
    return text_->batch(Split::kValidation, o_.batch_size, o_.seq_len, device,
                        o_.seed ^ kEvalSeedSalt, static_cast<uint64_t>(i));
  }

  void resume(const CheckpointInfo& info, const std::string& dir) {
    if (loader_) {
      KILN_CHECK(info.loader.has_value(), "[pretrain] the checkpoint in ", dir,
                 " has no loader position: it was trained on a text or token file, not on the "
                 "shards ",
                 o_.data_path);
      loader_->load_state(*info.loader);
    } else {
      KILN_CHECK(!info.loader.has_value(), "[pretrain] the checkpoint in ", dir,
                 " was trained on token shards, not on ", o_.data_path);
    }
  }
  std::optional<pretrain::LoaderState> loader_state() const {
    if (loader_) return loader_->state();
    return std::nullopt;
  }

 private:
  const PretrainOptions& o_;
  int rank_ = 0, world_ = 1;
  std::optional<TokenDataset> text_;
  std::optional<pretrain::ShardLoader> loader_;
};

// Bytes held by tensors on the GPU, the process's resident set on the CPU.
int64_t memory_bytes(Device device) {
  if (device.is_cuda()) return cuda::memory_stats().allocated;
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (statm >> size >> resident) return resident * ::sysconf(_SC_PAGESIZE);
  return 0;
}

// "312 MiB" / "1.25 GiB".
std::string format_memory(int64_t bytes) {
  const double mib = static_cast<double>(bytes) / (1 << 20);
  return mib >= 1024 ? format_number(mib / 1024, 2) + " GiB" : format_number(mib, 0) + " MiB";
}

// With dp, rank r evaluates the batches r, r + world, ... and the sums are added up: the same
// batches and mean as one process. Every rank runs as many forwards (FSDP's are collective); a
// rank without a batch of its own repeats its last one, not counted.
double evaluate(GPT& model, const TrainData& data, const PretrainOptions& o, Device device,
                DataParallel* dp = nullptr) {
  if (!data.has_validation()) return std::numeric_limits<double>::quiet_NaN();
  NoGradGuard no_grad;
  const int64_t rank = dp ? dp->rank() : 0, world = dp ? dp->world() : 1;
  const int64_t rounds = (o.eval_batches + world - 1) / world;
  double sum = 0;
  for (int64_t k = 0; k < rounds; ++k) {
    const int64_t i = k * world + rank;
    const auto batch = data.validation_batch(std::min(i, o.eval_batches - 1), device);
    auto loss = [&] { return precision_loss(model, batch.first, batch.second, o.precision); };
    const double v = (dp ? dp->forward(loss) : loss()).item<double>();
    if (i < o.eval_batches) sum += v;
  }
  if (dp) sum = dp->sum({sum})[0];
  return sum / static_cast<double>(o.eval_batches);
}

// SIGINT and SIGTERM during pretrain(): the handler records the signal and puts the default
// action back (a second Ctrl-C kills at once); the loop checks after every step, saves a
// checkpoint and returns.
std::atomic<int> g_stop_signal{0};
void on_stop_signal(int sig) {
  g_stop_signal.store(sig);
  std::signal(sig, SIG_DFL);
}

class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, &old_int_);
    ::sigaction(SIGTERM, &sa, &old_term_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &old_int_, nullptr);
    ::sigaction(SIGTERM, &old_term_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  int received() const { return g_stop_signal.load(); }

 private:
  struct sigaction old_int_ {};
  struct sigaction old_term_ {};
};

}  // namespace

Device default_device() { return cuda::is_available() ? Device(kCUDA) : Device(kCPU); }

void PretrainOptions::validate() const {
  KILN_CHECK(!data_path.empty(), "[pretrain] no data file given (data_path)");
  KILN_CHECK(batch_size > 0, "[pretrain] batch_size must be positive, got ", batch_size);
  KILN_CHECK(seq_len > 0, "[pretrain] seq_len must be positive, got ", seq_len);
  KILN_CHECK(max_steps > 0, "[pretrain] max_steps must be positive, got ", max_steps);
  KILN_CHECK(lr_decay_steps >= 0, "[pretrain] lr_decay_steps must be >= 0, got ", lr_decay_steps);
  KILN_CHECK(std::isfinite(lr) && lr > 0 && min_lr >= 0 && min_lr <= lr,
             "[pretrain] need 0 <= min_lr <= lr and lr > 0 (finite), got lr ", lr, " min_lr ",
             min_lr);
  int64_t tokens = 0;
  KILN_CHECK(!__builtin_mul_overflow(batch_size, seq_len, &tokens) &&
                 !__builtin_mul_overflow(tokens, grad_accum_steps, &tokens),
             "[pretrain] batch_size ", batch_size, " x seq_len ", seq_len, " x grad_accum_steps ",
             grad_accum_steps, " tokens per step overflows int64");
  KILN_CHECK(warmup_steps >= 0, "[pretrain] warmup_steps must be >= 0, got ", warmup_steps);
  KILN_CHECK(std::isfinite(weight_decay) && weight_decay >= 0,
             "[pretrain] weight_decay must be finite and >= 0, got ", weight_decay);
  KILN_CHECK(std::isfinite(grad_clip) && grad_clip >= 0,
             "[pretrain] grad_clip must be finite and >= 0 (0 = off), got ", grad_clip);
  KILN_CHECK(std::isfinite(eps) && eps >= 0, "[pretrain] eps must be finite and >= 0, got ", eps);
  KILN_CHECK(grad_accum_steps > 0, "[pretrain] grad_accum_steps must be positive, got ",
             grad_accum_steps);
  KILN_CHECK(log_interval > 0, "[pretrain] log_interval must be positive, got ", log_interval);
  KILN_CHECK(eval_interval >= 0 && eval_batches > 0,
             "[pretrain] eval_interval must be >= 0 and eval_batches positive");
  KILN_CHECK(checkpoint_interval >= 0, "[pretrain] checkpoint_interval must be >= 0");
  KILN_CHECK(keep_checkpoints >= 1, "[pretrain] keep_checkpoints must be >= 1, got ",
             keep_checkpoints);
  KILN_CHECK(!resume || !out_dir.empty(), "[pretrain] resume needs out_dir (the checkpoint)");
  check_precision(precision, "pretrain");
}

PretrainSummary pretrain(const PretrainOptions& options, std::ostream& log_stream) {
  const auto t_start = Clock::now();
  options.validate();
  PretrainOptions o = options;  // a resume replaces the schedule by the checkpoint's
  KILN_CHECK(o.hf_dir.empty() || !o.config, "[pretrain] both config (",
             o.config ? o.config->name : "", ") and hf_dir (", o.hf_dir,
             ") given: the model comes from one of them");
  const ModelConfig cfg = !o.hf_dir.empty() ? hf_model_config(o.hf_dir)
                          : o.config        ? *o.config
                                            : ModelConfig::from_name(o.config_name);
  cfg.validate();
  KILN_CHECK(o.seq_len <= cfg.block_size, "[pretrain] seq_len ", o.seq_len,
             " exceeds the block_size ", cfg.block_size, " of ", cfg.name);
  std::unique_ptr<DataParallel> dp;
  if (!o.dist.empty()) {
    DataParallel::check_mode(o.dist, o.compile, "pretrain");
    dp = std::make_unique<DataParallel>(o.dist, o.device.value_or(default_device()).is_cuda(),
                                        "pretrain");
  }
  const Device device = dp ? dp->device() : o.device.value_or(default_device());
  const bool rank0 = !dp || dp->rank() == 0;
  const int world = dp ? dp->world() : 1;
  // Rank 0 reports, writes the metrics and the checkpoints; the others' lines go nowhere.
  std::ostringstream null_log;
  std::ostream& log = rank0 ? log_stream : null_log;
  // Everything that can fail before training does so now: the output directory, an existing
  // state file in it (read even without resume: the first save would read it), the data.
  std::optional<CheckpointInfo> existing;
  if (!o.out_dir.empty()) {
    if (rank0) {
      check_output_dir(o.out_dir);
      remove_stale_temporaries(o.out_dir);
      internal::remove_superseded_files(o.out_dir);
    }
    if (dp) dp->barrier();
    existing = read_checkpoint_info(o.out_dir);
  }
  if (o.resume && existing) {
    check_resume_settings(*existing, o, world, log);
    if (existing->step >= o.max_steps) {
      log << "the checkpoint in " << o.out_dir << " is at step " << existing->step
          << (existing->step == o.max_steps ? ", the last step" : ", past the last step")
          << " (max_steps " << o.max_steps
          << "): nothing to train; raise max_steps to train further\n";
      PretrainSummary summary;
      summary.start_step = summary.steps = existing->step;
      summary.final_train_loss = summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
      summary.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
      return summary;
    }
  }
  const std::optional<RunTokenizer> tokenizer = hf_tokenizer(o.hf_dir);
  TrainData data(o, cfg, tokenizer ? &*tokenizer : nullptr, dp ? dp->rank() : 0, world);

  manual_seed(o.seed);
  GPT model(cfg, TensorOptions().device(device).dtype(param_dtype(o.precision)));
  model->train();
  auto opt = make_optimizer(model, o);
  const int64_t decay_steps = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.max_steps;
  // A run shorter than its warm-up warms up over the whole run.
  const int64_t warmup = std::min(o.warmup_steps, decay_steps);
  optim::CosineAnnealingWithWarmup sched(*opt, warmup, decay_steps, o.min_lr);

  PretrainSummary summary;
  std::optional<int64_t> last_saved;  // the step of the newest checkpoint of this run
  const bool resuming = o.resume && existing;
  // A run from a Hugging Face directory starts from its weights (a resume from the checkpoint's).
  if (!o.hf_dir.empty() && !resuming) {
    load_hf_weights(*model, o.hf_dir);
    log << "initial weights: " << o.hf_dir << "\n";
  }
  if (o.resume) {
    if (const auto& info = existing) {
      const std::string stored_hf = info->hf_dir.value_or("");
      KILN_CHECK(same_dir(stored_hf, o.hf_dir), "[pretrain] the checkpoint in ", o.out_dir,
                 " was started from ",
                 stored_hf.empty() ? "the registered config " + info->config
                                   : "the Hugging Face directory " + stored_hf,
                 ", not from ",
                 o.hf_dir.empty() ? "the registered config " + cfg.name
                                  : "the Hugging Face directory " + o.hf_dir);
      KILN_CHECK(info->config == cfg.name, "[pretrain] the checkpoint in ", o.out_dir,
                 " is of config ", info->config, ", not ", cfg.name);
      KILN_CHECK(info->precision == o.precision, "[pretrain] the checkpoint in ", o.out_dir,
                 " was trained in ", info->precision, ", not ", o.precision);
      data.resume(*info, o.out_dir);
      internal::load_model_file(model, (fs::path(o.out_dir) / info->model_file).string());
      if (!dp || !dp->sharded()) {  // FSDP loads the optimizer's shards once it has them
        internal::load_optimizer_file(*opt, (fs::path(o.out_dir) / info->optimizer_file).string());
      }
      last_saved = info->step;
      sched.set_last_epoch(info->step);
      summary.start_step = info->step;
      log << "resumed from " << o.out_dir << " at step " << info->step << "\n";
    } else {
      log << "no checkpoint in " << o.out_dir << ": starting from step 0\n";
    }
  }

  const int64_t num_parameters = model->num_parameters();  // before FSDP makes them shards
  if (dp) {
    dp->wrap(model, *opt);
    if (o.resume && existing && dp->sharded()) {
      internal::load_optimizer_file(*opt, (fs::path(o.out_dir) / existing->optimizer_file).string(),
                                    dp->state_layout());
    }
  }
  const int64_t tokens_per_step = o.batch_size * o.seq_len * o.grad_accum_steps * world;
  const double flops_per_token = cfg.flops_per_token(o.seq_len);
  const bool on_cuda = device.is_cuda();
  log << "pretraining " << cfg.name << " (" << num_parameters << " parameters) on "
      << data.describe() << "\n"
      << "device " << device.str() << ", precision " << o.precision << ", batch " << o.batch_size
      << " x seq " << o.seq_len << " x accum " << o.grad_accum_steps;
  if (dp) log << " x " << world << " ranks (" << dp->mode() << ")";
  log << " = " << tokens_per_step << " tokens/step, steps " << summary.start_step + 1 << ".."
      << o.max_steps << ", lr " << o.lr << " -> " << o.min_lr << " (warmup " << warmup << ")\n";

  if (o.compile) log << "the training step runs through kiln::compile\n";
  // For the run, restored afterwards (the caller's setting wins when it is already on).
  const DeterministicGuard deterministic(o.deterministic || are_deterministic_algorithms_enabled());
  if (o.deterministic) log << "deterministic algorithms (bit-exact on CUDA)\n";
  const MatmulAutotuneScope autotune(on_cuda, o.matmul_autotune);
  log << std::flush;
  const double clip = o.grad_clip > 0 ? o.grad_clip : std::numeric_limits<double>::infinity();
  // With skip_nonfinite the values are read before the update, which then runs eagerly.
  TrainStep train(model, *opt, o.precision, clip, o.compile,
                  /*update_inside=*/!o.skip_nonfinite, dp.get(), o.cuda_graphs);
  // What a non-finite value stops with: the step, what was not finite, what is kept.
  auto stop_nonfinite = [&](int64_t step, const std::string& what) {
    std::ostringstream kept;
    if (o.out_dir.empty()) {
      kept << "no checkpoints (no out_dir)";
    } else if (last_saved) {
      kept << "the last checkpoint in " << o.out_dir << " (step " << *last_saved << ") is kept";
    } else {
      kept << "this run saved no checkpoint in " << o.out_dir;
    }
    KILN_FAIL("[pretrain] step ", step, ": ", what, "; stopped before saving: ", kept.str(),
              ". Lower the lr, or skip such steps (skip_nonfinite; kiln pretrain "
              "--skip-nonfinite)");
  };
  pretrain::Progress progress(log, o.progress_bar.value_or(pretrain::Progress::is_terminal(log)),
                              static_cast<double>(o.max_steps), "step",
                              static_cast<double>(summary.start_step));
  std::optional<pretrain::MetricsLog> metrics;
  if (!o.out_dir.empty() && rank0) {
    metrics.emplace(o.out_dir, summary.start_step);
    // The options as run (a resume's schedule included): `kiln pretrain --config run.toml`
    // repeats the run.
    write_run_config(o.out_dir, o);
  }
  const StopSignals stop;
  double timed_seconds = 0, window_seconds = 0;
  int64_t timed_steps = 0, window_steps = 0;
  summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
  summary.steps = summary.start_step;
  for (int64_t step = summary.start_step + 1; step <= o.max_steps; ++step) {
    const auto t0 = Clock::now();
    const bool first = step == summary.start_step + 1;
    std::optional<internal::KernelSetupReading> setup_before;
    if (first && on_cuda) setup_before = internal::KernelSetupReading::now();
    const double lr = opt->get_lr();
    std::vector<Tensor> xs, ys;
    for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) {
      auto [x, y] = data.train_batch(step, micro, device);
      xs.push_back(std::move(x));
      ys.push_back(std::move(y));
    }
    if (o.before_step) o.before_step(step, model);
    const std::vector<Tensor> out = train(xs, ys);  // micro-batch losses, then the grad norm
    double loss_sum = 0;
    for (size_t i = 0; i + 1 < out.size(); ++i) loss_sum += out[i].item<double>();
    const double grad_norm = out.back().item<double>();  // of the global gradient
    // Under dist every rank decides alike: the mean loss over the ranks, and whether any rank
    // received a stop signal.
    int signal = stop.received();
    if (dp) {
      const std::vector<double> all = dp->sum({loss_sum, signal != 0 ? 1.0 : 0.0});
      loss_sum = all[0] / world;
      if (all[1] > 0 && signal == 0) signal = SIGTERM;
    }
    const bool finite = std::isfinite(loss_sum) && std::isfinite(grad_norm);
    if (!finite && !o.skip_nonfinite) {
      stop_nonfinite(step, "the loss is " + format_value(loss_sum) + " and the gradient norm " +
                               format_value(grad_norm) + " (not finite)");
    }
    if (!finite) {
      summary.skipped_steps.push_back(step);
    } else if (o.skip_nonfinite) {
      train.update();
    }
    sched.step();
    if (on_cuda) cuda::synchronize();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    if (setup_before) {
      std::ostringstream line;
      line << "first step done in " << std::fixed << std::setprecision(2) << dt
           << " s; its kernel setup: "
           << internal::kernel_setup_text(*setup_before, internal::KernelSetupReading::now());
      progress.line(line.str());
    }
    // The first step of a run pays for one-time setup (allocations, kernel loading).
    if (!first || o.max_steps == summary.start_step + 1) {
      timed_seconds += dt;
      ++timed_steps;
    }
    window_seconds += dt;
    ++window_steps;
    const double loss_value = loss_sum;
    summary.train_losses.push_back(loss_value);
    summary.final_train_loss = loss_value;
    summary.steps = step;
    if (!finite) {
      progress.line("step " + std::to_string(step) + " skipped: loss " + format_value(loss_value) +
                    ", grad norm " + format_value(grad_norm) + " (not finite; no update)");
    }

    // The values of this step; the throughput over the steps since the last logged line.
    const double tok_s = static_cast<double>(window_steps * tokens_per_step) / window_seconds;
    std::ostringstream values, speed;
    values << "loss " << format_value(loss_value) << " | lr " << format_number(lr, 2, true)
           << " | grad norm "
           << (std::isfinite(grad_norm) ? format_number(grad_norm, 3) : format_value(grad_norm));
    speed << static_cast<int64_t>(tok_s) << " tok/s";
    if (on_cuda) {
      speed << ", MFU "
            << format_number(100 * flops_per_token * tok_s / world / kPeakFlopsH100Bf16, 1) << "%";
    }
    const int64_t mem = memory_bytes(device);
    speed << ", mem " << format_memory(mem);
    // A skipped step's NaN has no place in the JSON lines or the plot.
    if (metrics && finite) metrics->train(step, loss_value, lr, grad_norm, tok_s, mem);
    progress.update(static_cast<double>(step), values.str() + " | " + speed.str());
    if (step % o.log_interval == 0 || step == o.max_steps || first) {
      progress.line(
          "step " + std::to_string(step) + "/" + std::to_string(o.max_steps) + " | " +
          values.str() + " | " + speed.str() + ", ETA " +
          pretrain::Progress::format_duration(progress.eta_seconds(static_cast<double>(step))));
      window_seconds = 0;
      window_steps = 0;
      if (metrics) metrics->write_plot();
    }
    const bool last = step == o.max_steps;
    if ((o.eval_interval > 0 && step % o.eval_interval == 0) || last) {
      summary.final_val_loss = evaluate(model, data, o, device, dp.get());
      progress.line("eval step " + std::to_string(step) + " | val loss " +
                    format_number(summary.final_val_loss, 4));
      if (metrics) {
        metrics->eval(step, summary.final_val_loss);
        metrics->write_plot();
      }
    }
    if (!o.out_dir.empty() &&
        ((o.checkpoint_interval > 0 && step % o.checkpoint_interval == 0) || last || signal)) {
      // A finite loss and gradient can still give non-finite weights (an lr that overflows the
      // update): they must not replace a good checkpoint.
      const std::vector<std::string> bad = internal::nonfinite_parameters(model);
      const bool any_bad = dp ? dp->sum({static_cast<double>(bad.size())})[0] > 0 : !bad.empty();
      if (any_bad) {
        std::string names;
        for (size_t i = 0; i < bad.size() && i < 3; ++i) names += (i ? ", " : "") + bad[i];
        if (bad.size() > 3) names += ", ... (" + std::to_string(bad.size()) + " parameters)";
        stop_nonfinite(step, "the weights are not finite after the update (" + names + ")");
      }
      if (dp) {
        // Full tensors, gathered by every rank, written by rank 0: the files one process writes.
        SafetensorsMetadata opt_metadata;
        const TensorMap model_state = dp->full_model_state(model);
        const TensorMap opt_state = dp->full_optimizer_state(*opt, &opt_metadata);
        if (rank0) {
          PretrainOptions global = o;  // the state stores the global batch
          global.batch_size *= world;
          save_checkpoint(
              o.out_dir, [&](const std::string& path) { save_safetensors(model_state, path); },
              [&](const std::string& path) { save_safetensors(opt_state, path, opt_metadata); },
              cfg.name, global, step, {o.lr, o.min_lr, warmup, decay_steps}, data.loader_state());
        }
        dp->barrier();
      } else {
        save_checkpoint(
            o.out_dir, [&](const std::string& path) { save(model, path); },
            [&](const std::string& path) { opt->save(path); }, cfg.name, o, step,
            {o.lr, o.min_lr, warmup, decay_steps}, data.loader_state());
      }
      last_saved = step;
      progress.line("checkpoint step " + std::to_string(step) + " -> " + o.out_dir);
    }
    if (signal != 0 && !last) {
      summary.stop_signal = signal;
      progress.line(std::string("stopped by ") + (signal == SIGINT ? "SIGINT" : "SIGTERM") +
                    " after step " + std::to_string(step) +
                    (o.out_dir.empty() ? "" : "; continue with --resume"));
      break;
    }
  }
  if (metrics) metrics->write_plot();
  progress.finish();
  log_compile_stats(train, log);
  if (const compiler::CompileStats* s = train.stats()) {
    summary.compile_traces = s->misses;
    summary.compile_replays = s->hits;
  }
  if (timed_steps > 0) {
    summary.tokens_per_s = static_cast<double>(timed_steps * tokens_per_step) / timed_seconds;
    if (on_cuda) summary.mfu = flops_per_token * summary.tokens_per_s / world / kPeakFlopsH100Bf16;
  }
  summary.world_size = world;
  summary.rank = dp ? dp->rank() : 0;
  summary.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  return summary;
}

}  // namespace kiln::models
