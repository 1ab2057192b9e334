// Linear algebra: mm, bmm and addmm are the registry ops (on the CPU each matrix product is one
// Eigen GEMM, kernels/cpu/linalg.cpp); matmul, linear, outer and dot are compositions of them
// with views, so autograd and the compiler only need rules for the three primitives.
//
// No operand is copied unless a view cannot express it: transposed operands are read in place,
// the batch dims of a left operand that can be viewed as [rows, k] fold into the GEMM's M
// ([B, T, K] @ [K, N] is one GEMM), and a broadcast operand of a batched product is an
// expanded view (batch stride 0) that bmm reads without materialising.
#include "tensor/autocast_state.h"
#include "tensor/ops.h"
#include "tensor/ops/decomposition_kernel.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

// The checks every product shares: same dtype (PyTorch does not promote here) and a dtype the
// GEMM supports.
void check_operand_dtypes(const char* op, const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dtype() == b.dtype(), "[", op,
             "] expected both operands to have the same dtype, got ", dtype_name(a.dtype()),
             " and ", dtype_name(b.dtype()));
  KILN_CHECK(a.dtype() != kBool, "[", op, "] is not implemented for bool tensors");
}

void check_inner(const char* op, const Tensor& a, const Tensor& b, int64_t ka, int64_t kb) {
  KILN_CHECK(ka == kb, "[", op, "] shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()),
             " cannot be multiplied");
}

void check_dims(const char* op, const Tensor& a, const Tensor& b, int64_t want) {
  KILN_CHECK(a.dim() == want && b.dim() == want, "[", op, "] expected ", want, "-D tensors, got ",
             a.dim(), "-D and ", b.dim(), "-D (shapes ", shape_str(a.sizes()), " and ",
             shape_str(b.sizes()), ")");
}

SpecList mm_meta(const OpCall& c) {
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  check_dims("mm", a, b, 2);
  check_operand_dtypes("mm", a, b);
  check_inner("mm", a, b, a.size(1), b.size(0));
  return {{Shape{a.size(0), b.size(1)}, a.dtype(), a.device()}};
}

SpecList bmm_meta(const OpCall& c) {
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  check_dims("bmm", a, b, 3);
  check_operand_dtypes("bmm", a, b);
  KILN_CHECK(a.size(0) == b.size(0), "[bmm] batch sizes of ", shape_str(a.sizes()), " and ",
             shape_str(b.sizes()), " do not match");
  check_inner("bmm", a, b, a.size(2), b.size(1));
  return {{Shape{a.size(0), a.size(1), b.size(2)}, a.dtype(), a.device()}};
}

// addmm(self, mat1, mat2; beta, alpha) = beta * self + alpha * (mat1 @ mat2), self broadcast.
SpecList addmm_meta(const OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& a = c.input(1);
  const Tensor& b = c.input(2);
  check_dims("addmm", a, b, 2);
  check_operand_dtypes("addmm", a, b);
  KILN_CHECK(self.dtype() == a.dtype(), "[addmm] expected self to have the operands' dtype ",
             dtype_name(a.dtype()), ", got ", dtype_name(self.dtype()));
  check_inner("addmm", a, b, a.size(1), b.size(0));
  const Shape out{a.size(0), b.size(1)};
  bool broadcasts = self.dim() <= 2;
  for (int64_t d = 0; broadcasts && d < self.dim(); ++d) {
    const int64_t s = self.size(d), want = out[2 - self.dim() + d];
    broadcasts = s == want || s == 1;
  }
  KILN_CHECK(broadcasts, "[addmm] self of shape ", shape_str(self.sizes()),
             " cannot be broadcast to ", shape_str(out));
  if (is_integral(a.dtype(), /*include_bool=*/false)) {
    KILN_CHECK(!c.attr<Scalar>(0).is_floating_point() && !c.attr<Scalar>(1).is_floating_point(),
               "[addmm] for integral tensors, beta and alpha must not be floating-point numbers");
  }
  return {{out, a.dtype(), a.device()}};
}

// mm_into_(out, a, b) -> out: out = a @ b written in place, for kiln::compile's
// fold_copy_into_mm (a product copied into place: DDP's gradient buckets take the weight
// gradients so). out: contiguous, of the product's sizes, dtype and device, not overlapping a or
// b. Its kernel is mm's run into out on every device, so it gives mm-then-copy_'s bits.
SpecList mm_into_meta(const OpCall& c) {
  KILN_CHECK(
      c.inputs.size() == 3 && c.input(0).defined() && c.input(1).defined() && c.input(2).defined(),
      "[mm_into_] expected three defined tensors (out, a, b)");
  OpCall product;
  product.inputs = {c.input(1), c.input(2)};
  const TensorSpec want = mm_meta(product)[0];
  const Tensor& out = c.input(0);
  KILN_CHECK(out.sizes() == want.sizes && out.dtype() == want.dtype &&
                 out.device() == want.device && out.is_contiguous(),
             "[mm_into_] expected out to be a contiguous ", dtype_name(want.dtype),
             " tensor of "
             "shape ",
             shape_str(want.sizes), " on ", want.device.str(), ", got ", dtype_name(out.dtype()),
             " ", shape_str(out.sizes()), out.is_contiguous() ? "" : " strided", " on ",
             out.device().str());
  return {};
}

// mm_with_bias_grad(a, b; operand) -> (a @ b, sums): the product and, in the same call, the sums
// over the product's k of one operand: operand 0 sums a [m, k] over k into [m], operand 1 sums
// b [k, n] over k into [n]. It is the backward of a Linear layer with a bias (addmm's rule):
// the weight's gradient g^T @ x (operand 0: g^T) or x^T @ g (operand 1: g), and the bias's
// gradient, the sum of g over the rows. On CUDA cuBLASLt computes the sums in the product's
// epilogue (CUBLASLT_EPILOGUE_BGRADA / BGRADB), so g is read once (kernels/cuda/linalg.cu);
// elsewhere, and where cuBLASLt has no such algorithm, it is mm and sum (the decomposition).
// The sums are in the operands' dtype, accumulated in f32 for f16/bf16 as sum's are.
// The checks of a fused op's floating-point product a @ b of two matrices.
void check_float_mm(const char* op, const Tensor& a, const Tensor& b) {
  check_dims(op, a, b, 2);
  check_operand_dtypes(op, a, b);
  check_inner(op, a, b, a.size(1), b.size(0));
  KILN_CHECK(is_floating_point(a.dtype()), "[", op, "] expected floating-point operands, got ",
             dtype_name(a.dtype()));
}

SpecList mm_with_bias_grad_meta(const OpCall& c) {
  constexpr const char* kOp = "mm_with_bias_grad";
  KILN_CHECK(c.inputs.size() == 2 && c.attrs.size() == 1, "[", kOp,
             "] expected inputs (a, b) and the attribute operand");
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  check_float_mm(kOp, a, b);
  const int64_t operand = c.attr<int64_t>(0);
  KILN_CHECK(operand == 0 || operand == 1, "[", kOp,
             "] operand must be 0 (sum a over k) or 1 (sum b over k), got ", operand);
  const int64_t sums = operand == 0 ? a.size(0) : b.size(1);
  return {{Shape{a.size(0), b.size(1)}, a.dtype(), a.device()},
          {Shape{sums}, a.dtype(), a.device()}};
}

TensorVec mm_with_bias_grad_decomposition(const OpCall& c) {
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  return {mm(a, b), c.attr<int64_t>(0) == 0 ? sum(a, {1}) : sum(b, {0})};
}

// addmm_activation(self, mat1, mat2; beta, alpha, use_gelu) -> act(addmm(self, mat1, mat2; beta,
// alpha)), act = relu, or gelu(x, "tanh") with use_gelu (PyTorch's _addmm_activation). The
// compiler's matmul_epilogue writes it for an mm or addmm read only by relu or tanh-gelu
// (compiler/matmul_epilogue.cpp); on CUDA cuBLASLt applies bias and activation in the product's
// epilogue (kernels/cuda/linalg.cu), so the pre-activation never reaches memory. Elsewhere it is
// the addmm and the activation. No backward rule: it is written into programs
// whose backward is already traced (relu's backward reads relu's output, not its input).
SpecList addmm_activation_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3 && c.attrs.size() == 3,
             "[addmm_activation] expected inputs (self, mat1, mat2) and attributes (beta, alpha, "
             "use_gelu)");
  KILN_CHECK(is_floating_point(c.input(1).dtype()),
             "[addmm_activation] expected floating-point operands, got ",
             dtype_name(c.input(1).dtype()));
  (void)c.attr<bool>(2);
  return addmm_meta(c);
}

TensorVec addmm_activation_decomposition(const OpCall& c) {
  const Tensor y = addmm(c.input(0), c.input(1), c.input(2), c.attr<Scalar>(0), c.attr<Scalar>(1));
  return {c.attr<bool>(2) ? gelu(y, "tanh") : relu(y)};
}

// addmm_gelu_aux(self, mat1, mat2; beta, alpha) -> (gelu(p, "tanh"), p), p = addmm(self, mat1,
// mat2; beta, alpha), and mm_dgelu(mat1, mat2, p) -> gelu_backward(mat1 @ mat2, p, "tanh"): a
// tanh-gelu layer's forward that keeps its input for the backward, and that backward's product
// times gelu'(p). The compiler's matmul_epilogue writes them for an mm or addmm read by gelu and
// kept for its backward, and for the product of the gradient that gelu_backward reads
// (compiler/matmul_epilogue.cpp); on CUDA they are cuBLASLt's GELU_AUX(_BIAS) and DGELU epilogues
// (kernels/cuda/linalg.cu), so the gelu's and its gradient's passes over memory go. Elsewhere they
// are the product and the elementwise op. No backward rules: they are written into programs
// whose backward is already traced.
SpecList addmm_gelu_aux_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 3 && c.attrs.size() == 2,
             "[addmm_gelu_aux] expected inputs (self, mat1, mat2) and attributes (beta, alpha)");
  KILN_CHECK(is_floating_point(c.input(1).dtype()),
             "[addmm_gelu_aux] expected floating-point operands, got ",
             dtype_name(c.input(1).dtype()));
  const SpecList out = addmm_meta(c);
  return {out[0], out[0]};
}

TensorVec addmm_gelu_aux_decomposition(const OpCall& c) {
  Tensor p = addmm(c.input(0), c.input(1), c.input(2), c.attr<Scalar>(0), c.attr<Scalar>(1));
  return {gelu(p, "tanh"), p};
}

SpecList mm_dgelu_meta(const OpCall& c) {
  constexpr const char* kOp = "mm_dgelu";
  KILN_CHECK(c.inputs.size() == 3 && c.attrs.empty(), "[", kOp,
             "] expected inputs (mat1, mat2, pre)");
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  const Tensor& pre = c.input(2);
  check_float_mm(kOp, a, b);
  const Shape out{a.size(0), b.size(1)};
  KILN_CHECK(pre.dtype() == a.dtype() && to_shape(pre.sizes()) == out, "[", kOp, "] pre (",
             dtype_name(pre.dtype()), " ", shape_str(pre.sizes()), ") must be the product's ",
             dtype_name(a.dtype()), " ", shape_str(out));
  KILN_CHECK(pre.device() == a.device(), "[", kOp, "] pre is on ", pre.device().str(),
             " but the operands on ", a.device().str());
  return {{out, a.dtype(), a.device()}};
}

TensorVec mm_dgelu_decomposition(const OpCall& c) {
  static const OpDef& op = KILN_OP(gelu_backward);
  return {call_op1(op, {mm(c.input(0), c.input(1)), c.input(2)}, {std::string("tanh")})};
}

void mm_into_kernel(OpCall& c) {
  static const OpDef& mm_op = KILN_OP(mm);
  Tensor out = c.input(0);  // a handle: writes go to the caller's tensor
  if (internal::memory_overlaps(out, c.input(1)) || internal::memory_overlaps(out, c.input(2))) {
    // out shares memory with an operand: the product first, as eager code makes it.
    out.copy_(call_op1(mm_op, {c.input(1), c.input(2)}));
    return;
  }
  run_into(mm_op, {c.input(1), c.input(2)}, {out});
}

}  // namespace

KILN_DEFINE_OP(mm, OpKind::kFunctional, mm_meta);
KILN_DEFINE_OP(bmm, OpKind::kFunctional, bmm_meta);
KILN_DEFINE_OP(addmm, OpKind::kFunctional, addmm_meta);
KILN_DEFINE_OP(mm_into_, OpKind::kInplace, mm_into_meta);
KILN_DEFINE_OP(mm_with_bias_grad, OpKind::kFunctional, mm_with_bias_grad_meta);
KILN_REGISTER_DECOMPOSITION(mm_with_bias_grad, mm_with_bias_grad_decomposition);
KILN_REGISTER_KERNEL(mm_with_bias_grad, kCPU, decomposition_kernel);
KILN_DEFINE_OP(addmm_activation, OpKind::kFunctional, addmm_activation_meta);
KILN_REGISTER_DECOMPOSITION(addmm_activation, addmm_activation_decomposition);
KILN_REGISTER_KERNEL(addmm_activation, kCPU, decomposition_kernel);
KILN_DEFINE_OP(addmm_gelu_aux, OpKind::kFunctional, addmm_gelu_aux_meta);
KILN_REGISTER_DECOMPOSITION(addmm_gelu_aux, addmm_gelu_aux_decomposition);
KILN_REGISTER_KERNEL(addmm_gelu_aux, kCPU, decomposition_kernel);
KILN_DEFINE_OP(mm_dgelu, OpKind::kFunctional, mm_dgelu_meta);
KILN_REGISTER_DECOMPOSITION(mm_dgelu, mm_dgelu_decomposition);
KILN_REGISTER_KERNEL(mm_dgelu, kCPU, decomposition_kernel);
KILN_REGISTER_KERNEL(mm_into_, kCPU, mm_into_kernel);
#if defined(KILN_WITH_CUDA)
KILN_REGISTER_KERNEL(mm_into_, kCUDA, mm_into_kernel);
#endif

Tensor mm(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(mm);
  return call_op1(op, {a, b});
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  static const OpDef& op = KILN_OP(bmm);
  return call_op1(op, {a, b});
}

Tensor addmm(const Tensor& self, const Tensor& mat1, const Tensor& mat2, const Scalar& beta,
             const Scalar& alpha) {
  static const OpDef& op = KILN_OP(addmm);
  return call_op1(op, {self, mat1, mat2}, {beta, alpha});
}

Tensor dot(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dim() == 1 && b.dim() == 1, "[dot] expected 1-D tensors, got ", a.dim(), "-D and ",
             b.dim(), "-D (shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()), ")");
  check_operand_dtypes("dot", a, b);
  KILN_CHECK(a.size(0) == b.size(0), "[dot] shapes ", shape_str(a.sizes()), " and ",
             shape_str(b.sizes()), " have different numbers of elements");
  return mm(a.unsqueeze(0), b.unsqueeze(1)).view({});
}

// As torch.outer (a multiply in PyTorch): mixed dtypes promote, and bool is logical and.
Tensor outer(const Tensor& a, const Tensor& b) {
  KILN_CHECK(a.dim() == 1 && b.dim() == 1, "[outer] expected 1-D tensors, got ", a.dim(), "-D and ",
             b.dim(), "-D (shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()), ")");
  const ScalarType t = promote_types(a.dtype(), b.dtype());
  if (t == kBool) return outer(a.to(kInt32), b.to(kInt32)).to(kBool);
  return mm(a.to(t).unsqueeze(1), b.to(t).unsqueeze(0));
}

Tensor matmul(const Tensor& a, const Tensor& b) {
  const int64_t da = a.dim(), db = b.dim();
  KILN_CHECK(da >= 1 && db >= 1, "[matmul] both arguments need to be at least 1-D, got ", da,
             "-D and ", db, "-D (shapes ", shape_str(a.sizes()), " and ", shape_str(b.sizes()),
             ")");
  // Under autocast the mm/bmm below cast both operands to the autocast dtype (nn/autocast.h).
  if (!is_autocast_enabled(a.device().type())) check_operand_dtypes("matmul", a, b);
  const int64_t k = a.size(-1);
  check_inner("matmul", a, b, k, db == 1 ? b.size(0) : b.size(-2));

  if (da == 1 && db == 1) return dot(a, b);
  if (da == 2 && db == 1) return mm(a, b.unsqueeze(1)).squeeze(1);
  if (da == 1 && db == 2) return mm(a.unsqueeze(0), b).squeeze(0);
  if (da == 2 && db == 2) return mm(a, b);

  if (db <= 2) {
    // [..., n, k] @ [k(, p)]: the left operand's rows, batch included, are one GEMM's M.
    // reshape is a view for a contiguous operand and copies only when no view exists.
    Shape out(a.sizes().begin(), a.sizes().end() - 1);
    const Tensor a2 = a.reshape({numel_of(out), k});
    const Tensor b2 = db == 1 ? b.unsqueeze(1) : b;
    if (db == 2) out.push_back(b.size(1));
    return mm(a2, b2).view(out);
  }

  // Batched: broadcast the batch dims, run one bmm over their product. A broadcast operand is
  // an expanded view (batch stride 0), which reshape keeps as a view when its batch dims merge.
  const Tensor a3 = da == 1 ? a.unsqueeze(0) : a;  // [..., n, k]
  const Tensor b3 = db == 1 ? b.unsqueeze(1) : b;  // [..., k, p]
  const IntArrayRef a_batch = a3.sizes().subspan(0, a3.dim() - 2);
  const IntArrayRef b_batch = b3.sizes().subspan(0, b3.dim() - 2);
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  const int64_t n = a3.size(-2), p = b3.size(-1), nb = numel_of(batch);
  Shape a_sizes = batch, b_sizes = batch;
  a_sizes.insert(a_sizes.end(), {n, k});
  b_sizes.insert(b_sizes.end(), {k, p});
  const Tensor r =
      bmm(a3.expand(a_sizes).reshape({nb, n, k}), b3.expand(b_sizes).reshape({nb, k, p}));
  Shape out = batch;
  if (da > 1) out.push_back(n);
  if (db > 1) out.push_back(p);
  return r.view(out);
}

Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias) {
  KILN_CHECK(weight.dim() == 2, "[linear] weight must be 2-D [out_features, in_features], got ",
             "shape ", shape_str(weight.sizes()));
  KILN_CHECK(input.dim() >= 1, "[linear] input must be at least 1-D, got a 0-d tensor");
  const int64_t in = weight.size(1), out_features = weight.size(0);
  KILN_CHECK(input.size(-1) == in, "[linear] input of shape ", shape_str(input.sizes()),
             " does not match weight of shape ", shape_str(weight.sizes()),
             ": the last input dim must equal in_features (", in, ")");
  // Under autocast the addmm/mm below cast input, weight and bias alike (nn/autocast.h).
  const bool autocast = is_autocast_enabled(input.device().type());
  if (!autocast) check_operand_dtypes("linear", input, weight);
  const Tensor wt = weight.t();  // read in place by the GEMM (column-major), no copy
  if (!bias.defined()) return matmul(input, wt);
  KILN_CHECK(autocast || bias.dtype() == input.dtype(),
             "[linear] expected bias to have the input's dtype ", dtype_name(input.dtype()),
             ", got ", dtype_name(bias.dtype()));
  KILN_CHECK(
      bias.dim() == 0 || (bias.dim() == 1 && (bias.size(0) == out_features || bias.size(0) == 1)),
      "[linear] bias of shape ", shape_str(bias.sizes()), " does not match out_features (",
      out_features, ")");
  if (input.dim() == 2) return addmm(bias, input, wt);
  // Any leading dims fold into the GEMM's rows; the bias is added by the same GEMM call.
  Shape out(input.sizes().begin(), input.sizes().end() - 1);
  const Tensor x2 = input.reshape({numel_of(out), in});
  out.push_back(out_features);
  return addmm(bias, x2, wt).view(out);
}

Tensor Tensor::matmul(const Tensor& other) const { return kiln::matmul(*this, other); }
Tensor Tensor::mm(const Tensor& other) const { return kiln::mm(*this, other); }
Tensor Tensor::bmm(const Tensor& other) const { return kiln::bmm(*this, other); }
Tensor Tensor::addmm(const Tensor& mat1, const Tensor& mat2, const Scalar& beta,
                     const Scalar& alpha) const {
  return kiln::addmm(*this, mat1, mat2, beta, alpha);
}
Tensor Tensor::outer(const Tensor& other) const { return kiln::outer(*this, other); }
Tensor Tensor::dot(const Tensor& other) const { return kiln::dot(*this, other); }

}  // namespace kiln
