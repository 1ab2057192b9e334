// kiln::dist::internal::PeerAllReduce: ProcessGroupNCCL's all_reduce_beside_compute of large
// floating-point tensors when every rank's GPU is on one host and reaches the others' memory
// (NVLink or PCIe peer access). The data moves with the GPUs' copy engines, not with kernels, so
// that an all-reduce overlapping a backward leaves the SMs to the backward's matrix products:
// NCCL's ring kernels take 24 of an H100's 132 SMs while they run, which made llama-3.2-1b's
// GEMMs 12% slower under DDP (benchmarks/RESULTS.md, session 22).
//
// How, for a tensor cut into pieces that fit a slot of the staging memory, each piece into one
// chunk per rank:
//   1. push: every rank copies chunk q of its tensor into rank q's staging (cudaMemcpyAsync to
//      the peer's memory, mapped through CUDA IPC), one stream per peer;
//   2. reduce: rank q sums the chunks it received and its own (peer_sum: f32 accumulation in
//      rank order, one rounding), writing chunk q of its tensor and of its staging;
//   3. pull: every rank copies the reduced chunk q from rank q's staging into its tensor.
// The ranks signal each other with 32-bit flags in the staging memory, written by
// cuStreamWriteValue32 into the peer's memory after a copy and waited for by
// cuStreamWaitValue32, so no step blocks the host. Each flag counts the uses of its slot; a slot
// is reused only after every rank has reduced and pulled its previous piece. A thread of its own
// queues those operations (about 25 CUDA calls a piece), so that the caller's thread, busy
// launching the backward, only records an event; another, the watchdog, releases the streams of
// an all-reduce not done within the group's timeout (release()).
//
// Memory: one block of kSlots x kSlotBytes (256 MiB) per rank, from cudaMalloc (CUDA IPC cannot
// share the stream-ordered pool's memory), outside kiln's memory statistics.
//
// create() is collective: every rank calls it at the same point. It returns null on every rank
// when any rank cannot take part (another host, no peer access, IPC unavailable), and the group
// keeps NCCL's all-reduce. On its own this is slower than NCCL's ring (about 150 against 350
// GB/s of bus bandwidth on 4 H200s): it pays only beside compute.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dist/process_group.h"

struct CUstream_st;
struct CUevent_st;

namespace kiln::dist::internal {

class PeerAllReduce {
 public:
  static constexpr int kSlots = 8;
  static constexpr int64_t kSlotBytes = int64_t{32} << 20;
  // Smaller all-reduces stay with NCCL, whose latency is lower.
  static constexpr int64_t kMinBytes = int64_t{4} << 20;
  static constexpr int kMaxRanks = 8;

  // `agree(ok)` must return whether `ok` holds on every rank (a collective over the group).
  // `why` gets the reason when the result is null. An all-reduce not done within `timeout`
  // releases the streams (release()).
  static std::unique_ptr<PeerAllReduce> create(std::shared_ptr<Store> store, const std::string& key,
                                               int rank, int size, int device, Milliseconds timeout,
                                               const std::function<bool(bool)>& agree,
                                               std::string* why);
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  // Whether run() takes `t` with `op` (a rank-independent rule: the same on every rank for the
  // same call): kSum or kAvg, f32, f64, bf16 or f16, at least kMinBytes, contiguous, and not
  // while the current stream is being captured into a CUDA graph (the flags' values are fixed
  // when queued; a graph's all-reduces start after each launch instead:
  // cuda::internal::defer_to_each_launch).
  static bool takes(const Tensor& t, ReduceOp op);
  // t = op over the ranks' t, queued after the current stream's work; the Work's wait() makes
  // the current stream wait for it (wait(timeout) blocks the host, and calls release() when the
  // time is up).
  std::shared_ptr<Work> run(Tensor& t, ReduceOp op);
  // Lets every wait of this rank's streams go (their results are then garbage): after a timeout,
  // so that the streams do not hang forever. The group fails its later calls.
  void release() noexcept;

 private:
  PeerAllReduce() = default;
  struct Queue;  // the queueing thread and its tasks
  // Queues the all-reduce of t after `start` (on the queueing thread); returns the events that
  // end it.
  std::vector<CUevent_st*> enqueue(const Tensor& t, ReduceOp op, CUevent_st* start);
  // Flag arrays in every rank's block: [kSlots][kMaxRanks] uint32 each.
  enum Flag { kArrive = 0, kOutReady = 1, kPulled = 2, kNumFlags = 3 };
  static constexpr int64_t kFlagBytes = 64 << 10;  // the flags' region, before the slots
  // Address of flag f, slot s, rank index q in rank `owner`'s block (as mapped here).
  uint64_t flag(int owner, Flag f, int s, int q) const;
  char* slot_entry(int owner, int s, int q) const;
  void wait_flag(CUstream_st* stream, int s, Flag f, int q, uint32_t value) const;
  void write_flag(CUstream_st* stream, int owner, Flag f, int s, int q, uint32_t value) const;

  std::shared_ptr<Store> store_;
  std::string key_;
  int rank_ = 0;
  int size_ = 1;
  int device_ = 0;
  int64_t entry_bytes_ = 0;         // one rank's chunk in a slot
  std::vector<char*> base_;         // each rank's block as mapped here (base_[rank_]: own)
  std::vector<CUstream_st*> push_;  // per peer
  std::vector<CUstream_st*> pull_;  // per peer
  CUstream_st* reduce_ = nullptr;
  CUstream_st* rescue_ = nullptr;  // release()'s writes
  std::atomic<uint64_t> next_piece_{0};
  std::atomic<bool> released_{false};
  std::unique_ptr<Queue> queue_;
};

}  // namespace kiln::dist::internal
