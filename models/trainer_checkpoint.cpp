// Checkpoint files of `kiln pretrain` (models/trainer.h): writing them (model, optimizer,
// trainer_state.json), pruning old ones, reading trainer_state.json back, loading a model.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <sstream>

#include "models/trainer_internal.h"
#include "nn/json.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "tensor/error.h"

namespace kiln::models {
namespace internal {
namespace {

namespace fs = std::filesystem;

// The step of a checkpoint file the trainer writes ("model-00000040.safetensors",
// "optimizer-...", "trainer_state-....json"), or -1.
int64_t checkpoint_file_step(const std::string& name) {
  for (const auto& [prefix, suffix] :
       {std::pair{"model-", ".safetensors"}, std::pair{"optimizer-", ".safetensors"},
        std::pair{"trainer_state-", ".json"}}) {
    const std::string p = prefix, x = suffix;
    if (name.size() == p.size() + 8 + x.size() && name.rfind(p, 0) == 0 &&
        name.compare(name.size() - x.size(), x.size(), x) == 0) {
      const std::string digits = name.substr(p.size(), 8);
      if (digits.find_first_not_of("0123456789") != std::string::npos) return -1;
      return std::stoll(digits);
    }
  }
  return -1;
}

// Keeps the checkpoint of `step` and the keep - 1 newest before it; removes the files of every
// other step (older ones, and newer ones left by an earlier run in the same directory).
void prune_checkpoints(const std::string& dir, int64_t step, int64_t keep) {
  std::vector<std::pair<int64_t, fs::path>> files;
  std::vector<int64_t> older;
  for (const auto& e : fs::directory_iterator(dir)) {
    const int64_t s = checkpoint_file_step(e.path().filename().string());
    if (s < 0) continue;
    files.emplace_back(s, e.path());
    if (s < step) older.push_back(s);
  }
  std::sort(older.begin(), older.end(), std::greater<>());
  older.erase(std::unique(older.begin(), older.end()), older.end());
  if (static_cast<int64_t>(older.size()) > keep - 1) older.resize(static_cast<size_t>(keep - 1));
  for (const auto& [s, path] : files) {
    if (s == step || std::find(older.begin(), older.end(), s) != older.end()) continue;
    std::error_code ec;
    fs::remove(path, ec);
  }
}

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}
}  // namespace

void remove_stale_temporaries(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.find(".tmp.");
    if (at == std::string::npos || !e.is_regular_file()) continue;
    const std::string base = name.substr(0, at);
    if (checkpoint_file_step(base) >= 0 || base == kStateFile || base == "metrics.jsonl" ||
        base == "metrics.svg") {
      std::error_code ec;
      fs::remove(e.path(), ec);
    }
  }
}

void save_checkpoint(const std::string& dir, const GPT& model, const optim::AdamW& opt,
                     const std::string& config, const PretrainOptions& o, int64_t step,
                     const CheckpointInfo::Schedule& schedule,
                     const std::optional<pretrain::LoaderState>& loader) {
  fs::create_directories(dir);
  std::ostringstream id;
  id << std::setw(8) << std::setfill('0') << step;
  const std::string model_file = "model-" + id.str() + ".safetensors";
  const std::string opt_file = "optimizer-" + id.str() + ".safetensors";
  save(model, (fs::path(dir) / model_file).string());
  opt.save((fs::path(dir) / opt_file).string());
  std::ostringstream js;
  js << "{\n  \"config\": " << nn::json_string(config) << ",\n  \"step\": " << step
     << ",\n  \"precision\": \"" << o.precision << "\",\n  \"model\": \"" << model_file
     << "\",\n  \"optimizer\": \"" << opt_file << "\",\n  \"seed\": " << o.seed
     << ",\n  \"batch_size\": " << o.batch_size << ",\n  \"seq_len\": " << o.seq_len
     << ",\n  \"grad_accum_steps\": " << o.grad_accum_steps
     << ",\n  \"data\": " << nn::json_string(o.data_path);
  js << ",\n  \"schedule\": {\"lr\": " << exact(schedule.lr)
     << ", \"min_lr\": " << exact(schedule.min_lr)
     << ", \"warmup_steps\": " << schedule.warmup_steps
     << ", \"lr_decay_steps\": " << schedule.lr_decay_steps << "}";
  if (loader) js << ",\n  \"loader\": " << loader->to_json();
  js << "\n}\n";
  // With several kept, each has its own state file (copy it to trainer_state.json to resume
  // from it); trainer_state.json, written last, names the newest.
  if (o.keep_checkpoints > 1) {
    write_file_atomically((fs::path(dir) / ("trainer_state-" + id.str() + ".json")).string(),
                          js.str(), "pretrain");
  }
  write_file_atomically((fs::path(dir) / kStateFile).string(), js.str(), "pretrain");
  prune_checkpoints(dir, step, o.keep_checkpoints);
}

void check_output_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "[pretrain] ", dir, ": cannot create the output directory: ", ec.message());
  KILN_CHECK(fs::is_directory(dir), "[pretrain] ", dir, ": the output path is not a directory");
  const fs::path probe = fs::path(dir) / (".kiln-write-test-" + std::to_string(::getpid()));
  {
    std::ofstream f(probe);
    KILN_CHECK(f.good(), "[pretrain] ", dir, ": the output directory is not writable");
  }
  fs::remove(probe, ec);
}

}  // namespace internal

namespace {

namespace fs = std::filesystem;
using internal::kStateFile;

// A file name with no directory part: what trainer_state.json may name.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

std::optional<CheckpointInfo> read_checkpoint_info(const std::string& dir) {
  const fs::path path = fs::path(dir) / kStateFile;
  std::ifstream in(path);
  if (!in.good()) return std::nullopt;
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  CheckpointInfo info;
  std::optional<int64_t> step;
  try {
    nn::JsonReader r(text);
    r.begin_object();
    while (auto key = r.next_key()) {
      if (*key == "config") {
        info.config = r.read_string();
      } else if (*key == "step") {
        step = r.read_int64("step");
      } else if (*key == "precision") {
        info.precision = r.read_string();
      } else if (*key == "model") {
        info.model_file = r.read_string();
      } else if (*key == "optimizer") {
        info.optimizer_file = r.read_string();
      } else if (*key == "loader") {
        info.loader = pretrain::LoaderState::read_json(r, path.string());
      } else if (*key == "seed") {
        info.seed = r.read_uint64("seed");
      } else if (*key == "seq_len") {
        info.seq_len = r.read_int64("seq_len");
      } else if (*key == "schedule") {
        CheckpointInfo::Schedule sc;
        int seen = 0;
        r.begin_object();
        while (auto k = r.next_key()) {
          if (*k == "lr") {
            sc.lr = r.read_double("lr"), seen |= 1;
          } else if (*k == "min_lr") {
            sc.min_lr = r.read_double("min_lr"), seen |= 2;
          } else if (*k == "warmup_steps") {
            sc.warmup_steps = r.read_int64("warmup_steps"), seen |= 4;
          } else if (*k == "lr_decay_steps") {
            sc.lr_decay_steps = r.read_int64("lr_decay_steps"), seen |= 8;
          } else {
            r.skip_value();
          }
        }
        KILN_CHECK(seen == 15, "[checkpoint] ", path.string(),
                   ": \"schedule\" needs lr, min_lr, warmup_steps and lr_decay_steps");
        KILN_CHECK(std::isfinite(sc.lr) && sc.lr > 0 && sc.min_lr >= 0 && sc.min_lr <= sc.lr &&
                       sc.warmup_steps >= 0 && sc.lr_decay_steps > 0 &&
                       sc.warmup_steps <= sc.lr_decay_steps,
                   "[checkpoint] ", path.string(), ": bad schedule (lr ", sc.lr, ", min_lr ",
                   sc.min_lr, ", warmup_steps ", sc.warmup_steps, ", lr_decay_steps ",
                   sc.lr_decay_steps, ")");
        info.schedule = sc;
      } else {
        r.skip_value();
      }
    }
    r.end_document();
  } catch (const nn::JsonError& e) {
    KILN_FAIL("[checkpoint] ", path.string(), ": ", e.what());
  }
  for (const auto& [key, missing] :
       {std::pair{"config", info.config.empty()}, std::pair{"step", !step.has_value()},
        std::pair{"precision", info.precision.empty()}, std::pair{"model", info.model_file.empty()},
        std::pair{"optimizer", info.optimizer_file.empty()}}) {
    KILN_CHECK(!missing, "[checkpoint] ", path.string(), ": no \"", key, "\" field");
  }
  KILN_CHECK(*step >= 0, "[checkpoint] ", path.string(), ": bad step ", *step);
  // The files must be inside the directory: the trainer reads them, and removes them when the
  // next checkpoint replaces this one.
  for (const auto& [key, name] :
       {std::pair{"model", &info.model_file}, std::pair{"optimizer", &info.optimizer_file}}) {
    KILN_CHECK(is_plain_file_name(*name), "[checkpoint] ", path.string(), ": \"", key, "\" is \"",
               *name, "\", not a file name inside the checkpoint directory (no '/', no '..')");
  }
  info.step = *step;
  return info;
}

GPT load_checkpoint(const std::string& dir, Device device) {
  auto info = read_checkpoint_info(dir);
  KILN_CHECK(info.has_value(), "[checkpoint] ", dir, ": no ", kStateFile,
             " (not a kiln pretrain checkpoint directory)");
  GPT model(ModelConfig::from_name(info->config),
            TensorOptions().device(device).dtype(internal::param_dtype(info->precision)));
  load(model, (fs::path(dir) / info->model_file).string());
  return model;
}
}  // namespace kiln::models
