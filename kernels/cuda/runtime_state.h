// What kernels/cuda/runtime.cpp (devices, the stream-ordered allocator, streams, memory
// statistics) and kernels/cuda/graph.cpp (CUDA graph capture and replay) share: the per-device
// state, this thread's capture and the records of what a capture allocated and freed. Private to
// those two files.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace kiln::cuda::internal {

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

// The state of device `index`, an existing device (require_device): its pool is set up on first
// use (runtime.cpp).
DeviceState& state(int index);

// Makes `stream` this thread's current stream of `device` (null: the default stream).
void set_current_stream(int device, cudaStream_t stream);

// --- CUDA graph capture (capture_graph, graph.cpp) ----------------------------------------------

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

// The capture this thread runs, if any.
struct CaptureContext {
  cudaStream_t stream = nullptr;
  int device = -1;
  int64_t* error_flag = nullptr;  // the device's graph error flag (device address)
  std::shared_ptr<CaptureRecord> record;
  std::vector<DeferredFree> deferred;
  std::vector<AfterLaunch> after_launch;
};

// The capture this thread runs, or null (graph.cpp). The allocator gives such a capture's
// allocations graph memory and holds back the frees it cannot record.
CaptureContext* current_capture();

}  // namespace kiln::cuda::internal
