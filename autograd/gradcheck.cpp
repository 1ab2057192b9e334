#include "autograd/gradcheck.h"

#include <cmath>

#include "autograd/grad_mode.h"
#include "tensor/ops.h"

namespace kiln::autograd {
namespace {

// Output of fn flattened to doubles, evaluated without recording.
std::vector<double> eval(const GradcheckFn& fn, const variable_list& inputs) {
  NoGradGuard no_grad;
  return fn(inputs).to_vector<double>();
}

}  // namespace

bool gradcheck(const GradcheckFn& fn, const variable_list& inputs, const GradcheckOptions& o) {
  for (const Tensor& in : inputs) {
    if (in.defined() && in.requires_grad()) {
      KILN_CHECK(in.dtype() == kDouble, "[gradcheck] inputs that require grad should be float64, "
                 "got ", dtype_name(in.dtype()));
    }
  }
  const Tensor out = fn(inputs);
  const int64_t n_out = out.numel();
  variable_list diff_inputs;
  std::vector<size_t> which;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      diff_inputs.push_back(inputs[i]);
      which.push_back(i);
    }
  }
  KILN_CHECK(!diff_inputs.empty(), "[gradcheck] no input requires grad");
  // Analytical Jacobian rows: one backward per output element.
  std::vector<std::vector<std::vector<double>>> analytical(diff_inputs.size());
  for (int64_t j = 0; j < n_out; ++j) {
    Tensor go = zeros_like(out);
    go.view({-1})[j] = 1.0;
    variable_list g = out.requires_grad()
                          ? grad({out}, diff_inputs, {go}, /*retain_graph=*/true, false,
                                 /*allow_unused=*/true)
                          : variable_list(diff_inputs.size());
    for (size_t k = 0; k < diff_inputs.size(); ++k) {
      analytical[k].push_back(g[k].defined() ? g[k].contiguous().to_vector<double>()
                                             : std::vector<double>(diff_inputs[k].numel(), 0.0));
    }
  }
  // Numerical columns: perturb each input element in place (inputs are leaves: no grad mode).
  for (size_t k = 0; k < diff_inputs.size(); ++k) {
    Tensor x = diff_inputs[k];
    Tensor flat = x.detach().view({-1});  // detached alias: in-place writes reach x's storage
    KILN_CHECK(x.is_contiguous(), "[gradcheck] inputs must be contiguous");
    for (int64_t i = 0; i < x.numel(); ++i) {
      const double orig = flat[i].item<double>();
      flat[i] = orig + o.eps;
      const std::vector<double> plus = eval(fn, inputs);
      flat[i] = orig - o.eps;
      const std::vector<double> minus = eval(fn, inputs);
      flat[i] = orig;
      for (int64_t j = 0; j < n_out; ++j) {
        const double numerical = (plus[j] - minus[j]) / (2 * o.eps);
        const double a = analytical[k][j][i];
        KILN_CHECK(std::abs(a - numerical) <= o.atol + o.rtol * std::abs(numerical),
                   "[gradcheck] Jacobian mismatch for input ", which[k], " (shape ",
                   shape_str(x.sizes()), "), output element ", j, ", input element ", i,
                   ": analytical ", a, " vs numerical ", numerical);
      }
    }
  }
  return true;
}

bool gradgradcheck(const GradcheckFn& fn, const variable_list& inputs, const GradcheckOptions& o) {
  variable_list diff_inputs;
  for (const Tensor& in : inputs) {
    if (in.defined() && in.requires_grad()) diff_inputs.push_back(in);
  }
  Tensor probe;
  {
    NoGradGuard no_grad;
    probe = fn(inputs);
  }
  // A fixed random cotangent makes the vector-Jacobian product a scalar-valued check per input.
  Tensor v = randn(probe.sizes(), TensorOptions(kDouble)).requires_grad_(true);
  variable_list all = inputs;
  all.push_back(v);
  const size_t n = inputs.size();
  auto vjp = [&fn, n](const variable_list& xs) {
    // gradcheck evaluates its function under NoGradGuard for the finite differences; the
    // vector-Jacobian product needs the graph of fn all the same.
    AutoGradMode enable_grad(true);
    variable_list ins(xs.begin(), xs.begin() + n);
    variable_list diff;
    for (const Tensor& t : ins) {
      if (t.defined() && t.requires_grad()) diff.push_back(t);
    }
    Tensor out = fn(ins);
    variable_list g = grad({out}, diff, {xs[n]}, true, /*create_graph=*/true, true);
    // Concatenate the gradients (zeros for unused inputs) into one output.
    variable_list parts;
    for (size_t i = 0; i < g.size(); ++i) {
      parts.push_back(g[i].defined() ? g[i].reshape({-1}) : zeros({diff[i].numel()}, kDouble));
    }
    return cat(parts, 0);
  };
  return gradcheck(vjp, all, o);
}

}  // namespace kiln::autograd
