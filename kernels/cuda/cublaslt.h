// Matrix products on the GPU through cuBLASLt: what kiln's mm, bmm and addmm CUDA kernels
// (kernels/cuda/linalg.cu) call.
//
//   kiln::cuda::set_allow_tf32(true);   // f32 products on the tensor cores (TF32), as PyTorch's
//                                       // torch.backends.cuda.matmul.allow_tf32
//   kiln::cuda::set_matmul_autotune(true);  // or KILN_MATMUL_AUTOTUNE=1 in the environment:
//                                           // time the heuristic's top candidates per shape
//
// The public part is set_allow_tf32/allow_tf32, set_matmul_autotune/matmul_autotune and
// matmul_autotune_stats; it compiles in every build (a CPU-only build keeps the flags, which
// nothing reads). The rest is internal to kernels/cuda/:
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
//   C matrix scaled by beta (addmm's residual: beta = 1 adds it).
// - One cuBLASLt handle and one 32 MiB workspace per device; the chosen algorithm and the
//   descriptors are cached per shape (dtypes, sizes, strides, transposes, batch, epilogue,
//   alignments), so a training step's repeated shapes query the heuristic once.
// - Autotuning (off by default): the heuristic is asked for up to 8 candidates. With autotune
//   off the first is used. With it on, the first call of a shape outside CUDA graph capture
//   times every candidate on the real operands with CUDA events on the current stream (a
//   warm-up and 3 timed runs each; the host waits for them once), keeps the fastest for the
//   shape (the heuristic's first unless another is more than 1% faster), and then computes the real
//   result with it. Timing runs write the output buffer only where that cannot change the result
//   (beta = 0, or a C that is not the output); an accumulation into the output itself (C == out) is
//   timed into a scratch buffer. Off by default because the first call of every shape blocks the
//   host (about 30 runs of the product) and because the algorithm then depends on timing noise, so
//   two runs of a program may differ in the last bits; cuDNN's benchmark mode is off in PyTorch
//   likewise.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace kiln::cuda {

namespace internal {
inline std::atomic<bool>& allow_tf32_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
}  // namespace internal

// Whether f32 matrix products may use TF32 tensor cores (10-bit mantissa products, f32 sums).
// Off by default, as PyTorch's matmul default since 1.12.
inline bool allow_tf32() { return internal::allow_tf32_flag().load(std::memory_order_relaxed); }
inline void set_allow_tf32(bool enabled) {
  internal::allow_tf32_flag().store(enabled, std::memory_order_relaxed);
}

namespace internal {
// KILN_MATMUL_AUTOTUNE=1 (or any value but "" and "0") turns autotuning on at start-up.
inline bool matmul_autotune_from_env() {
  const char* v = std::getenv("KILN_MATMUL_AUTOTUNE");
  return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
}
inline std::atomic<bool>& matmul_autotune_flag() {
  static std::atomic<bool> flag{matmul_autotune_from_env()};
  return flag;
}
struct AutotuneCounters {
  std::atomic<int64_t> tuned_shapes{0}, cache_hits{0}, skipped_in_capture{0}, candidates_timed{0};
};
inline AutotuneCounters& autotune_counters() {
  static AutotuneCounters counters;
  return counters;
}
}  // namespace internal

// Whether cuBLASLt products pick, per shape, the fastest of the heuristic's candidates by
// timing them (see the banner). Off by default unless KILN_MATMUL_AUTOTUNE=1 is set.
inline bool matmul_autotune() {
  return internal::matmul_autotune_flag().load(std::memory_order_relaxed);
}
inline void set_matmul_autotune(bool enabled) {
  internal::matmul_autotune_flag().store(enabled, std::memory_order_relaxed);
}

// Counters of the autotuner since start-up (or the last reset), summed over devices.
struct MatmulAutotuneStats {
  int64_t tuned_shapes = 0;        // shapes whose algorithm was chosen (timed when > 1 candidate)
  int64_t cache_hits = 0;          // autotuned calls that reused an already chosen algorithm
  int64_t skipped_in_capture = 0;  // untuned shapes met during graph capture: heuristic's first
  int64_t candidates_timed = 0;    // candidate algorithms timed, over all shapes
};
inline MatmulAutotuneStats matmul_autotune_stats() {
  const internal::AutotuneCounters& c = internal::autotune_counters();
  MatmulAutotuneStats s;
  s.tuned_shapes = c.tuned_shapes.load(std::memory_order_relaxed);
  s.cache_hits = c.cache_hits.load(std::memory_order_relaxed);
  s.skipped_in_capture = c.skipped_in_capture.load(std::memory_order_relaxed);
  s.candidates_timed = c.candidates_timed.load(std::memory_order_relaxed);
  return s;
}
inline void reset_matmul_autotune_stats() {
  internal::AutotuneCounters& c = internal::autotune_counters();
  c.tuned_shapes = 0;
  c.cache_hits = 0;
  c.skipped_in_capture = 0;
  c.candidates_timed = 0;
}

namespace internal {

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

struct GemmArgs {
  GemmType type = GemmType::kF32;
  int64_t batch = 1;
  double alpha = 1.0;
  double beta = 0.0;
  // C, read when beta != 0: a contiguous row-major [batch, m, n] matrix; may be `out` itself.
  const void* c = nullptr;
  // A contiguous vector of n elements added to every row of the product (after alpha).
  const void* bias = nullptr;
};

// out[b] = alpha * a[b] @ b[b] (+ bias) (+ beta * c[b]) for every batch b, with `out` a
// contiguous row-major [batch, m, n] buffer. Returns false when cuBLASLt has no algorithm for
// this problem (the caller falls back); throws kiln::Error on a failing cuBLASLt call.
bool gemm(void* out, const Matrix& a, const Matrix& b, const GemmArgs& args);

}  // namespace internal
}  // namespace kiln::cuda
