// The internal part of the CUDA runtime (kernels/cuda/runtime.cpp, graph.cpp), for kernels/ and
// the tensor code that moves data: the pinned host memory cache behind Tensor::pin_memory and
// non-blocking copies. The public API (devices, memory statistics, streams, events, the runtime
// knobs) is kernels/cuda.h, which this header includes; users include that one.
//
//   kiln::Storage block = kiln::cuda::internal::allocate_pinned(nbytes);
//   ... cudaMemcpyAsync(dst, block->data(), nbytes, cudaMemcpyHostToDevice, stream) ...
//   kiln::cuda::internal::record_pinned_use(*block, stream);  // not reused before the copy
//
// Like kernels/cuda.h it includes no CUDA header and compiles in every build
// (kernels/cpu/cuda_unavailable.cpp is the CPU-only stand-in).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda.h"
#include "tensor/storage.h"

namespace kiln::cuda {

namespace internal {
// Fails with "[op] no CUDA device ..." or "[op] cuda:N does not exist ..." for a bad index.
void require_device(int index, const char* op);
// "12.50 MiB", as the runtime's messages print sizes.
std::string mib_text(int64_t bytes);

// A block of page-locked host memory (from a cache, cudaHostAlloc on a miss), for
// Tensor::pin_memory and non-blocking device-to-host copies.
Storage allocate_pinned(size_t nbytes);
// Notes that an asynchronous copy queued on `stream` reads or writes the pinned `storage`: its
// block is not reused before that work is done, even after the tensor dies.
void record_pinned_use(const StorageImpl& storage, CUstream_st* stream);
// Bytes of pinned memory held by the cache (in use or free), and freeing the unused blocks.
int64_t pinned_cached_bytes();
void empty_pinned_cache();

// --- CUDA graphs (kiln::compile's, compiler/cuda_graph.h) ------------------------------------
//
//   std::shared_ptr<CapturedGraph> g = capture_graph(device, [&] {
//     ...queue kernels...
//     return kept;  // the storages (graph allocations) that outlive the capture
//   });
//   g->launch();   // replays them on the current stream, as often as wanted
//
// capture_graph runs `fn` with a capture stream of `device` (a non-blocking stream kept for
// captures) as this thread's current stream, in thread-local capture mode (other threads, such
// as NVRTC's compile threads, are not disturbed), and instantiates what it queued. Allocations
// this thread makes on the capture stream meanwhile become the graph's memory (cudaMallocAsync
// under capture makes allocation nodes: fixed addresses on every replay, backed at the first
// launch and kept until empty_cache()); they are not counted in MemoryStats::allocated, and
// their frees during `fn` become free nodes. The storages `fn` returns may outlive the capture:
// each launch backs their allocations anew, at the same addresses, and they stay until the
// graph's next launch frees them (cudaGraphInstantiateFlagAutoFreeOnLaunch: a later launch
// overwrites what a storage still holding one reads). While the graph lives it owns them; when
// it is destroyed it frees those no storage holds, and the last storage holding one frees it.
// Every other tensor allocated during `fn` must be freed before it returns: one that outlives
// the capture makes it fail. Frees of ordinary pool memory made by this thread meanwhile (a
// capture cannot record them) are held back and queued after the first launch.
//
// When `fn` throws, the capture is invalidated (an op synchronised with the host, or made an
// unsafe call) or a tensor outlives it, the capture is ended and discarded, the stream is
// usable again and kiln::Error says why; nothing `fn` queued has run.
class CapturedGraph {
 public:
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  // Launches the graph on the current stream of its device (one cudaGraphLaunch); afterwards the
  // device's graph memory counts towards MemoryStats::peak.
  void launch();
  int device() const { return device_; }
  // Bytes the graph's allocation nodes asked for during the capture (before reuse).
  int64_t allocated_bytes() const { return allocated_bytes_; }

  struct Impl;  // the CUDA handles (graph.cpp)

 private:
  friend std::shared_ptr<CapturedGraph> capture_graph(
      int device, const std::function<std::vector<Storage>()>& fn);
  CapturedGraph() = default;
  std::unique_ptr<Impl> impl_;
  int device_ = -1;
  int64_t allocated_bytes_ = 0;
};
std::shared_ptr<CapturedGraph> capture_graph(int device,
                                             const std::function<std::vector<Storage>()>& fn);

// Returns the device's graph memory that no CUDA graph holds to the driver (after waiting for the
// device), and leaves kiln's pool as it is: what a dropped graph kept (its last launch's outputs,
// once freed) goes, while the pool keeps the memory the next run op by op takes again (empty_cache
// trims both, and the run after it grows the pool anew).
void trim_graph_memory(int device);

// Kernels that check their arguments on the device (an index out of range) raise an error flag
// that the host reads after waiting for the kernel (loops.cuh's ErrorFlag). A capture cannot
// wait, and a compiled program run op by op should not: each wait leaves the GPU idle while the
// host queues what follows (an embedding's check: about 0.2 ms of each llama-160m DDP step run
// op by op; benchmarks/RESULTS.md, session 32). While this thread captures a graph, or runs
// under a DeferredChecksScope for `device`, this is the device address of the device's deferred
// error flag ([set, value], in mapped pinned memory) that such kernels raise instead; null
// otherwise. The flag is checked before every launch of a graph and when a DeferredChecksScope
// for the device begins, so a bad argument is reported by the next run: "[cuda] a kernel of an
// earlier compiled run ... (value V ...)".
int64_t* deferred_error_flag(int device);

// While one lives on this thread, ErrorFlag's checks of kernels on `device` are deferred
// (deferred_error_flag): a compiled program's op-by-op steps (compiler/program.cpp). Begins by
// reporting (kiln::Error) a bad argument that an earlier deferred or graphed run left in the flag.
class DeferredChecksScope {
 public:
  explicit DeferredChecksScope(int device);
  ~DeferredChecksScope();
  DeferredChecksScope(const DeferredChecksScope&) = delete;
  DeferredChecksScope& operator=(const DeferredChecksScope&) = delete;

 private:
  int previous_;
};

// Whether this thread is capturing a graph (inside capture_graph's `fn`).
bool capturing_graph();

// While a TrustedIndicesScope lives on this thread, index_add's CUDA kernel does not wait for the
// device to read its out-of-range flag: the caller vouches for the indices (embedding's backward
// adds the rows at the ids its forward checked). The wait is a host-device synchronisation
// in the middle of a training step, after which the GPU idles while the host queues what follows
// (about 1.3 ms of a llama-3.2-1b eager step went so). Kernels still record a bad index; it is
// not reported.
inline thread_local bool indices_trusted = false;
class TrustedIndicesScope {
 public:
  TrustedIndicesScope() : previous_(indices_trusted) { indices_trusted = true; }
  ~TrustedIndicesScope() { indices_trusted = previous_; }
  TrustedIndicesScope(const TrustedIndicesScope&) = delete;
  TrustedIndicesScope& operator=(const TrustedIndicesScope&) = delete;

 private:
  bool previous_;
};

// Work that a graph cannot hold, started by the host after each launch of the graph being
// captured on this thread (capture_graph's `fn`): returns false, and does nothing, when the thread
// is not capturing. Otherwise the capture marks where the current stream stands: a one-thread
// kernel that counts the launches in a flag word (or, where the driver has no stream memory
// operations or the device's 4096 flags are taken, an external event record node, which costs the
// graph a bubble of about 30 us). After every launch of the graph, including its first, `start`
// runs on the launching thread with a stream of the device kept for it as the current stream,
// made to wait for that launch's mark (cuStreamWaitValue32 until the count reaches the launch's):
// what `start` queues runs after the graph's work before this call, beside the rest of the graph,
// and nothing in the graph waits for it. Whatever reads its results waits outside the graph (a
// later graph's launch follows a wait on the host's side). compiled DDP's all-reduces go this way
// (dist/collective_ops.cpp): the copy-engine all-reduce counts its slots' uses in flags, values a
// graph would freeze, and a wait inside a graph for work queued outside it never completes
// (benchmarks/RESULTS.md, session 29). An exception from `start` propagates out of
// CapturedGraph::launch; the parts after it are not started for that launch.
bool defer_to_each_launch(std::function<void()> start);

// Random ops in a CUDA graph (kernels/random_fn.h, stream_of): while a GraphRngScope lives on
// this thread, the CUDA random kernels it launches read their Philox offset as
// `*word + (offset - base)`: `base` is the offset the capture's run reserved, and the caller
// writes each replay's base into `word` (device memory outside the graph) before the launch,
// with write_device_word.
struct GraphRng {
  const uint64_t* word = nullptr;
  uint64_t base = 0;
};
const GraphRng* capture_rng();
class GraphRngScope {
 public:
  explicit GraphRngScope(const GraphRng* rng);
  ~GraphRngScope();
  GraphRngScope(const GraphRngScope&) = delete;
  GraphRngScope& operator=(const GraphRngScope&) = delete;

 private:
  const GraphRng* previous_;
};
// Queues `*word = value` (`word` on cuda:`device`) on that device's current stream (a one-thread
// kernel: the value travels as its argument, nothing on the host must outlive the call).
void write_device_word(int device, uint64_t* word, uint64_t value);
// Queues `*word += value` the same way (defer_to_each_launch's marks count the launches).
void add_device_word(int device, uint64_t* word, uint64_t value);
}  // namespace internal

}  // namespace kiln::cuda
