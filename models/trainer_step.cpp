// The training step of `kiln pretrain` and `kiln bench` (models/trainer_internal.h): the loss in
// the run's precision, clipping as tensors, the optimizer.
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>

#include "autograd/grad_mode.h"
#include "kernels/cuda.h"
#include "models/trainer_internal.h"
#include "nn/autocast.h"
#include "tensor/error.h"
#include "tensor/foreach.h"
#include "tensor/ops.h"

namespace kiln::models::internal {

ScalarType param_dtype(const std::string& precision) {
  if (precision == "bf16-true") return kBFloat16;
  return kFloat;
}

MatmulAutotuneScope::MatmulAutotuneScope(bool on_cuda, bool enabled) {
  if (!on_cuda) return;
  set_ = true;
  previous_ = cuda::matmul_autotune();
  cuda::set_matmul_autotune(enabled);
}

MatmulAutotuneScope::~MatmulAutotuneScope() {
  if (set_) cuda::set_matmul_autotune(previous_);
}

void check_precision(const std::string& precision, const char* who) {
  KILN_CHECK(precision == "f32" || precision == "bf16-true" || precision == "bf16-mixed", "[", who,
             "] precision must be f32, bf16-true or bf16-mixed, got '", precision, "'");
}

Tensor precision_loss(GPT& model, const Tensor& x, const Tensor& y, const std::string& precision) {
  AutocastGuard autocast(x.device().type(), kBFloat16, /*enabled=*/precision == "bf16-mixed");
  return model->loss(x, y);
}

// Clipping as tensors, so that a compiled step can run it (clip_grad_norm_ reads the norm with
// item()): the total 2-norm of the gradients, their norms (foreach_norm: f32 for f32 and bf16
// gradients, accumulated in f64 on the CPU and in f32 on the GPU) combined in f64, and every
// gradient scaled in place by min(1, max_norm / (total + 1e-6)), as torch's clip_grad_norm_, by
// foreach_mul_ with the coefficient left on the device. One foreach_norm and one foreach_mul_ per
// dtype and device of the gradients (multi-tensor kernels: a few launches, no host sync). With
// `coef`, the gradients are left as they are and the coefficient (0-d f64, on the first
// gradient's device) is returned there instead, for the optimizer to fold into its update.
// Returns the total, a 0-d f64 tensor.
Tensor clip_grad_norm(const std::vector<Tensor>& params, double max_norm,
                      const std::function<void(Tensor&)>& reduce_squares, Tensor* coef_out) {
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const Tensor& p : params) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (grads.empty()) {
    if (coef_out != nullptr) *coef_out = Tensor();  // nothing to scale: a plain step
    return zeros({}, kFloat64);
  }
  const std::vector<std::vector<Tensor>> groups = foreach_groups(grads);
  const Device device = groups[0][0].device();
  std::vector<Tensor> norms;
  for (const std::vector<Tensor>& g : groups) {
    norms.push_back(stack(foreach_norm(g, 2.0)).to(device, kFloat64));
  }
  Tensor squares = (norms.size() == 1 ? norms[0] : cat(norms)).square().sum().reshape({1});
  if (reduce_squares) reduce_squares(squares);
  const Tensor total = squares.reshape({}).sqrt();
  const Tensor coef = (max_norm / (total + 1e-6)).clamp_max(1.0);
  if (coef_out != nullptr) {
    *coef_out = coef;
    return total;
  }
  for (const std::vector<Tensor>& g : groups) foreach_mul_(g, coef.to(g[0].device()));
  return total;
}

std::vector<Tensor> train_step(GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& params,
                               const std::vector<Tensor>& xs, const std::vector<Tensor>& ys,
                               const std::string& precision, double clip, bool update,
                               DataParallel* dp) {
  opt.zero_grad();
  std::vector<Tensor> out;
  for (size_t i = 0; i < xs.size(); ++i) {
    auto micro_loss = [&] {
      Tensor loss = precision_loss(model, xs[i], ys[i], precision);
      if (xs.size() > 1) loss = loss / static_cast<double>(xs.size());
      return loss;
    };
    if (dp != nullptr) {
      out.push_back(dp->forward_backward(micro_loss, /*sync=*/i + 1 == xs.size()));
      continue;
    }
    Tensor loss = micro_loss();
    loss.backward();
    out.push_back(loss.detach());
  }
  // Clipping folded into the update where the optimizer can (Adam, AdamW): it reads every gradient
  // anyway, and nothing reads the clipped gradients but the update. Without the update here (the
  // caller runs it later, TrainStep::update), the gradients are clipped in place.
  const bool fold = update && opt.supports_grad_factor();
  Tensor coef;
  Tensor* coef_out = fold ? &coef : nullptr;
  out.push_back(dp != nullptr ? dp->clip_grad_norm(params, clip, coef_out)
                              : clip_grad_norm(params, clip, {}, coef_out));
  if (fold) {
    opt.step_with_grad_factor(coef);
  } else if (update) {
    opt.step();
  }
  return out;
}

KernelSetupReading KernelSetupReading::now() {
  return {cuda::kernel_setup_stats(), compiler::fused_cuda_stats()};
}

std::string kernel_setup_text(const KernelSetupReading& before, const KernelSetupReading& after) {
  const cuda::KernelSetupStats& a = before.kernels;
  const cuda::KernelSetupStats& b = after.kernels;
  std::ostringstream t;
  t << std::fixed << std::setprecision(2) << "matmul autotune "
    << b.matmul_timing_s - a.matmul_timing_s << " s ("
    << b.matmul_shapes_timed - a.matmul_shapes_timed << " shapes), cuDNN attention plans "
    << b.attention_build_s - a.attention_build_s << " s ("
    << b.attention_plans_built - a.attention_plans_built << " built), attention kernels timed "
    << b.attention_timing_s - a.attention_timing_s << " s ("
    << b.attention_shapes_timed - a.attention_shapes_timed
    << " shapes); timed choices: " << b.choices_read - a.choices_read << " from the disk cache, "
    << b.choices_written - a.choices_written
    << " stored; generated kernels: " << after.fused.nvrtc_compiles - before.fused.nvrtc_compiles
    << " compiled, " << after.fused.disk_hits - before.fused.disk_hits << " from the disk cache";
  return t.str();
}

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
  // Whether the step ran as CUDA graphs (CompileOptions::cuda_graphs), and why not.
  log << "\n  CUDA graphs: " << s->cuda_graph;
  if (!s->graph_reason.empty()) log << " (" << s->graph_reason << ")";
  if (s->graph_captures + s->graph_replays > 0) {
    log << ", " << s->graph_captures << (s->graph_captures == 1 ? " capture, " : " captures, ")
        << s->graph_replays << " replays";
    auto mib = [](int64_t bytes) {
      std::ostringstream m;
      m << std::fixed << std::setprecision(1) << static_cast<double>(bytes) / (1 << 20) << " MiB";
      return m.str();
    };
    log << ", static inputs " << mib(s->graph_static_bytes) << ", kept in graph memory "
        << mib(s->graph_kept_bytes);
  }
  for (const std::string& why : s->graph_recapture_reasons) log << "\n  captured again: " << why;
  log << "\n" << std::flush;
}

namespace {

std::vector<Tensor> params_where(const GPT& model, bool two_d) {
  std::vector<Tensor> out;
  for (const Tensor& p : model->parameters()) {
    if ((p.dim() >= 2) == two_d) out.push_back(p);
  }
  return out;
}

}  // namespace

std::unique_ptr<optim::AdamW> make_optimizer(const GPT& model, const PretrainOptions& o) {
  const auto defaults = optim::AdamWOptions(o.lr)
                            .betas(o.betas)
                            .eps(o.eps)
                            .weight_decay(o.weight_decay)
                            .state_in_param_dtype(o.adam_state_in_param_dtype);
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(params_where(model, true));
  std::vector<Tensor> no_decay = params_where(model, false);
  if (!no_decay.empty()) {
    groups.emplace_back(no_decay, std::make_unique<optim::AdamWOptions>(
                                      optim::AdamWOptions(defaults).weight_decay(0.0)));
  }
  return std::make_unique<optim::AdamW>(groups, defaults);
}

std::string format_number(double v, int precision, bool scientific) {
  std::ostringstream s;
  if (scientific)
    s << std::scientific;
  else
    s << std::fixed;
  s << std::setprecision(precision) << v;
  return s.str();
}

}  // namespace kiln::models::internal
