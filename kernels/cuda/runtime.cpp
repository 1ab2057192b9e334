// The CUDA runtime: devices, error checks, the stream-ordered allocator (with its side of a CUDA
// graph capture), memory statistics, streams and events (public API: kernels/cuda.h; internals:
// kernels/cuda/runtime.h; graph capture and replay: kernels/cuda/graph.cpp, which shares
// kernels/cuda/runtime_state.h; the pinned host memory cache: kernels/cuda/pinned.cpp; the
// knobs, in every build: kernels/cuda.cpp; the CPU-only stand-in:
// kernels/cpu/cuda_unavailable.cpp).
#include "kernels/cuda/runtime.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/runtime_state.h"
#include "tensor/error.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"
#include "tensor/tensor_impl.h"

namespace kiln::cuda {

using internal::CaptureContext;
using internal::CaptureRecord;
using internal::current_capture;
using internal::DeviceState;
using internal::set_current_stream;
using internal::state;

namespace internal {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  (void)cudaGetLastError();  // clears a non-sticky error so later calls don't report it again
  KILN_FAIL("[cuda] ", call, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
            " (", file, ":", line, ")");
}

void sync_if_debug(const char* what, const char* file, int line) {
  if (!launch_sync()) return;
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    throw_cuda_error(err, (std::string(what) + " (caught by KILN_CUDA_SYNC)").c_str(), file, line);
  }
}

void check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw_cuda_error(err, (std::string("launch of ") + kernel).c_str(), file, line);
  }
  sync_if_debug(kernel, file, line);
}

}  // namespace internal

namespace {

struct DeviceInfo {
  int count = 0;
  std::string reason;  // why count is 0
};

const DeviceInfo& device_info() {
  static const DeviceInfo info = [] {
    DeviceInfo i;
    const cudaError_t err = cudaGetDeviceCount(&i.count);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      i.count = 0;
      i.reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(err) + ": " +
                 cudaGetErrorString(err);
    } else if (i.count == 0) {
      i.reason = "the CUDA driver reports no GPU";
    }
    return i;
  }();
  return info;
}

// Checks that `index` names an existing device; `op` names the caller in the error.
void check_device(int index, const char* op) {
  const DeviceInfo& info = device_info();
  KILN_CHECK(info.count > 0, "[", op, "] no CUDA device: ", info.reason);
  KILN_CHECK(index >= 0 && index < info.count, "[", op, "] cuda:", index,
             " does not exist: this machine has ", info.count, " CUDA device(s)");
}

// `device`, or the current device when it is -1.
int resolve(int device, const char* op) {
  if (device < 0) {
    check_device(0, op);  // says "no CUDA device" in the caller's name
    KILN_CUDA_CHECK(cudaGetDevice(&device));
  }
  check_device(device, op);
  return device;
}

}  // namespace

DeviceState& internal::state(int index) {
  static std::vector<DeviceState*>* states = [] {
    auto* v = new std::vector<DeviceState*>();
    for (int i = 0; i < device_info().count; ++i) v->push_back(new DeviceState());
    return v;
  }();
  DeviceState& s = *(*states)[index];
  std::call_once(s.init, [&] {
    int supported = 0;
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, index));
    KILN_CHECK(supported != 0, "[allocate] cuda:", index,
               " does not support stream-ordered memory pools (cudaMallocAsync)");
    KILN_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&s.pool, index));
    // Keep freed memory in the pool instead of returning it at every synchronisation: the
    // point of a caching allocator. empty_cache() trims explicitly.
    uint64_t threshold = UINT64_MAX;
    KILN_CUDA_CHECK(cudaMemPoolSetAttribute(s.pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  });
  return s;
}

namespace {

std::string mib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return buf;
}

[[noreturn]] void throw_out_of_memory(int index, size_t nbytes, DeviceState& s) {
  std::string detail;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
    uint64_t reserved = 0;
    (void)cudaMemPoolGetAttribute(s.pool, cudaMemPoolAttrReservedMemCurrent, &reserved);
    detail = " (cuda:" + std::to_string(index) + ": " + mib(static_cast<int64_t>(reserved)) +
             " reserved by kiln, " + mib(static_cast<int64_t>(free_bytes)) + " free of " +
             mib(static_cast<int64_t>(total_bytes)) + ")";
  }
  (void)cudaGetLastError();
  KILN_FAIL("[allocate] CUDA out of memory: tried to allocate ", mib(static_cast<int64_t>(nbytes)),
            "; ", mib(s.allocated.load()), " in use", detail);
}

int64_t graph_memory(int index, cudaGraphMemAttributeType attr) {
  uint64_t bytes = 0;
  KILN_CUDA_CHECK(cudaDeviceGetGraphMemAttribute(index, attr, &bytes));
  return static_cast<int64_t>(bytes);
}

class CudaAllocator final : public Allocator {
 public:
  Storage allocate(size_t nbytes, Device device) override {
    const int index = device.index();
    check_device(index, "allocate");
    if (nbytes == 0) return std::make_shared<StorageImpl>(nullptr, 0, device, nullptr);
    DeviceState& s = state(index);
    DeviceGuard guard(index);
    const cudaStream_t stream = current_stream();
    CaptureContext* capture = current_capture();
    if (capture != nullptr && capture->stream == stream && capture->device == index) {
      return allocate_in_graph(nbytes, device, *capture);
    }
    void* p = nullptr;
    cudaError_t err = cudaMallocFromPoolAsync(&p, nbytes, s.pool, stream);
    if (err == cudaErrorMemoryAllocation) {
      // Frees still pending on the device cannot be reused yet: wait for them, then retry.
      (void)cudaGetLastError();
      KILN_CUDA_CHECK(cudaDeviceSynchronize());
      err = cudaMallocFromPoolAsync(&p, nbytes, s.pool, stream);
    }
    if (err == cudaErrorMemoryAllocation) throw_out_of_memory(index, nbytes, s);
    KILN_CUDA_CHECK(err);

    const int64_t size = static_cast<int64_t>(nbytes);
    const int64_t now = s.allocated.fetch_add(size) + size + s.graph_used.load();
    int64_t peak = s.peak.load();
    while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
    }
    return std::make_shared<StorageImpl>(p, nbytes, device, [index, size, stream](void* q) {
      // Freed by a thread that is capturing a graph: a capture cannot record the free of memory
      // it did not allocate, so it is queued after the graph's first launch (capture_graph).
      if (CaptureContext* capture = current_capture(); capture != nullptr) {
        try {
          capture->deferred.push_back({q, index, size, stream});
          return;
        } catch (...) {  // no memory for the list: free it now
        }
      }
      // A deleter must not throw; errors here (the runtime already unloaded at exit) are
      // ignored: the memory goes back with the process.
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != index &&
                            cudaSetDevice(index) == cudaSuccess;
      if (cudaFreeAsync(q, stream) != cudaSuccess) (void)cudaGetLastError();
      if (switched) (void)cudaSetDevice(previous);
      state(index).allocated.fetch_sub(size);
    });
  }

 private:
  // An allocation node of the graph being captured: no pool memory now, so not counted in
  // `allocated` (graph memory is counted at launch, note_graph_memory).
  static Storage allocate_in_graph(size_t nbytes, Device device, CaptureContext& capture) {
    const int index = device.index();
    DeviceState& s = state(index);
    void* p = nullptr;
    const cudaError_t err = cudaMallocFromPoolAsync(&p, nbytes, s.pool, capture.stream);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      KILN_FAIL("[allocate] allocating ", mib(static_cast<int64_t>(nbytes)),
                " while capturing a CUDA graph failed: ", cudaGetErrorName(err), ": ",
                cudaGetErrorString(err));
    }
    std::shared_ptr<CaptureRecord> record = capture.record;
    {
      std::lock_guard<std::mutex> lock(record->mu);
      record->live.emplace(p, nbytes);
      record->allocated_bytes += static_cast<int64_t>(nbytes);
    }
    const cudaStream_t stream = capture.stream;
    return std::make_shared<StorageImpl>(p, nbytes, device, [index, stream, record](void* q) {
      bool free_node = false;
      try {
        std::lock_guard<std::mutex> lock(record->mu);
        if (record->open) {
          record->live.erase(q);
          free_node = true;
        } else {
          auto kept = record->kept.find(q);
          if (kept == record->kept.end()) return;  // the capture is over: nothing backs it
          if (record->graph_alive) {               // the graph still owns it
            record->unheld.insert(q);
            return;
          }
          record->kept.erase(kept);  // the graph is gone: this storage held it last
          if (!record->launched) return;
        }
      } catch (...) {
        return;
      }
      int previous = -1;
      const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != index &&
                            cudaSetDevice(index) == cudaSuccess;
      // A free node of the capture (an invalidated capture refuses it: ignored), or the free of
      // a kept allocation that outlived its graph (waits for the device: rare).
      const cudaError_t err = free_node ? cudaFreeAsync(q, stream) : cudaFree(q);
      if (err != cudaSuccess) (void)cudaGetLastError();
      if (switched) (void)cudaSetDevice(previous);
    });
  }
};

// Installs the allocator when libkiln is loaded. Creating no CUDA context: that happens on
// the first allocation.
const bool g_registered = [] {
  static CudaAllocator allocator;
  set_allocator(kCUDA, &allocator);
  return true;
}();

// --- Streams ------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;
constexpr int kPoolSize = 32;

// This thread's current stream per device (null: the default stream), and how many devices
// have a non-default one, so that current_stream() is one thread-local test in the common case.
struct ThreadStreams {
  std::array<cudaStream_t, kMaxDevices> current{};
  int non_default = 0;
};
thread_local ThreadStreams t_streams;

}  // namespace

void internal::set_current_stream(int device, cudaStream_t stream) {
  cudaStream_t& slot = t_streams.current[device];
  t_streams.non_default += (stream != nullptr) - (slot != nullptr);
  slot = stream;
}

namespace {

// Streams handed out by Stream::create(): created on first use, never destroyed.
struct StreamPool {
  std::once_flag init;
  std::array<cudaStream_t, kPoolSize> streams{};
  std::atomic<uint32_t> next{0};
};

cudaStream_t pool_stream(int device) {
  static std::array<StreamPool, kMaxDevices>* pools = new std::array<StreamPool, kMaxDevices>();
  StreamPool& p = (*pools)[device];
  std::call_once(p.init, [&] {
    DeviceGuard guard(device);
    for (cudaStream_t& s : p.streams) {
      KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    }
  });
  return p.streams[p.next.fetch_add(1) % kPoolSize];
}

}  // namespace

namespace internal {

void require_device(int index, const char* op) { check_device(index, op); }

std::string mib_text(int64_t bytes) { return mib(bytes); }

}  // namespace internal

Stream::Stream() : handle_(nullptr), device_(current_device()) {}

Stream Stream::create(int device) {
  const int index = resolve(device, "Stream::create");
  KILN_CHECK(index < kMaxDevices, "[Stream::create] cuda:", index, " is beyond the ", kMaxDevices,
             " devices kiln supports");
  return Stream(pool_stream(index), index);
}

Stream Stream::default_stream(int device) {
  return Stream(nullptr, resolve(device, "default_stream"));
}

int Stream::device() const { return device_ >= 0 ? device_ : current_device(); }

void Stream::synchronize() const {
  DeviceGuard guard(device());
  KILN_CUDA_CHECK(cudaStreamSynchronize(handle_));
}

bool Stream::query() const {
  DeviceGuard guard(device());
  const cudaError_t err = cudaStreamQuery(handle_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  KILN_CUDA_CHECK(err);
  return true;
}

void Stream::wait(const Event& event) const {
  if (!event.is_recorded()) return;
  DeviceGuard guard(device());
  KILN_CUDA_CHECK(cudaStreamWaitEvent(handle_, event.handle(), 0));
}

void Stream::wait_stream(const Stream& other) const {
  if (other == *this) return;
  Event e;
  e.record(other);
  wait(e);
}

Stream current_stream(int device) {
  if (t_streams.non_default == 0) return Stream(nullptr, device);
  if (device < 0) KILN_CUDA_CHECK(cudaGetDevice(&device));
  return Stream(t_streams.current[device], device);
}

StreamGuard::StreamGuard(const Stream& stream) : previous_stream_(stream) {
  const int index = stream.device();
  check_device(index, "StreamGuard");
  KILN_CUDA_CHECK(cudaGetDevice(&previous_device_));
  if (previous_device_ != index) KILN_CUDA_CHECK(cudaSetDevice(index));
  previous_stream_ = current_stream(index);
  set_current_stream(index, stream.handle());
}

StreamGuard::~StreamGuard() {
  const int index = previous_stream_.device();
  set_current_stream(index, previous_stream_.handle());
  if (previous_device_ != index && cudaSetDevice(previous_device_) != cudaSuccess) {
    (void)cudaGetLastError();
  }
}

Event::Event(bool enable_timing) : timing_(enable_timing) {}

Event::~Event() {
  if (event_ != nullptr && cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
}

Event::Event(Event&& other) noexcept
    : event_(std::exchange(other.event_, nullptr)),
      device_(other.device_),
      timing_(other.timing_) {}

Event& Event::operator=(Event&& other) noexcept {
  if (this != &other) {
    if (event_ != nullptr && cudaEventDestroy(event_) != cudaSuccess) (void)cudaGetLastError();
    event_ = std::exchange(other.event_, nullptr);
    device_ = other.device_;
    timing_ = other.timing_;
  }
  return *this;
}

void Event::record() { record(current_stream()); }

void Event::record(const Stream& stream) {
  const int index = stream.device();
  DeviceGuard guard(index);
  if (event_ == nullptr) {
    KILN_CUDA_CHECK(
        cudaEventCreateWithFlags(&event_, timing_ ? cudaEventDefault : cudaEventDisableTiming));
    device_ = index;
  }
  KILN_CHECK(device_ == index, "[Event::record] the event belongs to cuda:", device_,
             " and cannot record a stream of cuda:", index);
  KILN_CUDA_CHECK(cudaEventRecord(event_, stream.handle()));
}

void Event::synchronize() const {
  if (event_ == nullptr) return;
  KILN_CUDA_CHECK(cudaEventSynchronize(event_));
}

bool Event::query() const {
  if (event_ == nullptr) return true;
  const cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  KILN_CUDA_CHECK(err);
  return true;
}

float Event::elapsed_time(const Event& end) const {
  KILN_CHECK(timing_ && end.timing_, "[Event::elapsed_time] both events need enable_timing=true");
  KILN_CHECK(event_ != nullptr && end.event_ != nullptr,
             "[Event::elapsed_time] both events must be recorded first");
  float ms = 0;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, event_, end.event_));
  return ms;
}

DeviceGuard::DeviceGuard(int index) {
  if (index < 0) return;
  int current = -1;
  KILN_CUDA_CHECK(cudaGetDevice(&current));
  if (current == index) return;
  KILN_CUDA_CHECK(cudaSetDevice(index));
  previous_ = current;
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
}

bool is_available() { return device_info().count > 0; }

int device_count() { return device_info().count; }

std::string unavailable_reason() { return device_info().reason; }

int current_device() { return resolve(-1, "current_device"); }

void set_device(int index) {
  check_device(index, "set_device");
  KILN_CUDA_CHECK(cudaSetDevice(index));
}

void synchronize(int device) {
  const int index = resolve(device, "synchronize");
  DeviceGuard guard(index);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
}

MemoryStats memory_stats(int device) {
  const int index = resolve(device, "memory_stats");
  DeviceState& s = state(index);
  uint64_t reserved = 0;
  KILN_CUDA_CHECK(cudaMemPoolGetAttribute(s.pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
  MemoryStats m;
  m.allocated = s.allocated.load();
  m.graph = graph_memory(index, cudaGraphMemAttrUsedMemCurrent);
  m.reserved =
      static_cast<int64_t>(reserved) + graph_memory(index, cudaGraphMemAttrReservedMemCurrent);
  m.peak = s.peak.load();
  return m;
}

void reset_peak_memory_stats(int device) {
  const int index = resolve(device, "reset_peak_memory_stats");
  DeviceState& s = state(index);
  s.graph_used.store(graph_memory(index, cudaGraphMemAttrUsedMemCurrent));
  s.peak.store(s.allocated.load() + s.graph_used.load());
}

namespace internal {
void trim_graph_memory(int device) {
  const int index = resolve(device, "trim_graph_memory");
  DeviceGuard guard(index);
  // Memory whose free is still queued is not released by a trim: finish the queue first.
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  KILN_CUDA_CHECK(cudaDeviceGraphMemTrim(index));  // graph memory no live graph holds
  state(index).graph_used.store(graph_memory(index, cudaGraphMemAttrUsedMemCurrent));
}
}  // namespace internal

void empty_cache(int device) {
  const int index = resolve(device, "empty_cache");
  internal::trim_graph_memory(index);  // waits for the device first
  DeviceGuard guard(index);
  KILN_CUDA_CHECK(cudaMemPoolTrimTo(state(index).pool, 0));
  internal::empty_pinned_cache();
}

}  // namespace kiln::cuda

namespace kiln {

Tensor Tensor::pin_memory() const {
  KILN_CHECK(defined(), "[pin_memory] the tensor is undefined");
  KILN_CHECK(is_cpu(), "[pin_memory] expected a cpu tensor, got one on ", device().str());
  if (is_pinned()) return *this;
  const Shape& sizes = impl()->sizes();
  Tensor out(std::make_shared<TensorImpl>(cuda::internal::allocate_pinned(nbytes()), sizes,
                                          contiguous_strides(sizes), 0, dtype()));
  out.copy_(*this);
  return out;
}

bool Tensor::is_pinned() const {
  return defined() && impl()->storage() != nullptr && impl()->storage()->is_pinned();
}

}  // namespace kiln
