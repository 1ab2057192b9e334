// Pretraining a GPT on a token file, checkpoints, resuming, and the training-step benchmark:
// what `kiln pretrain` and `kiln bench` run.
//
//   kiln::models::PretrainOptions opts;
//   opts.config_name = "kiln-tiny";
//   opts.data_path = "data/tinyshakespeare.txt";
//   opts.max_steps = 300;
//   opts.out_dir = "out/kiln-tiny";              // checkpoints; empty = none
//   auto summary = kiln::models::pretrain(opts, std::cout);
//   std::cout << summary.final_val_loss << "\n";
//
//   auto model = kiln::models::load_checkpoint("out/kiln-tiny", kiln::kCPU);  // for generating
//
// The loop: AdamW (decoupled weight decay on the 2-D weights only; norms get none), the lr
// schedule CosineAnnealingWithWarmup(warmup_steps, lr_decay_steps, min_lr), gradient
// accumulation over grad_accum_steps micro-batches (each loss divided by their number),
// clipping of the total gradient norm to grad_clip (as clip_grad_norm_, computed in tensors so
// that the step can be compiled). With compile, the whole step (zero_grad, the micro-batches'
// forward and backward, clipping, AdamW) runs through kiln::compile; the loop reads the losses
// and the norm it returns. The model is initialised after kiln::manual_seed(seed).
//
// Data (data_path): a text or token file (models/data.h): batches come from TokenDataset::batch
// with the run's seed and index step * grad_accum_steps + micro; or token shards, a directory or
// *.tokens files separated by commas (`kiln prepare`, docs/data.md): batches come from a
// kiln::pretrain::ShardLoader (pretrain/loader.h) seeded with the run's seed, whose position is
// saved in every checkpoint and restored on resume, so that a resumed run reads the sequences
// an uninterrupted one would; its validation part is the last 10% of the windows, at most 1024.
// Neither reads the global RNG.
//
// Progress: on a terminal (progress_bar unset and `log` is a terminal's std::cout) a bar with
// the ETA is redrawn after every step; otherwise, and always every log_interval steps, a line:
// step, loss (mean over the micro-batches), lr, gradient norm (before clipping), then tokens/s,
// on CUDA MFU = flops_per_token(seq_len) * tokens/s / 989 TFLOP/s (H100 bf16 dense peak), the
// memory (CUDA: allocated by tensors; CPU: the process's resident set) and the ETA. Every
// eval_interval steps and at the end it logs the mean loss over eval_batches fixed validation
// batches.
//
// Precision: "f32"; "bf16-true" (the model's parameters and activations in bf16; AdamW keeps
// its state in f32); "bf16-mixed" (f32 master weights; the forward runs under
// kiln::AutocastGuard, nn/autocast.h: matmuls and attention in bf16, norms, softmax and the loss
// in f32).
//
// Checkpoints (out_dir, every checkpoint_interval steps and at the end): model-<step>.safetensors
// (kiln::save of the model), optimizer-<step>.safetensors (Optimizer::save: moments, step counts,
// lrs), then trainer_state.json ({"config", "step", "precision", "model", "optimizer", ...,
// "loader": the shard loader's position when training on shards}),
// each written atomically. The json is written last and names the files it goes with, so a crash
// at any point leaves the previous complete checkpoint; files of checkpoints beyond the newest
// keep_checkpoints are removed after it, and temporary files of a killed save at the next start.
// A step saved again into the same directory (a run started over it) writes
// model-<step>.<generation>.safetensors and optimizer-...: never over the files the json names,
// so the json's rename publishes it whole too, and the files it replaced are removed after it
// (after a crash, at the next start).
// Beside the checkpoints: run.toml (the options as run, written before step 1:
// `kiln pretrain --config out/run.toml` repeats the run; models/run_config.h), metrics.jsonl (a
// line per step and per evaluation) and metrics.svg
// (train and validation loss and the lr against the step), refreshed at every logged line
// (pretrain/metrics.h). SIGINT or SIGTERM stops the run after the current step, with a
// checkpoint when out_dir is set (summary.stop_signal says which); a second one kills at once.
// With resume, a run restores the model, the optimizer and the step from out_dir and continues
// bit-exactly as an uninterrupted run (same batches, same schedule; the checkpoint's config
// must match). The schedule (lr, min_lr, warm-up and decay steps, as run), the seed, the data, the
// batch, seq_len and grad_accum_steps are stored in the state; a resume whose options differ is
// an error listing the differences (lr_decay_steps 0 takes the stored schedule's length), unless
// allow_resume_changes. max_steps only says where the resumed run stops: a run that will be
// resumed further sets lr_decay_steps to the whole run's length. Resuming at or past max_steps
// trains nothing and says so. A checkpoint of a config that is not in the registry cannot be
// reloaded by name. Loading checks every tensor of the model and optimizer files against the
// model's and the optimizer's (dtype, shape, the optimizer's buffers), and opens only regular
// files.
//
// Non-finite values: the loss and the gradient norm are checked after every step and the
// weights before every save. A non-finite one stops the run with an error naming the step and
// the value, before anything is saved, so the last good checkpoint stays; with skip_nonfinite
// a step with a non-finite loss or gradient norm is skipped instead (checked before the update;
// with compile the update then runs eagerly, outside the compiled step).
// The file names in trainer_state.json must be plain names inside the directory (no '/', no
// ".."): a crafted state file cannot make the trainer read or delete files elsewhere. The output
// directory is created and checked writable, and an existing trainer_state.json read, before the
// first step, so that such errors come at the start of a run, not at its end.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda.h"
#include "models/config.h"
#include "models/gpt.h"
#include "pretrain/loader.h"
#include "tensor/device.h"

namespace kiln::models {

struct PretrainOptions {
  std::string config_name = kDefaultConfig;
  std::optional<ModelConfig> config;  // when set, used instead of config_name
  // A Hugging Face checkpoint directory (config.json, model.safetensors or shards with
  // model.safetensors.index.json, tokenizer.json): when set, used instead of config_name (with
  // config too is an error). Its config.json gives the model and its weights the parameters at
  // step 0 (continued pretraining, fine-tuning); a resume takes the weights from out_dir. Its
  // tokenizer.json tokenises a text data file (one document, without special tokens, as kiln
  // prepare encodes each one) and must be the tokenizer of token shards (their fingerprint);
  // without one, text data is an error. Data ids must be below the model's vocab_size.
  std::string hf_dir;
  // Text (byte tokens), .bin/.u16/.u32 (models/data.h), or token shards: a directory or
  // *.tokens files separated by commas (docs/data.md).
  std::string data_path;
  int64_t batch_size = 16;
  int64_t seq_len = 128;       // <= the config's block_size
  int64_t max_steps = 300;     // the run ends after this step
  int64_t lr_decay_steps = 0;  // the schedule's total steps; 0 = max_steps
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 30;  // capped at the schedule's length
  double weight_decay = 0.1;
  std::tuple<double, double> betas = {0.9, 0.95};
  double eps = 1e-8;
  // AdamW's moments in the parameters' dtype (bf16 under bf16-true, as PyTorch's AdamW keeps them
  // for bf16 parameters: half the optimizer memory) instead of f32.
  bool adam_state_in_param_dtype = false;
  double grad_clip = 1.0;  // 0 = no clipping (the norm is still logged)
  int64_t grad_accum_steps = 1;
  std::string precision = "f32";  // "f32" | "bf16-true" | "bf16-mixed"
  std::optional<Device> device;   // default: default_device()
  int64_t log_interval = 10;
  int64_t eval_interval = 100;  // 0 = only at the end
  int64_t eval_batches = 8;
  std::string out_dir;              // empty = no checkpoints
  int64_t checkpoint_interval = 0;  // 0 = only at the end
  // Checkpoints kept: the newest keep_checkpoints; with more than one, each also has its own
  // trainer_state-<step>.json (copy it over trainer_state.json to resume from it).
  int64_t keep_checkpoints = 1;
  bool resume = false;
  // A resume must run as the checkpoint's run did: the same data, batch_size, seq_len,
  // grad_accum_steps, seed and schedule (lr, min_lr, warm-up; lr_decay_steps 0 takes the
  // checkpoint's), else it is an error listing the differences. With allow_resume_changes the
  // options win (the schedule too), and a line lists what changed.
  bool allow_resume_changes = false;
  // A step whose loss or gradient norm is not finite stops the run with an error naming the
  // step (the last good checkpoint stays). With skip_nonfinite the step is skipped instead: no
  // update (the optimizer state is untouched), the schedule moves on, a line says so.
  bool skip_nonfinite = false;
  uint64_t seed = 1337;
  // Runs the training step through kiln::compile (docs/compiler.md): traced on steps 1 and 2,
  // replayed after; the same kernels, so the same losses as eager.
  bool compile = false;
  // With compile on CUDA: the step's GPU work runs as CUDA graphs (CompileOptions::cuda_graphs).
  bool cuda_graphs = true;
  // On CUDA, for the run: matrix products choose their cuBLASLt algorithm per shape by timing the
  // candidates at the shape's first call (kiln::cuda::set_matmul_autotune; restored afterwards).
  // Ignored with deterministic (a timed choice may differ from run to run).
  bool matmul_autotune = true;
  // Deterministic algorithms for the run (tensor/deterministic.h): the CUDA attention backward
  // runs its ordered decomposition instead of the flash kernels, so that the same run gives the
  // same bits every time and --resume continues bit-exactly on CUDA too. Slower attention
  // backward and more memory; on the CPU nothing changes (every CPU kernel is deterministic).
  bool deterministic = false;
  // Data parallelism over the ranks that `kiln run` started (dist/launcher.h; docs/distributed.md):
  // "" (one process), "ddp" (DistributedDataParallel), "zero3" or its alias "fsdp" (FSDP: the
  // parameters, gradients and optimizer state sharded, each block gathered for its forward and
  // again for its backward), "zero2" (FSDP keeping the gathered parameters from the forward to
  // the end of backward). NCCL on CUDA (each rank on GPU LOCAL_RANK), Gloo on the CPU.
  // batch_size is per rank: a step takes the global batch of batch_size x world_size sequences
  // (from a text or token file: rank r takes rows r * batch_size .. of the global batch that one
  // process would draw with batch_size x world_size, so the run equals that process's; from token
  // shards: the loader's disjoint rank parts). Rank 0 logs, writes the metrics and the
  // checkpoints; checkpoints hold the full model and optimizer state whatever the mode, so a run
  // resumes under another mode or world size, or in one process (trainer_state.json stores the
  // global batch, batch_size x world_size, which a resume must keep). Not with compile yet.
  std::string dist;
  // nullopt: a progress bar when `log` is a terminal (pretrain::Progress::is_terminal), else
  // plain lines; true / false force one.
  std::optional<bool> progress_bar;
  // Called before each step with the step and the model (after the batches are drawn, before
  // the forward): to watch the weights, or in tests to inject a fault at a given step.
  std::function<void(int64_t step, GPT& model)> before_step;

  // Throws "[pretrain] ..." naming the first bad option.
  void validate() const;
};

struct PretrainSummary {
  int64_t start_step = 0;            // > 0 when resumed
  int64_t steps = 0;                 // the last step done
  double final_train_loss = 0;       // the last step's loss
  double final_val_loss = 0;         // the last evaluation's (NaN when the split is empty)
  double tokens_per_s = 0;           // training steps only, the first step excluded when possible
                                     // (with dist: every rank's tokens)
  int world_size = 1;                // ranks (with dist)
  int rank = 0;                      // this process's rank (with dist; only rank 0 logs)
  std::optional<double> mfu;         // on CUDA only
  double seconds = 0;                // wall time of the whole call
  std::vector<double> train_losses;  // per step done in this call
  int64_t compile_traces = 0;        // with compile: steps that traced, and steps that replayed
  int64_t compile_replays = 0;
  int stop_signal = 0;  // SIGINT or SIGTERM when one stopped the run (after a checkpoint)
  std::vector<int64_t> skipped_steps;  // with skip_nonfinite: the steps skipped
};

// cuda if kiln::cuda::is_available(), else cpu.
Device default_device();
// The H100's dense bf16 peak used for MFU.
inline constexpr double kPeakFlopsH100Bf16 = 989e12;

PretrainSummary pretrain(const PretrainOptions& options, std::ostream& log);

// What trainer_state.json says.
struct CheckpointInfo {
  std::string config;
  int64_t step = 0;
  std::string precision;
  std::string model_file;  // a file name inside the directory
  std::string optimizer_file;
  std::optional<pretrain::LoaderState> loader;  // when the run trained on token shards
  // The settings that shape the run (absent in checkpoints of older kilns).
  std::optional<uint64_t> seed;
  std::optional<int64_t> seq_len;
  std::optional<int64_t> batch_size;
  std::optional<int64_t> grad_accum_steps;
  std::optional<std::string> data;    // the data path as the run was given it
  std::optional<std::string> hf_dir;  // PretrainOptions::hf_dir of a run started from one
  struct Schedule {
    double lr = 0, min_lr = 0;
    int64_t warmup_steps = 0, lr_decay_steps = 0;
  };
  std::optional<Schedule> schedule;
};
// Reads <dir>/trainer_state.json; nullopt when there is none. Errors on a malformed one (duplicate
// keys, numbers out of range: a negative or absurd step, an unknown precision, non-positive
// sizes), on one that is not a regular file (a FIFO, a directory), and on file names that are
// not plain names inside `dir`.
std::optional<CheckpointInfo> read_checkpoint_info(const std::string& dir);
// The checkpoint's model (config from the registry by name, or from the config.json of the
// hf_dir it was started from) on `device`, in f32 or, for a bf16-true checkpoint, bf16. Every
// tensor of the file must have exactly the dtype and shape of the model's (an I32 tensor where F32
// is expected is an error naming the file and tensor).
GPT load_checkpoint(const std::string& dir, Device device);

// Training-step throughput on random tokens (what `kiln bench` prints): warmup_steps steps
// first (not timed), then `steps` timed steps of forward, backward and AdamW.
struct BenchOptions {
  std::string config_name;
  int64_t batch_size = 4;
  int64_t seq_len = 256;
  int64_t steps = 10;
  int64_t warmup_steps = 3;
  std::string precision = "bf16-true";
  std::optional<Device> device;
  uint64_t seed = 0;
  bool compile = false;                    // as PretrainOptions::compile
  bool cuda_graphs = true;                 // as PretrainOptions::cuda_graphs
  bool matmul_autotune = true;             // as PretrainOptions::matmul_autotune
  bool adam_state_in_param_dtype = false;  // as PretrainOptions::adam_state_in_param_dtype
  // As PretrainOptions::dist: batch_size per rank; tokens_per_s counts every rank's tokens and
  // peak_memory is the largest rank's.
  std::string dist;
  // After the timed steps, this many more run under kiln::profiler and the report (time per
  // kernel family, the slowest kernels) goes to the log.
  int64_t profile_steps = 0;
  // Under dist "ddp" on CUDA: SMs the matrix products leave to the gradients' all-reduces during
  // the backward (dist::DDPOptions::comm_sm_carveout).
  int comm_sm_carveout = 0;
  // Under dist "ddp": the gradient buckets' size in MiB (dist::DDPOptions::bucket_cap_mb, torch
  // DDP's bucket_cap_mb); unset: DDP's default.
  std::optional<double> ddp_bucket_mb;
  // Under dist "ddp": how many of the last buckets take the all-reduce that is fastest alone
  // (dist::DDPOptions::tail_buckets); unset: DDP's default.
  std::optional<int> ddp_tail_buckets;
  // With dist on CUDA: DDP's gradient all-reduces between the GPUs of one host move with the copy
  // engines (dist::ProcessGroupNCCLOptions::peer_all_reduce); false: NCCL's kernels.
  bool peer_all_reduce = true;
};
struct BenchResult {
  int64_t num_parameters = 0;
  int world_size = 1;  // ranks (with dist)
  int rank = 0;        // this process's rank (with dist; only rank 0 logs)
  double step_ms = 0;
  double tokens_per_s = 0;
  std::optional<double> mfu;           // on CUDA
  std::optional<int64_t> peak_memory;  // bytes, on CUDA (peak allocated during timed steps)
  double final_loss = 0;
  // Wall time of each warm-up step, in seconds, waited for on the device: the first holds the
  // process's first kernels, plans and measured choices (and with compile, the tracing and the
  // compilation of the step), so it is the time until the first step is done.
  std::vector<double> warmup_step_s;
  // On CUDA, where NVML reads it: this rank's GPU during the timed steps (clocks, power, energy:
  // a step at the card's power limit runs at lowered clocks).
  std::optional<cuda::PowerReport> power;
};
BenchResult bench(const BenchOptions& options, std::ostream& log);

}  // namespace kiln::models
