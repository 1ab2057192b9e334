// The CUDA runtime: devices, error checks, the stream-ordered allocator, memory statistics,
// CUDA graph capture, streams and events (public API: kernels/cuda.h; internals:
// kernels/cuda/runtime.h; the pinned host memory cache: kernels/cuda/pinned.cpp; the knobs, in
// every build: kernels/cuda.cpp; the CPU-only stand-in: kernels/cpu/cuda_unavailable.cpp).
#include "kernels/cuda/runtime.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/stream_mem_ops.h"
#include "tensor/error.h"
#include "tensor/storage.h"
#include "tensor/tensor.h"
#include "tensor/tensor_impl.h"

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
  // The graph memory in use at the last launch or trim (the peak counts allocated + it).
  std::atomic<int64_t> graph_used{0};
  std::once_flag capture_init;
  cudaStream_t capture_stream = nullptr;       // kept for CUDA graph captures (capture_graph)
  cudaStream_t after_launch_stream = nullptr;  // defer_to_each_launch's work starts there
  // defer_to_each_launch's flags: 64-bit words of device memory (zeroed), handed to captures and
  // back when their graphs go.
  std::mutex flags_mu;
  uint64_t* flag_words = nullptr;
  std::vector<int> free_flags;
  // deferred_error_flag: mapped pinned [set, value]
  std::once_flag error_flag_init;
  int64_t* graph_flag_host = nullptr;
  int64_t* graph_flag_device = nullptr;
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

// --- CUDA graph capture (internal::capture_graph) ------------------------------------------

// The graph allocations of one capture: open while the capture lasts. A graph allocation freed
// then becomes a free node; one freed after it (a tensor that outlived the capture, which fails
// it) has no memory behind it: the graph is discarded unlaunched.
//
// Allocations the caller keeps (capture_graph's `fn` returns their storages) outlive the capture:
// each launch backs them anew, at the same address, and they live until the graph's next launch
// frees them (cudaGraphInstantiateFlagAutoFreeOnLaunch). While the graph lives it owns them: a
// kept storage that dies only notes it. When the graph is destroyed it frees those no storage
// holds any more, and a storage still holding one frees it when it dies.
struct CaptureRecord {
  std::mutex mu;
  bool open = true;
  std::unordered_map<void*, size_t> live;  // graph allocations not freed yet
  int64_t allocated_bytes = 0;
  std::unordered_map<void*, size_t> kept;  // allocations that outlive the capture
  std::unordered_set<void*> unheld;        // kept ones whose storage died while the graph lived
  bool graph_alive = false;                // the graph was instantiated and not destroyed yet
  bool launched = false;                   // the kept allocations are backed (a launch ran)
};

// A pool free held back during a capture (see capture_graph).
struct DeferredFree {
  void* ptr;
  int device;
  int64_t size;
  cudaStream_t stream;  // the one it was allocated on
};

// Work the host starts after each launch of a graph (defer_to_each_launch), and what it waits
// for: a flag word in which a one-thread kernel of the graph counts its launches (the side stream
// waits with cuStreamWaitValue32 until it reaches the launch's number), or, where the driver lacks
// stream memory operations or the flags ran out, an event the graph records. An event record node
// costs the graph a bubble of about 30 us where it stands (llama-3.2-1b's compiled DDP step: 66 of
// them, 2 ms a step, on 4 H200s; benchmarks/RESULTS.md, session 31); a kernel node does not.
struct AfterLaunch {
  cudaEvent_t event = nullptr;
  int flag = -1;          // index into the device's flag words
  uint32_t launches = 0;  // launches so far (the flag's count once the mark is reached)
  std::function<void()> start;
};

constexpr int kFlagWords = 4096;

// The capture this thread runs, if any.
struct CaptureContext {
  cudaStream_t stream = nullptr;
  int device = -1;
  int64_t* error_flag = nullptr;  // the device's graph error flag (device address)
  std::shared_ptr<CaptureRecord> record;
  std::vector<DeferredFree> deferred;
  std::vector<AfterLaunch> after_launch;
};
thread_local CaptureContext* t_capture = nullptr;

// Frees held back by a capture, queued on `stream` (null: each on its own stream). Never throws.
void release_deferred(std::vector<DeferredFree>& frees, cudaStream_t stream, bool own_stream) {
  for (const DeferredFree& f : frees) {
    int previous = -1;
    const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != f.device &&
                          cudaSetDevice(f.device) == cudaSuccess;
    if (cudaFreeAsync(f.ptr, own_stream ? f.stream : stream) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    if (switched) (void)cudaSetDevice(previous);
    state(f.device).allocated.fetch_sub(f.size);
  }
  frees.clear();
}

// Counts the device's graph memory into the peak (after a graph launch).
void note_graph_memory(int index) {
  uint64_t used = 0;
  if (cudaDeviceGetGraphMemAttribute(index, cudaGraphMemAttrUsedMemCurrent, &used) !=
      cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  DeviceState& s = state(index);
  s.graph_used.store(static_cast<int64_t>(used));
  const int64_t now = s.allocated.load() + static_cast<int64_t>(used);
  int64_t peak = s.peak.load();
  while (now > peak && !s.peak.compare_exchange_weak(peak, now)) {
  }
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
    CaptureContext* capture = t_capture;
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
      if (CaptureContext* capture = t_capture; capture != nullptr) {
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

void set_current_stream(int device, cudaStream_t stream) {
  cudaStream_t& slot = t_streams.current[device];
  t_streams.non_default += (stream != nullptr) - (slot != nullptr);
  slot = stream;
}

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

// Destroys the events of `after` and hands its flags back to `device`'s words, cleared (after
// the device is idle: a graph's launches are done). Never throws.
void release_after_launch(std::vector<AfterLaunch>& after, int device, bool launched) {
  DeviceState& s = state(device);
  for (AfterLaunch& a : after) {
    if (a.event != nullptr && cudaEventDestroy(a.event) != cudaSuccess) (void)cudaGetLastError();
    a.event = nullptr;
    if (a.flag < 0) continue;
    // Counted to zero again for its next graph.
    if (launched && cudaMemset(s.flag_words + a.flag, 0, sizeof(uint64_t)) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;  // not handed back: it may hold a count
    }
    std::lock_guard<std::mutex> lock(s.flags_mu);
    s.free_flags.push_back(a.flag);
    a.flag = -1;
  }
  after.clear();
}

struct CapturedGraph::Impl {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<DeferredFree> deferred;    // queued after the first launch
  std::shared_ptr<CaptureRecord> record;  // its kept allocations
  std::vector<AfterLaunch> after_launch;  // started after every launch
};

CapturedGraph::~CapturedGraph() {
  if (!impl_) return;
  // Destroyed when the program is captured again or dropped: let its launches finish first.
  int previous = -1;
  const bool switched = cudaGetDevice(&previous) == cudaSuccess && previous != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  if (cudaDeviceSynchronize() != cudaSuccess) (void)cudaGetLastError();
  if (impl_->exec != nullptr && cudaGraphExecDestroy(impl_->exec) != cudaSuccess) {
    (void)cudaGetLastError();
  }
  if (impl_->graph != nullptr && cudaGraphDestroy(impl_->graph) != cudaSuccess) {
    (void)cudaGetLastError();
  }
  release_deferred(impl_->deferred, nullptr, /*own_stream=*/true);
  release_after_launch(impl_->after_launch, device_, /*launched=*/true);
  // Kept allocations: freed now where no storage holds them, else by the last storage's deleter.
  std::vector<void*> unheld;
  if (impl_->record) {
    std::lock_guard<std::mutex> lock(impl_->record->mu);
    CaptureRecord& r = *impl_->record;
    r.graph_alive = false;
    for (void* p : r.unheld) {
      r.kept.erase(p);
      if (r.launched) unheld.push_back(p);
    }
    r.unheld.clear();
  }
  for (void* p : unheld) {
    if (cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
  }
  if (switched) (void)cudaSetDevice(previous);
}

namespace {
thread_local int t_deferred_device = -1;  // DeferredChecksScope's device

// The device's deferred error flag, made on first use.
void make_error_flag(int device, DeviceState& s) {
  std::call_once(s.error_flag_init, [&] {
    DeviceGuard guard(device);
    void* host = nullptr;
    KILN_CUDA_CHECK(cudaHostAlloc(&host, 2 * sizeof(int64_t), cudaHostAllocMapped));
    s.graph_flag_host = static_cast<int64_t*>(host);
    s.graph_flag_host[0] = s.graph_flag_host[1] = 0;
    void* dev = nullptr;
    KILN_CUDA_CHECK(cudaHostGetDevicePointer(&dev, host, 0));
    s.graph_flag_device = static_cast<int64_t*>(dev);
  });
}

// Reports (and clears) a bad argument that a kernel of an earlier graph replay or deferred run
// left in the device's flag. Reads host memory: no wait for the device.
void check_deferred_error(int device) {
  volatile int64_t* flag = state(device).graph_flag_host;
  if (flag == nullptr || flag[0] == 0) return;
  const int64_t value = flag[1];
  flag[1] = 0;
  flag[0] = 0;
  KILN_FAIL("[cuda] a kernel of an earlier compiled run on cuda:", device,
            " (a CUDA graph's replay, or a step run op by op) found a bad argument (value ", value,
            ": an index out of range, or another argument an op checks on the device); run the "
            "code uncompiled to have the op report it");
}
}  // namespace

int64_t* deferred_error_flag(int device) {
  if (t_capture != nullptr) return t_capture->error_flag;
  return device >= 0 && device == t_deferred_device ? state(device).graph_flag_device : nullptr;
}

DeferredChecksScope::DeferredChecksScope(int device) : previous_(t_deferred_device) {
  check_device(device, "DeferredChecksScope");
  make_error_flag(device, state(device));
  check_deferred_error(device);
  t_deferred_device = device;
}

DeferredChecksScope::~DeferredChecksScope() { t_deferred_device = previous_; }

bool capturing_graph() { return t_capture != nullptr; }

namespace {
thread_local const GraphRng* t_graph_rng = nullptr;
}  // namespace

const GraphRng* capture_rng() { return t_graph_rng; }
GraphRngScope::GraphRngScope(const GraphRng* rng) : previous_(t_graph_rng) { t_graph_rng = rng; }
GraphRngScope::~GraphRngScope() { t_graph_rng = previous_; }

void CapturedGraph::launch() {
  DeviceGuard guard(device_);
  check_deferred_error(device_);  // what a kernel of an earlier run found (deferred_error_flag)
  const cudaStream_t stream = current_stream(device_);
  const cudaError_t err = cudaGraphLaunch(impl_->exec, stream);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    KILN_FAIL("[cuda_graph] launching the captured graph on cuda:", device_,
              " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
              " (rerun with compile's cuda_graphs(false) or --no-cuda-graphs to run op by op)");
  }
  if (impl_->record) {
    std::lock_guard<std::mutex> lock(impl_->record->mu);
    impl_->record->launched = true;
  }
  release_deferred(impl_->deferred, stream, /*own_stream=*/false);
  note_graph_memory(device_);
  sync_if_debug("cudaGraphLaunch", __FILE__, __LINE__);
  if (!impl_->after_launch.empty()) {
    // The work left to the host, each part after the graph's mark of it (the wait is queued after
    // cudaGraphLaunch: this launch's mark), on a stream of its own.
    const cudaStream_t side = state(device_).after_launch_stream;
    const cudaStream_t previous = t_streams.current[device_];
    // Every mark counts this launch, whether or not its part starts (an earlier part's failure).
    for (AfterLaunch& a : impl_->after_launch) ++a.launches;
    set_current_stream(device_, side);
    try {
      for (const AfterLaunch& a : impl_->after_launch) {
        if (a.flag >= 0) {
          // GEQ compares (int32_t)(*word - launches) >= 0, so the count may wrap.
          const auto word = reinterpret_cast<CUdeviceptr>(state(device_).flag_words + a.flag);
          KILN_CHECK(stream_mem_ops().wait(side, word, a.launches, CU_STREAM_WAIT_VALUE_GEQ) ==
                         CUDA_SUCCESS,
                     "[cuda_graph] queuing the wait for a graph's mark on cuda:", device_,
                     " failed");
        } else {
          KILN_CUDA_CHECK(cudaStreamWaitEvent(side, a.event, 0));
        }
        a.start();
      }
    } catch (...) {
      set_current_stream(device_, previous);
      throw;
    }
    set_current_stream(device_, previous);
  }
}

const StreamMemOps& stream_mem_ops() {
  static const StreamMemOps ops = [] {
    StreamMemOps r;
    r.ok = driver_entry_point("cuStreamWriteValue32", r.write) &&
           driver_entry_point("cuStreamWaitValue32", r.wait);
    return r;
  }();
  return ops;
}

bool defer_to_each_launch(std::function<void()> start) {
  if (t_capture == nullptr) return false;
  CaptureContext& c = *t_capture;
  DeviceState& s = state(c.device);
  AfterLaunch a;
  a.start = std::move(start);
  if (stream_mem_ops().ok) {
    std::lock_guard<std::mutex> lock(s.flags_mu);
    if (!s.free_flags.empty()) {
      a.flag = s.free_flags.back();
      s.free_flags.pop_back();
    }
  }
  c.after_launch.push_back(std::move(a));  // released with the capture if it fails
  AfterLaunch& added = c.after_launch.back();
  if (added.flag >= 0) {
    add_device_word(c.device, s.flag_words + added.flag, 1);  // a kernel node
  } else {
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&added.event, cudaEventDisableTiming));
    KILN_CUDA_CHECK(
        cudaEventRecordWithFlags(added.event, current_stream(c.device), cudaEventRecordExternal));
  }
  return true;
}

std::shared_ptr<CapturedGraph> capture_graph(int device,
                                             const std::function<std::vector<Storage>()>& fn) {
  check_device(device, "cuda_graph");
  KILN_CHECK(t_capture == nullptr,
             "[cuda_graph] this thread is capturing a graph already: captures do not nest");
  DeviceGuard guard(device);
  DeviceState& s = state(device);
  std::call_once(s.capture_init, [&] {
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s.capture_stream, cudaStreamNonBlocking));
    // defer_to_each_launch's stream and flags, made here: a capture may not allocate or clear
    // memory.
    KILN_CUDA_CHECK(cudaStreamCreateWithFlags(&s.after_launch_stream, cudaStreamNonBlocking));
    void* words = nullptr;
    KILN_CUDA_CHECK(cudaMalloc(&words, kFlagWords * sizeof(uint64_t)));
    KILN_CUDA_CHECK(cudaMemset(words, 0, kFlagWords * sizeof(uint64_t)));
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
    s.flag_words = static_cast<uint64_t*>(words);
    for (int i = kFlagWords; i-- > 0;) s.free_flags.push_back(i);
  });
  make_error_flag(device, s);
  const cudaStream_t stream = s.capture_stream;
  CaptureContext context;
  context.stream = stream;
  context.device = device;
  context.record = std::make_shared<CaptureRecord>();
  context.error_flag = s.graph_flag_device;
  const cudaStream_t previous_stream = t_streams.current[device];
  KILN_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  set_current_stream(device, stream);
  t_capture = &context;
  std::string failure;
  std::vector<Storage> kept;
  try {
    kept = fn();
  } catch (const std::exception& e) {
    failure = e.what();
  } catch (...) {
    failure = "an exception that is not a std::exception";
  }
  t_capture = nullptr;
  set_current_stream(device, previous_stream);
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (ended != cudaSuccess) (void)cudaGetLastError();
  int64_t leaked = 0, leaked_bytes = 0, allocated_bytes = 0;
  {
    std::lock_guard<std::mutex> lock(context.record->mu);
    context.record->open = false;
    for (const Storage& k : kept) {
      auto it = k ? context.record->live.find(k->data()) : context.record->live.end();
      if (it == context.record->live.end()) continue;  // not this capture's allocation
      context.record->kept.insert(*it);
      context.record->live.erase(it);
    }
    leaked = static_cast<int64_t>(context.record->live.size());
    for (const auto& [p, n] : context.record->live) leaked_bytes += static_cast<int64_t>(n);
    allocated_bytes = context.record->allocated_bytes;
  }
  if (failure.empty() && ended != cudaSuccess) {
    failure = std::string("cudaStreamEndCapture failed: ") + cudaGetErrorName(ended) + ": " +
              cudaGetErrorString(ended) +
              " (an op synchronised with the host or made a call a capture forbids)";
  }
  if (failure.empty() && leaked > 0) {
    failure = std::to_string(leaked) + " tensor(s) (" + mib(leaked_bytes) +
              ") allocated during the capture outlive it (a cache filled while capturing?)";
  }
  cudaGraphExec_t exec = nullptr;
  if (failure.empty()) {
    const cudaError_t err =
        cudaGraphInstantiateWithFlags(&exec, graph, cudaGraphInstantiateFlagAutoFreeOnLaunch);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      exec = nullptr;
      failure = std::string("cudaGraphInstantiate failed: ") + cudaGetErrorName(err) + ": " +
                cudaGetErrorString(err);
    }
  }
  if (!failure.empty()) {
    if (graph != nullptr && cudaGraphDestroy(graph) != cudaSuccess) (void)cudaGetLastError();
    // Nothing of the capture ran: the held-back frees can go now, each on its own stream.
    release_deferred(context.deferred, nullptr, /*own_stream=*/true);
    release_after_launch(context.after_launch, device, /*launched=*/false);
    KILN_FAIL("[cuda_graph] capture on cuda:", device, " failed: ", failure);
  }
  std::shared_ptr<CapturedGraph> g(new CapturedGraph());
  g->impl_ = std::make_unique<CapturedGraph::Impl>();
  g->impl_->graph = graph;
  g->impl_->exec = exec;
  g->impl_->deferred = std::move(context.deferred);
  g->impl_->after_launch = std::move(context.after_launch);
  {
    std::lock_guard<std::mutex> lock(context.record->mu);
    context.record->graph_alive = true;
  }
  g->impl_->record = context.record;
  g->device_ = device;
  g->allocated_bytes_ = allocated_bytes;
  return g;
}

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
