// foreach_norm and foreach_mul_, the multi-tensor ops of gradient clipping (as torch's
// _foreach_norm and _foreach_mul_.Tensor), with their decompositions (API: tensor/foreach.h; call
// layout and support rule: tensor/ops/foreach.h; kernels: kernels/cpu/foreach.cpp and
// kernels/cuda/foreach.cu, the latter on the multi-tensor tables of kernels/cuda/multi_tensor.cuh;
// callers: models/trainer.cpp's clip_grad_norm, nn/utils/clip_grad.cpp; tests:
// tests/tensor/foreach_test.cpp, tests/kernels/gpu_foreach_test.cpp; benchmark: the clip rows of
// benchmarks/gpu/gpu_bench.cu). They have no backward: clipping runs under NoGradGuard.
//
// foreach_norm(tensors[n]; n, ord) returns n 0-d tensors, t.norm(ord) of each tensor, f64 for
// f64 tensors and f32 for f32, bf16 and f16 ones: t.to(kFloat).norm(ord), which t.norm(ord)
// rounds to t's dtype. Every ord of norm (0, 1, 2, inf, -inf, any p).
// foreach_mul_(tensors[n], scale; n) does t.mul_(scale) for each tensor: scale is a 0-d floating
// tensor on the tensors' device or on the CPU (allow_cpu_scalars).
//
// One call takes floating tensors of one dtype on one device. Contiguous tensors go to the
// kernels; a call with another goes through the decomposition (the loop of t.norm / t.mul_).
#include "tensor/ops/foreach.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "tensor/foreach.h"
#include "tensor/ops.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {

namespace internal {

namespace {

int64_t list_length(const OpCall& c) {
  const int64_t n = c.attr<int64_t>(0);
  KILN_CHECK(n >= 0, "[", c.name(), "] the list length n must be non-negative, got ", n);
  return n;
}

}  // namespace

ForeachNormCall::ForeachNormCall(const OpCall& c) : ord(c.attr<double>(1)) {
  const int64_t n = list_length(c);
  KILN_CHECK(static_cast<int64_t>(c.inputs.size()) == n, "[foreach_norm] expected ", n,
             " tensors for n = ", n, ", got ", c.inputs.size());
  tensors = TensorList(c.inputs.data(), c.inputs.size());
}

ForeachMulCall::ForeachMulCall(const OpCall& c) {
  const int64_t n = list_length(c);
  KILN_CHECK(static_cast<int64_t>(c.inputs.size()) == n + 1, "[foreach_mul_] expected ", n + 1,
             " tensors for n = ", n, " (the tensors, then the scale), got ", c.inputs.size());
  tensors = TensorList(c.inputs.data(), static_cast<size_t>(n));
  scale = c.inputs.back();
}

ScalarType foreach_norm_result_dtype(ScalarType dtype) {
  return dtype == kDouble ? kDouble : kFloat;
}

bool foreach_supported(const OpCall& c) {
  const bool mul = c.name() == "foreach_mul_";
  const size_t n = static_cast<size_t>(c.attr<int64_t>(0));
  for (size_t i = 0; i < n; ++i) {
    const Tensor& t = c.inputs[i];
    if (!t.is_contiguous()) return false;
    if (mul && t.dim() == 0 && promote_types(t.dtype(), c.inputs.back().dtype()) != t.dtype()) {
      return false;
    }
  }
  return true;
}

}  // namespace internal

namespace {

using internal::ForeachMulCall;
using internal::ForeachNormCall;

// "tensors[3]": entry i of the list, for messages.
std::string entry(size_t i) { return "tensors[" + std::to_string(i) + "]"; }

// Floating tensors of one dtype and device (tensors[0]'s).
void check_list(const char* op, TensorList tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    const Tensor& t0 = tensors[0];
    KILN_CHECK(t.defined(), "[", op, "] ", entry(i), " is undefined");
    KILN_CHECK(is_floating_point(t.dtype()), "[", op, "] expected floating-point tensors, got ",
               dtype_name(t.dtype()), " for ", entry(i), " of shape ", shape_str(t.sizes()));
    KILN_CHECK(t.dtype() == t0.dtype(), "[", op, "] ", entry(i), " has dtype ",
               dtype_name(t.dtype()), " but tensors[0] has ", dtype_name(t0.dtype()),
               ": one call takes tensors of one dtype (group them by dtype and device)");
    KILN_CHECK(t.device() == t0.device(), "[", op, "] ", entry(i), " is on ", t.device().str(),
               " but tensors[0] is on ", t0.device().str(),
               ": one call takes tensors of one device (group them by dtype and device)");
  }
}

// --- foreach_norm --------------------------------------------------------------------------------

SpecList foreach_norm_meta(const OpCall& c) {
  const ForeachNormCall f(c);
  KILN_CHECK(!std::isnan(f.ord), "[foreach_norm] ord must not be nan");
  check_list("foreach_norm", f.tensors);
  SpecList specs;
  specs.reserve(f.tensors.size());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    const Tensor& t = f.tensors[i];
    KILN_CHECK(!std::isinf(f.ord) || t.numel() != 0, "[foreach_norm] cannot compute the ",
               f.ord > 0 ? "" : "-", "inf norm of ", entry(i), ", which is empty (shape ",
               shape_str(t.sizes()), ")");
    specs.push_back({{}, internal::foreach_norm_result_dtype(t.dtype()), t.device()});
  }
  return specs;
}

// Each tensor's norm in the result dtype (bit for bit the CPU kernel's: the same reduction loop
// over the same values, accumulated in f64).
TensorVec foreach_norm_decomposition(const OpCall& c) {
  const ForeachNormCall f(c);
  TensorVec out;
  out.reserve(f.tensors.size());
  for (const Tensor& t : f.tensors) {
    const ScalarType rt = internal::foreach_norm_result_dtype(t.dtype());
    out.push_back((t.dtype() == rt ? t : t.to(rt)).norm(f.ord));
  }
  return out;
}

// --- foreach_mul_ --------------------------------------------------------------------------------

void foreach_mul_mutated(const OpCall& c, TensorVec& out) {
  const ForeachMulCall m(c);
  out.insert(out.end(), m.tensors.begin(), m.tensors.end());
}

SpecList foreach_mul_meta(const OpCall& c) {
  const ForeachMulCall m(c);
  const Tensor& s = m.scale;
  KILN_CHECK(s.defined(), "[foreach_mul_] the scale is undefined");
  KILN_CHECK(s.dim() == 0 && is_floating_point(s.dtype()),
             "[foreach_mul_] the scale must be a 0-d floating-point tensor, got a ",
             dtype_name(s.dtype()), " tensor of shape ", shape_str(s.sizes()), " on ",
             s.device().str());
  check_list("foreach_mul_", m.tensors);
  SpecList specs;
  specs.reserve(m.tensors.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const Tensor& t = m.tensors[i];
    KILN_CHECK(s.device() == t.device() || s.is_cpu(), "[foreach_mul_] the scale is on ",
               s.device().str(), " but ", entry(i), " is on ", t.device().str(),
               ": the scale must be on the tensors' device or on the CPU");
    KILN_CHECK(!t.is_same(s), "[foreach_mul_] the scale is ", entry(i), " itself: pass a copy");
    internal::check_inplace_result("foreach_mul_", t, t.sizes(), t.dtype());
    internal::check_no_partial_overlap("foreach_mul_", t, s);
    specs.push_back({to_shape(t.sizes()), t.dtype(), t.device()});
  }
  return specs;
}

// t.mul_(scale), tensor by tensor.
TensorVec foreach_mul_decomposition(const OpCall& c) {
  const ForeachMulCall m(c);
  TensorVec out;
  out.reserve(m.tensors.size());
  for (Tensor t : m.tensors) {
    t.mul_(m.scale);
    out.push_back(t);
  }
  return out;
}

}  // namespace

// Attributes: 0 n (int64), 1 ord (double). One 0-d output per tensor.
KILN_DEFINE_OP(foreach_norm, OpKind::kFunctional, foreach_norm_meta,
               OpFlags{.allow_cpu_scalars = false});
KILN_REGISTER_DECOMPOSITION(foreach_norm, foreach_norm_decomposition);
// Attributes: 0 n (int64). Inputs: the n tensors, then the scale. Writes the n tensors.
KILN_DEFINE_OP(foreach_mul_, OpKind::kInplace, foreach_mul_meta,
               OpFlags{.mutated = foreach_mul_mutated});
KILN_REGISTER_DECOMPOSITION(foreach_mul_, foreach_mul_decomposition);

std::vector<Tensor> foreach_norm(TensorList tensors, double ord) {
  static const OpDef& op = KILN_OP(foreach_norm);
  const TensorVec out = call_op(op, TensorVec(tensors.begin(), tensors.end()),
                                {static_cast<int64_t>(tensors.size()), ord});
  return std::vector<Tensor>(out.begin(), out.end());
}

void foreach_mul_(TensorList tensors, const Tensor& scale) {
  static const OpDef& op = KILN_OP(foreach_mul_);
  TensorVec inputs(tensors.begin(), tensors.end());
  inputs.push_back(scale);
  call_op(op, std::move(inputs), {static_cast<int64_t>(tensors.size())});
}

std::vector<std::vector<Tensor>> foreach_groups(TensorList tensors) {
  std::vector<std::vector<Tensor>> groups;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    KILN_CHECK(t.defined(), "[foreach_groups] ", entry(i), " is undefined");
    auto same = [&](const std::vector<Tensor>& g) {
      return g[0].dtype() == t.dtype() && g[0].device() == t.device();
    };
    auto it = std::find_if(groups.begin(), groups.end(), same);
    if (it == groups.end()) {
      groups.push_back({t});
    } else {
      it->push_back(t);
    }
  }
  return groups;
}

}  // namespace kiln
