// Internals shared by the trainer's files (models/trainer.cpp: the pretraining loop and its data;
// trainer_step.cpp: the training step, eager or compiled, and its optimizer;
// trainer_checkpoint.cpp: checkpoint files, trainer_state.json; trainer_bench.cpp: `kiln bench`).
// Not a public API: models/trainer.h is.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/fused_cuda.h"
#include "kernels/cuda.h"
#include "models/gpt.h"
#include "models/trainer.h"
#include "nn/optim/adamw.h"
#include "nn/safetensors.h"
#include "pretrain/loader.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace kiln::models::internal {

inline constexpr const char* kStateFile = "trainer_state.json";

// Matmul autotuning (kiln::cuda::set_matmul_autotune) set for a run on CUDA and restored at its
// end; off the GPU nothing changes.
class MatmulAutotuneScope {
 public:
  MatmulAutotuneScope(bool on_cuda, bool enabled);
  ~MatmulAutotuneScope();
  MatmulAutotuneScope(const MatmulAutotuneScope&) = delete;
  MatmulAutotuneScope& operator=(const MatmulAutotuneScope&) = delete;

 private:
  bool set_ = false;
  bool previous_ = false;
};

class DataParallel;

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
// With `dp`, each micro-batch runs through it (the gradients reduced over the ranks with the
// last one) and so does clipping.
std::vector<Tensor> train_step(GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& params,
                               const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                               const std::string& precision, double clip, bool update,
                               DataParallel* dp = nullptr);
// The total 2-norm of the parameters' gradients and clipping to max_norm, as tensors (no host
// sync). `reduce_squares`, when given, sums the squared norm (a 1-element f64 tensor on the
// gradients' device) over the ranks in place, for gradients sharded over them. With `coef`, the
// gradients are not scaled: *coef receives the clipping coefficient (0-d f64 on the gradients'
// device; undefined when no parameter has a gradient), for Optimizer::step_with_grad_factor.
Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm,
                      const std::function<void(Tensor&)>& reduce_squares = {},
                      Tensor* coef = nullptr);

// How a checkpoint's optimizer buffers (full parameter shapes) map onto the optimizer's
// parameters (FSDP's 1-d shards): the full shape of each parameter index, and the slice.
struct StateLayout {
  std::vector<Shape> full_shapes;
  std::function<Tensor(size_t index, const Tensor& full)> to_shard;
};

// Data parallelism of pretrain and bench (PretrainOptions::dist) over the ranks `kiln run`
// started (models/trainer_dist.cpp).
class DataParallel {
 public:
  // Errors unless `mode` is "ddp", "zero2", "zero3" or "fsdp"; `who` names the caller. Every mode
  // compiles (`compiled`): DDP's and FSDP's collectives are ops that the trace records.
  static void check_mode(const std::string& mode, bool compiled, const char* who);
  // Joins the job: rendezvous from the environment and a process group, NCCL when `cuda` (the
  // rank's device cuda:LOCAL_RANK, made current), else Gloo on the CPU.
  // `peer_all_reduce`: dist::InitOptions::peer_all_reduce (NCCL only).
  DataParallel(const std::string& mode, bool cuda, const char* who, bool peer_all_reduce = true);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Device device() const;
  int rank() const;
  int world() const;
  bool sharded() const;  // FSDP (zero2, zero3)
  const std::string& mode() const;

  // Wraps the model, once the optimizer is built over its full-shaped parameters and a resumed
  // checkpoint is loaded: DDP broadcasts rank 0's parameters; FSDP shards every block and the
  // root (rank 0's values), after which the parameters are 1-d shards.
  // `comm_sm_carveout`, `bucket_cap_mb`, `tail_buckets` (unset: the default): DDP's
  // dist::DDPOptions.
  void wrap(GPT& model, const optim::Optimizer& opt, int comm_sm_carveout = 0,
            std::optional<double> bucket_cap_mb = std::nullopt,
            std::optional<int> tail_buckets = std::nullopt);
  // One micro-batch: `loss` (the forward) through the wrapper, then its backward. The gradients
  // are reduced when `sync` (DDP accumulates locally otherwise; FSDP reduces every micro-batch).
  // Returns the loss, detached.
  Tensor forward_backward(const std::function<Tensor()>& loss, bool sync);
  // A forward without backward (evaluation), through the wrapper.
  Tensor forward(const std::function<Tensor()>& f);
  // The gradient norm before clipping, as a 0-d f64 tensor: the parameters' gradients are the
  // global ones (DDP) or shards whose squares sum over the ranks to the model's (FSDP). With
  // `coef`, the coefficient is returned there and the gradients are left as they are (see
  // internal::clip_grad_norm).
  Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm, Tensor* coef = nullptr);
  // Element-wise sums over the ranks (every rank passes as many values).
  std::vector<double> sum(const std::vector<double>& values);
  double max(double value);
  void barrier();

  // Checkpoints hold full tensors, as one process writes them. Collective; complete on rank 0.
  TensorMap full_model_state(GPT& model);
  TensorMap full_optimizer_state(const optim::Optimizer& opt, SafetensorsMetadata* metadata);
  // Under FSDP, how a checkpoint's full optimizer state maps onto this rank's shards (for
  // load_optimizer_file); nullptr under DDP.
  const StateLayout* state_layout() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The training step of pretrain and bench, eager or compiled.
class TrainStep {
 public:
  // update_inside: the optimizer's update is part of the step (compiled with it); otherwise the
  // caller reads the losses and the norm, then calls update() if it wants the update.
  // `dp` (data parallelism): compiled too, its collectives in the trace (docs/distributed.md).
  // cuda_graphs: CompileOptions::cuda_graphs of the compiled step.
  TrainStep(GPT& model, optim::Optimizer& opt, std::string precision, double clip, bool compiled,
            bool update_inside = true, DataParallel* dp = nullptr, bool cuda_graphs = true)
      : fn_{model, opt, model->parameters(), std::move(precision), clip, update_inside, dp} {
    if (compiled) {
      compiled_.emplace(fn_, CompileOptions().name("train_step").cuda_graphs(cuda_graphs));
    }
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
    DataParallel* dp;
    std::vector<Tensor> operator()(const std::vector<Tensor>& xs, const std::vector<Tensor>& ys) {
      return train_step(model, opt, params, xs, ys, precision, clip, update, dp);
    }
  };
  Fn fn_;
  std::optional<CompiledFunction<Fn>> compiled_;
};

// "compile: 2 traces (trace 812 ms, ...), 98 replays": what the compiled step cost.
void log_compile_stats(const TrainStep& step, std::ostream& log);

// The kernels' one-time setup counters (kiln::cuda::kernel_setup_stats and the generated
// kernels'), read before and after a step: kernel_setup_text says what the step spent there,
// "matmul autotune 0.96 s (17 shapes), cuDNN attention plans 1.12 s (5 built), ...".
struct KernelSetupReading {
  cuda::KernelSetupStats kernels;
  compiler::FusedCudaStats fused;
  static KernelSetupReading now();
};
std::string kernel_setup_text(const KernelSetupReading& before, const KernelSetupReading& after);

// AdamW with decoupled weight decay on the 2-D weights only (norms and biases get none).
std::unique_ptr<optim::AdamW> make_optimizer(const GPT& model, const PretrainOptions& o);

std::string format_number(double v, int precision, bool scientific = false);

// Writes model-<step>.safetensors, optimizer-<step>.safetensors, then trainer_state.json (and
// trainer_state-<step>.json when more than one checkpoint is kept), each atomically; then
// removes the files of checkpoints beyond the newest keep_checkpoints. A step that has files in
// `dir` already is saved as model-<step>.<generation>.safetensors (and optimizer-...), the next
// generation, so that trainer_state.json's rename publishes the whole checkpoint at once; the
// files it replaces are removed after.
// `write_model` and `write_optimizer` write the two files at the path they are given.
void save_checkpoint(const std::string& dir,
                     const std::function<void(const std::string&)>& write_model,
                     const std::function<void(const std::string&)>& write_optimizer,
                     const std::string& config, const PretrainOptions& o, int64_t step,
                     const CheckpointInfo::Schedule& schedule,
                     const std::optional<pretrain::LoaderState>& loader);
// Temporary files of a save that was killed (write_file_atomically's "<name>.tmp.<pid>.<hex>"
// beside a checkpoint file, trainer_state.json or a metrics file): removed at the next start.
void remove_stale_temporaries(const std::string& dir);
// The model and optimizer files of trainer_state.json's step that neither it nor that step's
// trainer_state-<step>.json names: what a save of the same step again left when it was killed
// before removing them (save_checkpoint gives such a save new names). Removed at the next start.
void remove_superseded_files(const std::string& dir);
// trainer_state.json's reader (read_checkpoint_info) on any state file: trainer_state-<step>.json.
std::optional<CheckpointInfo> read_state_file(const std::string& path);
// Creates `dir` and checks that files can be created in it, before any training.
void check_output_dir(const std::string& dir);
// Errors unless `path` is a regular file: no such file, a directory, a FIFO (whose open would
// wait for a writer) are each named.
void check_regular_file(const std::string& path);
// Loads a checkpoint's model file into `model`, and an optimizer file into `opt`, after checking
// that it is a regular file and that every tensor has exactly the dtype and shape expected
// (errors name the file, the tensor, what was expected and what was found).
void load_model_file(GPT& model, const std::string& path);
// With `layout` (FSDP), the file's buffers have the full shapes and are sliced to the shards.
void load_optimizer_file(optim::Optimizer& opt, const std::string& path,
                         const StateLayout* layout = nullptr);
// The names of the parameters holding a NaN or an infinity (empty when all are finite).
std::vector<std::string> nonfinite_parameters(const GPT& model);

}  // namespace kiln::models::internal
