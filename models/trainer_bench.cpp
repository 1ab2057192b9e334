// `kiln bench` (models/trainer.h): training-step throughput on random tokens.
#include <chrono>
#include <iomanip>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

#include "kernels/cuda.h"
#include "models/trainer_internal.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"
#include "tensor/random.h"

namespace kiln::models {

using internal::check_precision;
using internal::DataParallel;
using internal::log_compile_stats;
using internal::make_optimizer;
using internal::param_dtype;
using internal::TrainStep;
using Clock = std::chrono::steady_clock;

BenchResult bench(const BenchOptions& o, std::ostream& log) {
  KILN_CHECK(o.batch_size > 0 && o.seq_len > 0 && o.steps > 0 && o.warmup_steps >= 0 &&
                 o.profile_steps >= 0,
             "[bench] batch, seq, steps must be positive and warmup and profile steps >= 0");
  check_precision(o.precision, "bench");
  const ModelConfig cfg = ModelConfig::from_name(o.config_name);
  KILN_CHECK(o.seq_len <= cfg.block_size, "[bench] seq_len ", o.seq_len, " exceeds the block_size ",
             cfg.block_size, " of ", cfg.name);
  std::unique_ptr<DataParallel> dp;
  if (!o.dist.empty()) {
    DataParallel::check_mode(o.dist, o.compile, "bench");
    dp = std::make_unique<DataParallel>(o.dist,
                                        o.device ? o.device->is_cuda() : default_device().is_cuda(),
                                        "bench", o.peer_all_reduce);
  }
  const Device device = dp ? dp->device() : o.device.value_or(default_device());
  const bool on_cuda = device.is_cuda();
  manual_seed(o.seed);
  GPT model(cfg, TensorOptions().device(device).dtype(param_dtype(o.precision)));
  model->train();
  BenchResult r;
  r.num_parameters = model->num_parameters();
  PretrainOptions po;
  po.lr = 1e-4;
  po.weight_decay = 0.1;
  po.adam_state_in_param_dtype = o.adam_state_in_param_dtype;
  auto opt = make_optimizer(model, po);
  if (dp) {
    dp->wrap(model, *opt, o.comm_sm_carveout, o.ddp_bucket_mb, o.ddp_tail_buckets);
    r.world_size = dp->world();
    r.rank = dp->rank();
    manual_seed(o.seed + static_cast<uint64_t>(dp->rank()));  // each rank its own tokens
  }
  const internal::MatmulAutotuneScope autotune(on_cuda, o.matmul_autotune);
  TrainStep train(model, *opt, o.precision, /*clip=*/1.0, o.compile, /*update_inside=*/true,
                  dp.get(), o.cuda_graphs);
  std::ostringstream null_log;  // the other ranks' lines go nowhere: rank 0 reports
  std::ostream& out = dp && dp->rank() != 0 ? null_log : log;
  out << "bench " << cfg.name << " (" << r.num_parameters << " parameters), device " << device.str()
      << ", precision " << o.precision << ", batch " << o.batch_size << " x seq " << o.seq_len
      << (dp ? " per rank" : "") << ", " << o.warmup_steps << " warm-up + " << o.steps
      << " timed steps" << (o.compile ? ", compiled" : "");
  if (dp) out << ", " << dp->mode() << " over " << dp->world() << " ranks";
  out << "\n" << std::flush;
  Tensor last_loss;
  auto train_step = [&]() {
    Tensor tokens = randint(0, cfg.vocab_size, {o.batch_size, o.seq_len + 1},
                            TensorOptions().dtype(kInt64).device(device));
    Tensor x = tokens.narrow(1, 0, o.seq_len).contiguous();
    Tensor y = tokens.narrow(1, 1, o.seq_len).contiguous();
    last_loss = train({x}, {y}).front();
  };
  auto warmup_step = [&] {
    const auto w0 = Clock::now();
    train_step();
    (void)last_loss.item<double>();  // waits for the device
    if (on_cuda) cuda::synchronize();
    r.warmup_step_s.push_back(std::chrono::duration<double>(Clock::now() - w0).count());
  };
  std::string first_setup;  // the first step's one-time kernel setup
  for (int64_t i = 0; i < o.warmup_steps; ++i) {
    std::optional<internal::KernelSetupReading> before;
    if (i == 0 && on_cuda) before = internal::KernelSetupReading::now();
    warmup_step();
    if (before)
      first_setup = internal::kernel_setup_text(*before, internal::KernelSetupReading::now());
  }
  // A compiled step that is still choosing how to run (a DDP program times its all-reduces op by
  // op and in CUDA graphs first: compiler/graph_trial.h) warms up until it has chosen.
  auto choosing = [&] {
    const compiler::CompileStats* s = train.stats();
    return s != nullptr && (s->cuda_graph == "measuring" || s->cuda_graph == "warm-up");
  };
  bool chose = false;
  for (int extra = 0; o.warmup_steps > 0 && extra < 20 && choosing(); ++extra) {
    warmup_step();
    chose = true;
  }
  // One step more after the choice: what the way not taken left (the last graph replay's
  // gradients, in graph memory) is replaced and trimmed before the peak is measured.
  if (chose) warmup_step();
  if (!r.warmup_step_s.empty()) {
    std::ostringstream steps;
    steps << std::fixed << std::setprecision(2);
    for (size_t i = 0; i < r.warmup_step_s.size(); ++i)
      steps << (i > 0 ? ", " : "") << r.warmup_step_s[i];
    out << "warm-up steps: " << steps.str() << " s (the first: the time to the first step done)\n";
    if (!first_setup.empty()) out << "the first step's kernel setup: " << first_setup << "\n";
  }
  if (on_cuda) {
    cuda::synchronize();
    cuda::reset_peak_memory_stats();
    // What the warm-up left: tensors alive (parameters, optimizer state, caches) and graph memory.
    const cuda::MemoryStats m = cuda::memory_stats();
    std::ostringstream line;
    line << std::fixed << std::setprecision(2)
         << "GPU memory as the timed steps start: " << static_cast<double>(m.allocated) / (1 << 30)
         << " GiB in tensors, " << static_cast<double>(m.graph) / (1 << 30)
         << " GiB in CUDA graphs\n";
    out << line.str();
  }
  if (dp) dp->barrier();  // the ranks start the timed steps together
  std::optional<cuda::PowerMonitor> power;
  if (on_cuda) power.emplace(device.index());
  const auto t0 = Clock::now();
  for (int64_t i = 0; i < o.steps; ++i) train_step();
  r.final_loss = last_loss.item<double>();  // waits for the device
  if (on_cuda) cuda::synchronize();
  // Before the power monitor stops: joining its sampling thread takes up to its 20 ms period.
  double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  if (power && power->available()) r.power = power->stop();
  if (dp) {
    seconds = dp->max(seconds);  // the slowest rank's time
    r.final_loss = dp->sum({r.final_loss})[0] / dp->world();
  }
  r.step_ms = 1e3 * seconds / static_cast<double>(o.steps);
  r.tokens_per_s = static_cast<double>(o.steps * o.batch_size * o.seq_len * r.world_size) / seconds;
  if (on_cuda) {
    r.mfu = cfg.flops_per_token(o.seq_len) * r.tokens_per_s / r.world_size / kPeakFlopsH100Bf16;
    r.peak_memory = cuda::memory_stats().peak;
    if (dp) r.peak_memory = static_cast<int64_t>(dp->max(static_cast<double>(*r.peak_memory)));
  }
  if (r.power) {
    const cuda::PowerReport& p = *r.power;
    std::ostringstream line;
    line << std::fixed << std::setprecision(0) << "GPU " << device.index()
         << " during the timed steps: SM clock " << p.mean_sm_clock_mhz << " MHz (max "
         << p.max_sm_clock_mhz << "), " << p.mean_power_watts << " W (limit " << p.power_limit_watts
         << "), " << std::setprecision(1) << p.energy_joules / static_cast<double>(o.steps)
         << " J a step, held back by the power "
         << "limit " << std::setprecision(0) << 100 * p.power_capped << "% of the time";
    if (p.thermal_capped > 0) line << ", by temperature " << 100 * p.thermal_capped << "%";
    out << line.str() << "\n";
  }
  log_compile_stats(train, out);
  if (o.profile_steps > 0) {
    profiler::Profiler prof;
    prof.start();
    for (int64_t i = 0; i < o.profile_steps; ++i) train_step();
    prof.stop();
    profiler::print_report(prof.results(), o.profile_steps, r.step_ms, out);
  }
  return r;
}

}  // namespace kiln::models
