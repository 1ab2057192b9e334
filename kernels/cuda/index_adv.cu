// CUDA kernels of advanced indexing (index, index_put_), of the ops whose output size depends
// on the data (nonzero, masked_select) and of one_hot, with the semantics of
// kernels/cpu/index.cpp (rules in tensor/ops/index.cpp).
//
// index / index_put_: self[dims = index tensors] is laid out as [pre][b][post] (pre empty when
// the indexed dims are not adjacent), b being the index tensors' broadcast shape. A first
// kernel turns every position j of b into mid[j], the offset in self that the index values
// select (negative values wrap, bad ones raise kiln::Error with the CPU's message); element
// (i, j, k) of the result is then self at pre(i) + mid[j] + post(k).
// Repeated indices in index_put_: with accumulate every write adds atomically (exact for
// integers and bool; for floats the order of the additions, and so the last bits, may differ
// from the CPU's serial order); without it the CPU's last write wins: a stable sort of mid
// marks, among the positions of b that select the same element, the last one, and only that
// one writes.
//
// nonzero / masked_select: a flag per element (of the input, or of the broadcast shape), an
// exclusive scan of the flags (CUB) giving each selected element its output row, and one copy
// of the count to the host to allocate the output; the order is row-major, as on the CPU.
#include <cub/device/device_scan.cuh>

#include "kernels/cuda/index_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/sort.cuh"

#define KILN_GRID_STRIDE(i, n)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

namespace kiln::cuda {
namespace {

using internal::atomic_accumulate;
using internal::visit_bytes;
using loops::ErrorFlag;
using loops::FlagView;
using loops::Geometry;
using loops::kMaxDims;

unsigned int grid(int64_t n) { return loops::grid_for(n); }

// `t` on `device` (the dispatcher lets 0-d CPU tensors join CUDA inputs).
Tensor on_device(const Tensor& t, Device device) { return t.is_cpu() ? t.to(device) : t; }

// t's element strides when read as broadcast to `sizes` (0 along broadcast dims).
Shape expand_strides(const Tensor& t, IntArrayRef sizes) {
  return loops::broadcast_strides(t, sizes);
}

// --- index, index_put_ -----------------------------------------------------------------------

// The index tensors, read as broadcast to b: for tensor t, the element at position j of b is at
// the offset of j's coordinates times strides[t].
struct IndexTensors {
  int count = 0;
  int ndim = 0;
  int64_t b_sizes[kMaxDims];
  const void* ptr[kMaxDims];
  bool is_int32[kMaxDims];
  int64_t dim_size[kMaxDims];
  int64_t self_stride[kMaxDims];
  int64_t strides[kMaxDims][kMaxDims];
};

// Where a bad index was found: [set, value, which index tensor].
struct IndexErrorView {
  int64_t* p;
  __device__ void raise(int64_t value, int64_t which) const {
    p[1] = value;
    p[2] = which;
    __threadfence();
    p[0] = 1;
  }
};

// mid[j] = sum over the index tensors t of wrap(value of t at j) * self_stride[t].
__global__ void mid_offsets_kernel(int64_t* mid, int64_t nb, IndexTensors it,
                                   IndexErrorView error) {
  KILN_GRID_STRIDE(j, nb) {
    int64_t coord[kMaxDims];
    int64_t rem = j;
    for (int d = it.ndim - 1; d >= 0; --d) {
      coord[d] = rem % it.b_sizes[d];
      rem /= it.b_sizes[d];
    }
    int64_t offset = 0;
    for (int t = 0; t < it.count; ++t) {
      int64_t at = 0;
      for (int d = 0; d < it.ndim; ++d) at += coord[d] * it.strides[t][d];
      int64_t v = it.is_int32[t] ? static_cast<int64_t>(static_cast<const int32_t*>(it.ptr[t])[at])
                                 : static_cast<const int64_t*>(it.ptr[t])[at];
      const int64_t size = it.dim_size[t];
      if (v < -size || v >= size) {
        error.raise(v, t);
        v = 0;
      } else if (v < 0) {
        v += size;
      }
      offset += v * it.self_stride[t];
    }
    mid[j] = offset;
  }
}

// The layout of self[dims = idx] and, on the device, the offsets mid of its b positions.
struct AdvancedPlan {
  Shape b, pre_sizes, post_sizes, pre_strides, post_strides;
  int64_t npre = 1, nb = 1, npost = 1;
  Tensor mid;  // int64 [nb] on the device
  Shape result() const {
    Shape r = pre_sizes;
    r.insert(r.end(), b.begin(), b.end());
    r.insert(r.end(), post_sizes.begin(), post_sizes.end());
    return r;
  }
};

AdvancedPlan plan_advanced(const Tensor& self, const Shape& dims, TensorList idx_in,
                           const char* op) {
  AdvancedPlan p;
  const Device device = self.device();
  TensorVec idx;
  for (const Tensor& t : idx_in) idx.push_back(on_device(t, device));
  for (size_t k = 0; k < idx.size(); ++k) {
    p.b = k == 0 ? to_shape(idx[k].sizes()) : broadcast_shapes(p.b, idx[k].sizes(), op);
  }
  const int64_t k = static_cast<int64_t>(dims.size());
  const bool adjacent = dims.back() - dims.front() == k - 1;
  for (int64_t d = 0; d < self.dim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) continue;
    const bool before = adjacent && d < dims.front();
    (before ? p.pre_sizes : p.post_sizes).push_back(self.sizes()[d]);
    (before ? p.pre_strides : p.post_strides).push_back(self.strides()[d]);
  }
  p.npre = numel_of(p.pre_sizes);
  p.nb = numel_of(p.b);
  p.npost = numel_of(p.post_sizes);
  p.mid = loops::empty_on({p.nb}, kInt64, device);
  if (p.nb == 0) return p;
  KILN_CHECK(static_cast<int>(p.b.size()) <= kMaxDims && k <= kMaxDims, "[", op,
             "] the CUDA kernel handles at most ", kMaxDims,
             " dimensions of index tensors, got the broadcast shape ", shape_str(p.b));
  IndexTensors it;
  it.count = static_cast<int>(k);
  it.ndim = static_cast<int>(p.b.size());
  for (int d = 0; d < it.ndim; ++d) it.b_sizes[d] = p.b[d];
  for (int t = 0; t < it.count; ++t) {
    it.ptr[t] = idx[t].data_ptr();
    it.is_int32[t] = idx[t].dtype() == kInt32;
    it.dim_size[t] = self.sizes()[dims[t]];
    it.self_stride[t] = self.strides()[dims[t]];
    const Shape st = expand_strides(idx[t], p.b);
    for (int d = 0; d < it.ndim; ++d) it.strides[t][d] = st[d];
  }
  Tensor error = loops::empty_on({3}, kInt64, device);
  KILN_CUDA_CHECK(cudaMemsetAsync(error.data_ptr(), 0, 3 * sizeof(int64_t), current_stream()));
  mid_offsets_kernel<<<grid(p.nb), loops::kThreads, 0, current_stream()>>>(
      static_cast<int64_t*>(p.mid.data_ptr()), p.nb, it,
      IndexErrorView{static_cast<int64_t*>(error.data_ptr())});
  KILN_CUDA_LAUNCH_CHECK("mid_offsets_kernel");
  int64_t host[3] = {0, 0, 0};
  KILN_CUDA_CHECK(cudaMemcpyAsync(host, error.data_ptr(), sizeof(host), cudaMemcpyDeviceToHost,
                                  current_stream()));
  KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
  if (host[0] != 0) {
    const int64_t dim = dims[host[2]];
    KILN_FAIL("[", op, "] index ", host[1], " is out of bounds for dimension ", dim, " with size ",
              self.sizes()[dim]);
  }
  return p;
}

// out (contiguous, [pre][b][post]) = self at pre(i) + mid[j] + post(k).
template <typename U>
__global__ void index_gather_kernel(U* out, const U* self, const int64_t* mid, int64_t n,
                                    int64_t nb, int64_t npost, Geometry<1> pre, Geometry<1> post) {
  KILN_GRID_STRIDE(i, n) {
    const int64_t k = i % npost, rest = i / npost;
    const int64_t j = rest % nb, ip = rest / nb;
    int64_t a[1], c[1];
    loops::offsets<int64_t, 1>(pre, ip, a);
    loops::offsets<int64_t, 1>(post, k, c);
    out[i] = self[a[0] + mid[j] + c[0]];
  }
}

void index_cuda(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& out = c.outputs[0];
  DeviceGuard guard(out.device().index());
  const TensorList idx = absl::MakeConstSpan(c.inputs).subspan(1);
  const AdvancedPlan p = plan_advanced(self, c.attr<Shape>(0), idx, "index");
  const int64_t n = out.numel();
  if (n == 0) return;
  const Shape pre_strides[1] = {p.pre_strides}, post_strides[1] = {p.post_strides};
  const Geometry<1> pre = loops::make_geometry<1>(p.pre_sizes, pre_strides, "index");
  const Geometry<1> post = loops::make_geometry<1>(p.post_sizes, post_strides, "index");
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    index_gather_kernel<U><<<grid(n), loops::kThreads, 0, current_stream()>>>(
        static_cast<U*>(out.data_ptr()), static_cast<const U*>(self.data_ptr()),
        static_cast<const int64_t*>(p.mid.data_ptr()), n, p.nb, p.npost, pre, post);
    KILN_CUDA_LAUNCH_CHECK("index_gather_kernel");
  });
}

// last[j] = whether j is the last position of b (in order) whose mid is mid[j]: from the
// positions sorted stably by mid, the last of each run of equal mids.
template <typename C>
__global__ void last_writer_kernel(bool* last, const C* sorted, const int64_t* mid, int64_t nb) {
  KILN_GRID_STRIDE(s, nb) {
    const int64_t j = static_cast<int64_t>(sorted[s]);
    last[j] = s + 1 == nb || mid[static_cast<int64_t>(sorted[s + 1])] != mid[j];
  }
}

// keys[j] = ordered_key(mid[j]).
__global__ void mid_keys_kernel(uint64_t* keys, const int64_t* mid, int64_t nb) {
  KILN_GRID_STRIDE(j, nb) { keys[j] = internal::ordered_key(mid[j]); }
}

// Element (i, j, k) of the result shape: self at pre(i)[0] + mid[j] + post(k)[0] receives values
// at pre(i)[1] + vb(j) + post(k)[1] (written when `last` is null or last[j], else added).
template <typename T, bool kAccumulate>
__global__ void index_put_kernel(T* self, const T* values, const int64_t* mid, const bool* last,
                                 int64_t n, int64_t nb, int64_t npost, Geometry<2> pre,
                                 Geometry<1> vb, Geometry<2> post) {
  KILN_GRID_STRIDE(i, n) {
    const int64_t k = i % npost, rest = i / npost;
    const int64_t j = rest % nb, ip = rest / nb;
    if (!kAccumulate && last != nullptr && !last[j]) continue;
    int64_t a[2], b[1], c[2];
    loops::offsets<int64_t, 2>(pre, ip, a);
    loops::offsets<int64_t, 1>(vb, j, b);
    loops::offsets<int64_t, 2>(post, k, c);
    T* to = self + a[0] + mid[j] + c[0];
    const T v = values[a[1] + b[0] + c[1]];
    if constexpr (kAccumulate) {
      atomic_accumulate<T>(to, static_cast<opmath_t<T>>(v));
    } else {
      *to = v;
    }
  }
}

void index_put_cuda(OpCall& c) {
  const Tensor& self = c.outputs[0];
  DeviceGuard guard(self.device().index());
  const Tensor values = on_device(c.input(1), self.device());
  const TensorList idx = absl::MakeConstSpan(c.inputs).subspan(2);
  const bool accumulate = c.attr<bool>(1);
  const AdvancedPlan p = plan_advanced(self, c.attr<Shape>(0), idx, "index_put_");
  const Shape result = p.result();
  const int64_t n = numel_of(result);
  if (n == 0) return;
  const cudaStream_t stream = current_stream();
  // values' strides over the result shape, split like the result into pre, b and post.
  const Shape vs = expand_strides(values, result);
  const size_t np = p.pre_sizes.size(), nbd = p.b.size();
  const Shape vpre(vs.begin(), vs.begin() + np), vb(vs.begin() + np, vs.begin() + np + nbd),
      vpost(vs.begin() + np + nbd, vs.end());
  const Shape pre_strides[2] = {p.pre_strides, vpre}, post_strides[2] = {p.post_strides, vpost};
  const Shape b_strides[1] = {vb};
  const Geometry<2> pre = loops::make_geometry<2>(p.pre_sizes, pre_strides, "index_put_");
  const Geometry<1> bg = loops::make_geometry<1>(p.b, b_strides, "index_put_");
  const Geometry<2> post = loops::make_geometry<2>(p.post_sizes, post_strides, "index_put_");
  const int64_t* mid = static_cast<const int64_t*>(p.mid.data_ptr());
  Tensor last;
  if (!accumulate && p.nb > 1) {
    Tensor keys = internal::device_bytes(p.nb * 8, self.device());
    mid_keys_kernel<<<grid(p.nb), loops::kThreads, 0, stream>>>(
        static_cast<uint64_t*>(keys.data_ptr()), mid, p.nb);
    KILN_CUDA_LAUNCH_CHECK("mid_keys_kernel");
    const Tensor sorted =
        internal::sort_positions(keys.data_ptr(), 8, 1, p.nb, false, self.device());
    last = loops::empty_on({p.nb}, kBool, self.device());
    bool* lp = static_cast<bool*>(last.data_ptr());
    if (sorted.dtype() == kInt32) {
      last_writer_kernel<int32_t><<<grid(p.nb), loops::kThreads, 0, stream>>>(
          lp, static_cast<const int32_t*>(sorted.data_ptr()), mid, p.nb);
    } else {
      last_writer_kernel<int64_t><<<grid(p.nb), loops::kThreads, 0, stream>>>(
          lp, static_cast<const int64_t*>(sorted.data_ptr()), mid, p.nb);
    }
    KILN_CUDA_LAUNCH_CHECK("last_writer_kernel");
  }
  const bool* lp = last.defined() ? static_cast<const bool*>(last.data_ptr()) : nullptr;
  visit_dtype(self.dtype(), [&]<typename T>(TypeTag<T>) {
    T* s = static_cast<T*>(self.data_ptr());
    const T* v = static_cast<const T*>(values.data_ptr());
    if (accumulate) {
      index_put_kernel<T, true><<<grid(n), loops::kThreads, 0, stream>>>(
          s, v, mid, nullptr, n, p.nb, p.npost, pre, bg, post);
    } else {
      index_put_kernel<T, false>
          <<<grid(n), loops::kThreads, 0, stream>>>(s, v, mid, lp, n, p.nb, p.npost, pre, bg, post);
    }
    KILN_CUDA_LAUNCH_CHECK("index_put_kernel");
  });
}

// --- nonzero, masked_select -------------------------------------------------------------------

// Runs `flag_kernel(flags)` to write flags[i] in {0, 1} for i < n, turns them into exclusive
// prefix sums (flags[n] = 0 first, so flags[n] ends as the count) and returns the count, read
// on the host once.
template <typename Launch>
int64_t scan_flags(Tensor& flags, int64_t n, Device device, const Launch& flag_kernel) {
  const cudaStream_t stream = current_stream();
  flags = loops::empty_on({n + 1}, kInt64, device);
  int64_t* f = static_cast<int64_t*>(flags.data_ptr());
  KILN_CUDA_CHECK(cudaMemsetAsync(f + n, 0, sizeof(int64_t), stream));
  flag_kernel(f);
  size_t bytes = 0;
  // In place: the overload that reads and writes one array.
  KILN_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, f, n + 1, stream));
  Tensor temp = internal::device_bytes(static_cast<int64_t>(bytes), device);
  KILN_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.data_ptr(), bytes, f, n + 1, stream));
  int64_t count = 0;
  KILN_CUDA_CHECK(cudaMemcpyAsync(&count, f + n, sizeof(count), cudaMemcpyDeviceToHost, stream));
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
  return count;
}

// Selected when pos[i + 1] > pos[i] (pos: the scanned flags).
__device__ __forceinline__ bool selected(const int64_t* pos, int64_t i) {
  return pos[i + 1] != pos[i];
}

template <typename T>
__global__ void nonzero_flags_kernel(int64_t* flags, const T* src, int64_t n, Geometry<1> g) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[1];
    loops::offsets<int64_t, 1>(g, i, off);
    flags[i] = static_cast<opmath_t<T>>(src[off[0]]) != opmath_t<T>(0) ? 1 : 0;
  }
}

struct Sizes {
  int ndim = 0;
  int64_t v[kMaxDims];
};

// Row pos[i] of out [count, ndim] = the coordinates of element i.
__global__ void nonzero_write_kernel(int64_t* out, const int64_t* pos, int64_t n, Sizes sizes) {
  KILN_GRID_STRIDE(i, n) {
    if (!selected(pos, i)) continue;
    int64_t* row = out + pos[i] * sizes.ndim;
    int64_t rem = i;
    for (int d = sizes.ndim - 1; d >= 0; --d) {
      row[d] = rem % sizes.v[d];
      rem /= sizes.v[d];
    }
  }
}

void nonzero_cuda(OpCall& c) {
  const Tensor& t = c.input(0);
  const Device device = t.device();
  DeviceGuard guard(device.index());
  const cudaStream_t stream = current_stream();
  const int64_t n = t.numel();
  const int nd = static_cast<int>(t.dim());
  KILN_CHECK(nd <= kMaxDims, "[nonzero] the CUDA kernel handles at most ", kMaxDims,
             " dimensions, got shape ", shape_str(t.sizes()));
  Tensor flags;
  int64_t count = 0;
  if (n > 0) {
    const Shape strides[1] = {to_shape(t.strides())};
    const Geometry<1> g = loops::make_geometry<1>(t.sizes(), strides, "nonzero");
    count = scan_flags(flags, n, device, [&](int64_t* f) {
      visit_dtype(t.dtype(), [&]<typename T>(TypeTag<T>) {
        nonzero_flags_kernel<T>
            <<<grid(n), loops::kThreads, 0, stream>>>(f, static_cast<const T*>(t.data_ptr()), n, g);
        KILN_CUDA_LAUNCH_CHECK("nonzero_flags_kernel");
      });
    });
  }
  Tensor out = loops::empty_on({count, nd}, kInt64, device);
  if (count > 0 && nd > 0) {
    Sizes sizes;
    sizes.ndim = nd;
    for (int d = 0; d < nd; ++d) sizes.v[d] = t.sizes()[d];
    nonzero_write_kernel<<<grid(n), loops::kThreads, 0, stream>>>(
        static_cast<int64_t*>(out.data_ptr()), static_cast<const int64_t*>(flags.data_ptr()), n,
        sizes);
    KILN_CUDA_LAUNCH_CHECK("nonzero_write_kernel");
  }
  c.outputs.assign({out});
}

// Offsets {self, mask} over the broadcast shape.
__global__ void mask_flags_kernel(int64_t* flags, const bool* mask, int64_t n, Geometry<2> g) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, i, off);
    flags[i] = mask[off[1]] ? 1 : 0;
  }
}

template <typename U>
__global__ void masked_select_write_kernel(U* out, const U* self, const int64_t* pos, int64_t n,
                                           Geometry<2> g) {
  KILN_GRID_STRIDE(i, n) {
    if (!selected(pos, i)) continue;
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, i, off);
    out[pos[i]] = self[off[0]];
  }
}

void masked_select_cuda(OpCall& c) {
  Device device = c.input(0).device();
  if (device.is_cpu()) device = c.input(1).device();
  DeviceGuard guard(device.index());
  const cudaStream_t stream = current_stream();
  const Tensor self = on_device(c.input(0), device);
  const Tensor mask = on_device(c.input(1), device);
  const Shape shape = broadcast_shapes(self.sizes(), mask.sizes(), "masked_select");
  const int64_t n = numel_of(shape);
  const Shape strides[2] = {expand_strides(self, shape), expand_strides(mask, shape)};
  const Geometry<2> g = loops::make_geometry<2>(shape, strides, "masked_select");
  Tensor flags;
  int64_t count = 0;
  if (n > 0) {
    count = scan_flags(flags, n, device, [&](int64_t* f) {
      mask_flags_kernel<<<grid(n), loops::kThreads, 0, stream>>>(
          f, static_cast<const bool*>(mask.data_ptr()), n, g);
      KILN_CUDA_LAUNCH_CHECK("mask_flags_kernel");
    });
  }
  Tensor out = loops::empty_on({count}, self.dtype(), device);
  if (count > 0) {
    visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
      masked_select_write_kernel<U><<<grid(n), loops::kThreads, 0, stream>>>(
          static_cast<U*>(out.data_ptr()), static_cast<const U*>(self.data_ptr()),
          static_cast<const int64_t*>(flags.data_ptr()), n, g);
      KILN_CUDA_LAUNCH_CHECK("masked_select_write_kernel");
    });
  }
  c.outputs.assign({out});
}

// --- one_hot ----------------------------------------------------------------------------------

// out (contiguous [..., classes], zeroed) gets a 1 at (i, idx[i]); a value outside
// [0, classes) raises the flag with that value.
__global__ void one_hot_kernel(int64_t* out, const int64_t* idx, int64_t n, int64_t classes,
                               Geometry<1> g, FlagView flag) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[1];
    loops::offsets<int64_t, 1>(g, i, off);
    const int64_t v = idx[off[0]];
    if (v < 0 || v >= classes) {
      flag.raise(v);
      continue;
    }
    out[i * classes + v] = 1;
  }
}

void one_hot_cuda(OpCall& c) {
  const Tensor& idx = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t classes = c.attr<int64_t>(0);
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  if (out.numel() > 0) KILN_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, out.nbytes(), stream));
  const int64_t n = idx.numel();
  if (n == 0) return;
  const Shape strides[1] = {to_shape(idx.strides())};
  const Geometry<1> g = loops::make_geometry<1>(idx.sizes(), strides, "one_hot");
  const ErrorFlag flag(out.device());
  one_hot_kernel<<<grid(n), loops::kThreads, 0, stream>>>(
      static_cast<int64_t*>(out.data_ptr()), static_cast<const int64_t*>(idx.data_ptr()), n,
      classes, g, flag.view());
  KILN_CUDA_LAUNCH_CHECK("one_hot_kernel");
  int64_t v = 0;
  if (flag.raised(&v)) {
    KILN_CHECK(v >= 0, "[one_hot] class values must be non-negative, got ", v);
    KILN_FAIL("[one_hot] class values must be smaller than num_classes (", classes, "), got ", v);
  }
}

}  // namespace

KILN_REGISTER_KERNEL(index, kCUDA, index_cuda);
KILN_REGISTER_KERNEL(index_put_, kCUDA, index_put_cuda);
KILN_REGISTER_KERNEL(nonzero, kCUDA, nonzero_cuda);
KILN_REGISTER_KERNEL(masked_select, kCUDA, masked_select_cuda);
KILN_REGISTER_KERNEL(one_hot, kCUDA, one_hot_cuda);

}  // namespace kiln::cuda

#undef KILN_GRID_STRIDE
