// CUDA kernels of the reductions (sum, mean, prod, amax/amin, max/min, max_dim/min_dim,
// argmax/argmin, var/std, norm, logsumexp, all/any) and of cumsum. Semantics, dtypes and
// argument rules are those of the CPU kernels (kernels/cpu/reduce.cpp, tensor/ops/reduce.cpp).
//
// Every reduction is brought to a contiguous [A, R, K] block whose middle dim is reduced by the
// CPU's own reduce_block (no copy for contiguous inputs reduced over inner or outer dims). Then:
//   - K == 1, short rows: one warp per row, lanes striding along it, a shuffle tree at the end;
//   - K == 1, long rows: one block per row (block-wide tree through shared memory), sized so that
//     each thread has a full round of 16-byte loads (block_threads), and when there are too few
//     rows to fill the GPU, several blocks per row that write partial accumulators, merged by a
//     second kernel (the multi-block path);
//   - K > 1: blocks of 32 columns x 8 row slices (coalesced along K), split along R the same way
//     when there are few columns.
// Rows (K == 1) are read with 16-byte loads (8 bf16/f16, 4 f32) after a scalar head up to the
// first 16-byte boundary, and a scalar tail, for every reducer (argmax/argmin included: each
// thread meets its elements in increasing index order); 32-bit offsets within a row, and a
// 32-register cap for the plain sums so that a multiprocessor holds 2048 threads of loads.
// A split reduction (a full reduction: A == 1) uses one wave of blocks and a second kernel that
// merges the partials in a fixed order, with one block per output when there are few outputs:
// the result is deterministic.
// Accumulators: float for f32, f16 and bf16, double for f64, int64 for integers (wrapping, as
// PyTorch). The reducers are the CPU's (kernels/reduce_fn.h): init/step/merge/finish, where merge
// must not depend on which side covers lower indices except through explicit indices (argmax).
#include <limits>
#include <type_traits>

#include "kernels/cpu/reduce.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/reduce_fn.h"
#include "tensor/env_switch.h"

namespace kiln::cuda {
namespace {

using loops::as_dtype;

constexpr int kWarp = 32;
constexpr int kRowThreads = 512;       // threads of a block that reduces one (long) row
constexpr int64_t kWarpRowMax = 4096;  // rows up to this length get one warp each
constexpr int kColX = 32, kColY = 8;   // the column kernel's block

template <typename T>
using float_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T>
using acc_t = scalar::sum_acc_t<T, float_acc_t<T>>;

using scalar::from_acc;
using scalar::NormKind;
using scalar::wrap_add;

// --- The reduction kernels ------------------------------------------------------------------

template <typename Red>
using red_acc_t = typename Red::acc_t;

template <typename Red>
__device__ __forceinline__ red_acc_t<Red> warp_reduce(const Red& red, red_acc_t<Red> a) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) a = red.merge(a, loops::shfl_down(a, o));
  return a;
}

// The merged accumulator of the whole block, valid in thread 0.
template <typename Red>
__device__ __forceinline__ red_acc_t<Red> block_reduce(const Red& red, red_acc_t<Red> a) {
  using Acc = red_acc_t<Red>;
  __shared__ alignas(16) unsigned char smem[kWarp * sizeof(Acc)];
  Acc* s = reinterpret_cast<Acc*>(smem);
  const int tid = threadIdx.x + threadIdx.y * blockDim.x;
  const int nthreads = blockDim.x * blockDim.y;
  const int lane = tid % kWarp, warp = tid / kWarp, nwarps = (nthreads + kWarp - 1) / kWarp;
  a = warp_reduce(red, a);
  if (lane == 0) s[warp] = a;
  __syncthreads();
  if (warp == 0) {
    a = lane < nwarps ? s[lane] : red.init();
    a = warp_reduce(red, a);
  }
  __syncthreads();
  return a;
}

template <typename Red>
__global__ void empty_kernel(Red red, int64_t outputs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < outputs;
       i += step) {
    red.finish(red.init(), i);
  }
}

constexpr int kRowUnroll = 4;  // 16-byte loads each thread keeps in flight

// Steps acc over p[0, n) (the elements r0 + 0 ... r0 + n - 1 of a row; n < 2^31) as thread t of
// nt: a scalar head up to the first 16-byte boundary, then 16-byte packs (V = 16 / sizeof(T)
// elements: 8 bf16/f16, 4 f32, 2 f64), kRowUnroll of them loaded before their use, then a scalar
// tail. Offsets are 32-bit (fewer instructions per pack: the kernels are issue-bound at 16-bit
// widths), and the full rounds run without bounds checks. Each thread meets its elements in
// increasing index order, as the reducers' step expects (argmax keeps the first of equal values;
// the index r0 + e is computed only by reducers that read it).
template <typename T, typename Red>
__device__ __forceinline__ void step_range(const Red& red, red_acc_t<Red>& acc, const T* p,
                                           int64_t r0, int n, int t, int nt) {
  constexpr int V = static_cast<int>(16 / sizeof(T));
  using Vt = loops::Vec<T, V>;
  const int h = loops::head_of(p, n);
  const int nv = (n - h) / V;
  for (int e = t; e < h; e += nt) red.step(acc, p[e], r0 + e);
  const Vt* v = reinterpret_cast<const Vt*>(p + h);
  const int64_t rv = r0 + h;
  int i0 = t;
#pragma unroll 1
  for (; i0 + (kRowUnroll - 1) * nt < nv; i0 += kRowUnroll * nt) {
    Vt buf[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) buf[u] = v[i0 + u * nt];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      const int64_t e = rv + static_cast<int64_t>(i0 + u * nt) * V;
#pragma unroll
      for (int j = 0; j < V; ++j) red.step(acc, buf[u].v[j], e + j);
    }
  }
  if (i0 < nv) {  // the last, partial round: its loads also issued before their use
    Vt buf[kRowUnroll];
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (i0 + u * nt < nv) buf[u] = v[i0 + u * nt];
    }
#pragma unroll
    for (int u = 0; u < kRowUnroll; ++u) {
      if (i0 + u * nt < nv) {
        const int64_t e = rv + static_cast<int64_t>(i0 + u * nt) * V;
#pragma unroll
        for (int j = 0; j < V; ++j) red.step(acc, buf[u].v[j], e + j);
      }
    }
  }
  for (int e = h + nv * V + t; e < n; e += nt) red.step(acc, p[e], r0 + e);
}

// Register caps. At 32 registers a multiprocessor holds 2048 threads, each with kRowUnroll 16-byte
// loads in flight (128 KiB per multiprocessor); uncapped, the row kernels of the sums took 37-52
// registers, which left a quarter to a half of that (the 512-thread block of a 16-bit row sum
// fitted 3 per multiprocessor). The caps are for the reducers whose kernels fit 32 registers
// without spilling (ptxas -v, sm_90a): the plain sums (sum, mean, prod, the 0-, 1- and 2-norms)
// over elements of 2 to 8 bytes in the block kernel, of 2 bytes in the warp kernel. The others
// (extrema with indices, var, logsumexp, ...) keep the compiler's choice.
template <typename Red>
struct IsPlainSum : std::false_type {};
template <typename T, typename F>
struct IsPlainSum<scalar::SumReducer<T, F>> : std::true_type {};
template <typename T, typename F>
struct IsPlainSum<scalar::ProdReducer<T, F>> : std::true_type {};
template <typename T, typename F, NormKind kKind>
struct IsPlainSum<scalar::NormReducer<T, F, kKind>>
    : std::bool_constant<kKind == NormKind::kZero || kKind == NormKind::kOne ||
                         kKind == NormKind::kTwo> {};

template <typename T, typename Red>
inline constexpr int kWarpRowMinBlocks = IsPlainSum<Red>::value && sizeof(T) == 2
                                             ? 2048 / loops::kThreads
                                             : 1;
template <typename T, typename Red>
inline constexpr int kRowMinBlocks = IsPlainSum<Red>::value && sizeof(T) >= 2 ? 2048 / kRowThreads
                                                                              : 1;

// One warp per row (any length below 2^31).
template <typename T, typename Red>
__global__ void __launch_bounds__(loops::kThreads, kWarpRowMinBlocks<T, Red>)
    rows_warp_kernel(Red red, const T* x, int64_t A, int R) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
       a < A; a += warps) {
    red_acc_t<Red> acc = red.init();
    step_range(red, acc, x + a * R, 0, R, lane, kWarp);
    acc = warp_reduce(red, acc);
    if (lane == 0) red.finish(acc, a);
  }
}

// Block (row blockIdx.x, chunk blockIdx.y of `chunk` elements, chunk < 2^31); with `partial`,
// writes the chunk's accumulator there instead of finishing. Any block size that is a multiple
// of 32 up to kRowThreads (row_threads picks it).
template <typename T, typename Red>
__global__ void __launch_bounds__(kRowThreads, kRowMinBlocks<T, Red>)
    rows_block_kernel(Red red, const T* x, int64_t R, int chunk, red_acc_t<Red>* partial,
                      int64_t outputs) {
  const int64_t a = blockIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int n = static_cast<int>(r0 + chunk < R ? chunk : R - r0);
  red_acc_t<Red> acc = red.init();
  step_range(red, acc, x + a * R + r0, r0, n, static_cast<int>(threadIdx.x),
             static_cast<int>(blockDim.x));
  acc = block_reduce(red, acc);
  if (threadIdx.x == 0) {
    if (partial != nullptr) {
      partial[static_cast<int64_t>(blockIdx.y) * outputs + a] = acc;
    } else {
      red.finish(acc, a);
    }
  }
}

template <typename T, typename Red>
__global__ void __launch_bounds__(kColX* kColY)
    columns_kernel(Red red, const T* x, int64_t A, int64_t R, int64_t K, int64_t chunk,
                   red_acc_t<Red>* partial) {
  using Acc = red_acc_t<Red>;
  __shared__ alignas(16) unsigned char smem[kColX * kColY * sizeof(Acc)];
  Acc* s = reinterpret_cast<Acc*>(smem);
  const int64_t k = static_cast<int64_t>(blockIdx.x) * kColX + threadIdx.x;
  const int64_t r0 = static_cast<int64_t>(blockIdx.z) * chunk;
  const int64_t r1 = r0 + chunk < R ? r0 + chunk : R;
  const int64_t outputs = A * K;
  for (int64_t a = blockIdx.y; a < A; a += gridDim.y) {
    Acc acc = red.init();
    if (k < K) {
      const T* base = x + a * R * K + k;
      for (int64_t r = r0 + threadIdx.y; r < r1; r += kColY) red.step(acc, base[r * K], r);
    }
    s[threadIdx.y * kColX + threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && k < K) {
      for (int y = 1; y < kColY; ++y) acc = red.merge(acc, s[y * kColX + threadIdx.x]);
      if (partial != nullptr) {
        partial[static_cast<int64_t>(blockIdx.z) * outputs + a * K + k] = acc;
      } else {
        red.finish(acc, a * K + k);
      }
    }
    __syncthreads();
  }
}

template <typename Red>
__global__ void finalize_kernel(Red red, const red_acc_t<Red>* partial, int64_t splits,
                                int64_t outputs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < outputs;
       i += step) {
    red_acc_t<Red> acc = partial[i];
    for (int64_t s = 1; s < splits; ++s) acc = red.merge(acc, partial[s * outputs + i]);
    red.finish(acc, i);
  }
}

// One block per output for few outputs: a long partial list is merged by many threads (in a
// fixed order: the result does not depend on timing).
constexpr int kFinalizeThreads = 256;
template <typename Red>
__global__ void __launch_bounds__(kFinalizeThreads)
    finalize_block_kernel(Red red, const red_acc_t<Red>* partial, int64_t splits, int64_t outputs) {
  const int64_t i = blockIdx.x;
  red_acc_t<Red> acc = red.init();
  for (int64_t s = threadIdx.x; s < splits; s += blockDim.x) {
    acc = red.merge(acc, partial[s * outputs + i]);
  }
  acc = block_reduce(red, acc);
  if (threadIdx.x == 0) red.finish(acc, i);
}

// Blocks of `kernel` with `threads` threads that fit on one multiprocessor at once.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  KILN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0));
  return std::max(n, 1);
}

// KILN_REDUCE_ROW_THREADS (cached; reload_env_switches() after a setenv): the threads that
// reduce one row of a K == 1 reduction, for timing side by side and for the tests: 32 takes the
// warp kernel at any row length (where the rows are not split), 64-512 the block kernel with that
// many threads (also for short rows, and for the chunks of split rows); unset: row_threads.
int row_threads_switch() {
  static const kiln::internal::EnvChoice choice("KILN_REDUCE_ROW_THREADS",
                                                {"32", "64", "128", "256", "512"});
  constexpr int kThreadsOf[] = {32, 64, 128, 256, 512};
  const int i = choice.get();
  return i < 0 ? 0 : kThreadsOf[i];
}

// Threads of the block kernel for a row (or chunk) of n elements of `elem` bytes: each thread gets
// at least a full round of kRowUnroll 16-byte packs, from 64 to kRowThreads threads. A row of
// 8192 bf16 (1024 packs) gets 256 threads, 8192 f32 512: with 512 threads a 16-bit row gave each
// thread only two loads, and half the bytes in flight of the f32 row.
int block_threads(int64_t n, size_t elem) {
  const int64_t packs = n * static_cast<int64_t>(elem) / 16;
  int t = 64;
  while (t < kRowThreads && int64_t{2} * t * kRowUnroll <= packs) t *= 2;
  return t;
}

// Threads per row: a warp up to kWarpRowMax elements (several rows per block, no barrier), else
// block_threads.
int row_threads(int64_t n, size_t elem) {
  return n <= kWarpRowMax ? kWarp : block_threads(n, elem);
}

// Reduces the contiguous [A, R, K] block `x` with `red`, calling red.finish once per output.
template <typename T, typename Red>
void reduce_loop(const Red& red, const T* x, int64_t A, int64_t R, int64_t K, Device device) {
  using Acc = red_acc_t<Red>;
  const int64_t outputs = A * K;
  if (outputs == 0) return;
  const cudaStream_t stream = current_stream();
  if (R == 0) {
    empty_kernel<<<loops::grid_for(outputs), loops::kThreads, 0, stream>>>(red, outputs);
    KILN_CUDA_LAUNCH_CHECK("empty_kernel");
    return;
  }
  const int64_t sms = loops::multiprocessor_count();
  const int forced = K == 1 ? row_threads_switch() : 0;
  // Row kernels index a row (chunk) with 32-bit offsets.
  constexpr int64_t kMaxChunk = int64_t{1} << 30;
  int row_thr = forced > 0 ? forced : row_threads(R, sizeof(T));
  if (R > kMaxChunk && row_thr == kWarp) row_thr = kRowThreads;
  // Blocks without a split, and the split of R that fills the GPU in one wave (the blocks that
  // fit on a multiprocessor at once, on each; about 4 for the column kernel) when those are too
  // few, each chunk at least 4096 elements long. Row chunks are a multiple of 16 elements so
  // that they share the row's alignment (the same scalar head, then 16-byte loads).
  const int64_t natural = K == 1 ? A : ((K + kColX - 1) / kColX) * std::min<int64_t>(A, 65535);
  int64_t splits = 1;
  if ((K > 1 || row_thr > kWarp) && natural < 2 * sms) {
    const int64_t min_chunk = 4096;
    const int64_t per_sm = K == 1 ? resident_blocks(rows_block_kernel<T, Red>, row_thr) : 4;
    splits = std::clamp<int64_t>(std::min((R + min_chunk - 1) / min_chunk, per_sm * sms / natural),
                                 1, 65535);
  }
  if (K == 1 && row_thr > kWarp) splits = std::max(splits, (R + kMaxChunk - 1) / kMaxChunk);
  int64_t chunk = (R + splits - 1) / splits;
  if (K == 1 && splits > 1) chunk = (chunk + 15) / 16 * 16;
  splits = (R + chunk - 1) / chunk;
  if (K == 1 && row_thr > kWarp && forced == 0) row_thr = block_threads(chunk, sizeof(T));
  Tensor workspace;
  Acc* partial = nullptr;
  if (splits > 1) {
    const int64_t bytes = splits * outputs * static_cast<int64_t>(sizeof(Acc));
    workspace = loops::empty_on({(bytes + 7) / 8}, kInt64, device);
    partial = static_cast<Acc*>(workspace.data_ptr());
  }
  if (K == 1 && row_thr == kWarp) {
    const int warps_per_block = loops::kThreads / kWarp;
    rows_warp_kernel<<<loops::grid_for(A, warps_per_block), loops::kThreads, 0, stream>>>(
        red, x, A, static_cast<int>(R));
    KILN_CUDA_LAUNCH_CHECK("rows_warp_kernel");
  } else if (K == 1) {
    KILN_CHECK(A < (int64_t{1} << 31), "[reduce] too many rows for the CUDA kernel: ", A);
    const dim3 grid(static_cast<unsigned>(A), static_cast<unsigned>(splits));
    rows_block_kernel<<<grid, row_thr, 0, stream>>>(red, x, R, static_cast<int>(chunk), partial,
                                                    outputs);
    KILN_CUDA_LAUNCH_CHECK("rows_block_kernel");
  } else {
    const int64_t kblocks = (K + kColX - 1) / kColX;
    KILN_CHECK(kblocks < (int64_t{1} << 31), "[reduce] too many columns for the CUDA kernel: ", K);
    const dim3 grid(static_cast<unsigned>(kblocks),
                    static_cast<unsigned>(std::min<int64_t>(A, 65535)),
                    static_cast<unsigned>(splits));
    columns_kernel<<<grid, dim3(kColX, kColY), 0, stream>>>(red, x, A, R, K, chunk, partial);
    KILN_CUDA_LAUNCH_CHECK("columns_kernel");
  }
  if (splits > 1 && outputs <= 1024) {
    finalize_block_kernel<<<static_cast<unsigned>(outputs), kFinalizeThreads, 0, stream>>>(
        red, partial, splits, outputs);
    KILN_CUDA_LAUNCH_CHECK("finalize_block_kernel");
  } else if (splits > 1) {
    finalize_kernel<<<loops::grid_for(outputs), loops::kThreads, 0, stream>>>(red, partial, splits,
                                                                              outputs);
    KILN_CUDA_LAUNCH_CHECK("finalize_kernel");
  }
}

Shape dims_attr(const OpCall& c, size_t i) {
  return reduction_dims(c.attr<Shape>(i), c.input(0).dim(), c.name().c_str());
}

// Runs `red` over `x` (already of dtype T) reduced over `dims`.
template <typename T, typename Red>
void run_reduction(const Tensor& x, IntArrayRef dims, const Red& red, bool index_order = false) {
  DeviceGuard guard(x.device().index());
  const cpu::ReduceBlock b = cpu::reduce_block(x, dims, index_order);
  const T* p = b.input.numel() == 0 ? nullptr : static_cast<const T*>(b.input.data_ptr());
  reduce_loop<T>(red, p, b.outer, b.reduced, b.inner, x.device());
}

// --- sum, mean, prod --------------------------------------------------------------------------

// The reducers are the CPU's (kernels/reduce_fn.h), accumulating in float_acc_t.
template <typename T>
using SumReducer = scalar::SumReducer<T, float_acc_t<T>>;
template <typename T>
using ProdReducer = scalar::ProdReducer<T, float_acc_t<T>>;

void sum_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, SumReducer<T>{out.data_ptr<T>(), acc_t<T>(1)});
  });
}

void mean_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  int64_t count = 1;
  for (int64_t d : dims) count *= x.sizes()[d];
  visit_floating(out.dtype(), "mean", [&]<typename T>(TypeTag<T>) {
    // An empty reduction gives 0 * (1 / 0) = nan, as PyTorch's mean.
    const double scale = count == 0 ? std::numeric_limits<double>::quiet_NaN() : 1.0 / count;
    run_reduction<T>(x, dims, SumReducer<T>{out.data_ptr<T>(), static_cast<acc_t<T>>(scale)});
  });
}

void prod_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ProdReducer<T>{out.data_ptr<T>()});
  });
}

// --- amax, amin, max, min ---------------------------------------------------------------------

using scalar::ExtremumReducer;

template <bool kMax>
void extremum_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ExtremumReducer<T, kMax>{c.outputs[0].data_ptr<T>()});
  });
}

// --- max/min with indices, argmax/argmin -------------------------------------------------------

using scalar::ArgReducer;

template <bool kMax>
void max_dim_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = reduction_dims({c.attr<int64_t>(0)}, x.dim(), c.name().c_str());
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(
        x, dims, ArgReducer<T, kMax>{c.outputs[0].data_ptr<T>(), c.outputs[1].data_ptr<int64_t>()},
        /*index_order=*/true);
  });
}

template <bool kMax>
void argmax_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = c.has_attr(0) ? reduction_dims({c.attr<int64_t>(0)}, x.dim(), c.name().c_str())
                                   : reduction_dims({}, x.dim(), c.name().c_str());
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, ArgReducer<T, kMax>{nullptr, c.outputs[0].data_ptr<int64_t>()},
                     /*index_order=*/true);
  });
}

// --- var, std ---------------------------------------------------------------------------------

template <bool kStd>
void var_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  const double correction = static_cast<double>(c.attr<int64_t>(1));
  visit_floating(x.dtype(), c.name(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims,
                     scalar::VarReducer<T, float_acc_t<T>, kStd>{
                         c.outputs[0].data_ptr<T>(), static_cast<float_acc_t<T>>(correction)});
  });
}

// --- norm -------------------------------------------------------------------------------------

void norm_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const double p = c.attr<Scalar>(0).toDouble();
  const Shape dims = dims_attr(c, 1);
  visit_floating(x.dtype(), "norm", [&]<typename T>(TypeTag<T>) {
    T* out = c.outputs[0].data_ptr<T>();
    const float_acc_t<T> pa = static_cast<float_acc_t<T>>(p);
    scalar::visit_norm_kind(p, [&]<NormKind kKind>() {
      run_reduction<T>(x, dims, scalar::NormReducer<T, float_acc_t<T>, kKind>{out, pa});
    });
  });
}

// --- logsumexp --------------------------------------------------------------------------------

void logsumexp_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor x = as_dtype(c.input(0), out.dtype());
  const Shape dims = dims_attr(c, 0);
  visit_floating(out.dtype(), "logsumexp", [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, scalar::LogSumExpReducer<T, float_acc_t<T>>{out.data_ptr<T>()});
  });
}

// --- all, any ---------------------------------------------------------------------------------

template <bool kAll>
void logical_reduce_cuda(OpCall& c) {
  const Tensor& x = c.input(0);
  const Shape dims = dims_attr(c, 0);
  visit_dtype(x.dtype(), [&]<typename T>(TypeTag<T>) {
    run_reduction<T>(x, dims, scalar::LogicalReducer<T, kAll>{c.outputs[0].data_ptr<bool>()});
  });
}

// --- cumsum -----------------------------------------------------------------------------------

// The running sum in double for floating types (as the CPU kernel) and int64 for integers.
template <typename T>
using scan_t = scalar::sum_acc_t<T, double>;

template <typename T>
__device__ __forceinline__ scan_t<T> scan_add(scan_t<T> a, scan_t<T> b) {
  if constexpr (std::is_integral_v<T>) {
    return wrap_add(a, b);
  } else {
    return a + b;
  }
}

template <typename T>
__device__ __forceinline__ scan_t<T> to_scan(T x) {
  return scalar::to_acc<scan_t<T>>(x);
}

// K == 1: one warp per row, 32 elements at a time (a shuffle scan plus the running carry).
template <typename T>
__global__ void cumsum_rows_kernel(const T* x, T* y, int64_t A, int64_t R) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t a = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + threadIdx.x / kWarp;
       a < A; a += warps) {
    scan_t<T> carry = 0;
    for (int64_t r0 = 0; r0 < R; r0 += kWarp) {
      const int64_t r = r0 + lane;
      scan_t<T> v = r < R ? to_scan(x[a * R + r]) : scan_t<T>(0);
#pragma unroll
      for (int o = 1; o < kWarp; o <<= 1) {
        const scan_t<T> u = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v = scan_add<T>(u, v);
      }
      v = scan_add<T>(carry, v);
      if (r < R) y[a * R + r] = from_acc<T>(v);
      carry = __shfl_sync(0xffffffffu, v, kWarp - 1);
    }
  }
}

// K > 1: one thread per column (a, k), walking R; neighbouring threads read neighbouring k.
template <typename T>
__global__ void cumsum_columns_kernel(const T* x, T* y, int64_t A, int64_t R, int64_t K) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < A * K;
       i += step) {
    const int64_t a = i / K, k = i % K;
    scan_t<T> acc = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t off = (a * R + r) * K + k;
      acc = scan_add<T>(acc, to_scan(x[off]));
      y[off] = from_acc<T>(acc);
    }
  }
}

void cumsum_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const Tensor x = as_dtype(c.input(0), out.dtype()).contiguous();
  const int64_t dim = wrap_dim(c.attr<int64_t>(0), x.dim(), "cumsum");
  const int64_t R = x.dim() == 0 ? 1 : x.sizes()[dim];
  const int64_t K = x.dim() == 0 ? 1 : numel_of(x.sizes().subspan(dim + 1));
  const int64_t A = x.numel() / (R * K);
  const cudaStream_t stream = current_stream();
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    const T* in = static_cast<const T*>(x.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    if (K == 1) {
      cumsum_rows_kernel<<<loops::grid_for(A, loops::kThreads / kWarp), loops::kThreads, 0,
                           stream>>>(in, o, A, R);
      KILN_CUDA_LAUNCH_CHECK("cumsum_rows_kernel");
    } else {
      cumsum_columns_kernel<<<loops::grid_for(A * K), loops::kThreads, 0, stream>>>(in, o, A, R, K);
      KILN_CUDA_LAUNCH_CHECK("cumsum_columns_kernel");
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(sum, kCUDA, sum_cuda);
KILN_REGISTER_KERNEL(mean, kCUDA, mean_cuda);
KILN_REGISTER_KERNEL(prod, kCUDA, prod_cuda);
KILN_REGISTER_KERNEL(amax, kCUDA, extremum_cuda<true>);
KILN_REGISTER_KERNEL(amin, kCUDA, extremum_cuda<false>);
KILN_REGISTER_KERNEL(max, kCUDA, extremum_cuda<true>);
KILN_REGISTER_KERNEL(min, kCUDA, extremum_cuda<false>);
KILN_REGISTER_KERNEL(max_dim, kCUDA, max_dim_cuda<true>);
KILN_REGISTER_KERNEL(min_dim, kCUDA, max_dim_cuda<false>);
KILN_REGISTER_KERNEL(argmax, kCUDA, argmax_cuda<true>);
KILN_REGISTER_KERNEL(argmin, kCUDA, argmax_cuda<false>);
KILN_REGISTER_KERNEL(var, kCUDA, var_cuda<false>);
KILN_REGISTER_KERNEL(std, kCUDA, var_cuda<true>);
KILN_REGISTER_KERNEL(norm, kCUDA, norm_cuda);
KILN_REGISTER_KERNEL(logsumexp, kCUDA, logsumexp_cuda);
KILN_REGISTER_KERNEL(all, kCUDA, logical_reduce_cuda<true>);
KILN_REGISTER_KERNEL(any, kCUDA, logical_reduce_cuda<false>);
KILN_REGISTER_KERNEL(cumsum, kCUDA, cumsum_cuda);

}  // namespace kiln::cuda
