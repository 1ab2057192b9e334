// CUDA kernels for mm, bmm and addmm (semantics: tensor/ops/linalg.cpp, kernels/cpu/linalg.cpp).
//
// Floating dtypes go through cuBLASLt (kernels/cuda/cublaslt.h): operands are read in place
// whenever one of their matrix dims has unit stride (transposed views included), batches are
// strided batches (broadcast operands with batch stride 0). addmm's self becomes, in order of
// preference: the bias epilogue (a contiguous [n] vector with beta = 1, the Linear layer's
// case), cuBLASLt's C matrix (a contiguous [m, n] self, any beta), or is first written into the
// output (broadcast, scaled by 1) which then serves as C.
//
// Integers, k == 0 and problems cuBLASLt has no algorithm for run a plain tiled kernel with the
// CPU's accumulation types (f32 for f16/bf16).
//
// mm_with_bias_grad adds the bias gradient epilogue: the product and one operand's sums over k;
// addmm_activation the ReLU and tanh-GELU epilogues, addmm_gelu_aux and mm_dgelu GELU_AUX and
// DGELU.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>

#include "kernels/cuda/check.h"
#include "kernels/cuda/cublaslt.h"
#include "tensor/ops.h"
#include "tensor/ops/decomposition_kernel.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::GemmArgs;
using internal::GemmType;
using internal::Matrix;

constexpr int kTile = 16;

// Element strides of one operand ([batch,] rows, cols); batch_stride 0 repeats one matrix.
struct Strides {
  int64_t batch = 0, row = 0, col = 0;
};

// out[z] = alpha * a[z] @ b[z] + beta * self (self broadcast over z and to [m, n] through its
// strides; skipped when self is null). Shared-memory tiles of kTile x kTile.
template <typename T>
__global__ void tiled_gemm_kernel(T* out, const T* a, Strides sa, const T* b, Strides sb,
                                  const T* self, Strides ss, int64_t batch, int64_t m, int64_t n,
                                  int64_t k, opmath_t<T> alpha, opmath_t<T> beta) {
  using Acc = opmath_t<T>;
  __shared__ Acc ta[kTile][kTile];
  __shared__ Acc tb[kTile][kTile];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t row = static_cast<int64_t>(blockIdx.y) * kTile + ty;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kTile + tx;
  for (int64_t z = blockIdx.z; z < batch; z += gridDim.z) {
    const T* pa = a + z * sa.batch;
    const T* pb = b + z * sb.batch;
    Acc acc = Acc(0);
    for (int64_t k0 = 0; k0 < k; k0 += kTile) {
      const int64_t ka = k0 + tx, kb = k0 + ty;
      ta[ty][tx] = row < m && ka < k ? static_cast<Acc>(pa[row * sa.row + ka * sa.col]) : Acc(0);
      tb[ty][tx] = kb < k && col < n ? static_cast<Acc>(pb[kb * sb.row + col * sb.col]) : Acc(0);
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < kTile; ++kk) acc += ta[ty][kk] * tb[kk][tx];
      __syncthreads();
    }
    if (row < m && col < n) {
      Acc v = alpha * acc;
      if (self != nullptr) v += beta * static_cast<Acc>(self[row * ss.row + col * ss.col]);
      out[(z * m + row) * n + col] = T(v);
    }
  }
}

// The batch/row/col strides of a 2-D or 3-D tensor (2-D: one matrix).
Strides strides_of(const Tensor& t) {
  const int64_t d = t.dim();
  return {d == 3 ? t.stride(0) : 0, t.stride(d - 2), t.stride(d - 1)};
}

// self's strides when broadcast to [m, n] (a missing or size-1 dim reads stride 0).
Strides broadcast_strides(const Tensor& self) {
  Strides s;
  const int64_t d = self.dim();
  if (d >= 1 && self.size(d - 1) != 1) s.col = self.stride(d - 1);
  if (d == 2 && self.size(0) != 1) s.row = self.stride(0);
  return s;
}

void tiled_gemm(const Tensor& out, const Tensor* self, const Tensor& a, const Tensor& b,
                const Scalar& beta, const Scalar& alpha) {
  const int64_t d = a.dim();
  const int64_t batch = d == 3 ? a.size(0) : 1, m = a.size(d - 2), k = a.size(d - 1),
                n = b.size(d - 1);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, bool>) {
      KILN_FAIL("[mm] is not implemented for bool tensors");
    } else {
      using Acc = opmath_t<T>;
      const T* ps = self != nullptr ? static_cast<const T*>(self->data_ptr()) : nullptr;
      const Strides ss = self != nullptr ? broadcast_strides(*self) : Strides{};
      const dim3 threads(kTile, kTile);
      const dim3 blocks(static_cast<unsigned>((n + kTile - 1) / kTile),
                        static_cast<unsigned>((m + kTile - 1) / kTile),
                        static_cast<unsigned>(std::min<int64_t>(batch, 65535)));
      tiled_gemm_kernel<T><<<blocks, threads, 0, current_stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(a.data_ptr()), strides_of(a),
          static_cast<const T*>(b.data_ptr()), strides_of(b), ps, ss, batch, m, n, k,
          alpha.to<Acc>(), beta.to<Acc>());
      KILN_CUDA_LAUNCH_CHECK("tiled_gemm_kernel");
    }
  });
}

std::optional<GemmType> gemm_type(ScalarType t) {
  switch (t) {
    case kFloat:
      return GemmType::kF32;
    case kDouble:
      return GemmType::kF64;
    case kHalf:
      return GemmType::kF16;
    case kBFloat16:
      return GemmType::kBF16;
    default:
      return std::nullopt;
  }
}

Matrix matrix_of(const Tensor& t) {
  const Strides s = strides_of(t);
  const int64_t d = t.dim();
  return Matrix{t.data_ptr(), t.size(d - 2), t.size(d - 1), s.row, s.col, s.batch};
}

// A bias vector cuBLASLt's epilogue can read: n contiguous elements, 16-byte aligned.
bool is_bias_vector(const Tensor& self, int64_t n) {
  if (self.dim() == 0 || self.size(-1) != n || n <= 1) return false;
  if (self.dim() == 2 && self.size(0) != 1) return false;
  return self.stride(-1) == 1 && reinterpret_cast<uintptr_t>(self.data_ptr()) % 16 == 0;
}

bool is_full_matrix(const Tensor& self, int64_t m, int64_t n) {
  return self.dim() == 2 && self.size(0) == m && self.size(1) == n && self.is_contiguous();
}

// out = beta * self + alpha * a @ b on one GPU; self may be null (mm, bmm) and broadcasts.
void product(const Tensor& out, const Tensor* self_in, const Tensor& a, const Tensor& b,
             const Scalar& beta, const Scalar& alpha) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const bool use_self = self_in != nullptr && beta.toDouble() != 0.0;
  Tensor self;
  if (use_self) self = self_in->is_cuda() ? *self_in : self_in->to(out.device());
  const std::optional<GemmType> type = gemm_type(out.dtype());
  const int64_t d = a.dim();
  const int64_t m = a.size(d - 2), k = a.size(d - 1), n = b.size(d - 1);
  if (!type || k == 0) {
    tiled_gemm(out, use_self ? &self : nullptr, a, b, beta, alpha);
    return;
  }

  GemmArgs args;
  args.type = *type;
  args.batch = d == 3 ? a.size(0) : 1;
  args.alpha = alpha.toDouble();
  // Tries cuBLASLt on a and b (in place, then contiguous copies if that found nothing).
  auto run = [&](const GemmArgs& g) {
    if (internal::gemm(out.data_ptr(), matrix_of(a), matrix_of(b), g)) return true;
    if (a.is_contiguous() && b.is_contiguous()) return false;
    const Tensor ac = a.contiguous(), bc = b.contiguous();
    return internal::gemm(out.data_ptr(), matrix_of(ac), matrix_of(bc), g);
  };

  if (!use_self) {
    if (run(args)) return;
  } else {
    if (args.batch == 1 && beta.toDouble() == 1.0 && is_bias_vector(self, n)) {
      GemmArgs g = args;
      g.bias = self.data_ptr();
      if (run(g)) return;
    }
    GemmArgs g = args;
    g.beta = beta.toDouble();
    if (args.batch == 1 && is_full_matrix(self, m, n)) {
      g.c = self.data_ptr();
    } else {
      // out = broadcast(self), then out serves as C.
      tiled_gemm(out, &self, a.narrow(d - 1, 0, 0), b.narrow(d - 2, 0, 0), 1, 1);
      g.c = out.data_ptr();
    }
    if (run(g)) return;
  }
  tiled_gemm(out, use_self ? &self : nullptr, a, b, beta, alpha);
}

void mm_cuda(OpCall& c) { product(c.outputs[0], nullptr, c.input(0), c.input(1), 0, 1); }

void bmm_cuda(OpCall& c) { product(c.outputs[0], nullptr, c.input(0), c.input(1), 0, 1); }

void addmm_cuda(OpCall& c) {
  product(c.outputs[0], &c.input(0), c.input(1), c.input(2), c.attr<Scalar>(0),
          c.attr<Scalar>(1));
}

// mm_with_bias_grad (tensor/ops/linalg.cpp): the product with the operand's sums over k from
// cuBLASLt's bias gradient epilogue, so the gradient is read once; where cuBLASLt has no such
// algorithm (f64, some layouts), the decomposition (mm and sum).
void mm_with_bias_grad_cuda(OpCall& c) {
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  const Tensor& out = c.outputs[0];
  const Tensor& sums = c.outputs[1];
  const int operand = static_cast<int>(c.attr<int64_t>(0));
  DeviceGuard guard(out.device().index());
  const std::optional<GemmType> type = gemm_type(out.dtype());
  if (type && out.numel() > 0 && a.size(1) > 0 && sums.is_contiguous() &&
      reinterpret_cast<uintptr_t>(sums.data_ptr()) % 16 == 0) {
    GemmArgs args;
    args.type = *type;
    args.bias_grad = sums.data_ptr();
    args.bias_grad_of = operand;
    if (internal::gemm(out.data_ptr(), matrix_of(a), matrix_of(b), args)) return;
  }
  decomposition_kernel(c);
}

// addmm(self, a, b; beta, alpha) with cuBLASLt's activation epilogue `act` (and its aux output)
// after the bias vector (beta = 1, a Linear layer's) or with no self (beta = 0); otherwise, and
// where cuBLASLt has no such algorithm, the op's decomposition.
void addmm_epilogue_cuda(OpCall& c, internal::GemmActivation act, void* aux) {
  const Tensor& out = c.outputs[0];
  const Tensor& a = c.input(1);
  const Tensor& b = c.input(2);
  const Scalar& beta = c.attr<Scalar>(0);
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const std::optional<GemmType> type = gemm_type(out.dtype());
  if (type && a.size(1) > 0) {
    GemmArgs args;
    args.type = *type;
    args.alpha = c.attr<Scalar>(1).toDouble();
    args.activation = act;
    args.aux = aux;
    const Tensor& self = c.input(0);
    if (beta.toDouble() == 1.0 && self.is_cuda() && is_bias_vector(self, b.size(1))) {
      args.bias = self.data_ptr();
      if (internal::gemm(out.data_ptr(), matrix_of(a), matrix_of(b), args)) return;
    } else if (beta.toDouble() == 0.0) {
      if (internal::gemm(out.data_ptr(), matrix_of(a), matrix_of(b), args)) return;
    }
  }
  decomposition_kernel(c);
}

// addmm_activation (tensor/ops/linalg.cpp): relu or tanh-gelu applied by cuBLASLt's epilogue.
void addmm_activation_cuda(OpCall& c) {
  addmm_epilogue_cuda(
      c, c.attr<bool>(2) ? internal::GemmActivation::kGeluTanh : internal::GemmActivation::kRelu,
      nullptr);
}

// addmm_gelu_aux (tensor/ops/linalg.cpp): GELU_AUX(_BIAS) writes the gelu and its input, p
// (outputs[1]), from one product.
void addmm_gelu_aux_cuda(OpCall& c) {
  addmm_epilogue_cuda(c, internal::GemmActivation::kGeluTanhAux, c.outputs[1].data_ptr());
}

// mm_dgelu (tensor/ops/linalg.cpp): cuBLASLt's DGELU epilogue, the product times gelu'(pre) with
// pre read in the epilogue; otherwise the decomposition.
void mm_dgelu_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor& a = c.input(0);
  const Tensor& b = c.input(1);
  const Tensor& pre = c.input(2);
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const std::optional<GemmType> type = gemm_type(out.dtype());
  if (type && a.size(1) > 0 && pre.is_contiguous()) {
    GemmArgs args;
    args.type = *type;
    args.activation = internal::GemmActivation::kGeluTanhGrad;
    args.aux = pre.data_ptr();
    if (internal::gemm(out.data_ptr(), matrix_of(a), matrix_of(b), args)) return;
  }
  decomposition_kernel(c);
}

}  // namespace

KILN_REGISTER_KERNEL(addmm_activation, kCUDA, addmm_activation_cuda);
KILN_REGISTER_KERNEL(addmm_gelu_aux, kCUDA, addmm_gelu_aux_cuda);
KILN_REGISTER_KERNEL(mm_dgelu, kCUDA, mm_dgelu_cuda);
KILN_REGISTER_KERNEL(mm_with_bias_grad, kCUDA, mm_with_bias_grad_cuda);
KILN_REGISTER_KERNEL(mm, kCUDA, mm_cuda);
KILN_REGISTER_KERNEL(bmm, kCUDA, bmm_cuda);
KILN_REGISTER_KERNEL(addmm, kCUDA, addmm_cuda);

}  // namespace kiln::cuda
