// The CUDA kernels of the reductions (sum, mean, prod, amax/amin, max/min, max_dim/min_dim,
// argmax/argmin, var/std, norm, logsumexp, all/any) and of cumsum. Semantics, dtypes and argument
// rules are those of the CPU kernels (kernels/cpu/reduce.cpp, tensor/ops/reduce.cpp): the op
// kernels are kernels/reduce_fn.h's ReduceOps, shared with the CPU, with this file's CudaLoop.
//
// Every reduction is brought to a contiguous [A, R, K] block whose middle dim is reduced by the
// CPU's own reduce_block (no copy for contiguous inputs reduced over inner or outer dims); then
// reduce_loop picks a kernel of kernels/cuda/reduce.cuh from the shape alone:
//   - K == 1, rows up to 4096 elements: one warp per row;
//   - K == 1, longer rows: one block per row, sized so that each thread has a full round of
//     16-byte loads (block_threads); when there are too few rows to fill the GPU, several blocks
//     per row that write partial accumulators, merged by a second kernel;
//   - K > 1: the column kernel, on 16-byte packs of adjacent columns when K is a multiple of the
//     pack and the block is 16-byte aligned (else one element a thread), split along R the same
//     way (in chunks of 256 rows or more) when there are few columns.
// A split reduction uses one wave of blocks and merges the partials in a fixed order, with one
// block per output when there are few outputs: the result is deterministic.
// Accumulators: float for f32, f16 and bf16, double for f64, int64 for integers (wrapping, as
// PyTorch). The thread counts these won against live in the kernel lab
// (benchmarks/lab/reduce_lab.cu); measurements: benchmarks/RESULTS.md.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/cpu/reduce.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/reduce_fn.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::columns_kernel;
using internal::columns_packed_kernel;
using internal::empty_kernel;
using internal::finalize_block_kernel;
using internal::finalize_kernel;
using internal::kColumnsPacked;
using internal::kColX;
using internal::kColY;
using internal::kFinalizeThreads;
using internal::kRowThreads;
using internal::kRowUnroll;
using internal::red_acc_t;
using internal::resident_blocks;
using internal::rows_block_kernel;
using internal::rows_warp_kernel;
using scalar::from_acc;
using scalar::wrap_add;

constexpr int kWarp = internal::kReduceWarp;
constexpr int64_t kWarpRowMax = 4096;  // rows up to this length get one warp each
// The shortest row chunk of a split column reduction.
constexpr int64_t kColumnMinChunk = 256;

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

// The column kernel's blocks resident on a multiprocessor, and its launch: on 16-byte packs when
// `packed` (columns_packed_kernel, instantiated only where the reducer fits it), else one element
// a thread.
template <typename T, typename Red>
int64_t column_blocks_per_sm(bool packed) {
  if constexpr (kColumnsPacked<T, Red>) {
    if (packed) return resident_blocks(columns_packed_kernel<T, Red>, kColX * kColY);
  }
  return resident_blocks(columns_kernel<T, Red>, kColX * kColY);
}

template <typename T, typename Red>
void launch_columns(bool packed, dim3 grid, cudaStream_t stream, const Red& red, const T* x,
                    int64_t A, int64_t R, int64_t K, int64_t chunk, red_acc_t<Red>* partial) {
  if constexpr (kColumnsPacked<T, Red>) {
    if (packed) {
      columns_packed_kernel<<<grid, dim3(kColX, kColY), 0, stream>>>(red, x, A, R, K, chunk,
                                                                     partial);
      KILN_CUDA_LAUNCH_CHECK("columns_packed_kernel");
      return;
    }
  }
  columns_kernel<<<grid, dim3(kColX, kColY), 0, stream>>>(red, x, A, R, K, chunk, partial);
  KILN_CUDA_LAUNCH_CHECK("columns_kernel");
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
  // Row kernels index a row (chunk) with 32-bit offsets.
  constexpr int64_t kMaxChunk = int64_t{1} << 30;
  int row_thr = row_threads(R, sizeof(T));
  if (R > kMaxChunk && row_thr == kWarp) row_thr = kRowThreads;
  // Blocks without a split, and the split of R that fills the GPU in one wave (the blocks that
  // fit on a multiprocessor at once, on each) when those are too few, each chunk at least 4096
  // elements of a row long, or kColumnMinChunk rows of the column kernel (a [8192, 2048] bf16 sum
  // over its rows ran at 176 GB/s with 4096-row chunks, 128 blocks on 132 SMs). Row chunks are a
  // multiple of 16 elements so that they share the row's alignment (the same scalar head, then
  // 16-byte loads).
  // Columns: on 16-byte packs when every row's packs are aligned (columns_packed_kernel).
  constexpr int64_t V = 16 / sizeof(T);
  const bool packed =
      K > 1 && kColumnsPacked<T, Red> && K % V == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const int64_t col_width = packed ? kColX * V : kColX;  // columns of a block
  const int64_t natural =
      K == 1 ? A : ((K + col_width - 1) / col_width) * std::min<int64_t>(A, 65535);
  int64_t splits = 1;
  if ((K > 1 || row_thr > kWarp) && natural < 2 * sms) {
    const int64_t min_chunk = K == 1 ? 4096 : kColumnMinChunk;
    const int64_t per_sm = K == 1 ? resident_blocks(rows_block_kernel<T, Red>, row_thr)
                                  : column_blocks_per_sm<T, Red>(packed);
    splits = std::clamp<int64_t>(std::min((R + min_chunk - 1) / min_chunk, per_sm * sms / natural),
                                 1, 65535);
  }
  if (K == 1 && row_thr > kWarp) splits = std::max(splits, (R + kMaxChunk - 1) / kMaxChunk);
  int64_t chunk = (R + splits - 1) / splits;
  if (K == 1 && splits > 1) chunk = (chunk + 15) / 16 * 16;
  splits = (R + chunk - 1) / chunk;
  if (K == 1 && row_thr > kWarp) row_thr = block_threads(chunk, sizeof(T));
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
    const int64_t kblocks = (K + col_width - 1) / col_width;
    KILN_CHECK(kblocks < (int64_t{1} << 31), "[reduce] too many columns for the CUDA kernel: ", K);
    const dim3 grid(static_cast<unsigned>(kblocks),
                    static_cast<unsigned>(std::min<int64_t>(A, 65535)),
                    static_cast<unsigned>(splits));
    launch_columns(packed, grid, stream, red, x, A, R, K, chunk, partial);
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

// The CUDA side of the reduction ops (scalar::ReduceOps): floats accumulate in float (double for
// f64), and reduce_loop runs the reducer on the current device.
struct CudaLoop {
  template <typename T>
  using float_acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  template <typename T, bool kMax>
  static scalar::ExtremumReducer<T, kMax> extremum(T* out) {
    return {out};
  }
  template <typename T, typename Red>
  static void run(const Tensor& x, IntArrayRef dims, const Red& red, bool index_order) {
    DeviceGuard guard(x.device().index());
    const cpu::ReduceBlock b = cpu::reduce_block(x, dims, index_order);
    const T* p = b.input.numel() == 0 ? nullptr : static_cast<const T*>(b.input.data_ptr());
    reduce_loop<T>(red, p, b.outer, b.reduced, b.inner, x.device());
  }
};

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
  const Tensor x = loops::as_dtype(c.input(0), out.dtype()).contiguous();
  const scalar::DimBlock blk =
      scalar::dim_block(x, wrap_dim(c.attr<int64_t>(0), x.dim(), "cumsum"));
  const int64_t A = blk.A, R = blk.R, K = blk.K;
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

KILN_REGISTER_REDUCE_KERNELS(kCUDA, CudaLoop);
KILN_REGISTER_KERNEL(cumsum, kCUDA, cumsum_cuda);

}  // namespace kiln::cuda
