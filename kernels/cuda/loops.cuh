// Device-side elementwise machinery for kiln's CUDA kernels: broadcasting through strides, a
// contiguous fast path with 16-byte vectorised loads and stores, and a strided path for views.
//
//   // out[i] = f(a[i], b[i]) with a and b broadcast to out's shape, both of element type T:
//   struct AddOp { __device__ float operator()(T x, T y) const { return float(x) + float(y); } };
//   cuda::loops::elementwise<T, T, T>(out, AddOp{}, a, b);
//
// As kernels/cpu/loops.h: inputs must already have the element types the functor takes (the
// first template arguments after Out), except for 0-d CPU tensors (wrapped Scalars and other
// CPU scalars, which the dispatcher lets join GPU inputs): those are read on the host, converted
// to the functor's type as kernels/cpu/binary.cpp converts them, and passed to the kernel by
// value. The output may have any strides (in-place ops write into views). Functors are structs
// with a __device__ operator() (kiln builds without nvcc's --extended-lambda).
//
// Also here: device math overloads for float and double, the 16-bit float conversions, a
// device-side error flag (for index checks and integer division by zero, which must raise
// kiln::Error like the CPU kernels), and launch helpers. Internal to kernels/cuda/.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/runtime.h"
#include "kernels/int_div.h"
#include "kernels/scalar_fn.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda::loops {

inline constexpr int kMaxDims = 16;
inline constexpr int kThreads = 256;

// --- Host-side helpers ----------------------------------------------------------------------

// Blocks for a grid-stride loop over `work` items with `threads` per block: enough to fill the
// GPU several times over, and no more (each thread then loops).
inline unsigned int grid_for(int64_t work, int threads = kThreads) {
  const int64_t blocks = (work + threads - 1) / threads;
  return static_cast<unsigned int>(std::clamp<int64_t>(blocks, 1, int64_t{1} << 16));
}

// A device attribute of `device` (-1: the current device), queried once per device and
// attribute. Threads racing on the first query store the same value.
template <cudaDeviceAttr kAttr>
int device_attribute(int device = -1) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int value = 0;
  if (device < 0) KILN_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= kMaxDevices) {  // beyond the cache: queried at every call
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttr, device));
    return value;
  }
  value = cached[device].load(std::memory_order_relaxed);
  if (value == 0) {
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&value, kAttr, device));
    cached[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

// The number of multiprocessors of the current device (cached per device).
inline int multiprocessor_count() {
  return std::max(device_attribute<cudaDevAttrMultiProcessorCount>(), 1);
}

// `t` converted to dtype (a no-op when it already has it), on its own device.
inline Tensor as_dtype(const Tensor& t, ScalarType dtype) {
  return t.dtype() == dtype ? t : t.to(dtype);
}

// A 0-d CPU tensor: read on the host and passed by value.
inline bool is_host_scalar(const Tensor& t) { return t.is_cpu() && t.dim() == 0; }

// dst = src (converted, broadcast) through the CUDA copy_ kernel, without the dispatcher (we are
// already inside a kernel; the write must not be recorded by autograd).
inline void copy_into(const Tensor& dst, const Tensor& src) {
  static const OpDef& op = KILN_OP(copy_);
  const KernelFn kernel = op.first_kernel(kCUDA);
  KILN_CHECK(kernel != nullptr, "[copy_] the CUDA kernel is not registered");
  OpCall call;
  call.op = &op;
  call.inputs = {dst, src};
  kernel(call);
}

// A fresh contiguous tensor on `device`.
inline Tensor empty_on(IntArrayRef sizes, ScalarType dtype, Device device) {
  return empty(sizes, TensorOptions(dtype).device(device));
}

// t's strides (in elements) when read as if broadcast to `sizes`.
inline Shape broadcast_strides(const Tensor& t, IntArrayRef sizes) {
  Shape out(sizes.size(), 0);
  const size_t lead = sizes.size() - static_cast<size_t>(t.dim());
  for (size_t d = 0; d < static_cast<size_t>(t.dim()); ++d) {
    out[lead + d] = t.sizes()[d] == 1 ? 0 : t.strides()[d];
  }
  return out;
}

// v (of element type S) as a D: the conversion of the CPU's binary kernels (kernels/scalar_fn.h).
using ::kiln::scalar::convert;

// The value of a 0-d CPU tensor as a T.
template <typename T>
T read_host_scalar(const Tensor& t) {
  return visit_dtype(t.dtype(), [&]<typename S>(TypeTag<S>) -> T {
    return convert<T>(*static_cast<const S*>(t.data_ptr()));
  });
}

// --- Geometry: the index arithmetic of an N-operand loop -------------------------------------

// Sizes and per-operand strides (in elements) after dropping size-1 dims and merging dims that
// are contiguous for every operand; `divs` divide by the sizes (kernels/int_div.h) in the 32-bit
// index path: code that changes `sizes` after make_geometry calls update_divs.
template <int N>
struct Geometry {
  int ndim = 0;
  int64_t sizes[kMaxDims];
  int64_t strides[N][kMaxDims];
  ::kiln::internal::IntDivider divs[kMaxDims];
};

// Sets g.divs from g.sizes (sizes past 2^31 keep a placeholder: they never take 32-bit indices).
template <int N>
void update_divs(Geometry<N>& g) {
  for (int d = 0; d < g.ndim; ++d) {
    g.divs[d] = g.sizes[d] >= 1 && g.sizes[d] <= (int64_t{1} << 31)
                    ? ::kiln::internal::IntDivider(g.sizes[d])
                    : ::kiln::internal::IntDivider();
  }
}

template <int N>
Geometry<N> make_geometry(IntArrayRef sizes, const Shape (&strides)[N], std::string_view op) {
  Geometry<N> g;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    bool merge = g.ndim > 0;
    for (int k = 0; k < N && merge; ++k) {
      merge = g.strides[k][g.ndim - 1] == strides[k][d] * sizes[d];
    }
    if (merge) {
      g.sizes[g.ndim - 1] *= sizes[d];
      for (int k = 0; k < N; ++k) g.strides[k][g.ndim - 1] = strides[k][d];
      continue;
    }
    KILN_CHECK(g.ndim < kMaxDims, "[", op, "] the CUDA kernel handles at most ", kMaxDims,
               " non-mergeable dimensions, got shape ", shape_str(sizes));
    g.sizes[g.ndim] = sizes[d];
    for (int k = 0; k < N; ++k) g.strides[k][g.ndim] = strides[k][d];
    ++g.ndim;
  }
  update_divs(g);
  return g;
}

// Whether every offset of the geometry (and n) fits a 32-bit index, which makes the div/mod of
// the strided path several times cheaper.
template <int N>
bool fits_int32(const Geometry<N>& g, int64_t n) {
  if (n >= (int64_t{1} << 31)) return false;
  for (int k = 0; k < N; ++k) {
    int64_t extent = 0;
    for (int d = 0; d < g.ndim; ++d) extent += (g.sizes[d] - 1) * std::abs(g.strides[k][d]);
    if (extent >= (int64_t{1} << 31)) return false;
  }
  return true;
}

// Element offsets of linear index i (row-major over the geometry's sizes) for each operand. With
// 32-bit indices (fits_int32: i < 2^31) the div/mod are multiply-shifts (IntDivider).
template <typename I, int N>
__device__ __forceinline__ void offsets(const Geometry<N>& g, I i, I (&off)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) off[k] = 0;
  for (int d = g.ndim - 1; d >= 0; --d) {
    I idx;
    if constexpr (sizeof(I) == 4) {
      uint32_t q, r;
      g.divs[d].divmod(static_cast<uint32_t>(i), q, r);
      idx = static_cast<I>(r);
      i = static_cast<I>(q);
    } else {
      const I size = static_cast<I>(g.sizes[d]);
      idx = i % size;
      i /= size;
    }
#pragma unroll
    for (int k = 0; k < N; ++k) off[k] += idx * static_cast<I>(g.strides[k][d]);
  }
}

// --- Device math ----------------------------------------------------------------------------

// exp, log, sqrt, ..., is_nan, is_finite for float and double: the host+device overloads of
// kernels/scalar_fn.h, which the CPU kernels call too.
namespace dmath = ::kiln::scalar::math;

// --- Operands -------------------------------------------------------------------------------

// One input of a loop: device memory, or (ptr == nullptr) a value read on the host.
template <typename T>
struct Operand {
  const T* ptr = nullptr;
  T value{};
};

template <typename T, typename I>
__device__ __forceinline__ T load(const Operand<T>& op, I off) {
  return op.ptr != nullptr ? op.ptr[off] : op.value;
}

// The number of elements of p before its first 16-byte boundary, at most n: the scalar head of
// a pass in 16-byte Vecs (tensor data is always aligned to its element size). I: the index type.
template <typename T, typename I>
__device__ __forceinline__ I head_of(const T* p, I n) {
  const auto mis = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) % 16);
  const I h = mis == 0 ? 0 : static_cast<I>((16 - mis) / sizeof(T));
  return h < n ? h : n;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// --- Kernels --------------------------------------------------------------------------------

template <typename I, typename Out, typename F, typename... Ins, size_t... K>
__device__ __forceinline__ void apply_strided(Out* out, const F& f, const I* off,
                                              std::index_sequence<K...>,
                                              const Operand<Ins>&... in) {
  out[off[0]] = static_cast<Out>(f(load(in, off[K + 1])...));
}

template <typename I, typename Out, typename F, typename... Ins>
__global__ void __launch_bounds__(kThreads)
    strided_kernel(Out* out, I n, Geometry<sizeof...(Ins) + 1> g, F f, Operand<Ins>... in) {
  constexpr int N = sizeof...(Ins) + 1;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    I off[N];
    offsets<I, N>(g, i, off);
    apply_strided<I, Out>(out, f, off, std::index_sequence_for<Ins...>{}, in...);
  }
}

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const Operand<T>& op, int64_t base) {
  if (op.ptr != nullptr) return *reinterpret_cast<const Vec<T, V>*>(op.ptr + base);
  Vec<T, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = op.value;
  return r;
}

template <int V, typename Out, typename F, typename... Ins>
__device__ __forceinline__ void apply_vec(Out* out, int64_t base, const F& f,
                                          const Vec<Ins, V>&... v) {
  Vec<Out, V> r;
#pragma unroll
  for (int j = 0; j < V; ++j) r.v[j] = static_cast<Out>(f(v.v[j]...));
  *reinterpret_cast<Vec<Out, V>*>(out + base) = r;
}

// Every operand dense with out's shape: V elements per thread and step with one aligned load
// per input and one store (V * sizeof = 16 bytes for the widest type); the tail is scalar.
template <int V, typename Out, typename F, typename... Ins>
__global__ void __launch_bounds__(kThreads)
    contiguous_kernel(Out* out, int64_t n, F f, Operand<Ins>... in) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / V;
  for (int64_t t = tid; t < nvec; t += step) {
    apply_vec<V>(out, t * V, f, load_vec<Ins, V>(in, t * V)...);
  }
  for (int64_t i = nvec * V + tid; i < n; i += step) {
    out[i] = static_cast<Out>(f(load(in, i)...));
  }
}

// --- The host-side entry point --------------------------------------------------------------

template <typename T>
using TensorFor = const Tensor&;

template <typename T>
constexpr size_t max_size_of() {
  return sizeof(T);
}
template <typename T, typename U, typename... Rest>
constexpr size_t max_size_of() {
  return std::max(sizeof(T), max_size_of<U, Rest...>());
}

template <typename T>
Operand<T> make_operand(const Tensor& t, const char* op) {
  Operand<T> o;
  if (is_host_scalar(t)) {
    o.value = read_host_scalar<T>(t);
    return o;
  }
  KILN_CHECK(t.is_cuda(), "[", op, "] expected a CUDA tensor, got one on ", t.device().str());
  KILN_CHECK(t.dtype() == dtype_of<T>(), "[", op, "] internal: operand of dtype ",
             dtype_name(t.dtype()), " where ", dtype_name(dtype_of<T>()), " was expected");
  o.ptr = static_cast<const T*>(t.data_ptr());
  return o;
}

template <typename T>
bool aligned_to(const Operand<T>& o, size_t bytes) {
  return o.ptr == nullptr || reinterpret_cast<uintptr_t>(o.ptr) % bytes == 0;
}

// out[i] = f(in[i]...) with the inputs broadcast to out's shape (see the top of the file).
template <typename Out, typename... Ins, typename F>
void elementwise(const Tensor& out, const F& f, TensorFor<Ins>... in) {
  constexpr int N = sizeof...(Ins) + 1;
  const int64_t n = out.numel();
  if (n == 0) return;
  const char* op = "elementwise";
  KILN_CHECK(out.is_cuda() && out.dtype() == dtype_of<Out>(),
             "[elementwise] internal: unexpected output ", out.device().str(), " ",
             dtype_name(out.dtype()));
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  Out* o = static_cast<Out*>(out.data_ptr());
  const std::tuple<Operand<Ins>...> ops{make_operand<Ins>(in, op)...};

  bool dense = out.is_contiguous();
  ((dense = dense && (is_host_scalar(in) || (in.sizes() == out.sizes() && in.is_contiguous()))),
   ...);
  if (dense) {
    constexpr int V = static_cast<int>(16 / max_size_of<Out, Ins...>());
    bool aligned = reinterpret_cast<uintptr_t>(o) % (sizeof(Out) * V) == 0;
    std::apply(
        [&](const auto&... x) { ((aligned = aligned && aligned_to(x, sizeof(x.value) * V)), ...); },
        ops);
    std::apply(
        [&](const auto&... x) {
          if (aligned && V > 1) {
            contiguous_kernel<V, Out, F, Ins...>
                <<<grid_for((n + V - 1) / V), kThreads, 0, stream>>>(o, n, f, x...);
          } else {
            contiguous_kernel<1, Out, F, Ins...>
                <<<grid_for(n), kThreads, 0, stream>>>(o, n, f, x...);
          }
        },
        ops);
    KILN_CUDA_LAUNCH_CHECK("contiguous_kernel");
    return;
  }
  const Shape strides[N] = {
      to_shape(out.strides()),
      (is_host_scalar(in) ? Shape(out.dim(), 0) : broadcast_strides(in, out.sizes()))...};
  const Geometry<N> g = make_geometry<N>(out.sizes(), strides, op);
  std::apply(
      [&](const auto&... x) {
        if (fits_int32(g, n)) {
          strided_kernel<int32_t, Out, F, Ins...>
              <<<grid_for(n), kThreads, 0, stream>>>(o, static_cast<int32_t>(n), g, f, x...);
        } else {
          strided_kernel<int64_t, Out, F, Ins...>
              <<<grid_for(n), kThreads, 0, stream>>>(o, n, g, f, x...);
        }
      },
      ops);
  KILN_CUDA_LAUNCH_CHECK("strided_kernel");
}

// --- A device-side error flag ----------------------------------------------------------------

// Kernels that find a bad argument (an out-of-range index, an integer division by zero) record
// it here; the host reads it after the kernel (waiting for the device) and raises kiln::Error,
// so GPU and CPU kernels fail on the same inputs with comparable messages. While a CUDA graph is
// captured the host cannot wait, and in a compiled program's op-by-op steps it should not: the
// kernels raise the device's deferred flag instead, which the next run checks (runtime.h,
// deferred_error_flag), and raised() says no.
struct FlagView {
  int64_t* p;  // [set, value]
  __device__ void raise(int64_t value) const {
    p[1] = value;
    __threadfence();
    p[0] = 1;
  }
};

class ErrorFlag {
 public:
  explicit ErrorFlag(Device device)
      : graph_flag_(internal::deferred_error_flag(static_cast<int>(device.index()))) {
    if (graph_flag_ != nullptr) return;
    buffer_ = empty_on({2}, kInt64, device);
    KILN_CUDA_CHECK(cudaMemsetAsync(buffer_.data_ptr(), 0, 2 * sizeof(int64_t), current_stream()));
  }
  FlagView view() const {
    return {graph_flag_ != nullptr ? graph_flag_ : static_cast<int64_t*>(buffer_.data_ptr())};
  }
  // Waits for the device; true (and the recorded value) when a kernel raised the flag.
  bool raised(int64_t* value = nullptr) const {
    if (graph_flag_ != nullptr) return false;  // checked by the next run
    int64_t host[2] = {0, 0};
    KILN_CUDA_CHECK(cudaMemcpyAsync(host, buffer_.data_ptr(), sizeof(host), cudaMemcpyDeviceToHost,
                                    current_stream()));
    KILN_CUDA_CHECK(cudaStreamSynchronize(current_stream()));
    if (value != nullptr) *value = host[1];
    return host[0] != 0;
  }

 private:
  int64_t* graph_flag_ = nullptr;
  Tensor buffer_;
};

// --- Reductions across a warp ----------------------------------------------------------------

// __shfl_down_sync of any trivially copyable value, word by word.
template <typename T>
__device__ __forceinline__ T shfl_down(const T& v, int delta) {
  constexpr int kWords = (sizeof(T) + 3) / 4;
  int words[kWords] = {};
  memcpy(words, &v, sizeof(T));
#pragma unroll
  for (int w = 0; w < kWords; ++w) words[w] = __shfl_down_sync(0xffffffffu, words[w], delta);
  T out;
  memcpy(&out, words, sizeof(T));
  return out;
}

template <typename T>
__device__ __forceinline__ T shfl_xor(const T& v, int mask) {
  constexpr int kWords = (sizeof(T) + 3) / 4;
  int words[kWords] = {};
  memcpy(words, &v, sizeof(T));
#pragma unroll
  for (int w = 0; w < kWords; ++w) words[w] = __shfl_xor_sync(0xffffffffu, words[w], mask);
  T out;
  memcpy(&out, words, sizeof(T));
  return out;
}

}  // namespace kiln::cuda::loops
