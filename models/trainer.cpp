#include "models/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <limits>
#include <sstream>

#include "autograd/grad_mode.h"
#include "compiler/compile.h"
#include "kernels/cuda.h"
#include "models/data.h"
#include "nn/autocast.h"
#include "nn/json.h"
#include "nn/optim/adamw.h"
#include "nn/optim/lr_scheduler.h"
#include "nn/safetensors.h"
#include "nn/serialize.h"
#include "pretrain/metrics.h"
#include "pretrain/progress.h"
#include "tensor/error.h"
#include "tensor/foreach.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"
#include "tensor/random.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kStateFile = "trainer_state.json";
// The validation batches are drawn from their own Philox stream, the same at every evaluation.
constexpr uint64_t kEvalSeedSalt = 0x9E3779B97F4A7C15ull;

ScalarType param_dtype(const std::string& precision) {
  if (precision == "bf16-true") return kBFloat16;
  return kFloat;
}

void check_precision(const std::string& precision, const char* who) {
  KILN_CHECK(precision == "f32" || precision == "bf16-true" || precision == "bf16-mixed", "[", who,
             "] precision must be f32, bf16-true or bf16-mixed, got '", precision, "'");
}

// The model's loss in the run's precision: bf16-mixed runs the matmuls (and attention) in bf16
// under autocast on f32 master weights, norms, softmax and the loss in f32 (nn/autocast.h);
// f32 and bf16-true run in the parameters' dtype.
Tensor precision_loss(GPT& model, const Tensor& x, const Tensor& y, const std::string& precision) {
  AutocastGuard autocast(x.device().type(), kBFloat16, /*enabled=*/precision == "bf16-mixed");
  return model->loss(x, y);
}

// Clipping as tensors, so that a compiled step can run it (clip_grad_norm_ reads the norm with
// item()): the total 2-norm of the gradients, their norms (foreach_norm: f32 for f32 and bf16
// gradients, accumulated in f64 on the CPU and in f32 on the GPU) combined in f64, and every
// gradient scaled in place by min(1, max_norm / (total + 1e-6)), as torch's clip_grad_norm_, by
// foreach_mul_ with the coefficient left on the device. One foreach_norm and one foreach_mul_ per
// dtype and device of the gradients (multi-tensor kernels: a few launches, no host sync).
// Returns the total, a 0-d f64 tensor.
Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm) {
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) return zeros({}, kFloat64);
  const std::vector<std::vector<Tensor>> groups = foreach_groups(grads);
  const Device device = groups[0][0].device();
  std::vector<Tensor> norms;
  for (const std::vector<Tensor>& g : groups) {
    norms.push_back(stack(foreach_norm(g, 2.0)).to(device, kFloat64));
  }
  const Tensor total = (norms.size() == 1 ? norms[0] : cat(norms)).square().sum().sqrt();
  const Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  for (const std::vector<Tensor>& g : groups) foreach_mul_(g, coef.to(g[0].device()));
  return total;
}

// One optimizer step over the micro-batches xs[i], ys[i]: zero_grad, forward and backward of
// each (its loss divided by their number), clipping to `clip`, the update. Returns the
// micro-batches' losses, then the gradient norm before clipping: tensors, read by the caller,
// so that the same function runs eagerly or through kiln::compile (PretrainOptions::compile).
std::vector<Tensor> train_step(GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& params,
                               const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                               const std::string& precision, double clip) {
  opt.zero_grad();
  std::vector<Tensor> out;
  for (size_t i = 0; i < xs.size(); ++i) {
    Tensor loss = precision_loss(model, xs[i], ys[i], precision);
    if (xs.size() > 1) loss = loss / static_cast<double>(xs.size());
    loss.backward();
    out.push_back(loss.detach());
  }
  out.push_back(clip_grad_norm(params, clip));
  opt.step();
  return out;
}

// The training step of pretrain and bench, eager or compiled.
class TrainStep {
 public:
  TrainStep(GPT& model, optim::Optimizer& opt, std::string precision, double clip, bool compiled)
      : fn_{model, opt, model->parameters(), std::move(precision), clip} {
    if (compiled) compiled_.emplace(fn_, CompileOptions().name("train_step"));
  }

  std::vector<Tensor> operator()(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) {
    return compiled_ ? (*compiled_)(xs, ys) : fn_(xs, ys);
  }
  // Nullptr when eager.
  const compiler::CompileStats* stats() const { return compiled_ ? &compiled_->stats() : nullptr; }

 private:
  struct Fn {
    GPT model;
    optim::Optimizer& opt;
    std::vector<Tensor> params;
    std::string precision;
    double clip;
    std::vector<Tensor> operator()(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) {
      return train_step(model, opt, params, xs, ys, precision, clip);
    }
  };
  Fn fn_;
  std::optional<CompiledFunction<Fn>> compiled_;
};

// "compile: 2 traces (trace 812 ms, ...), 98 replays": what the compiled step cost.
void log_compile_stats(const TrainStep& step, std::ostream& log) {
  const compiler::CompileStats* s = step.stats();
  if (s == nullptr) return;
  log << "compile: " << s->misses << " traces, " << s->hits << " replays";
  if (!s->stage_ms.empty()) {
    log << "; the last compilation:";
    for (const auto& [stage, ms] : s->stage_ms) {
      std::ostringstream t;
      t << std::fixed << std::setprecision(1) << ms;
      log << " " << stage << " " << t.str() << " ms";
    }
  }
  for (const std::string& why : s->recompile_reasons) log << "\n  traced again: " << why;
  if (s->fell_back_to_eager) log << "\n  fell back to eager (recompile limit)";
  log << "\n" << std::flush;
}

std::vector<Tensor> params_where(const GPT& model, bool two_d) {
  std::vector<Tensor> out;
  for (const Tensor& p : model->parameters()) {
    if ((p.dim() >= 2) == two_d) out.push_back(p);
  }
  return out;
}

std::unique_ptr<optim::AdamW> make_optimizer(const GPT& model, const PretrainOptions& o) {
  const auto defaults =
      optim::AdamWOptions(o.lr).betas(o.betas).eps(o.eps).weight_decay(o.weight_decay);
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(params_where(model, true));
  std::vector<Tensor> no_decay = params_where(model, false);
  if (!no_decay.empty()) {
    groups.emplace_back(no_decay, std::make_unique<optim::AdamWOptions>(
                                      optim::AdamWOptions(defaults).weight_decay(0.0)));
  }
  return std::make_unique<optim::AdamW>(groups, defaults);
}

std::string format_number(double v, int precision, bool scientific = false) {
  std::ostringstream s;
  if (scientific)
    s << std::scientific;
  else
    s << std::fixed;
  s << std::setprecision(precision) << v;
  return s.str();
}

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

// Temporary files of a save that was killed (write_file_atomically's "<name>.tmp.<pid>.<hex>"
// beside a checkpoint file, trainer_state.json or a metrics file): removed at the next start.
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

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
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

// The run's data: a text or token file (TokenDataset, batches a pure function of the step), or
// token shards (a ShardLoader, whose position goes into checkpoints).
class TrainData {
 public:
  TrainData(const PretrainOptions& o, const ModelConfig& cfg) : o_(o) {
    if (is_shard_data(o.data_path)) {
      auto set = std::make_shared<pretrain::ShardSet>(pretrain::ShardSet::open(o.data_path));
      KILN_CHECK(set->vocab_size() <= cfg.vocab_size, "[pretrain] ", o.data_path,
                 ": the shards come from a tokenizer of ", set->vocab_size(),
                 " ids, more than the vocab_size ", cfg.vocab_size, " of ", cfg.name);
      pretrain::LoaderOptions lo;
      lo.seq_len = o.seq_len;
      lo.batch_size = o.batch_size;
      lo.seed = o.seed;
      lo.val_fraction = 0.1;
      lo.max_val_sequences = 1024;
      loader_.emplace(std::move(set), lo);
      return;
    }
    text_.emplace(TokenDataset::from_file(o.data_path));
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
    return text_->batch(Split::kTrain, o_.batch_size, o_.seq_len, device, o_.seed, index);
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
  std::optional<TokenDataset> text_;
  std::optional<pretrain::ShardLoader> loader_;
};

// Creates `dir` and checks that files can be created in it, before any training.
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

double evaluate(GPT& model, const TrainData& data, const PretrainOptions& o, Device device) {
  if (!data.has_validation()) return std::numeric_limits<double>::quiet_NaN();
  NoGradGuard no_grad;
  double sum = 0;
  for (int64_t i = 0; i < o.eval_batches; ++i) {
    auto [x, y] = data.validation_batch(i, device);
    sum += precision_loss(model, x, y, o.precision).item<double>();
  }
  return sum / static_cast<double>(o.eval_batches);
}

}  // namespace

namespace {

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

// A file name with no directory part: what trainer_state.json may name.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

Device default_device() { return cuda::is_available() ? Device(kCUDA) : Device(kCPU); }

void PretrainOptions::validate() const {
  KILN_CHECK(!data_path.empty(), "[pretrain] no data file given (data_path)");
  KILN_CHECK(batch_size > 0, "[pretrain] batch_size must be positive, got ", batch_size);
  KILN_CHECK(seq_len > 0, "[pretrain] seq_len must be positive, got ", seq_len);
  KILN_CHECK(max_steps > 0, "[pretrain] max_steps must be positive, got ", max_steps);
  KILN_CHECK(lr_decay_steps >= 0, "[pretrain] lr_decay_steps must be >= 0, got ", lr_decay_steps);
  KILN_CHECK(lr > 0 && min_lr >= 0 && min_lr <= lr,
             "[pretrain] need 0 <= min_lr <= lr and lr > 0, "
             "got lr ",
             lr, " min_lr ", min_lr);
  KILN_CHECK(warmup_steps >= 0, "[pretrain] warmup_steps must be >= 0, got ", warmup_steps);
  KILN_CHECK(weight_decay >= 0, "[pretrain] weight_decay must be >= 0, got ", weight_decay);
  KILN_CHECK(grad_clip >= 0, "[pretrain] grad_clip must be >= 0 (0 = off), got ", grad_clip);
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
            TensorOptions().device(device).dtype(param_dtype(info->precision)));
  load(model, (fs::path(dir) / info->model_file).string());
  return model;
}

PretrainSummary pretrain(const PretrainOptions& options, std::ostream& log) {
  const auto t_start = Clock::now();
  options.validate();
  PretrainOptions o = options;  // a resume replaces the schedule by the checkpoint's
  const ModelConfig cfg = o.config ? *o.config : ModelConfig::from_name(o.config_name);
  cfg.validate();
  KILN_CHECK(o.seq_len <= cfg.block_size, "[pretrain] seq_len ", o.seq_len,
             " exceeds the block_size ", cfg.block_size, " of ", cfg.name);
  const Device device = o.device.value_or(default_device());
  // Everything that can fail before training does so now: the output directory, an existing
  // state file in it (read even without resume: the first save would read it), the data.
  std::optional<CheckpointInfo> existing;
  if (!o.out_dir.empty()) {
    check_output_dir(o.out_dir);
    remove_stale_temporaries(o.out_dir);
    existing = read_checkpoint_info(o.out_dir);
  }
  if (o.resume && existing) {
    const CheckpointInfo& info = *existing;
    KILN_CHECK(!info.seed || *info.seed == o.seed, "[pretrain] the checkpoint in ", o.out_dir,
               " was trained with seed ", info.seed.value_or(0), ", not ", o.seed,
               " (the seed shapes the batches)");
    KILN_CHECK(!info.seq_len || *info.seq_len == o.seq_len, "[pretrain] the checkpoint in ",
               o.out_dir, " was trained with seq_len ", info.seq_len.value_or(0), ", not ",
               o.seq_len);
    if (const auto& sc = info.schedule) {
      const int64_t asked_decay = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.max_steps;
      const int64_t asked_warmup = std::min(o.warmup_steps, asked_decay);
      if (sc->lr != o.lr || sc->min_lr != o.min_lr || sc->warmup_steps != asked_warmup ||
          sc->lr_decay_steps != asked_decay) {
        log << "resume keeps the run's schedule: lr " << sc->lr << " -> " << sc->min_lr
            << ", warmup " << sc->warmup_steps << ", decay over " << sc->lr_decay_steps
            << " steps (the options asked for lr " << o.lr << " -> " << o.min_lr << ", warmup "
            << asked_warmup << ", decay over " << asked_decay << ")\n";
      }
      o.lr = sc->lr;
      o.min_lr = sc->min_lr;
      o.warmup_steps = sc->warmup_steps;
      o.lr_decay_steps = sc->lr_decay_steps;
    }
  }
  TrainData data(o, cfg);

  manual_seed(o.seed);
  GPT model(cfg, TensorOptions().device(device).dtype(param_dtype(o.precision)));
  model->train();
  auto opt = make_optimizer(model, o);
  const int64_t decay_steps = o.lr_decay_steps > 0 ? o.lr_decay_steps : o.max_steps;
  // A run shorter than its warm-up warms up over the whole run.
  const int64_t warmup = std::min(o.warmup_steps, decay_steps);
  optim::CosineAnnealingWithWarmup sched(*opt, warmup, decay_steps, o.min_lr);

  PretrainSummary summary;
  if (o.resume) {
    if (const auto& info = existing) {
      KILN_CHECK(info->config == cfg.name, "[pretrain] the checkpoint in ", o.out_dir,
                 " is of config ", info->config, ", not ", cfg.name);
      KILN_CHECK(info->precision == o.precision, "[pretrain] the checkpoint in ", o.out_dir,
                 " was trained in ", info->precision, ", not ", o.precision);
      data.resume(*info, o.out_dir);
      load(model, (fs::path(o.out_dir) / info->model_file).string());
      opt->load((fs::path(o.out_dir) / info->optimizer_file).string());
      sched.set_last_epoch(info->step);
      summary.start_step = info->step;
      log << "resumed from " << o.out_dir << " at step " << info->step << "\n";
    } else {
      log << "no checkpoint in " << o.out_dir << ": starting from step 0\n";
    }
  }

  const int64_t tokens_per_step = o.batch_size * o.seq_len * o.grad_accum_steps;
  const double flops_per_token = cfg.flops_per_token(o.seq_len);
  const bool on_cuda = device.is_cuda();
  log << "pretraining " << cfg.name << " (" << model->num_parameters() << " parameters) on "
      << data.describe() << "\n"
      << "device " << device.str() << ", precision " << o.precision << ", batch " << o.batch_size
      << " x seq " << o.seq_len << " x accum " << o.grad_accum_steps << " = " << tokens_per_step
      << " tokens/step, steps " << summary.start_step + 1 << ".." << o.max_steps << ", lr " << o.lr
      << " -> " << o.min_lr << " (warmup " << warmup << ")\n";

  if (o.compile) log << "the training step runs through kiln::compile\n";
  log << std::flush;
  const double clip = o.grad_clip > 0 ? o.grad_clip : std::numeric_limits<double>::infinity();
  TrainStep train(model, *opt, o.precision, clip, o.compile);
  pretrain::Progress progress(log, o.progress_bar.value_or(pretrain::Progress::is_terminal(log)),
                              static_cast<double>(o.max_steps), "step",
                              static_cast<double>(summary.start_step));
  std::optional<pretrain::MetricsLog> metrics;
  if (!o.out_dir.empty()) metrics.emplace(o.out_dir, summary.start_step);
  const StopSignals stop;
  double timed_seconds = 0, window_seconds = 0;
  int64_t timed_steps = 0, window_steps = 0;
  summary.final_val_loss = std::numeric_limits<double>::quiet_NaN();
  summary.steps = summary.start_step;
  for (int64_t step = summary.start_step + 1; step <= o.max_steps; ++step) {
    const auto t0 = Clock::now();
    const double lr = opt->get_lr();
    std::vector<Tensor> xs, ys;
    for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) {
      auto [x, y] = data.train_batch(step, micro, device);
      xs.push_back(std::move(x));
      ys.push_back(std::move(y));
    }
    const std::vector<Tensor> out = train(xs, ys);  // micro-batch losses, then the grad norm
    double loss_sum = 0;
    for (size_t i = 0; i + 1 < out.size(); ++i) loss_sum += out[i].item<double>();
    const double grad_norm = out.back().item<double>();
    sched.step();
    if (on_cuda) cuda::synchronize();
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    // The first step of a run pays for one-time setup (allocations, kernel loading).
    if (step > summary.start_step + 1 || o.max_steps == summary.start_step + 1) {
      timed_seconds += dt;
      ++timed_steps;
    }
    window_seconds += dt;
    ++window_steps;
    const double loss_value = loss_sum;
    summary.train_losses.push_back(loss_value);
    summary.final_train_loss = loss_value;
    summary.steps = step;
    KILN_CHECK(std::isfinite(loss_value), "[pretrain] the loss became ", loss_value, " at step ",
               step, " (try a lower lr)");

    // The values of this step; the throughput over the steps since the last logged line.
    const double tok_s = static_cast<double>(window_steps * tokens_per_step) / window_seconds;
    std::ostringstream values, speed;
    values << "loss " << format_number(loss_value, 4) << " | lr " << format_number(lr, 2, true)
           << " | grad norm " << format_number(grad_norm, 3);
    speed << static_cast<int64_t>(tok_s) << " tok/s";
    if (on_cuda) {
      speed << ", MFU " << format_number(100 * flops_per_token * tok_s / kPeakFlopsH100Bf16, 1)
            << "%";
    }
    const int64_t mem = memory_bytes(device);
    speed << ", mem " << format_memory(mem);
    if (metrics) metrics->train(step, loss_value, lr, grad_norm, tok_s, mem);
    progress.update(static_cast<double>(step), values.str() + " | " + speed.str());
    if (step % o.log_interval == 0 || step == o.max_steps || step == summary.start_step + 1) {
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
      summary.final_val_loss = evaluate(model, data, o, device);
      progress.line("eval step " + std::to_string(step) + " | val loss " +
                    format_number(summary.final_val_loss, 4));
      if (metrics) {
        metrics->eval(step, summary.final_val_loss);
        metrics->write_plot();
      }
    }
    const int signal = stop.received();
    if (!o.out_dir.empty() &&
        ((o.checkpoint_interval > 0 && step % o.checkpoint_interval == 0) || last || signal)) {
      save_checkpoint(o.out_dir, model, *opt, cfg.name, o, step,
                      {o.lr, o.min_lr, warmup, decay_steps}, data.loader_state());
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
    if (on_cuda) summary.mfu = flops_per_token * summary.tokens_per_s / kPeakFlopsH100Bf16;
  }
  summary.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  return summary;
}

BenchResult bench(const BenchOptions& o, std::ostream& log) {
  KILN_CHECK(o.batch_size > 0 && o.seq_len > 0 && o.steps > 0 && o.warmup_steps >= 0 &&
                 o.profile_steps >= 0,
             "[bench] batch, seq, steps must be positive and warmup and profile steps >= 0");
  check_precision(o.precision, "bench");
  const ModelConfig cfg = ModelConfig::from_name(o.config_name);
  KILN_CHECK(o.seq_len <= cfg.block_size, "[bench] seq_len ", o.seq_len, " exceeds the block_size ",
             cfg.block_size, " of ", cfg.name);
  const Device device = o.device.value_or(default_device());
  const bool on_cuda = device.is_cuda();
  manual_seed(o.seed);
  GPT model(cfg, TensorOptions().device(device).dtype(param_dtype(o.precision)));
  model->train();
  PretrainOptions po;
  po.lr = 1e-4;
  po.weight_decay = 0.1;
  auto opt = make_optimizer(model, po);
  TrainStep train(model, *opt, o.precision, /*clip=*/1.0, o.compile);
  BenchResult r;
  r.num_parameters = model->num_parameters();
  log << "bench " << cfg.name << " (" << r.num_parameters << " parameters), device " << device.str()
      << ", precision " << o.precision << ", batch " << o.batch_size << " x seq " << o.seq_len
      << ", " << o.warmup_steps << " warm-up + " << o.steps << " timed steps"
      << (o.compile ? ", compiled" : "") << "\n"
      << std::flush;
  Tensor last_loss;
  auto train_step = [&]() {
    Tensor tokens = randint(0, cfg.vocab_size, {o.batch_size, o.seq_len + 1},
                            TensorOptions().dtype(kInt64).device(device));
    Tensor x = tokens.narrow(1, 0, o.seq_len).contiguous();
    Tensor y = tokens.narrow(1, 1, o.seq_len).contiguous();
    last_loss = train({x}, {y}).front();
  };
  for (int64_t i = 0; i < o.warmup_steps; ++i) train_step();
  if (on_cuda) {
    cuda::synchronize();
    cuda::reset_peak_memory_stats();
  }
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < o.steps; ++i) train_step();
  r.final_loss = last_loss.item<double>();  // waits for the device
  if (on_cuda) cuda::synchronize();
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.step_ms = 1e3 * seconds / static_cast<double>(o.steps);
  r.tokens_per_s = static_cast<double>(o.steps * o.batch_size * o.seq_len) / seconds;
  if (on_cuda) {
    r.mfu = cfg.flops_per_token(o.seq_len) * r.tokens_per_s / kPeakFlopsH100Bf16;
    r.peak_memory = cuda::memory_stats().peak;
  }
  log_compile_stats(train, log);
  if (o.profile_steps > 0) {
    profiler::Profiler prof;
    prof.start();
    for (int64_t i = 0; i < o.profile_steps; ++i) train_step();
    prof.stop();
    profiler::print_report(prof.results(), o.profile_steps, r.step_ms, log);
  }
  return r;
}

}  // namespace kiln::models
