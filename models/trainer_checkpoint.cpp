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

#include "autograd/grad_mode.h"
#include "models/run_config.h"
#include "models/trainer_internal.h"
#include "nn/json.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/shape.h"

namespace kiln::models {
namespace internal {
namespace {

namespace fs = std::filesystem;

bool all_digits(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

// A checkpoint file the trainer writes: "model-00000040.safetensors", "optimizer-...",
// "trainer_state-00000040.json", and for the model and optimizer of a step saved again in the
// same directory "model-00000040.<generation>.safetensors" (generation 1, 2, ...).
struct CheckpointFile {
  int64_t step = -1;  // -1: not a checkpoint file
  int64_t generation = 0;
  bool state = false;  // trainer_state-<step>.json
};
CheckpointFile parse_checkpoint_file(const std::string& name) {
  for (const auto& [prefix, suffix] :
       {std::pair{"model-", ".safetensors"}, std::pair{"optimizer-", ".safetensors"},
        std::pair{"trainer_state-", ".json"}}) {
    const std::string p = prefix, x = suffix;
    if (name.size() < p.size() + 8 + x.size() || name.rfind(p, 0) != 0 ||
        name.compare(name.size() - x.size(), x.size(), x) != 0) {
      continue;
    }
    const std::string middle = name.substr(p.size(), name.size() - p.size() - x.size());
    const std::string digits = middle.substr(0, 8), rest = middle.substr(8);
    if (!all_digits(digits)) return {};
    CheckpointFile f{std::stoll(digits), 0, x == ".json"};
    if (rest.empty()) return f;
    // ".<generation>": model and optimizer files only, 1 to 9 digits, no leading zero.
    if (f.state || rest[0] != '.' || rest.size() > 10 || !all_digits(rest.substr(1)) ||
        rest[1] == '0') {
      return {};
    }
    f.generation = std::stoll(rest.substr(1));
    return f;
  }
  return {};
}
int64_t checkpoint_file_step(const std::string& name) { return parse_checkpoint_file(name).step; }

// Keeps the checkpoint of `step` (only the files in `current`) and the keep - 1 newest before
// it; removes the files of every other step (older ones, and newer ones left by an earlier run
// in the same directory) and those of `step` that a save of it again replaced.
void prune_checkpoints(const std::string& dir, int64_t step, int64_t keep,
                       const std::vector<std::string>& current) {
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
    if (s == step) {
      const std::string name = path.filename().string();
      if (std::find(current.begin(), current.end(), name) != current.end()) continue;
    } else if (std::find(older.begin(), older.end(), s) != older.end()) {
      continue;
    }
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
        base == "metrics.svg" || base == kRunConfigFile) {
      std::error_code ec;
      fs::remove(e.path(), ec);
    }
  }
}

void save_checkpoint(const std::string& dir,
                     const std::function<void(const std::string&)>& write_model,
                     const std::function<void(const std::string&)>& write_optimizer,
                     const std::string& config, const PretrainOptions& o, int64_t step,
                     const CheckpointInfo::Schedule& schedule,
                     const std::optional<pretrain::LoaderState>& loader) {
  fs::create_directories(dir);
  std::ostringstream id;
  id << std::setw(8) << std::setfill('0') << step;
  // A step saved before in this directory (a run started again over it, a stop signal right
  // after a periodic save) has files that trainer_state.json may name: overwriting them one after
  // the other could leave the new model beside the previous optimizer state. The new files get
  // the next generation's names instead, and the rename of trainer_state.json publishes them as
  // it publishes a new step; the files they replace are removed after it (or, after a crash, at
  // the next start: remove_superseded_files).
  int64_t generation = -1;
  for (const auto& e : fs::directory_iterator(dir)) {
    const CheckpointFile f = parse_checkpoint_file(e.path().filename().string());
    if (f.step == step && !f.state) generation = std::max(generation, f.generation);
  }
  ++generation;
  const std::string files_id = id.str() + (generation > 0 ? "." + std::to_string(generation) : "");
  const std::string model_file = "model-" + files_id + ".safetensors";
  const std::string opt_file = "optimizer-" + files_id + ".safetensors";
  write_model((fs::path(dir) / model_file).string());
  write_optimizer((fs::path(dir) / opt_file).string());
  std::ostringstream js;
  js << "{\n  \"config\": " << nn::json_string(config) << ",\n  \"step\": " << step
     << ",\n  \"precision\": \"" << o.precision << "\",\n  \"model\": \"" << model_file
     << "\",\n  \"optimizer\": \"" << opt_file << "\",\n  \"seed\": " << o.seed
     << ",\n  \"batch_size\": " << o.batch_size << ",\n  \"seq_len\": " << o.seq_len
     << ",\n  \"grad_accum_steps\": " << o.grad_accum_steps
     << ",\n  \"data\": " << nn::json_string(o.data_path);
  if (!o.hf_dir.empty()) js << ",\n  \"hf\": " << nn::json_string(o.hf_dir);
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
  prune_checkpoints(dir, step, o.keep_checkpoints,
                    {model_file, opt_file, "trainer_state-" + id.str() + ".json"});
}

void remove_superseded_files(const std::string& dir) {
  std::optional<CheckpointInfo> info;
  try {
    info = read_checkpoint_info(dir);
  } catch (const Error&) {
    return;  // the run reports it
  }
  if (!info) return;
  // What the state files of that step name: trainer_state.json, and trainer_state-<step>.json,
  // which a killed save may have written before it (so both are whole checkpoints).
  std::vector<std::string> named = {info->model_file, info->optimizer_file};
  std::ostringstream id;
  id << std::setw(8) << std::setfill('0') << info->step;
  const std::string own_state = "trainer_state-" + id.str() + ".json";
  try {
    if (const auto own = read_state_file((fs::path(dir) / own_state).string())) {
      if (own->step == info->step) {
        named.push_back(own->model_file);
        named.push_back(own->optimizer_file);
      }
    }
  } catch (const Error&) {
  }
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const CheckpointFile f = parse_checkpoint_file(name);
    if (f.step != info->step || f.state || !e.is_regular_file()) continue;
    if (std::find(named.begin(), named.end(), name) != named.end()) continue;
    std::error_code ec;
    fs::remove(e.path(), ec);
  }
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

namespace {

// A dtype as a safetensors header spells it, as a user reading the file sees it.
std::string file_dtype(ScalarType t) {
  switch (t) {
    case kFloat64:
      return "F64";
    case kFloat32:
      return "F32";
    case kFloat16:
      return "F16";
    case kBFloat16:
      return "BF16";
    case kInt64:
      return "I64";
    case kInt32:
      return "I32";
    case kBool:
      return "BOOL";
    case kUInt8:
      return "U8";
    default:
      return std::string(dtype_name(t));
  }
}

}  // namespace

void check_regular_file(const std::string& path) {
  std::error_code ec;
  const fs::file_type type = fs::status(path, ec).type();
  KILN_CHECK(type != fs::file_type::not_found, "[checkpoint] ", path, ": no such file");
  KILN_CHECK(!ec, "[checkpoint] ", path, ": cannot stat: ", ec.message());
  KILN_CHECK(type != fs::file_type::directory, "[checkpoint] ", path,
             ": is a directory, not a file");
  KILN_CHECK(type != fs::file_type::fifo, "[checkpoint] ", path,
             ": is a FIFO, not a regular file (reading it would wait for a writer)");
  KILN_CHECK(type == fs::file_type::regular, "[checkpoint] ", path, ": is not a regular file");
}

void load_model_file(GPT& model, const std::string& path) {
  check_regular_file(path);
  const TensorMap tensors = load_safetensors(path);
  const std::map<std::string, Tensor> expected = model->state_dict();
  // Exactly the model's tensors, each in its exact dtype: a bf16 or I32 tensor where the
  // trainer wrote F32 means another file, which kiln::load would silently convert.
  for (const auto& [name, want] : expected) {
    const auto it = tensors.find(name);
    KILN_CHECK(it != tensors.end(), "[checkpoint] ", path, ": no tensor \"", name, "\" (expected ",
               file_dtype(want.dtype()), " ", shape_str(want.sizes()), ")");
    const Tensor& got = it->second;
    KILN_CHECK(got.dtype() == want.dtype() && got.sizes() == want.sizes(), "[checkpoint] ", path,
               ": tensor \"", name, "\" is ", file_dtype(got.dtype()), " ", shape_str(got.sizes()),
               ", expected ", file_dtype(want.dtype()), " ", shape_str(want.sizes()));
  }
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(expected.contains(name), "[checkpoint] ", path, ": unexpected tensor \"", name,
               "\" (not a parameter or buffer of the model)");
  }
  model->load_state_dict(tensors, /*strict=*/true);
}

void load_optimizer_file(optim::Optimizer& opt, const std::string& path,
                         const StateLayout* layout) {
  check_regular_file(path);
  SafetensorsMetadata metadata;
  TensorMap tensors = load_safetensors(path, &metadata);
  // The buffers ("state.<index>.<name>") in the exact dtype and shape of the state the optimizer
  // keeps; the optimizer checks the set of buffers and the metadata.
  const std::vector<Tensor> params = opt.parameters();
  for (const auto& [name, t] : tensors) {
    const size_t dot = name.find('.', 6);
    int64_t index = -1;
    if (name.starts_with("state.") && dot != std::string::npos && dot > 6) {
      const std::string digits = name.substr(6, dot - 6);
      if (digits.size() < 10 && digits.find_first_not_of("0123456789") == std::string::npos) {
        index = std::stoll(digits);
      }
    }
    KILN_CHECK(index >= 0 && index < static_cast<int64_t>(params.size()), "[checkpoint] ", path,
               ": unexpected tensor \"", name, "\" (the optimizer has ", params.size(),
               " parameters)");
    const Tensor& p = params[static_cast<size_t>(index)];
    const ScalarType want = optim::Optimizer::state_dtype(p);
    const Shape shape = layout != nullptr ? layout->full_shapes.at(static_cast<size_t>(index))
                                          : Shape(p.sizes().begin(), p.sizes().end());
    KILN_CHECK(t.dtype() == want && t.sizes() == IntArrayRef(shape), "[checkpoint] ", path,
               ": tensor \"", name, "\" is ", file_dtype(t.dtype()), " ", shape_str(t.sizes()),
               ", expected ", file_dtype(want), " ", shape_str(shape));
  }
  if (layout != nullptr) {
    for (auto& [name, t] : tensors) {
      t = layout->to_shard(static_cast<size_t>(std::stoll(name.substr(6))), t);
    }
  }
  try {
    opt.load_state_dict(tensors, metadata);
  } catch (const Error& e) {
    KILN_FAIL("[checkpoint] ", path, ": ", e.what());
  }
}

std::vector<std::string> nonfinite_parameters(const GPT& model) {
  NoGradGuard no_grad;
  // x * 0 is 0 for every finite x and NaN for an infinity or a NaN: one exact sum per parameter,
  // one read for all of them.
  const auto named = model->named_parameters();
  std::vector<Tensor> sums;
  for (const auto& item : named) sums.push_back((item.value() * 0.0).sum().to(kCPU, kFloat64));
  std::vector<std::string> bad;
  if (sums.empty()) return bad;
  const Tensor all = stack(sums);
  if (std::isfinite(all.sum().item<double>())) return bad;
  const std::vector<double> each = all.to_vector<double>();
  size_t i = 0;
  for (const auto& item : named) {
    if (!std::isfinite(each[i++])) bad.push_back(item.key());
  }
  return bad;
}

}  // namespace internal

namespace {

namespace fs = std::filesystem;
using internal::kStateFile;

// The largest step a state file may hold: far beyond any run, small enough that step + 1,
// step * grad_accum_steps and the step as a double stay exact.
constexpr int64_t kMaxStep = int64_t{1} << 40;

// A file name with no directory part: what trainer_state.json may name.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

std::optional<CheckpointInfo> read_checkpoint_info(const std::string& dir) {
  return internal::read_state_file((fs::path(dir) / kStateFile).string());
}

std::optional<CheckpointInfo> internal::read_state_file(const std::string& file) {
  const fs::path path = file;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec)) && !fs::exists(fs::status(path, ec))) {
    return std::nullopt;
  }
  internal::check_regular_file(path.string());
  std::ifstream in(path);
  KILN_CHECK(in.good(), "[checkpoint] ", path.string(), ": cannot open");
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
      } else if (*key == "batch_size") {
        info.batch_size = r.read_int64("batch_size");
      } else if (*key == "grad_accum_steps") {
        info.grad_accum_steps = r.read_int64("grad_accum_steps");
      } else if (*key == "data") {
        info.data = r.read_string();
      } else if (*key == "hf") {
        if (std::string dir = r.read_string(); !dir.empty()) info.hf_dir = std::move(dir);
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
  KILN_CHECK(*step >= 0 && *step <= kMaxStep, "[checkpoint] ", path.string(), ": bad step ", *step,
             " (must be in [0, ", kMaxStep, "])");
  KILN_CHECK(
      info.precision == "f32" || info.precision == "bf16-true" || info.precision == "bf16-mixed",
      "[checkpoint] ", path.string(), ": unknown precision \"", info.precision,
      "\" (f32, bf16-true or bf16-mixed)");
  // The sizes a run was given: positive, and their product (tokens per step) fits in int64.
  int64_t tokens = 1;
  for (const auto& [key, value] :
       {std::pair{"seq_len", info.seq_len}, std::pair{"batch_size", info.batch_size},
        std::pair{"grad_accum_steps", info.grad_accum_steps}}) {
    if (!value) continue;
    KILN_CHECK(*value > 0 && !__builtin_mul_overflow(tokens, *value, &tokens), "[checkpoint] ",
               path.string(), ": bad ", key, " ", *value,
               " (must be positive, with batch_size x seq_len x grad_accum_steps within int64)");
  }
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
  std::error_code ec;
  KILN_CHECK(!fs::exists(dir, ec) || fs::is_directory(dir, ec), "[checkpoint] ", dir,
             ": is a file, not a checkpoint directory (give the kiln pretrain --out directory)");
  auto info = read_checkpoint_info(dir);
  KILN_CHECK(info.has_value(), "[checkpoint] ", dir, ": no ", kStateFile,
             " (not a kiln pretrain checkpoint directory)");
  // A run from a Hugging Face directory has its model in that directory's config.json.
  const ModelConfig cfg =
      info->hf_dir ? ModelConfig::from_hf_config((fs::path(*info->hf_dir) / "config.json").string())
                   : ModelConfig::from_name(info->config);
  GPT model(cfg, TensorOptions().device(device).dtype(internal::param_dtype(info->precision)));
  internal::load_model_file(model, (fs::path(dir) / info->model_file).string());
  return model;
}
}  // namespace kiln::models
