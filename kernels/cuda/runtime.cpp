// The CUDA runtime: devices, error checks, the stream-ordered allocator and memory statistics.
#include "kernels/cuda/runtime.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"
#include "tensor/error.h"
#include "tensor/storage.h"

namespace kiln::cuda {

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

std::atomic<bool>& launch_sync_flag() {
  static std::atomic<bool> flag = [] {
    const char* env = std::getenv("KILN_CUDA_SYNC");
    return env != nullptr && env[0] != '\0' && std::string(env) != "0";
  }();
  return flag;
}

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

// Per-device allocator state. Never destroyed: storages freed during static destruction
// (a global tensor) still find it.
struct DeviceState {
  std::once_flag init;
  cudaMemPool_t pool = nullptr;
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak{0};
};

DeviceState& state(int index) {
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

class CudaAllocator final : public Allocator {
 public:
  Storage allocate(size_t nbytes, Device device) override {
    const int index = device.index();
    check_device(index, "allocate");
    if (nbytes == 0) return std::make_shared<StorageImpl>(nullptr, 0, device, nullptr);
    DeviceState& s = state(index);
    DeviceGuard guard(index);
    const cudaStream_t stream = current_stream();
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
    const int64_t now = s.allocated.fetch_add(size) + size;
    int64_t peak = s.peak.load();
    while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
    }
    return std::make_shared<StorageImpl>(p, nbytes, device, [index, size, stream](void* q) {
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
};

// Installs the allocator when libkiln is loaded. Creating no CUDA context: that happens on
// the first allocation.
const bool g_registered = [] {
  static CudaAllocator allocator;
  set_allocator(kCUDA, &allocator);
  return true;
}();

}  // namespace

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
  m.reserved = static_cast<int64_t>(reserved);
  m.peak = s.peak.load();
  return m;
}

void reset_peak_memory_stats(int device) {
  const int index = resolve(device, "reset_peak_memory_stats");
  DeviceState& s = state(index);
  s.peak.store(s.allocated.load());
}

void empty_cache(int device) {
  const int index = resolve(device, "empty_cache");
  DeviceState& s = state(index);
  DeviceGuard guard(index);
  // Memory whose free is still queued is not released by a trim: finish the queue first.
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  KILN_CUDA_CHECK(cudaMemPoolTrimTo(s.pool, 0));
}

bool launch_sync() { return launch_sync_flag().load(std::memory_order_relaxed); }

void set_launch_sync(bool enabled) { launch_sync_flag().store(enabled, std::memory_order_relaxed); }

}  // namespace kiln::cuda
