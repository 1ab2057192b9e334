// lstm_cell_fused and gru_cell_fused, the fused pointwise parts of one recurrent step, with their
// decompositions and their fused backward ops (kernels: kernels/cpu/rnn.cpp,
// kernels/cuda/rnn.cu, formulas in kernels/rnn_cell.h; backward rules: autograd/rnn_backward.cpp;
// the layers: nn/modules/rnn.cpp; tests: tests/nn/rnn_test.cpp, tests/kernels/gpu_rnn_test.cpp;
// benchmark: benchmarks/rnn_bench.cpp).
//
//   auto [hy, cy] = kiln::lstm_cell_fused(gates, cx);  // gates = x W_ih^T + h W_hh^T + biases
//   Tensor hy = kiln::gru_cell_fused(igates, hgates, hx);  // igates = x W_ih^T + b_ih
//
// lstm_cell_fused(gates [B, 4H], cx [B, H]) -> (hy [B, H], cy [B, H], workspace [B, 5H]), gates
//   in PyTorch's order i, f, g, o: cy = sigmoid(f) cx + sigmoid(i) tanh(g), hy = sigmoid(o)
//   tanh(cy); the workspace holds sigmoid(i), sigmoid(f), tanh(g), sigmoid(o), tanh(cy) for the
//   backward (the public function returns hy and cy).
// lstm_cell_fused_backward(grad_hy, grad_cy, workspace, cx) -> (grad_gates, grad_cx).
// gru_cell_fused(igates [B, 3H], hgates [B, 3H], hx [B, H]) -> hy [B, H], gates r, z, n:
//   r = sigmoid(ir + hr), z = sigmoid(iz + hz), n = tanh(in + r hn), hy = (1 - z) n + z hx.
// gru_cell_fused_backward(grad_hy, igates, hgates, hx) -> (grad_igates, grad_hgates, grad_hx).
// unbind_copy(x; dim) -> the slices of x along dim as fresh tensors (PyTorch's unbind_copy).
// All operands of one floating dtype and device, any strides; outputs contiguous, computed in f32
// for f16/bf16 (f64 for f64). Without the fused ops a step is about ten small ops
// (chunk, three sigmoids, two tanh, products, sums) and as many autograd nodes.
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

void check_operand(const char* op, const char* name, const Tensor& t, const Tensor& ref,
                   int64_t rows, int64_t cols) {
  KILN_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "[", op, "] expected ", name,
             " of shape [", rows, ", ", cols, "], got ", shape_str(t.sizes()));
  KILN_CHECK(t.dtype() == ref.dtype(), "[", op, "] ", name, " (", dtype_name(t.dtype()),
             ") must have the dtype of the gates (", dtype_name(ref.dtype()), ")");
  KILN_CHECK(t.device() == ref.device(), "[", op, "] ", name, " is on ", t.device().str(),
             " but the gates are on ", ref.device().str());
}

// The gates [B, G * H]: returns H.
int64_t check_gates(const char* op, const char* name, const Tensor& gates, int64_t g) {
  KILN_CHECK(is_floating_point(gates.dtype()), "[", op, "] expected floating-point ", name,
             ", got ", dtype_name(gates.dtype()));
  KILN_CHECK(gates.dim() == 2 && gates.size(1) % g == 0, "[", op, "] expected ", name,
             " of shape [batch, ", g, " * hidden_size], got ", shape_str(gates.sizes()));
  return gates.size(1) / g;
}

SpecList lstm_cell_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2, "[lstm_cell_fused] expected inputs (gates, cx)");
  const Tensor& gates = c.input(0);
  const int64_t h = check_gates("lstm_cell_fused", "gates", gates, 4), b = gates.size(0);
  check_operand("lstm_cell_fused", "cx", c.input(1), gates, b, h);
  const TensorSpec s{{b, h}, gates.dtype(), gates.device()};
  return {s, s, {{b, 5 * h}, gates.dtype(), gates.device()}};
}

SpecList lstm_cell_fused_backward_meta(const OpCall& c) {
  const char* op = "lstm_cell_fused_backward";
  KILN_CHECK(c.inputs.size() == 4, "[", op, "] expected inputs (grad_hy, grad_cy, workspace, cx)");
  const Tensor& ws = c.input(2);
  const int64_t h = check_gates(op, "workspace", ws, 5), b = ws.size(0);
  check_operand(op, "grad_hy", c.input(0), ws, b, h);
  check_operand(op, "grad_cy", c.input(1), ws, b, h);
  check_operand(op, "cx", c.input(3), ws, b, h);
  return {{{b, 4 * h}, ws.dtype(), ws.device()}, {{b, h}, ws.dtype(), ws.device()}};
}

SpecList gru_cell_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3, "[gru_cell_fused] expected inputs (igates, hgates, hx)");
  const Tensor& ig = c.input(0);
  const int64_t h = check_gates("gru_cell_fused", "igates", ig, 3);
  check_operand("gru_cell_fused", "hgates", c.input(1), ig, ig.size(0), 3 * h);
  check_operand("gru_cell_fused", "hx", c.input(2), ig, ig.size(0), h);
  return {{{ig.size(0), h}, ig.dtype(), ig.device()}};
}

SpecList gru_cell_fused_backward_meta(const OpCall& c) {
  const char* op = "gru_cell_fused_backward";
  KILN_CHECK(c.inputs.size() == 4, "[", op, "] expected inputs (grad_hy, igates, hgates, hx)");
  const Tensor& ig = c.input(1);
  const int64_t h = check_gates(op, "igates", ig, 3), b = ig.size(0);
  check_operand(op, "grad_hy", c.input(0), ig, b, h);
  check_operand(op, "hgates", c.input(2), ig, b, 3 * h);
  check_operand(op, "hx", c.input(3), ig, b, h);
  const TensorSpec g{{b, 3 * h}, ig.dtype(), ig.device()};
  return {g, g, {{b, h}, ig.dtype(), ig.device()}};
}

ScalarType compute_type(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

// The cells as plain ops, in the compute dtype.
TensorVec lstm_cell_fused_decomposition(const OpCall& c) {
  const ScalarType dt = c.input(0).dtype(), ct = compute_type(dt);
  const std::vector<Tensor> g = c.input(0).to(ct).chunk(4, 1);
  const Tensor i = g[0].sigmoid(), f = g[1].sigmoid(), gg = g[2].tanh(), o = g[3].sigmoid();
  const Tensor cy = f * c.input(1).to(ct) + i * gg;
  const Tensor tc = cy.tanh();
  return {(o * tc).to(dt), cy.to(dt), cat({i, f, gg, o, tc}, 1).to(dt)};
}

TensorVec gru_cell_fused_decomposition(const OpCall& c) {
  const ScalarType dt = c.input(0).dtype(), ct = compute_type(dt);
  const std::vector<Tensor> i = c.input(0).to(ct).chunk(3, 1);
  const std::vector<Tensor> h = c.input(1).to(ct).chunk(3, 1);
  const Tensor r = (i[0] + h[0]).sigmoid(), z = (i[1] + h[1]).sigmoid();
  const Tensor n = (i[2] + r * h[2]).tanh();
  const Tensor hx = c.input(2).to(ct);
  return {(n + z * (hx - n)).to(dt)};
}

// unbind_copy(x; dim) -> x.size(dim) outputs, each x.select(dim, i) as a fresh tensor.
SpecList unbind_copy_meta(const OpCall& c) {
  const Tensor& x = c.input(0);
  KILN_CHECK(x.dim() > 0, "[unbind_copy] cannot unbind a 0-d tensor");
  const int64_t d = wrap_dim(c.attr<int64_t>(0), x.dim(), "unbind_copy");
  Shape rest = to_shape(x.sizes());
  rest.erase(rest.begin() + d);
  return SpecList(static_cast<size_t>(x.size(d)), TensorSpec{rest, x.dtype(), x.device()});
}

}  // namespace

// Attribute: 0 dim (int64). The recurrent layers split their hoisted input projection [T, B, G]
// into steps with it: its backward is one stack of the steps' gradients, where T selects would
// each give back a zero-filled [T, B, G] tensor to accumulate (quadratic in T).
KILN_DEFINE_OP(unbind_copy, OpKind::kFunctional, unbind_copy_meta);

KILN_DEFINE_OP(lstm_cell_fused, OpKind::kFunctional, lstm_cell_meta);
KILN_REGISTER_DECOMPOSITION(lstm_cell_fused, lstm_cell_fused_decomposition);
KILN_DEFINE_OP(lstm_cell_fused_backward, OpKind::kFunctional, lstm_cell_fused_backward_meta);
KILN_DEFINE_OP(gru_cell_fused, OpKind::kFunctional, gru_cell_meta);
KILN_REGISTER_DECOMPOSITION(gru_cell_fused, gru_cell_fused_decomposition);
KILN_DEFINE_OP(gru_cell_fused_backward, OpKind::kFunctional, gru_cell_fused_backward_meta);

std::tuple<Tensor, Tensor> lstm_cell_fused(const Tensor& gates, const Tensor& cx) {
  static const OpDef& op = KILN_OP(lstm_cell_fused);
  const TensorVec out = call_op(op, {gates, cx});
  return {out[0], out[1]};
}

std::vector<Tensor> unbind_copy(const Tensor& x, int64_t dim) {
  static const OpDef& op = KILN_OP(unbind_copy);
  const TensorVec out = call_op(op, {x}, {dim});
  return std::vector<Tensor>(out.begin(), out.end());
}

Tensor gru_cell_fused(const Tensor& igates, const Tensor& hgates, const Tensor& hx) {
  static const OpDef& op = KILN_OP(gru_cell_fused);
  return call_op1(op, {igates, hgates, hx});
}

}  // namespace kiln
