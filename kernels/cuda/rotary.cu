// CUDA kernels of rotary_emb and rotary_emb_qk (tensor/ops/rotary.cpp; reference:
// kernels/cpu/rotary.cpp). Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// One thread per pair of packs: N elements of the first half of a row and the N elements half a
// row further, which is all a rotated element needs (x1 and x2 at the same offset within their
// halves), so every element of x is read once and every element of y written once, in 16-byte
// packs when the row layout allows. x is read in place through its strides: the rows of x (every
// dim but the last, which must be dense) are decomposed with one div/mod per non-mergeable dim,
// in x's memory order (see RowGeometry), so the [B, H, T, D] views of a fused qkv projection
// cost no copy and are read sequentially. cos/sin ([T, D], 1 MiB at
// most for Llama shapes) stay in L2. The q-and-k form runs both tensors in one grid: threads
// below q's share of the work rotate q, the rest k.
//
// Merged q-and-k form: when q and k are the adjacent head ranges of one fused projection (k's data
// pointer is q's plus Hq head strides; equal head strides, equal sizes and strides in every other
// dim, dense last dims), they are read as ONE tensor of Hq + Hkv heads in memory order, so each
// position's q and k heads are one contiguous run instead of two passes over runs with gaps (k's
// pass reads 1 KiB runs 6 KiB apart at Llama-1B's shape). The work item's head picks the output:
// heads below Hq write q's output, the rest k's. The reads are exactly the addresses the two-job
// form reads, so the pointer test is all it needs. The environment variable KILN_ROPE_QK_MERGE
// (cached; kiln::internal::reload_env_switches() after a setenv) times both side by side: "0"
// keeps the two-job form everywhere; unset or "1", the merged form where it applies.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "tensor/env_switch.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::load_pack;
using internal::store_pack;

constexpr int kMaxRowDims = 8;
constexpr int kThreads = 256;

// The rows of x: sizes and strides (elements) of every dim but the last, size-1 dims dropped and
// contiguous neighbours merged, then ordered by decreasing |stride| (x's memory order); `rows`
// are the strides of the same dims in rows of the contiguous output (the logical row index).
// Work item r decomposes over these dims (the last fastest), so consecutive threads read
// consecutive memory of x: for the [B, H, T, D] view of a [B, T, H, D] projection, the heads of
// one position (one contiguous run, sharing their cos/sin rows) rather than the positions of
// one head (rows a whole projection row apart).
struct RowGeometry {
  int ndim = 0;
  int64_t sizes[kMaxRowDims];
  int64_t strides[kMaxRowDims];
  int64_t rows[kMaxRowDims];
};

// The heads of the merged q-and-k form (see the header): dim `dim` of the merged rows holds
// q_heads + k_heads heads, q's then k's. It is never merged with a neighbour (its index in the
// row geometry is `at`), and the logical rows are counted twice: as rows of q's output (the
// geometry's `rows`, head dim of size q_heads) and of k's (`k_rows`, head dim of size k_heads).
struct HeadSplit {
  int dim = -1;
  int64_t q_heads = 0, k_heads = 0;
  int at = -1;
  int64_t k_rows[kMaxRowDims] = {};
};

// Builds the row geometry of dims [0, sizes.size()) of a tensor (all but its dense last dim),
// with the merged form's heads when `split` is given. False when there are too many dims.
bool make_rows(IntArrayRef sizes, IntArrayRef strides, RowGeometry& g, HeadSplit* split = nullptr) {
  const int64_t keep = split != nullptr ? split->dim : -1;
  int kept_at = -1;  // g's index of dim `keep`
  for (int64_t d = 0; d < static_cast<int64_t>(sizes.size()); ++d) {
    const int64_t size = sizes[d], stride = strides[d];
    if (size == 1 && d != keep) continue;
    if (g.ndim > 0 && d != keep && g.ndim - 1 != kept_at &&
        g.strides[g.ndim - 1] == stride * size) {
      g.sizes[g.ndim - 1] *= size;
      g.strides[g.ndim - 1] = stride;
      continue;
    }
    if (g.ndim == kMaxRowDims) return false;
    if (d == keep) kept_at = g.ndim;
    g.sizes[g.ndim] = size;
    g.strides[g.ndim] = stride;
    ++g.ndim;
  }
  int64_t rows = 1, k_rows = 1;
  for (int d = g.ndim - 1; d >= 0; --d) {
    g.rows[d] = rows;
    if (d != kept_at) {
      rows *= g.sizes[d];
      if (split != nullptr) split->k_rows[d] = k_rows;
      k_rows *= g.sizes[d];
    } else {
      rows *= split->q_heads;
      split->k_rows[d] = k_rows;
      k_rows *= split->k_heads;
    }
  }
  // Insertion sort by decreasing |stride| (stable: equal strides keep the logical order).
  for (int i = 1; i < g.ndim; ++i) {
    for (int j = i; j > 0 && std::abs(g.strides[j]) > std::abs(g.strides[j - 1]); --j) {
      std::swap(g.sizes[j], g.sizes[j - 1]);
      std::swap(g.strides[j], g.strides[j - 1]);
      std::swap(g.rows[j], g.rows[j - 1]);
      if (split != nullptr) std::swap(split->k_rows[j], split->k_rows[j - 1]);
      if (kept_at == j) {
        kept_at = j - 1;
      } else if (kept_at == j - 1) {
        kept_at = j;
      }
    }
  }
  if (split != nullptr) split->at = kept_at;
  return true;
}

// The row geometry of x (x.stride(-1) == 1).
bool make_rows(const Tensor& x, RowGeometry& g) {
  const size_t n = static_cast<size_t>(x.dim() - 1);
  return make_rows(x.sizes().subspan(0, n), x.strides().subspan(0, n), g);
}

// One rotated tensor: x read through `rows`, y contiguous.
template <typename T>
struct Job {
  const T* x;
  T* y;
  RowGeometry rows;
  int64_t work;  // rows * packs per half row
};

// Work row r (in x's memory order): its offset in x and its logical row (the output's row).
template <typename I>
__device__ __forceinline__ void row_at(const RowGeometry& g, I r, I& x_off, I& row) {
  x_off = 0;
  row = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    const I size = static_cast<I>(g.sizes[d]);
    const I idx = r % size;
    x_off += idx * static_cast<I>(g.strides[d]);
    row += idx * static_cast<I>(g.rows[d]);
    r /= size;
  }
}

// Rotates the N-element packs at xr and xr + h into yr and yr + h with the packs at tab and
// tab + h of the tables.
template <int N, typename T, typename C, typename I>
__device__ __forceinline__ void rotate_packs(const T* xr, T* yr, const C* __restrict__ cos,
                                             const C* __restrict__ sin, I tab, I h,
                                             bool transpose) {
  using Acc = opmath_t<T>;
  Acc x1[N], x2[N], c1[N], c2[N], s1[N], s2[N], y1[N], y2[N];
  load_pack<N>(xr, x1);
  load_pack<N>(xr + h, x2);
  load_pack<N>(cos + tab, c1);
  load_pack<N>(cos + tab + h, c2);
  load_pack<N>(sin + tab, s1);
  load_pack<N>(sin + tab + h, s2);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const Acc a1 = transpose ? s2[i] : -s1[i], a2 = transpose ? -s1[i] : s2[i];
    y1[i] = x1[i] * c1[i] + x2[i] * a1;
    y2[i] = x2[i] * c2[i] + x1[i] * a2;
  }
  store_pack<N>(yr, y1);
  store_pack<N>(yr + h, y2);
}

// Work item w of a job: row w / hp, pack w % hp of each half.
template <typename T, typename C, int N, typename I>
__global__ void __launch_bounds__(kThreads)
    rotary_kernel(Job<T> j0, Job<T> j1, const C* __restrict__ cos, const C* __restrict__ sin,
                  I t_len, I d, I hp, bool transpose) {
  const I total = static_cast<I>(j0.work + j1.work);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const I h = d / 2;
  for (I w = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += step) {
    // Branches rather than a reference to one of the jobs, which would copy both to local memory.
    const T* xr;
    T* yr;
    I row, col, x_off;
    if (w < static_cast<I>(j0.work)) {
      const I r = w / hp;
      col = (w - r * hp) * N;
      row_at<I>(j0.rows, r, x_off, row);
      xr = j0.x + x_off + col;
      yr = j0.y + row * d + col;
    } else {
      const I item = w - static_cast<I>(j0.work);
      const I r = item / hp;
      col = (item - r * hp) * N;
      row_at<I>(j1.rows, r, x_off, row);
      xr = j1.x + x_off + col;
      yr = j1.y + row * d + col;
    }
    rotate_packs<N>(xr, yr, cos, sin, (row % t_len) * d + col, h, transpose);
  }
}

// The merged q-and-k form: x is q's data pointer, read through `rows` (q's heads then k's, see
// HeadSplit); yq and yk are the contiguous outputs.
template <typename T>
struct MergedJob {
  const T* x;
  T* yq;
  T* yk;
  RowGeometry rows;
  HeadSplit split;
  int64_t k_base;  // q_heads * split.k_rows[split.at]: k's rows of head q_heads are its head 0
  int64_t work;    // rows * packs per half row
};

// Work item w: row w / hp (its head decides the output), pack w % hp of each half.
template <typename T, typename C, int N, typename I>
__global__ void __launch_bounds__(kThreads)
    rotary_merged_kernel(MergedJob<T> j, const C* __restrict__ cos, const C* __restrict__ sin,
                         I t_len, I d, I hp, bool transpose) {
  const I total = static_cast<I>(j.work);
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  const I h = d / 2;
  for (I w = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; w < total; w += step) {
    I r = w / hp;
    const I col = (w - r * hp) * N;
    I x_off = 0, q_row = 0, k_row = 0, head = 0;
    for (int dd = j.rows.ndim - 1; dd >= 0; --dd) {
      const I size = static_cast<I>(j.rows.sizes[dd]);
      const I idx = r % size;
      x_off += idx * static_cast<I>(j.rows.strides[dd]);
      q_row += idx * static_cast<I>(j.rows.rows[dd]);
      k_row += idx * static_cast<I>(j.split.k_rows[dd]);
      if (dd == j.split.at) head = idx;
      r /= size;
    }
    // q's and k's rows of one work item are at the same position (the last logical dim).
    T* yr = head < static_cast<I>(j.split.q_heads)
                ? j.yq + q_row * d + col
                : j.yk + (k_row - static_cast<I>(j.k_base)) * d + col;
    rotate_packs<N>(j.x + x_off + col, yr, cos, sin, (q_row % t_len) * d + col, h, transpose);
  }
}

// x with a dense last dim and a row geometry the kernel takes (a copy otherwise).
Tensor readable(const Tensor& x, RowGeometry& g) {
  g = RowGeometry{};
  if (x.dim() >= 1 && (x.stride(-1) == 1 || x.size(-1) <= 1) && make_rows(x, g)) return x;
  g = RowGeometry{};
  const Tensor c = x.contiguous();
  make_rows(c, g);
  return c;
}

// Largest element offset of the rows of g (rows of d elements) plus one row.
int64_t extent(const RowGeometry& g, int64_t d) {
  int64_t e = d;
  for (int k = 0; k < g.ndim; ++k) e += (g.sizes[k] - 1) * std::abs(g.strides[k]);
  return e;
}

// Largest element offset of x's rows plus one row: whether 32-bit indices suffice.
int64_t extent(const Tensor& x, const RowGeometry& g) {
  return std::max(extent(g, x.size(-1)), x.numel());
}

// Whether KILN_ROPE_QK_MERGE allows the merged q-and-k form (unset: yes; "0": no).
bool merge_allowed() {
  static const kiln::internal::EnvInt merge("KILN_ROPE_QK_MERGE", 1, 0, 1);
  return merge.get() != 0;
}

// The merged rows of q and k ([..., H, T, D], heads at dim -3) when k's heads continue q's in
// memory (see the header); false otherwise.
bool merge_rows(const Tensor& q, const Tensor& k, RowGeometry& g, HeadSplit& split) {
  const int64_t n = q.dim();
  if (n < 3 || k.dim() != n || q.numel() == 0 || k.numel() == 0) return false;
  if (q.stride(-1) != 1 || k.stride(-1) != 1) return false;
  const int64_t hd = n - 3, hq = q.size(hd), hkv = k.size(hd), s = q.stride(hd);
  for (int64_t i = 0; i < n; ++i) {
    if (i != hd && (q.size(i) != k.size(i) || q.stride(i) != k.stride(i))) return false;
  }
  if (hkv != 1 && k.stride(hd) != s) return false;  // a single k head's stride is never used
  // Unsigned arithmetic: s may be negative.
  const auto q_addr = reinterpret_cast<uintptr_t>(q.data_ptr());
  const auto k_addr = reinterpret_cast<uintptr_t>(k.data_ptr());
  const int64_t gap = hq * s * static_cast<int64_t>(element_size(q.dtype()));
  if (k_addr != q_addr + static_cast<uintptr_t>(gap)) return false;
  Shape sizes = to_shape(q.sizes().subspan(0, static_cast<size_t>(n - 1)));
  sizes[static_cast<size_t>(hd)] = hq + hkv;
  split = HeadSplit{};
  split.dim = static_cast<int>(hd);
  split.q_heads = hq;
  split.k_heads = hkv;
  g = RowGeometry{};
  return make_rows(sizes, q.strides().subspan(0, static_cast<size_t>(n - 1)), g, &split);
}

// Rotates xs[i] into ys[i] (one or two tensors) in one launch.
void rotary_cuda_impl(const std::vector<Tensor>& xs_in, const std::vector<Tensor>& ys,
                      const Tensor& cos_in, const Tensor& sin_in, bool transpose) {
  const Tensor& x0 = xs_in[0];
  const int64_t d = x0.size(-1), t_len = x0.size(-2), h = d / 2;
  if (h == 0) return;
  DeviceGuard guard(x0.device().index());
  const cudaStream_t stream = current_stream();
  const Tensor cos = cos_in.contiguous(), sin = sin_in.contiguous();
  // The merged form: xs = {q}, geos[0] the rows of q's and k's heads.
  RowGeometry merged_rows;
  HeadSplit split;
  const bool merged =
      xs_in.size() == 2 && merge_allowed() && merge_rows(xs_in[0], xs_in[1], merged_rows, split);
  std::vector<Tensor> xs;
  std::vector<RowGeometry> geos(2);
  int64_t max_extent = 0;
  if (merged) {
    xs.push_back(xs_in[0]);
    geos[0] = merged_rows;
    max_extent = std::max(extent(merged_rows, d), xs_in[0].numel() + xs_in[1].numel());
  } else {
    for (size_t i = 0; i < xs_in.size(); ++i) {
      xs.push_back(readable(xs_in[i], geos[i]));
      max_extent = std::max(max_extent, extent(xs[i], geos[i]));
    }
  }
  visit_floating(x0.dtype(), "rotary_emb", [&]<typename T>(TypeTag<T>) {
    auto run = [&]<typename C>(TypeTag<C>) {
      constexpr int kPack = 16 / sizeof(T);
      bool packed = h % kPack == 0 && aligned_to(cos.data_ptr(), sizeof(C) * kPack) &&
                    aligned_to(sin.data_ptr(), sizeof(C) * kPack);
      for (size_t i = 0; i < ys.size(); ++i) packed = packed && aligned_to(ys[i].data_ptr(), 16);
      for (size_t i = 0; i < xs.size(); ++i) {
        packed = packed && aligned_to(xs[i].data_ptr(), 16);
        for (int k = 0; k < geos[i].ndim; ++k) packed = packed && geos[i].strides[k] % kPack == 0;
      }
      auto launch = [&]<int N, typename I>(std::integral_constant<int, N>, TypeTag<I>) {
        const C* cos_p = static_cast<const C*>(cos.data_ptr());
        const C* sin_p = static_cast<const C*>(sin.data_ptr());
        if (merged) {
          const int64_t work = (xs_in[0].numel() + xs_in[1].numel()) / d * (h / N);
          const MergedJob<T> job = {static_cast<const T*>(xs[0].data_ptr()),
                                    static_cast<T*>(ys[0].data_ptr()),
                                    static_cast<T*>(ys[1].data_ptr()),
                                    merged_rows,
                                    split,
                                    split.q_heads * split.k_rows[split.at],
                                    work};
          rotary_merged_kernel<T, C, N, I>
              <<<loops::grid_for(work, kThreads), kThreads, 0, stream>>>(
                  job, cos_p, sin_p, static_cast<I>(t_len), static_cast<I>(d),
                  static_cast<I>(h / N), transpose);
          KILN_CUDA_LAUNCH_CHECK("rotary_merged_kernel");
          return;
        }
        Job<T> jobs[2] = {};
        for (size_t i = 0; i < xs.size(); ++i) {
          jobs[i] = {static_cast<const T*>(xs[i].data_ptr()), static_cast<T*>(ys[i].data_ptr()),
                     geos[i], xs[i].numel() / d * (h / N)};
        }
        const int64_t total = jobs[0].work + jobs[1].work;
        if (total == 0) return;
        rotary_kernel<T, C, N, I><<<loops::grid_for(total, kThreads), kThreads, 0, stream>>>(
            jobs[0], jobs[1], cos_p, sin_p, static_cast<I>(t_len), static_cast<I>(d),
            static_cast<I>(h / N), transpose);
        KILN_CUDA_LAUNCH_CHECK("rotary_kernel");
      };
      // 2^30: the grid-stride index must not overflow after its last step either.
      const bool small = max_extent < (int64_t{1} << 30) && cos.numel() < (int64_t{1} << 30);
      if (packed && small) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int32_t>{});
      } else if (packed) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int64_t>{});
      } else if (small) {
        launch(std::integral_constant<int, 1>{}, TypeTag<int32_t>{});
      } else {
        launch(std::integral_constant<int, 1>{}, TypeTag<int64_t>{});
      }
    };
    if (cos.dtype() == x0.dtype()) {
      run(TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      run(TypeTag<float>{});
    } else {
      KILN_FAIL("[rotary_emb] unsupported cos/sin dtype ", dtype_name(cos.dtype()));
    }
  });
}

void rotary_emb_cuda(OpCall& c) {
  rotary_cuda_impl({c.input(0)}, {c.outputs[0]}, c.input(1), c.input(2), c.attr<bool>(0));
}

void rotary_emb_qk_cuda(OpCall& c) {
  rotary_cuda_impl({c.input(0), c.input(1)}, {c.outputs[0], c.outputs[1]}, c.input(2), c.input(3),
                   c.attr<bool>(0));
}

}  // namespace

KILN_REGISTER_KERNEL(rotary_emb, kCUDA, rotary_emb_cuda);
KILN_REGISTER_KERNEL(rotary_emb_qk, kCUDA, rotary_emb_qk_cuda);

}  // namespace kiln::cuda
