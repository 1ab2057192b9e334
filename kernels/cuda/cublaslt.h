// Matrix products on the GPU through cuBLASLt: what kiln's mm, bmm and addmm CUDA kernels
// (kernels/cuda/linalg.cu) call.
//
// Internal to kernels/cuda/. Its knobs are public, in kernels/cuda.h (set_allow_tf32,
// set_matmul_autotune, matmul_autotune_stats), defined in kernels/cuda.cpp for every build.
//
//   internal::Matrix a = ..., b = ...;         // row-major views: pointer, strides, batch
//   internal::gemm(out_desc, a, b, {.alpha = 1, .beta = 0});
//
// - bf16 and f16 multiply with f32 accumulation and f32 scaling; f32 runs in full precision
//   unless allow_tf32() is set; f64 in f64.
// - Transposed operands are not copied: a row-major view with stride 1 in either matrix dim is
//   a column-major matrix for cuBLASLt, read with the matching op flag. Batches are strided
//   batches (any batch stride, 0 included for a broadcast operand).
// - Views need not be 256-byte aligned (cuBLASLt's default assumption): the alignment of every
//   pointer goes into the heuristic query (and into the cache key), so offset views get an
//   algorithm that is valid for them.
// - Epilogue: a bias vector added to every row of the result (addmm's self of shape [N]), and a
//   C matrix scaled by beta (addmm's residual: beta = 1 adds it); or the bias gradient, the sums
//   of one operand over k written beside the product (mm_with_bias_grad: a Linear's backward);
//   or ReLU / tanh-GELU after the bias (addmm_activation, written by the compiler).
// - One cuBLASLt handle and one 32 MiB workspace per device; the chosen algorithm and the
//   descriptors are cached per shape (dtypes, sizes, strides, transposes, batch, epilogue,
//   alignments), so a training step's repeated shapes query the heuristic once.
// - Autotuning (matmul_autotune(), off by default): the heuristic is asked for up to 8
//   candidates. With autotune off the first is used. With it on, the first call of a shape
//   outside CUDA graph capture times every candidate on the real operands with CUDA events on the
//   current stream (a warm-up and 3 timed runs each; the host waits for them once), keeps the
//   fastest for the shape (the heuristic's first unless another is more than 1% faster), and then
//   computes the real result with it. Timing runs write the output buffer only where that cannot
//   change the result (beta = 0, or a C that is not the output); an accumulation into the output
//   itself (C == out) is timed into a scratch buffer. kernels/cuda.h says why it is off by
//   default.
#pragma once

#include <atomic>
#include <cstdint>

#include "kernels/cuda.h"

namespace kiln::cuda::internal {

// What matmul_autotune_stats() reports (kernels/cuda.cpp holds them; gemm() counts).
struct AutotuneCounters {
  std::atomic<int64_t> tuned_shapes{0}, cache_hits{0}, skipped_in_capture{0}, candidates_timed{0};
};
AutotuneCounters& autotune_counters();

// The element types the wrapper multiplies (kiln's floating dtypes).
enum class GemmType : uint8_t { kF32, kF64, kF16, kBF16 };

// A batch of row-major [rows, cols] matrices: element (b, i, j) lives at
// data + b * batch_stride + i * row_stride + j * col_stride (strides in elements). Either
// row_stride or col_stride must be 1 (or the dim must have size 1), which the caller arranges.
struct Matrix {
  const void* data = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t row_stride = 0, col_stride = 1;
  int64_t batch_stride = 0;
};

// cuBLASLt's epilogue activations: ReLU, and GELU with the tanh approximation
// (gelu(x, "tanh")); kGeluTanhAux also writes the pre-activation to GemmArgs::aux (GELU_AUX), and
// kGeluTanhGrad multiplies the product by gelu'(aux) (DGELU: the gradient of a GELU_AUX product's
// input, from the gradient of its output).
enum class GemmActivation : uint8_t { kNone, kRelu, kGeluTanh, kGeluTanhAux, kGeluTanhGrad };

struct GemmArgs {
  GemmType type = GemmType::kF32;
  int64_t batch = 1;
  double alpha = 1.0;
  double beta = 0.0;
  // C, read when beta != 0: a contiguous row-major [batch, m, n] matrix; may be `out` itself.
  const void* c = nullptr;
  // A contiguous vector of n elements added to every row of the product (after alpha).
  const void* bias = nullptr;
  // The bias gradient epilogue (batch 1, no bias, no C): the sums over k of a (bias_grad_of 0:
  // m elements, one per row of a) or of b (1: n elements, one per column of b), written to
  // bias_grad (contiguous, of the output's type, 16-byte aligned) by the product's kernel.
  void* bias_grad = nullptr;
  int bias_grad_of = 0;
  // An activation applied in the epilogue, after alpha and the bias (no bias gradient, no C).
  GemmActivation activation = GemmActivation::kNone;
  // kGeluTanhAux's output and kGeluTanhGrad's input (batch 1; kGeluTanhGrad takes no bias): a
  // contiguous row-major [m, n] matrix of the output's type, 16-byte aligned, n a multiple of 8.
  void* aux = nullptr;
};

// out[b] = alpha * a[b] @ b[b] (+ bias) (+ beta * c[b]) for every batch b, with `out` a
// contiguous row-major [batch, m, n] buffer. Returns false when cuBLASLt has no algorithm for
// this problem (the caller falls back); throws kiln::Error on a failing cuBLASLt call.
bool gemm(void* out, const Matrix& a, const Matrix& b, const GemmArgs& args);

// Forgets every plan and autotuned choice, as a new process starts (tests). Timed choices stay in
// the disk cache (kernels/cuda/choices.h), where a new plan finds them instead of timing again.
void clear_plans();

}  // namespace kiln::cuda::internal
