// CUDA graph capture and replay (internal::capture_graph, CapturedGraph), the work the host
// starts after each launch (defer_to_each_launch), the device's deferred error flag and the
// captured RNG (kernels/cuda/runtime.h); the allocator's side of a capture is in
// kernels/cuda/runtime.cpp.
#include <cuda.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/runtime.h"
#include "kernels/cuda/runtime_state.h"
#include "kernels/cuda/stream_mem_ops.h"
#include "tensor/error.h"
#include "tensor/storage.h"

namespace kiln::cuda::internal {
namespace {

constexpr int kFlagWords = 4096;

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
  if (cudaDeviceGetGraphMemAttribute(index, cudaGraphMemAttrUsedMemCurrent, &used) != cudaSuccess) {
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

}  // namespace

CaptureContext* current_capture() { return t_capture; }

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
  std::vector<DeferredFree> deferred;     // queued after the first launch
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
  require_device(device, "DeferredChecksScope");
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
    const cudaStream_t previous = current_stream(device_);
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
  require_device(device, "cuda_graph");
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
  const cudaStream_t previous_stream = current_stream(device);
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
    failure = std::to_string(leaked) + " tensor(s) (" + mib_text(leaked_bytes) +
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

}  // namespace kiln::cuda::internal
