// CUDA kernels of the indexing ops index_select, embedding, gather, scatter (src and value),
// scatter_add, index_add, masked_fill and triu/tril (CPU: kernels/cpu/index.cpp; rules in
// tensor/ops/index.cpp).
//
// Ops that only move elements dispatch on the element size (1, 2, 4 or 8 bytes), as on the CPU,
// and work on any strides: each thread finds its element's offsets by decomposing its row-major
// index over the shape it walks, with one stride array per tensor it touches. Every index is
// checked before it is used; a bad one raises the device-side error flag and the host throws
// kiln::Error with the CPU kernel's message (which waits for the device).
//
// Writes to repeated positions: scatter (src, value) gives each row along `dim` to one thread
// that walks it in order, so the last write wins as on the CPU; scatter_add accumulates with
// atomics (exact for integers; for floats the order of the additions, and so the last bits, may
// differ from run to run, as in PyTorch's CUDA kernels). index_add of floats sums each index's
// slices in position order through a sorted copy of the index: deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <utility>

#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/index_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/sort.cuh"

namespace kiln::cuda {
namespace {

using internal::atomic_accumulate;
using internal::visit_bytes;
using internal::visit_index;
using loops::ErrorFlag;
using loops::FlagView;
using loops::Geometry;
using loops::kMaxDims;

// The loop geometry of `sizes` with one stride array per operand, without merging dims (the
// kernels need the coordinate along a given dim).
template <int N>
Geometry<N> raw_geometry(IntArrayRef sizes, const Shape (&strides)[N], const char* op) {
  KILN_CHECK(static_cast<int>(sizes.size()) <= kMaxDims, "[", op,
             "] the CUDA kernel handles at most ", kMaxDims, " dimensions, got shape ",
             shape_str(sizes));
  Geometry<N> g;
  g.ndim = static_cast<int>(sizes.size());
  for (int d = 0; d < g.ndim; ++d) {
    g.sizes[d] = sizes[d];
    for (int k = 0; k < N; ++k) g.strides[k][d] = strides[k][d];
  }
  loops::update_divs(g);
  return g;
}

// A stride array that is 1 along `dim` and 0 elsewhere: its offset is the coordinate along dim.
Shape unit_at(size_t ndim, int64_t dim) {
  Shape s(ndim, 0);
  s[dim] = 1;
  return s;
}

// `strides` with dim `dim` zeroed (its contribution comes from an index value instead).
Shape without(IntArrayRef strides, int64_t dim) {
  Shape s = to_shape(strides);
  s[dim] = 0;
  return s;
}

// Sizes and strides with a 0-d tensor read as shape [1] (gather/scatter treat it so).
struct Layout {
  Shape sizes, strides;
};
Layout layout_1d(const Tensor& t) {
  if (t.dim() == 0) return {Shape{1}, Shape{1}};
  return {to_shape(t.sizes()), to_shape(t.strides())};
}

// Reads index value v for a dim of `size`; a bad one raises the flag (and 0 is used).
__device__ __forceinline__ int64_t checked(int64_t v, int64_t size, const FlagView& flag) {
  if (v < 0 || v >= size) {
    flag.raise(v);
    return 0;
  }
  return v;
}

void throw_if_raised(const ErrorFlag& flag, const char* op, int64_t dim, int64_t size) {
  int64_t v = 0;
  KILN_CHECK(!flag.raised(&v), "[", op, "] index ", v, " is out of bounds for dimension ", dim,
             " with size ", size);
}

unsigned int grid(int64_t n) { return loops::grid_for(n); }

#define KILN_GRID_STRIDE(i, n)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// --- index_select, embedding, gather ----------------------------------------------------------

// out (contiguous) element i: self at offset s + idx[j] * dim_stride, where (s, j) are the
// offsets of i in the geometry {self strides without dim, unit at dim} over out's shape.
template <typename U, typename I>
__global__ void index_select_kernel(U* out, const U* self, const I* idx, int64_t n, Geometry<2> g,
                                    int64_t dim_size, int64_t dim_stride, FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, i, off);
    const int64_t v = checked(static_cast<int64_t>(idx[off[1]]), dim_size, flag);
    out[i] = self[off[0] + v * dim_stride];
  }
}

void index_select_cuda(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& out = c.outputs[0];
  DeviceGuard guard(out.device().index());
  const Tensor idx = c.input(1).reshape({-1}).contiguous();
  const Layout sl = layout_1d(self);
  const int64_t d = self.dim() == 0 ? 0 : wrap_dim(c.attr<int64_t>(0), self.dim(), "index_select");
  Shape walk = sl.sizes;
  walk[d] = idx.numel();
  const int64_t n = numel_of(walk);
  if (n == 0) return;
  const Shape strides[2] = {without(sl.strides, d), unit_at(walk.size(), d)};
  const Geometry<2> g = raw_geometry<2>(walk, strides, "index_select");
  const ErrorFlag flag(out.device());
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
      index_select_kernel<U, I><<<grid(n), loops::kThreads, 0, current_stream()>>>(
          static_cast<U*>(out.data_ptr()), static_cast<const U*>(self.data_ptr()),
          static_cast<const I*>(idx.data_ptr()), n, g, sl.sizes[d], sl.strides[d], flag.view());
      KILN_CUDA_LAUNCH_CHECK("index_select_kernel");
    });
  });
  throw_if_raised(flag, "index_select", d, sl.sizes[d]);
}

// out [N, D] (contiguous) = weight rows idx[n].
template <typename U, typename I>
__global__ void embedding_kernel(U* out, const U* weight, const I* idx, int64_t n, int64_t D,
                                 int64_t V, int64_t ws0, int64_t ws1, FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    const int64_t row = i / D, col = i % D;
    const int64_t v = checked(static_cast<int64_t>(idx[row]), V, flag);
    out[i] = weight[v * ws0 + col * ws1];
  }
}

void embedding_cuda(OpCall& c) {
  const Tensor& weight = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const Tensor idx = c.input(1).contiguous();
  const int64_t V = weight.sizes()[0], D = weight.sizes()[1];
  const ErrorFlag flag(out.device());
  visit_bytes(weight.dtype(), [&]<typename U>(TypeTag<U>) {
    visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
      embedding_kernel<U, I><<<grid(n), loops::kThreads, 0, current_stream()>>>(
          static_cast<U*>(out.data_ptr()), static_cast<const U*>(weight.data_ptr()),
          static_cast<const I*>(idx.data_ptr()), n, D, V, weight.strides()[0], weight.strides()[1],
          flag.view());
      KILN_CUDA_LAUNCH_CHECK("embedding_kernel");
    });
  });
  throw_if_raised(flag, "embedding", 0, V);
}

// Walks idx's shape: offsets {idx, self without dim, out}.
template <typename U>
__global__ void gather_kernel(U* out, const U* self, const int64_t* idx, int64_t n, Geometry<3> g,
                              int64_t dim_size, int64_t dim_stride, FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[3];
    loops::offsets<int64_t, 3>(g, i, off);
    const int64_t v = checked(idx[off[0]], dim_size, flag);
    out[off[2]] = self[off[1] + v * dim_stride];
  }
}

void gather_cuda(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const Tensor& out = c.outputs[0];
  const int64_t n = idx.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), "gather");
  const Layout il = layout_1d(idx), sl = layout_1d(self), ol = layout_1d(out);
  const Shape strides[3] = {il.strides, without(sl.strides, d), ol.strides};
  const Geometry<3> g = raw_geometry<3>(il.sizes, strides, "gather");
  const ErrorFlag flag(out.device());
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    gather_kernel<U><<<grid(n), loops::kThreads, 0, current_stream()>>>(
        static_cast<U*>(out.data_ptr()), static_cast<const U*>(self.data_ptr()),
        static_cast<const int64_t*>(idx.data_ptr()), n, g, sl.sizes[d], sl.strides[d], flag.view());
    KILN_CUDA_LAUNCH_CHECK("gather_kernel");
  });
  throw_if_raised(flag, "gather", d, sl.sizes[d]);
}

// --- scatter, scatter_add, index_add ----------------------------------------------------------

enum class ScatterMode { kSrc, kValue, kAdd };

// scatter (src, value): one thread per row along dim of idx's shape, in order. Geometry over the
// rows (idx's shape with dim set to 1): offsets {idx, out, src}.
template <typename T, ScatterMode kMode>
__global__ void scatter_rows_kernel(T* out, const T* src, T value, const int64_t* idx, int64_t rows,
                                    Geometry<3> g, int64_t len, int64_t idx_stride,
                                    int64_t out_stride, int64_t src_stride, int64_t dim_size,
                                    FlagView flag) {
  KILN_GRID_STRIDE(row, rows) {
    int64_t off[3];
    loops::offsets<int64_t, 3>(g, row, off);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t v = idx[off[0] + j * idx_stride];
      if (v < 0 || v >= dim_size) {
        flag.raise(v);
        continue;
      }
      T& to = out[off[1] + v * out_stride];
      if constexpr (kMode == ScatterMode::kValue) {
        to = value;
      } else {
        to = src[off[2] + j * src_stride];
      }
    }
  }
}

// scatter_add: one thread per index element, accumulating atomically. Offsets {idx, out
// without dim, src}.
template <typename T>
__global__ void scatter_add_kernel(T* out, const T* src, const int64_t* idx, int64_t n,
                                   Geometry<3> g, int64_t out_stride, int64_t dim_size,
                                   FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[3];
    loops::offsets<int64_t, 3>(g, i, off);
    const int64_t v = idx[off[0]];
    if (v < 0 || v >= dim_size) {
      flag.raise(v);
      continue;
    }
    atomic_accumulate<T>(out + off[1] + v * out_stride, static_cast<opmath_t<T>>(src[off[2]]));
  }
}

template <ScatterMode kMode, bool kInplace>
void scatter_cuda(OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& out = c.outputs[0];
  const Tensor& idx = c.input(1);
  DeviceGuard guard(out.device().index());
  if constexpr (!kInplace) loops::copy_into(out, c.input(0));
  if (idx.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), op);
  const Tensor src = kMode == ScatterMode::kValue ? idx : c.input(2);
  const Layout il = layout_1d(idx), ol = layout_1d(out), sl = layout_1d(src);
  const ErrorFlag flag(out.device());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    T* o = static_cast<T*>(out.data_ptr());
    const int64_t* ip = static_cast<const int64_t*>(idx.data_ptr());
    if constexpr (kMode == ScatterMode::kAdd) {
      const int64_t n = idx.numel();
      const Shape strides[3] = {il.strides, without(ol.strides, d), sl.strides};
      const Geometry<3> g = raw_geometry<3>(il.sizes, strides, op);
      scatter_add_kernel<T><<<grid(n), loops::kThreads, 0, current_stream()>>>(
          o, static_cast<const T*>(src.data_ptr()), ip, n, g, ol.strides[d], ol.sizes[d],
          flag.view());
      KILN_CUDA_LAUNCH_CHECK("scatter_add_kernel");
    } else {
      Shape row_sizes = il.sizes;
      row_sizes[d] = 1;
      const int64_t rows = numel_of(row_sizes);
      const Shape strides[3] = {
          il.strides, ol.strides,
          kMode == ScatterMode::kValue ? Shape(il.strides.size(), 0) : sl.strides};
      const Geometry<3> g = raw_geometry<3>(row_sizes, strides, op);
      const T value = kMode == ScatterMode::kValue ? c.attr<Scalar>(1).to<T>() : T();
      const T* s = kMode == ScatterMode::kValue ? nullptr : static_cast<const T*>(src.data_ptr());
      scatter_rows_kernel<T, kMode><<<grid(rows), loops::kThreads, 0, current_stream()>>>(
          o, s, value, ip, rows, g, il.sizes[d], il.strides[d], ol.strides[d],
          kMode == ScatterMode::kValue ? 0 : sl.strides[d], ol.sizes[d], flag.view());
      KILN_CUDA_LAUNCH_CHECK("scatter_rows_kernel");
    }
  });
  throw_if_raised(flag, op, d, ol.sizes[d]);
}

// index_add: one thread per source element. Geometry over source's shape: offsets {src, out
// without dim, position along dim}.
template <typename T, typename I>
__global__ void index_add_kernel(T* out, const T* src, const I* idx, int64_t n, Geometry<3> g,
                                 int64_t out_stride, int64_t dim_size, opmath_t<T> alpha,
                                 FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[3];
    loops::offsets<int64_t, 3>(g, i, off);
    const int64_t v = static_cast<int64_t>(idx[off[2]]);
    if (v < 0 || v >= dim_size) {
      flag.raise(v);
      continue;
    }
    const opmath_t<T> s = static_cast<opmath_t<T>>(src[off[0]]);
    if constexpr (std::is_same_v<T, bool>) {
      atomic_accumulate<T>(out + off[1] + v * out_stride, alpha && s);
    } else {
      atomic_accumulate<T>(out + off[1] + v * out_stride, alpha * s);
    }
  }
}

// index_add of floating values, deterministic: the index sorted stably (sorted, perm), one thread
// per (position in the sorted index, element of a slice) where a run of equal indices starts; it
// sums the run's source slices in position order in opmath and adds the sum once. Geometry over
// source's shape with dim's size 1: offsets {src, out} without dim.
template <typename T, typename I>
__global__ void index_add_sorted_kernel(T* out, const T* src, const I* sorted, const int64_t* perm,
                                        int64_t len, int64_t inner, Geometry<2> g,
                                        int64_t src_stride, int64_t out_stride, int64_t dim_size,
                                        opmath_t<T> alpha, FlagView flag) {
  KILN_GRID_STRIDE(i, len * inner) {
    const int64_t pos = i / inner;
    const I v = sorted[pos];
    if (pos > 0 && sorted[pos - 1] == v) continue;
    if (v < 0 || v >= dim_size) {
      flag.raise(static_cast<int64_t>(v));
      continue;
    }
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, i % inner, off);
    opmath_t<T> acc = 0;
    for (int64_t j = pos; j < len && sorted[j] == v; ++j)
      acc += static_cast<opmath_t<T>>(src[off[0] + perm[j] * src_stride]);
    T* dst = out + off[1] + static_cast<int64_t>(v) * out_stride;
    *dst = static_cast<T>(static_cast<opmath_t<T>>(*dst) + alpha * acc);
  }
}

// The same sums where the slices are dense rows of `inner` elements in both src and out (an
// embedding's backward; DDP's gathered rows): a block per position of the sorted index (a run's
// first; the rest return), each thread a 16-byte pack of the row, the run's source rows summed
// in position order as above, so that the bits are the same. One thread per element, with its
// 64-bit divisions and 2-byte accesses, ran at a tenth of memory bandwidth (0.96 ms for 32768
// rows of 2048 bf16 on an H200).
template <typename T, typename I, int N>
__global__ void __launch_bounds__(loops::kThreads)
    index_add_rows_kernel(T* out, const T* src, const I* sorted, const int64_t* perm, int64_t len,
                          int64_t inner, int64_t src_stride, int64_t out_stride, int64_t dim_size,
                          opmath_t<T> alpha, FlagView flag) {
  using M = opmath_t<T>;
  for (int64_t pos = blockIdx.x; pos < len; pos += gridDim.x) {
    const I v = sorted[pos];
    if (pos > 0 && sorted[pos - 1] == v) continue;
    if (v < 0 || v >= dim_size) {
      if (threadIdx.x == 0 && blockIdx.y == 0) flag.raise(static_cast<int64_t>(v));
      continue;
    }
    T* row = out + static_cast<int64_t>(v) * out_stride;
    for (int64_t col = (static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x) * N;
         col < inner; col += static_cast<int64_t>(gridDim.y) * blockDim.x * N) {
      M acc[N] = {};
      for (int64_t j = pos; j < len && sorted[j] == v; ++j) {
        M x[N];
        internal::load_pack<N>(src + perm[j] * src_stride + col, x);
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] += x[i];
      }
      M y[N];
      internal::load_pack<N>(row + col, y);
#pragma unroll
      for (int i = 0; i < N; ++i) y[i] = y[i] + alpha * acc[i];
      internal::store_pack<N>(row + col, y);
    }
  }
}

// keys[i] = idx[i] where it lies in [0, rows), else rows: out-of-range indices sort after every
// valid one, where the kernels report them.
template <typename I>
__global__ void index_keys_kernel(uint32_t* keys, const I* idx, int64_t n, int64_t rows) {
  KILN_GRID_STRIDE(i, n) {
    const auto v = static_cast<int64_t>(idx[i]);
    keys[i] = static_cast<uint32_t>(v >= 0 && v < rows ? v : rows);
  }
}

// sorted[i] = idx[pos[i]], perm[i] = pos[i].
template <typename I, typename P>
__global__ void gather_sorted_kernel(I* sorted, int64_t* perm, const I* idx, const P* pos,
                                     int64_t n) {
  KILN_GRID_STRIDE(i, n) {
    const auto p = static_cast<int64_t>(pos[i]);
    sorted[i] = idx[p];
    perm[i] = p;
  }
}

// index_add's index sorted stably, with the position each entry came from. The keys are the
// indices clamped to [0, rows], so that the radix sort takes only their low bit_width(rows) bits:
// 2 passes for llama-160m's 32000-row table, 3 for llama-3.2-1b's 128256, where sort() takes
// one per byte of int64 (8). Valid indices keep sort()'s order; out-of-range ones (an error the
// kernels report) come last.
std::pair<Tensor, Tensor> sort_index(const Tensor& idx, int64_t rows) {
  const int64_t n = idx.numel();
  if (rows >= std::numeric_limits<uint32_t>::max() || n > std::numeric_limits<int32_t>::max()) {
    auto [sorted, perm] = kiln::sort(idx, 0, /*descending=*/false, /*stable=*/true);
    return {sorted, perm};
  }
  const cudaStream_t stream = current_stream();
  Tensor keys = internal::device_bytes(n * 4, idx.device());
  auto* k = static_cast<uint32_t*>(keys.data_ptr());
  visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
    index_keys_kernel<I><<<grid(n), loops::kThreads, 0, stream>>>(
        k, static_cast<const I*>(idx.data_ptr()), n, rows);
  });
  KILN_CUDA_LAUNCH_CHECK("index_keys_kernel");
  const int bits = std::max(1, static_cast<int>(std::bit_width(static_cast<uint64_t>(rows))));
  const Tensor pos = internal::sort_positions(k, 4, 1, n, /*descending=*/false, idx.device(), bits);
  Tensor sorted = loops::empty_on({n}, idx.dtype(), idx.device());
  Tensor perm = loops::empty_on({n}, kInt64, idx.device());
  visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
    gather_sorted_kernel<I, int32_t><<<grid(n), loops::kThreads, 0, stream>>>(
        static_cast<I*>(sorted.data_ptr()), static_cast<int64_t*>(perm.data_ptr()),
        static_cast<const I*>(idx.data_ptr()), static_cast<const int32_t*>(pos.data_ptr()), n);
  });
  KILN_CUDA_LAUNCH_CHECK("gather_sorted_kernel");
  return {sorted, perm};
}

// Whether t's slices along d are dense rows: every dim before d of size 1, the dims after it
// row-major contiguous (size-1 dims ignored).
bool dense_rows(const Tensor& t, int64_t d) {
  for (int64_t k = 0; k < d; ++k) {
    if (t.size(k) != 1) return false;
  }
  int64_t expected = 1;
  for (int64_t k = t.dim() - 1; k > d; --k) {
    if (t.size(k) != 1 && t.stride(k) != expected) return false;
    expected *= t.size(k);
  }
  return true;
}

// index_add: integers and bools accumulate with atomics (exact in any order); floating values go
// through the sorted index (index_add_sorted_kernel), so that the result does not depend on the
// order in which threads run: embedding's backward is index_add, and a training step must give
// the same bits every time (bit-exact resume).
template <bool kInplace>
void index_add_cuda(OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& out = c.outputs[0];
  DeviceGuard guard(out.device().index());
  const Tensor idx = c.input(1).reshape({-1}).contiguous();
  const Tensor& src = c.input(2);
  if constexpr (!kInplace) loops::copy_into(out, c.input(0));
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), op);
  const int64_t n = src.numel();
  if (n == 0) return;
  const Layout ol = layout_1d(out), sl = layout_1d(src);
  const Shape strides[3] = {sl.strides, without(ol.strides, d), unit_at(sl.sizes.size(), d)};
  const Geometry<3> g = raw_geometry<3>(sl.sizes, strides, op);
  const ErrorFlag flag(out.device());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const M alpha = c.attr<Scalar>(1).to<M>();
    if constexpr (std::is_floating_point_v<M>) {
      const auto [sorted, perm] = sort_index(idx, ol.sizes[static_cast<size_t>(d)]);
      Shape slice = sl.sizes;
      slice[static_cast<size_t>(d)] = 1;
      const Shape slice_strides[2] = {without(sl.strides, d), without(ol.strides, d)};
      const Geometry<2> sg = raw_geometry<2>(slice, slice_strides, op);
      const int64_t len = sl.sizes[static_cast<size_t>(d)], inner = n / len;
      constexpr int kPack = 16 / sizeof(T);
      const int64_t src_stride = sl.strides[static_cast<size_t>(d)];
      const int64_t out_stride = ol.strides[static_cast<size_t>(d)];
      if (dense_rows(src, d) && dense_rows(out, d) && inner % kPack == 0 &&
          src_stride % kPack == 0 && out_stride % kPack == 0 &&
          internal::aligned_to(src.data_ptr(), 16) && internal::aligned_to(out.data_ptr(), 16)) {
        const int64_t packs = inner / kPack;
        const int threads =
            static_cast<int>(std::min<int64_t>(loops::kThreads, (packs + 31) / 32 * 32));
        const dim3 blocks(
            static_cast<unsigned>(std::min<int64_t>(len, int64_t{1} << 30)),
            static_cast<unsigned>(std::min<int64_t>((packs + threads - 1) / threads, 65535)));
        visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
          index_add_rows_kernel<T, I, kPack><<<blocks, threads, 0, current_stream()>>>(
              static_cast<T*>(out.data_ptr()), static_cast<const T*>(src.data_ptr()),
              static_cast<const I*>(sorted.data_ptr()),
              static_cast<const int64_t*>(perm.data_ptr()), len, inner, src_stride, out_stride,
              ol.sizes[static_cast<size_t>(d)], alpha, flag.view());
          KILN_CUDA_LAUNCH_CHECK("index_add_rows_kernel");
        });
        return;
      }
      visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
        index_add_sorted_kernel<T, I><<<grid(n), loops::kThreads, 0, current_stream()>>>(
            static_cast<T*>(out.data_ptr()), static_cast<const T*>(src.data_ptr()),
            static_cast<const I*>(sorted.data_ptr()), static_cast<const int64_t*>(perm.data_ptr()),
            len, inner, sg, sl.strides[static_cast<size_t>(d)], ol.strides[static_cast<size_t>(d)],
            ol.sizes[static_cast<size_t>(d)], alpha, flag.view());
        KILN_CUDA_LAUNCH_CHECK("index_add_sorted_kernel");
      });
      return;
    }
    visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
      index_add_kernel<T, I><<<grid(n), loops::kThreads, 0, current_stream()>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(src.data_ptr()),
          static_cast<const I*>(idx.data_ptr()), n, g, ol.strides[d], ol.sizes[d], alpha,
          flag.view());
      KILN_CUDA_LAUNCH_CHECK("index_add_kernel");
    });
  });
  if (!internal::indices_trusted) throw_if_raised(flag, op, d, ol.sizes[d]);
}

// --- masked_fill ------------------------------------------------------------------------------

template <typename T>
struct MaskedFillFn {
  T value;
  __device__ T operator()(T x, bool m) const { return m ? value : x; }
};

void masked_fill_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    loops::elementwise<T, T, bool>(out, MaskedFillFn<T>{c.attr<Scalar>(0).to<T>()}, c.input(0),
                                   c.input(1));
  });
}

// --- triu, tril -------------------------------------------------------------------------------

// out (contiguous) element i at (batch, row, col): self's element there when kept, else zero
// bits (zero in every dtype).
template <typename U, bool kUpper>
__global__ void triangle_kernel(U* out, const U* self, int64_t n, Geometry<1> g, int64_t rows,
                                int64_t cols, int64_t diag) {
  KILN_GRID_STRIDE(i, n) {
    const int64_t col = i % cols, row = (i / cols) % rows;
    const bool keep = kUpper ? col - row >= diag : col - row <= diag;
    if (keep) {
      int64_t off[1];
      loops::offsets<int64_t, 1>(g, i, off);
      out[i] = self[off[0]];
    } else {
      out[i] = U(0);
    }
  }
}

template <bool kUpper>
void triangle_cuda(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const int64_t nd = self.dim();
  const Shape strides[1] = {to_shape(self.strides())};
  const Geometry<1> g = loops::make_geometry<1>(self.sizes(), strides, c.name());
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    triangle_kernel<U, kUpper><<<grid(n), loops::kThreads, 0, current_stream()>>>(
        static_cast<U*>(out.data_ptr()), static_cast<const U*>(self.data_ptr()), n, g,
        self.sizes()[nd - 2], self.sizes()[nd - 1], c.attr<int64_t>(0));
    KILN_CUDA_LAUNCH_CHECK("triangle_kernel");
  });
}

#undef KILN_GRID_STRIDE

}  // namespace

KILN_REGISTER_KERNEL(index_select, kCUDA, index_select_cuda);
KILN_REGISTER_KERNEL(embedding, kCUDA, embedding_cuda);
KILN_REGISTER_KERNEL(gather, kCUDA, gather_cuda);
KILN_REGISTER_KERNEL(scatter, kCUDA, (scatter_cuda<ScatterMode::kSrc, false>));
KILN_REGISTER_KERNEL(scatter_, kCUDA, (scatter_cuda<ScatterMode::kSrc, true>));
KILN_REGISTER_KERNEL(scatter_value, kCUDA, (scatter_cuda<ScatterMode::kValue, false>));
KILN_REGISTER_KERNEL(scatter_value_, kCUDA, (scatter_cuda<ScatterMode::kValue, true>));
KILN_REGISTER_KERNEL(scatter_add, kCUDA, (scatter_cuda<ScatterMode::kAdd, false>));
KILN_REGISTER_KERNEL(scatter_add_, kCUDA, (scatter_cuda<ScatterMode::kAdd, true>));
KILN_REGISTER_KERNEL(index_add, kCUDA, index_add_cuda<false>);
KILN_REGISTER_KERNEL(index_add_, kCUDA, index_add_cuda<true>);
KILN_REGISTER_KERNEL(masked_fill, kCUDA, masked_fill_cuda);
KILN_REGISTER_KERNEL(masked_fill_, kCUDA, masked_fill_cuda);
KILN_REGISTER_KERNEL(triu, kCUDA, triangle_cuda<true>);
KILN_REGISTER_KERNEL(tril, kCUDA, triangle_cuda<false>);

}  // namespace kiln::cuda
