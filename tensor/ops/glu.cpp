// swiglu and geglu_tanh, fused registry ops with their decompositions (kernels:
// kernels/cpu/glu.cpp, kernels/cuda/glu.cu, both taking every call; backward rules:
// autograd/glu_backward.cpp; tests: tests/tensor/fused_ops_test.cpp,
// tests/kernels/gpu_fused_test.cpp), and their fused backward ops.
//
//   Tensor h = kiln::swiglu(gate, up);        // silu(gate) * up, the Llama MLP
//   Tensor h = kiln::geglu_tanh(gate, up);    // gelu(gate, "tanh") * up, the Gemma MLP
//
// swiglu(gate, up) -> y and geglu_tanh(gate, up) -> y: gate and up of one shape and floating
// dtype (any strides: the halves of a fused gate/up projection are read in place); y is
// contiguous, in their dtype, computed in f32 for f16/bf16 (f64 for f64).
// swiglu_backward(dy, gate, up) -> (dgate, dup), geglu_tanh_backward likewise: one pass,
//   dgate = dy * up * act'(gate),  dup = dy * act(gate).
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

void check_same(const char* op, const char* a_name, const Tensor& a, const char* b_name,
                const Tensor& b) {
  KILN_CHECK(is_floating_point(a.dtype()), "[", op, "] expected a floating-point ", a_name,
             ", got ", dtype_name(a.dtype()));
  KILN_CHECK(a.dtype() == b.dtype() && a.sizes() == b.sizes(), "[", op, "] ", a_name, " (",
             dtype_name(a.dtype()), " ", shape_str(a.sizes()), ") and ", b_name, " (",
             dtype_name(b.dtype()), " ", shape_str(b.sizes()),
             ") must have the same shape and dtype");
  KILN_CHECK(a.device() == b.device(), "[", op, "] ", a_name, " is on ", a.device().str(), " but ",
             b_name, " is on ", b.device().str());
}

template <const char* kName>
SpecList glu_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2, "[", kName, "] expected inputs (gate, up)");
  const Tensor& gate = c.input(0);
  check_same(kName, "gate", gate, "up", c.input(1));
  return {{to_shape(gate.sizes()), gate.dtype(), gate.device()}};
}

template <const char* kName>
SpecList glu_backward_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[", kName, "] expected inputs (dy, gate, up)");
  const Tensor& gate = c.input(1);
  check_same(kName, "gate", gate, "up", c.input(2));
  check_same(kName, "gate", gate, "dy", c.input(0));
  const Shape s = to_shape(gate.sizes());
  return {{s, gate.dtype(), gate.device()}, {s, gate.dtype(), gate.device()}};
}

// act(gate) * up in the compute dtype (f32 for f16/bf16), returned in gate's dtype.
template <bool kGelu>
TensorVec glu_decomposition(const OpCall& c) {
  const Tensor& gate = c.input(0);
  const ScalarType ct = gate.dtype() == kDouble ? kDouble : kFloat;
  const Tensor g = gate.to(ct);
  const Tensor act = kGelu ? gelu(g, "tanh") : silu(g);
  return {(act * c.input(1).to(ct)).to(gate.dtype())};
}

constexpr char kSwiglu[] = "swiglu";
constexpr char kSwigluBackward[] = "swiglu_backward";
constexpr char kGeglu[] = "geglu_tanh";
constexpr char kGegluBackward[] = "geglu_tanh_backward";

}  // namespace

KILN_DEFINE_OP(swiglu, OpKind::kFunctional, glu_meta<kSwiglu>);
KILN_REGISTER_DECOMPOSITION(swiglu, glu_decomposition<false>);
KILN_DEFINE_OP(swiglu_backward, OpKind::kFunctional, glu_backward_meta<kSwigluBackward>);
KILN_DEFINE_OP(geglu_tanh, OpKind::kFunctional, glu_meta<kGeglu>);
KILN_REGISTER_DECOMPOSITION(geglu_tanh, glu_decomposition<true>);
KILN_DEFINE_OP(geglu_tanh_backward, OpKind::kFunctional, glu_backward_meta<kGegluBackward>);

Tensor swiglu(const Tensor& gate, const Tensor& up) {
  static const OpDef& op = KILN_OP(swiglu);
  return call_op1(op, {gate, up});
}

Tensor geglu_tanh(const Tensor& gate, const Tensor& up) {
  static const OpDef& op = KILN_OP(geglu_tanh);
  return call_op1(op, {gate, up});
}

}  // namespace kiln
