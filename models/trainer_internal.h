// Internals shared by the trainer's files (models/trainer.cpp: the pretraining loop and its data;
// trainer_step.cpp: the training step, eager or compiled, and its optimizer;
// trainer_checkpoint.cpp: checkpoint files, trainer_state.json; trainer_bench.cpp: `kiln bench`).
// Not a public API: models/trainer.h is.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "models/gpt.h"
#include "models/trainer.h"
#include "nn/optim/adamw.h"
#include "pretrain/loader.h"
#include "tensor/tensor.h"

namespace kiln::models::internal {

inline constexpr const char* kStateFile = "trainer_state.json";

ScalarType param_dtype(const std::string& precision);
void check_precision(const std::string& precision, const char* who);

// The model's loss in the run's precision: bf16-mixed runs the matmuls (and attention) in bf16
// under autocast on f32 master weights, norms, softmax and the loss in f32 (nn/autocast.h);
// f32 and bf16-true run in the parameters' dtype.
Tensor precision_loss(GPT& model, const Tensor& x, const Tensor& y, const std::string& precision);

// One optimizer step over the micro-batches xs[i], ys[i]: zero_grad, forward and backward of
// each (its loss divided by their number), clipping to `clip`, the update (unless !update: the
// caller runs it after checking the values). Returns the
// micro-batches' losses, then the gradient norm before clipping: tensors, read by the caller,
// so that the same function runs eagerly or through kiln::compile (PretrainOptions::compile).
std::vector<Tensor> train_step(GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& params,
                               const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                               const std::string& precision, double clip, bool update);

// The training step of pretrain and bench, eager or compiled.
class TrainStep {
 public:
  // update_inside: the optimizer's update is part of the step (compiled with it); otherwise the
  // caller reads the losses and the norm, then calls update() if it wants the update.
  TrainStep(GPT& model, optim::Optimizer& opt, std::string precision, double clip, bool compiled,
            bool update_inside = true)
      : fn_{model, opt, model->parameters(), std::move(precision), clip, update_inside} {
    if (compiled) compiled_.emplace(fn_, CompileOptions().name("train_step"));
  }

  std::vector<Tensor> operator()(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) {
    return compiled_ ? (*compiled_)(xs, ys) : fn_(xs, ys);
  }
  // The update of a step run with update_inside false (eager).
  void update() { fn_.opt.step(); }
  // Nullptr when eager.
  const compiler::CompileStats* stats() const { return compiled_ ? &compiled_->stats() : nullptr; }

 private:
  struct Fn {
    GPT model;
    optim::Optimizer& opt;
    std::vector<Tensor> params;
    std::string precision;
    double clip;
    bool update;
    std::vector<Tensor> operator()(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) {
      return train_step(model, opt, params, xs, ys, precision, clip, update);
    }
  };
  Fn fn_;
  std::optional<CompiledFunction<Fn>> compiled_;
};

// "compile: 2 traces (trace 812 ms, ...), 98 replays": what the compiled step cost.
void log_compile_stats(const TrainStep& step, std::ostream& log);

// AdamW with decoupled weight decay on the 2-D weights only (norms and biases get none).
std::unique_ptr<optim::AdamW> make_optimizer(const GPT& model, const PretrainOptions& o);

std::string format_number(double v, int precision, bool scientific = false);

// Writes model-<step>.safetensors, optimizer-<step>.safetensors, then trainer_state.json (and
// trainer_state-<step>.json when more than one checkpoint is kept), each atomically; then
// removes the files of checkpoints beyond the newest keep_checkpoints.
void save_checkpoint(const std::string& dir, const GPT& model, const optim::AdamW& opt,
                     const std::string& config, const PretrainOptions& o, int64_t step,
                     const CheckpointInfo::Schedule& schedule,
                     const std::optional<pretrain::LoaderState>& loader);
// Temporary files of a save that was killed (write_file_atomically's "<name>.tmp.<pid>.<hex>"
// beside a checkpoint file, trainer_state.json or a metrics file): removed at the next start.
void remove_stale_temporaries(const std::string& dir);
// Creates `dir` and checks that files can be created in it, before any training.
void check_output_dir(const std::string& dir);
// Errors unless `path` is a regular file: no such file, a directory, a FIFO (whose open would
// wait for a writer) are each named.
void check_regular_file(const std::string& path);
// Loads a checkpoint's model file into `model`, and an optimizer file into `opt`, after checking
// that it is a regular file and that every tensor has exactly the dtype and shape expected
// (errors name the file, the tensor, what was expected and what was found).
void load_model_file(GPT& model, const std::string& path);
void load_optimizer_file(optim::Optimizer& opt, const std::string& path);
// The names of the parameters holding a NaN or an infinity (empty when all are finite).
std::vector<std::string> nonfinite_parameters(const GPT& model);

}  // namespace kiln::models::internal
