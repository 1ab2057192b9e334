// CUDA kernels for copies between dtypes, layouts and devices (to_copy, copy_) and for fill_.
//
// Same dtype and contiguous on both sides: one cudaMemcpyAsync, host<->device or
// device<->device; on one GPU, same dtype and rows of contiguous elements on both sides (a
// narrow of the last dimension, say): one cudaMemcpy2DAsync. Anything else runs the elementwise
// loops of loops.cuh on a GPU, dst[i] = convert(src[i]) with src broadcast to dst's shape (16-byte
// loads and stores where both sides are dense, else strided with 32-bit indices where they fit). A
// copy that also changes device converts where the data is when the source is a GPU (so only the
// result's bytes cross), and otherwise moves the source's bytes as they are and converts on the
// destination GPU. Conversions round exactly as the CPU kernels do (the same Half/BFloat16 code
// runs on the GPU).
//
// Copies that touch the host wait for the device (like PyTorch's blocking copies) unless
// to(..., non_blocking=true) moves them through pinned host memory; copies between GPUs are
// ordered against both devices' streams with events. One exception: a host-to-device copy of at
// most 8 bytes (a 0-d scalar, such as the optimizer's learning rate copied to the GPU every step)
// is written by a one-thread kernel that takes the bytes as its argument: queued on the stream,
// the host's bytes read when it is launched, nothing to wait for.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using loops::broadcast_strides;
using loops::convert;
using loops::Geometry;
using loops::make_geometry;

// dst = convert(src) as a functor of the elementwise loops (loops.cuh). (A loop of its own here,
// with a 64-bit division per element and dimension, converted at about a tenth of copy bandwidth.)
template <typename D, typename S>
struct ConvertOp {
  __device__ D operator()(S v) const { return convert<D, S>(v); }
};

// A fill's value, as a functor without inputs.
template <typename T>
struct FillOp {
  T value;
  __device__ T operator()() const { return value; }
};

// Same dtype, sizes and contiguous on both sides: the bytes can be moved as they are.
bool bytewise(const Tensor& dst, const Tensor& src) {
  return dst.dtype() == src.dtype() && dst.sizes() == src.sizes() && dst.is_contiguous() &&
         src.is_contiguous();
}

// Same dtype, and both sides rows of contiguous elements once the dimensions are merged (at most
// one outer dimension, positive pitches no shorter than a row): one cudaMemcpy2DAsync, which
// moves the bytes at copy bandwidth; the strided kernel reads and writes an element at a time
// (FSDP's copy out of an all-gather, a parameter's [world, shard] slices out of the gathered
// rows, ran at about a tenth of it). Returns false where it does not apply.
bool copy_rows(const Tensor& dst, const Tensor& src, const Geometry<2>& g, cudaStream_t stream) {
  if (g.ndim < 1 || g.ndim > 2) return false;
  const int inner = g.ndim - 1;
  if (g.strides[0][inner] != 1 || g.strides[1][inner] != 1) return false;
  const int64_t esize = static_cast<int64_t>(dst.element_size());
  const int64_t width = g.sizes[inner] * esize;
  const int64_t height = g.ndim == 2 ? g.sizes[0] : 1;
  const int64_t dpitch = g.ndim == 2 ? g.strides[0][0] * esize : width;
  const int64_t spitch = g.ndim == 2 ? g.strides[1][0] * esize : width;
  constexpr int64_t kMaxPitch = (int64_t{1} << 31) - 1;  // cudaDevAttrMaxPitch on every GPU
  if (dpitch < width || spitch < width || (height > 1 && std::max(dpitch, spitch) > kMaxPitch))
    return false;
  if (height == 1) {
    KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(width),
                                    cudaMemcpyDeviceToDevice, stream));
  } else {
    KILN_CUDA_CHECK(cudaMemcpy2DAsync(
        dst.data_ptr(), static_cast<size_t>(dpitch), src.data_ptr(), static_cast<size_t>(spitch),
        static_cast<size_t>(width), static_cast<size_t>(height), cudaMemcpyDeviceToDevice, stream));
  }
  internal::sync_if_debug("cudaMemcpy2DAsync (device to device)", __FILE__, __LINE__);
  return true;
}

// dst = convert(broadcast(src)); both on the same GPU.
void convert_on_device(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  DeviceGuard guard(dst.device().index());
  const cudaStream_t stream = current_stream();
  if (bytewise(dst, src)) {
    KILN_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(),
                                    cudaMemcpyDeviceToDevice, stream));
    internal::sync_if_debug("cudaMemcpyAsync (device to device)", __FILE__, __LINE__);
    return;
  }
  if (dst.dtype() == src.dtype()) {
    const Shape strides[2] = {to_shape(dst.strides()), broadcast_strides(src, dst.sizes())};
    if (copy_rows(dst, src, make_geometry<2>(dst.sizes(), strides, "copy_"), stream)) return;
  }
  visit_dtype(dst.dtype(), [&]<typename D>(TypeTag<D>) {
    visit_dtype(src.dtype(), [&]<typename S>(TypeTag<S>) {
      loops::elementwise<D, S>(dst, ConvertOp<D, S>{}, src);
    });
  });
}

// Up to 8 bytes, passed by value.
struct SmallBytes {
  unsigned char b[8];
};

__global__ void write_bytes_kernel(unsigned char* dst, SmallBytes bytes, int n) {
  for (int i = 0; i < n; ++i) dst[i] = bytes.b[i];
}

// An event that is destroyed with its scope (destroying a pending event is allowed).
class Event {
 public:
  Event() { KILN_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming)); }
  ~Event() { (void)cudaEventDestroy(event_); }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Moves the bytes of src into dst: same dtype and sizes, both contiguous, different devices.
// With non_blocking and a pinned host side, returns once the copy is queued.
void transfer(const Tensor& dst, const Tensor& src, bool non_blocking) {
  const size_t nbytes = dst.nbytes();
  if (nbytes == 0) return;
  if (dst.is_cuda() && src.is_cuda()) {
    // Between GPUs: the copy runs on the source's stream after the destination's queued work,
    // and the destination's later work waits for it.
    const int di = dst.device().index(), si = src.device().index();
    DeviceGuard to_dst(di);
    Event dst_ready;
    KILN_CUDA_CHECK(cudaEventRecord(dst_ready.get(), current_stream()));
    {
      DeviceGuard to_src(si);
      Event copied;
      KILN_CUDA_CHECK(cudaStreamWaitEvent(current_stream(), dst_ready.get(), 0));
      KILN_CUDA_CHECK(
          cudaMemcpyPeerAsync(dst.data_ptr(), di, src.data_ptr(), si, nbytes, current_stream()));
      KILN_CUDA_CHECK(cudaEventRecord(copied.get(), current_stream()));
      DeviceGuard back_to_dst(di);
      KILN_CUDA_CHECK(cudaStreamWaitEvent(current_stream(), copied.get(), 0));
    }
    internal::sync_if_debug("cudaMemcpyPeerAsync", __FILE__, __LINE__);
    return;
  }
  DeviceGuard guard((dst.is_cuda() ? dst : src).device().index());
  const cudaStream_t stream = current_stream();
  if (dst.is_cuda() && nbytes <= sizeof(SmallBytes)) {
    // A host scalar: its bytes travel in the kernel's arguments (see the banner).
    SmallBytes bytes{};
    std::memcpy(bytes.b, src.data_ptr(), nbytes);
    write_bytes_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned char*>(dst.data_ptr()), bytes,
                                            static_cast<int>(nbytes));
    KILN_CUDA_LAUNCH_CHECK("write_bytes_kernel");
    return;
  }
  KILN_CUDA_CHECK(
      cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes, cudaMemcpyDefault, stream));
  const Tensor& host = dst.is_cuda() ? src : dst;
  if (non_blocking && host.is_pinned()) {
    // The pinned block is not reused before the copy is done, even if its tensor dies first.
    internal::record_pinned_use(*host.impl()->storage(), stream);
    internal::sync_if_debug("cudaMemcpyAsync", __FILE__, __LINE__);
    return;
  }
  // The host side is ordinary (pageable) memory that the caller may read or free as soon as
  // the copy returns.
  KILN_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// dst = convert(broadcast(src)) with both on the CPU, through the CPU kernel (not the
// dispatcher: this is already inside a kernel).
void copy_on_cpu(const Tensor& dst, const Tensor& src) {
  static const OpDef& op = KILN_OP(copy_);
  const KernelFn kernel = op.first_kernel(kCPU);
  KILN_CHECK(kernel != nullptr, "[copy_] the CPU kernel is not registered");
  OpCall call;
  call.op = &op;
  call.inputs = {dst, src};
  kernel(call);
}

Tensor empty_on(IntArrayRef sizes, ScalarType dtype, Device device) {
  return empty(sizes, TensorOptions(dtype).device(device));
}

// dst = convert(broadcast(src)) where at least one side is a GPU.
void copy_tensor(const Tensor& dst, const Tensor& src, const char* op, bool non_blocking = false) {
  if (dst.numel() == 0 || dst.is_meta()) return;  // a meta tensor carries no data
  KILN_CHECK(!src.is_meta(), "[", op, "] cannot copy from a meta tensor into ", dst.device().str(),
             ": it has no data");
  if (dst.device() == src.device()) {
    convert_on_device(dst, src);
    return;
  }
  if (bytewise(dst, src)) {
    transfer(dst, src, non_blocking);
    return;
  }
  if (src.is_cuda() &&
      !(src.dtype() == dst.dtype() && src.sizes() == dst.sizes() && src.is_contiguous())) {
    Tensor staged = empty_on(dst.sizes(), dst.dtype(), src.device());
    convert_on_device(staged, src);
    copy_tensor(dst, staged, op, non_blocking);
    return;
  }
  // src is on the CPU, or already has dst's dtype and sizes: move its bytes as they are, then
  // lay them out (and convert, broadcast) on dst's device.
  Tensor packed = src;
  if (!src.is_contiguous()) {
    packed = empty_on(src.sizes(), src.dtype(), src.device());
    copy_on_cpu(packed, src);
  }
  Tensor landed = empty_on(src.sizes(), src.dtype(), dst.device());
  transfer(landed, packed, non_blocking && dst.is_cuda());
  if (dst.is_cuda()) {
    convert_on_device(dst, landed);
  } else {
    copy_on_cpu(dst, landed);
  }
}

void fill(const Tensor& t, const Scalar& value) {
  if (t.numel() == 0) return;
  DeviceGuard guard(t.device().index());
  const cudaStream_t stream = current_stream();
  visit_dtype(t.dtype(), [&]<typename T>(TypeTag<T>) {
    const T v = value.to<T>();
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &v, sizeof(T));
    const bool uniform_bytes =
        std::all_of(bytes, bytes + sizeof(T), [&](unsigned char b) { return b == bytes[0]; });
    if (t.is_contiguous() && uniform_bytes) {  // zeros, all-ones bits, any bool or 1-byte value
      KILN_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), bytes[0], t.nbytes(), stream));
      internal::sync_if_debug("cudaMemsetAsync", __FILE__, __LINE__);
      return;
    }
    loops::elementwise<T>(t, FillOp<T>{v});
  });
}

// attrs (dtype, device, non_blocking?). A non-blocking copy to the host lands in fresh pinned
// memory, as PyTorch's, so that it can be asynchronous.
void to_copy_cuda(OpCall& c) {
  const bool non_blocking = c.has_attr(2) && c.attr<bool>(2);
  Tensor& out = c.outputs[0];
  if (non_blocking && out.is_cpu() && !out.is_pinned() && out.nbytes() > 0) {
    out = Tensor(std::make_shared<TensorImpl>(internal::allocate_pinned(out.nbytes()),
                                              out.impl()->sizes(), out.impl()->strides(), 0,
                                              out.dtype()));
  }
  copy_tensor(out, c.input(0), "to", non_blocking);
}
void copy_cuda(OpCall& c) { copy_tensor(c.input(0), c.input(1), "copy_"); }
void fill_cuda(OpCall& c) { fill(c.input(0), c.attr<Scalar>(0)); }

}  // namespace

KILN_REGISTER_KERNEL(to_copy, kCUDA, to_copy_cuda);
KILN_REGISTER_KERNEL(copy_, kCUDA, copy_cuda);
KILN_REGISTER_KERNEL(fill_, kCUDA, fill_cuda);

}  // namespace kiln::cuda
