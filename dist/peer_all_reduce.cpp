#include "dist/peer_all_reduce.h"

#if KILN_WITH_NCCL
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "kernels/cuda.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/peer_reduce.h"
#include "kernels/cuda/stream_mem_ops.h"
#include "tensor/error.h"

namespace kiln::dist::internal {
namespace {

using Clock = std::chrono::steady_clock;

using cuda::internal::stream_mem_ops;

void check_cu(CUresult r, const char* what) {
  KILN_CHECK(r == CUDA_SUCCESS, "[all_reduce] ", what, " failed with CUDA driver error ",
             static_cast<int>(r));
}

// The events that end an all-reduce, shared by its Work and the watchdog.
struct DoneEvents {
  std::vector<cudaEvent_t> events;
  DoneEvents() = default;
  DoneEvents(const DoneEvents&) = delete;
  DoneEvents& operator=(const DoneEvents&) = delete;
  ~DoneEvents() {
    for (cudaEvent_t e : events) cudaEventDestroy(e);
  }
};

// What the queueing thread hands to the Work: the events that end the all-reduce (or the error
// that kept it from being queued). Holds the tensor until the caller's stream has been ordered
// after those events (its memory is freed in that stream's order); the watchdog keeps only the
// events, so that the tensor's memory goes when the Work does (a compiled step's gradients).
struct Queued {
  std::mutex mu;
  std::condition_variable cv;
  bool ready = false;
  std::shared_ptr<const DoneEvents> done = std::make_shared<DoneEvents>();
  std::exception_ptr error;
  Tensor tensor;

  void set(std::shared_ptr<const DoneEvents> events, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = std::move(events);
      error = std::move(e);
      ready = true;
    }
    cv.notify_all();
  }
  void wait_ready() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return ready; });
  }
};

class PeerWork final : public Work {
 public:
  PeerWork(PeerAllReduce* ar, std::shared_ptr<Queued> queued, int device)
      : Work("all_reduce"), ar_(ar), queued_(std::move(queued)), device_(device) {
    set_result({queued_->tensor});
  }
  ~PeerWork() override {
    try {
      // The tensor may be freed in the order of the current stream once this goes.
      if (!waited_) {
        queued_->wait_ready();
        current_wait();
      }
    } catch (...) {
    }
  }
  bool is_completed() override {
    {
      std::lock_guard<std::mutex> lock(queued_->mu);
      if (!queued_->ready) return false;
    }
    for (cudaEvent_t e : queued_->done->events) {
      if (cudaEventQuery(e) != cudaSuccess) return false;
    }
    return true;
  }
  bool wait(std::optional<Milliseconds> timeout) override {
    queued_->wait_ready();
    if (queued_->error) {
      finish(queued_->error);
      std::rethrow_exception(queued_->error);
    }
    if (timeout) {
      const auto deadline = Clock::now() + *timeout;
      while (!is_completed()) {
        if (Clock::now() > deadline) {
          ar_->release();
          KILN_FAIL("[all_reduce] the copy-engine all-reduce did not finish within ",
                    timeout->count(),
                    " ms (a rank died or issued a different collective); its streams were "
                    "released and the group fails from now on");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    current_wait();
    waited_ = true;
    finish();
    return true;
  }

 private:
  void current_wait() {
    cudaStream_t s = cuda::current_stream(device_);
    for (cudaEvent_t e : queued_->done->events) KILN_CUDA_CHECK(cudaStreamWaitEvent(s, e, 0));
  }
  PeerAllReduce* ar_;
  std::shared_ptr<Queued> queued_;
  int device_;
  bool waited_ = false;
};

cudaEvent_t record(cudaStream_t s) {
  cudaEvent_t e = nullptr;
  KILN_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  KILN_CUDA_CHECK(cudaEventRecord(e, s));
  return e;
}

}  // namespace

struct PeerAllReduce::Queue {
  struct Task {
    ReduceOp op;
    cudaEvent_t start;
    std::shared_ptr<Queued> queued;
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Task> tasks;
  bool stop = false;
  std::thread thread;
  // The watchdog: queued all-reduces not done yet, oldest first, with their deadlines.
  std::deque<std::pair<std::shared_ptr<const DoneEvents>, Clock::time_point>> running;
  std::condition_variable watchdog_cv;
  std::thread watchdog;
};

std::unique_ptr<PeerAllReduce> PeerAllReduce::create(std::shared_ptr<Store> store,
                                                     const std::string& key, int rank, int size,
                                                     int device, Milliseconds timeout,
                                                     const std::function<bool(bool)>& agree,
                                                     std::string* why) {
  auto say = [&](const std::string& reason) {
    if (why != nullptr) *why = reason;
  };
  if (size < 2 || size > kMaxRanks) {  // the same on every rank: no agreement needed
    say("needs 2 to " + std::to_string(kMaxRanks) + " ranks");
    return nullptr;
  }
  cuda::DeviceGuard guard(device);
  std::unique_ptr<PeerAllReduce> ar(new PeerAllReduce);
  ar->store_ = store;
  ar->key_ = key;
  ar->rank_ = rank;
  ar->size_ = size;
  ar->device_ = device;
  ar->entry_bytes_ = kSlotBytes / size / 256 * 256;
  ar->base_.assign(size, nullptr);
  ar->released_ = true;  // until every rank has agreed: nothing to wait for when destroyed

  // This rank's block and what the others need to know of it: host, PCI bus id, IPC handle.
  std::string reason;
  bool ok = stream_mem_ops().ok;
  if (!ok) reason = "the driver has no stream memory operations";
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char bus[64] = {};
  if (ok && cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) {
    cudaGetLastError();  // a failure here must not surface as a later launch's error
    ok = false;
    reason = "no PCI bus id for cuda:" + std::to_string(device);
  }
  cudaIpcMemHandle_t handle{};
  void* mine = nullptr;
  if (ok) {
    if (cudaMalloc(&mine, kFlagBytes + kSlots * kSlotBytes) != cudaSuccess ||
        cudaMemset(mine, 0, kFlagBytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
        cudaIpcGetMemHandle(&handle, mine) != cudaSuccess) {
      cudaGetLastError();
      ok = false;
      reason = "could not allocate or export " +
               std::to_string((kFlagBytes + kSlots * kSlotBytes) >> 20) + " MiB of staging memory";
    }
  }
  ar->base_[rank] = static_cast<char*>(mine);
  std::vector<uint8_t> msg(1 + sizeof(host) + sizeof(bus) + sizeof(handle), 0);
  msg[0] = ok ? 1 : 0;
  std::memcpy(msg.data() + 1, host, sizeof(host));
  std::memcpy(msg.data() + 1 + sizeof(host), bus, sizeof(bus));
  std::memcpy(msg.data() + 1 + sizeof(host) + sizeof(bus), &handle, sizeof(handle));
  store->set(key + "/" + std::to_string(rank), msg);
  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    const std::vector<uint8_t> got = store->get(key + "/" + std::to_string(q));
    if (!ok) continue;
    if (got.size() != msg.size() || got[0] != 1) {
      ok = false;
      reason = "rank " + std::to_string(q) + " has no staging memory";
      continue;
    }
    if (std::memcmp(got.data() + 1, host, sizeof(host)) != 0) {
      ok = false;
      reason = "rank " + std::to_string(q) + " is on another host";
      continue;
    }
    char peer_bus[64];
    std::memcpy(peer_bus, got.data() + 1 + sizeof(host), sizeof(peer_bus));
    peer_bus[sizeof(peer_bus) - 1] = 0;
    int peer_device = -1, can = 0;
    if (cudaDeviceGetByPCIBusId(&peer_device, peer_bus) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can, device, peer_device) != cudaSuccess || can == 0) {
      cudaGetLastError();
      ok = false;
      reason = "cuda:" + std::to_string(device) + " cannot access rank " + std::to_string(q) +
               "'s GPU (" + peer_bus + ")";
      continue;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, got.data() + 1 + sizeof(host) + sizeof(bus), sizeof(h));
    void* p = nullptr;
    if (cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess) {
      cudaGetLastError();
      ok = false;
      reason = "CUDA IPC could not map rank " + std::to_string(q) + "'s memory";
      continue;
    }
    ar->base_[q] = static_cast<char*>(p);
  }
  if (ok) {
    ar->push_.assign(size, nullptr);
    ar->pull_.assign(size, nullptr);
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      ok = ok && cudaStreamCreateWithFlags(&ar->push_[q], cudaStreamNonBlocking) == cudaSuccess &&
           cudaStreamCreateWithFlags(&ar->pull_[q], cudaStreamNonBlocking) == cudaSuccess;
    }
    ok = ok && cudaStreamCreateWithFlags(&ar->reduce_, cudaStreamNonBlocking) == cudaSuccess &&
         cudaStreamCreateWithFlags(&ar->rescue_, cudaStreamNonBlocking) == cudaSuccess;
    if (!ok) {
      cudaGetLastError();
      reason = "could not create streams";
    }
  }
  if (!agree(ok)) {
    say(ok ? "another rank cannot take part" : reason);
    return nullptr;
  }
  ar->released_ = false;
  ar->queue_ = std::make_unique<Queue>();
  ar->queue_->thread = std::thread([a = ar.get(), timeout] {
    Queue& q = *a->queue_;
    cudaSetDevice(a->device_);
    std::unique_lock<std::mutex> lock(q.mu);
    while (true) {
      q.cv.wait(lock, [&q] { return q.stop || !q.tasks.empty(); });
      if (q.tasks.empty()) return;  // stopped, and every task queued
      Queue::Task task = std::move(q.tasks.front());
      q.tasks.pop_front();
      lock.unlock();
      auto done = std::make_shared<DoneEvents>();
      std::exception_ptr error;
      try {
        done->events = a->enqueue(task.queued->tensor, task.op, task.start);
      } catch (...) {
        error = std::current_exception();
        a->release();  // partly queued: let this rank's waits go
      }
      cudaEventDestroy(task.start);
      task.queued->set(done, std::move(error));
      task = {};  // the tensor goes with the Work alone
      lock.lock();
      if (!error) q.running.emplace_back(std::move(done), Clock::now() + timeout);
    }
  });
  // The watchdog, a thread of its own (the queueing thread may block in a CUDA call once its
  // streams' queues are full behind a wait that never ends): an all-reduce still running after
  // the timeout (a rank died, or the ranks issued different collectives) releases this rank's
  // streams, which would otherwise wait for the peers' flags forever; the group fails its later
  // calls.
  ar->queue_->watchdog = std::thread([a = ar.get(), timeout] {
    Queue& q = *a->queue_;
    cudaSetDevice(a->device_);
    std::unique_lock<std::mutex> lock(q.mu);
    while (!q.stop) {
      q.watchdog_cv.wait_for(lock, std::chrono::milliseconds(50), [&q] { return q.stop; });
      while (!q.running.empty()) {
        const auto& [events, deadline] = q.running.front();
        bool done = true;
        // An error (the runtime unloading at exit) counts as done: nothing is left to wait for.
        for (cudaEvent_t e : events->events) done = done && cudaEventQuery(e) != cudaErrorNotReady;
        if (done) {
          q.running.pop_front();
          continue;
        }
        if (a->released_) {
          a->release();  // again, until every released wait has gone
        } else if (Clock::now() > deadline) {
          std::fprintf(stderr,
                       "[all_reduce] rank %d: a copy-engine all-reduce did not finish within "
                       "%lld ms (a rank died or issued a different collective); releasing its "
                       "streams, the group fails from now on\n",
                       a->rank_, static_cast<long long>(timeout.count()));
          a->release();
        }
        break;
      }
    }
  });
  return ar;
}

PeerAllReduce::~PeerAllReduce() {
  if (queue_ != nullptr) {
    {
      std::lock_guard<std::mutex> lock(queue_->mu);
      queue_->stop = true;
    }
    queue_->cv.notify_all();
    queue_->watchdog_cv.notify_all();
    queue_->thread.join();
    queue_->watchdog.join();
  }
  try {
    cuda::DeviceGuard guard(device_);
    if (!released_) {
      for (cudaStream_t s : push_) {
        if (s != nullptr) cudaStreamSynchronize(s);
      }
      for (cudaStream_t s : pull_) {
        if (s != nullptr) cudaStreamSynchronize(s);
      }
      if (reduce_ != nullptr) cudaStreamSynchronize(reduce_);
      // The others may still read this rank's block (their last pulls) or write its flags:
      // free it once every rank is done, or after a while when one is gone.
      if (store_ != nullptr) {
        store_->set(key_ + "/closed/" + std::to_string(rank_), std::string("1"));
        std::vector<std::string> keys;
        for (int q = 0; q < size_; ++q) keys.push_back(key_ + "/closed/" + std::to_string(q));
        store_->wait(keys, Milliseconds(30000));
      }
    }
  } catch (...) {
  }
  for (int q = 0; q < size_; ++q) {
    if (q != rank_ && base_[q] != nullptr) cudaIpcCloseMemHandle(base_[q]);
  }
  if (!base_.empty() && base_[rank_] != nullptr) cudaFree(base_[rank_]);
  for (cudaStream_t s : push_) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  for (cudaStream_t s : pull_) {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  if (reduce_ != nullptr) cudaStreamDestroy(reduce_);
  if (rescue_ != nullptr) cudaStreamDestroy(rescue_);
  cudaGetLastError();
}

bool PeerAllReduce::takes(const Tensor& t, ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) return false;
  const ScalarType d = t.dtype();
  if (d != kFloat && d != kDouble && d != kBFloat16 && d != kHalf) return false;
  if (!t.is_contiguous() || static_cast<int64_t>(t.nbytes()) < kMinBytes) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(cuda::current_stream(t.device().index()), &status) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return status == cudaStreamCaptureStatusNone;
}

uint64_t PeerAllReduce::flag(int owner, Flag f, int s, int q) const {
  const int64_t index = (static_cast<int64_t>(f) * kSlots + s) * kMaxRanks + q;
  return reinterpret_cast<uint64_t>(base_[owner] + index * sizeof(uint32_t));
}

char* PeerAllReduce::slot_entry(int owner, int s, int q) const {
  return base_[owner] + kFlagBytes + s * kSlotBytes + q * entry_bytes_;
}

void PeerAllReduce::wait_flag(CUstream_st* stream, int s, Flag f, int q, uint32_t value) const {
  check_cu(stream_mem_ops().wait(stream, flag(rank_, f, s, q), value, CU_STREAM_WAIT_VALUE_GEQ),
           "cuStreamWaitValue32");
}

void PeerAllReduce::write_flag(CUstream_st* stream, int owner, Flag f, int s, int q,
                               uint32_t value) const {
  check_cu(
      stream_mem_ops().write(stream, flag(owner, f, s, q), value, CU_STREAM_WRITE_VALUE_DEFAULT),
      "cuStreamWriteValue32");
}

std::shared_ptr<Work> PeerAllReduce::run(Tensor& t, ReduceOp op) {
  KILN_CHECK(!released_, "[all_reduce] rank ", rank_,
             ": the copy-engine all-reduce was released after an earlier timeout");
  cuda::DeviceGuard guard(device_);
  auto queued = std::make_shared<Queued>();
  queued->tensor = t;
  cudaEvent_t start = record(cuda::current_stream(device_));
  {
    std::lock_guard<std::mutex> lock(queue_->mu);
    queue_->tasks.push_back({op, start, queued});
  }
  queue_->cv.notify_one();
  return std::make_shared<PeerWork>(this, std::move(queued), device_);
}

std::vector<cudaEvent_t> PeerAllReduce::enqueue(const Tensor& t, ReduceOp op, cudaEvent_t start) {
  const int r = rank_, w = size_;
  for (int q = 0; q < w; ++q) {
    if (q != r) KILN_CUDA_CHECK(cudaStreamWaitEvent(push_[q], start, 0));
  }
  KILN_CUDA_CHECK(cudaStreamWaitEvent(reduce_, start, 0));

  const int64_t n = t.numel();
  const auto elem = static_cast<int64_t>(t.element_size());
  const int64_t align = 16 / elem;
  const int64_t piece = entry_bytes_ / elem * w;
  const double scale = op == ReduceOp::kAvg ? 1.0 / w : 1.0;
  char* data = static_cast<char*>(t.data_ptr());
  for (int64_t o = 0; o < n; o += piece) {
    const int64_t m = std::min(piece, n - o);
    const int64_t c = ((m + w - 1) / w + align - 1) / align * align;
    const uint64_t g = next_piece_++;
    const int s = static_cast<int>(g % kSlots);
    const auto k = static_cast<uint32_t>(g / kSlots + 1);
    auto begin = [&](int q) { return std::min<int64_t>(q * c, m); };
    auto len = [&](int q) { return std::min<int64_t>((q + 1) * c, m) - begin(q); };
    auto chunk = [&](int q) { return data + (o + begin(q)) * elem; };
    // 1. push chunk q to rank q, once rank q has reduced this slot's previous piece.
    for (int q = 0; q < w; ++q) {
      if (q == r) continue;
      if (k > 1) wait_flag(push_[q], s, kOutReady, q, k - 1);
      if (len(q) > 0) {
        KILN_CUDA_CHECK(cudaMemcpyAsync(slot_entry(q, s, r), chunk(q), len(q) * elem,
                                        cudaMemcpyDeviceToDevice, push_[q]));
      }
      write_flag(push_[q], q, kArrive, s, r, k);
    }
    // 2. reduce chunk r, once every peer has pushed it and pulled this slot's previous result.
    const void* inputs[kMaxRanks];
    for (int q = 0; q < w; ++q) {
      inputs[q] = q == r ? static_cast<const void*>(chunk(r)) : slot_entry(r, s, q);
      if (q == r) continue;
      wait_flag(reduce_, s, kArrive, q, k);
      if (k > 1) wait_flag(reduce_, s, kPulled, q, k - 1);
    }
    cuda::internal::peer_sum(t.dtype(), inputs, w, slot_entry(r, s, r), chunk(r), len(r), scale,
                             reduce_);
    for (int q = 0; q < w; ++q) {
      if (q != r) write_flag(reduce_, q, kOutReady, s, r, k);
    }
    // 3. pull the reduced chunk q from rank q.
    for (int q = 0; q < w; ++q) {
      if (q == r) continue;
      wait_flag(pull_[q], s, kOutReady, q, k);
      if (len(q) > 0) {
        KILN_CUDA_CHECK(cudaMemcpyAsync(chunk(q), slot_entry(q, s, q), len(q) * elem,
                                        cudaMemcpyDeviceToDevice, pull_[q]));
      }
      write_flag(pull_[q], q, kPulled, s, r, k);
    }
  }
  std::vector<cudaEvent_t> done{record(reduce_)};
  for (int q = 0; q < w; ++q) {
    if (q != r) done.push_back(record(pull_[q]));
  }
  return done;
}

void PeerAllReduce::release() noexcept {
  released_ = true;
  // Every flag far past any value waited for: (int32)(flag - value) >= 0 holds for them all. (A
  // peer's late write may lower one again: the watchdog repeats this while work is pending.)
  const auto past = static_cast<uint32_t>(next_piece_ / kSlots + (1u << 20));
  try {
    std::vector<uint32_t> flags(kNumFlags * kSlots * kMaxRanks, past);
    cuda::DeviceGuard guard(device_);
    if (cudaMemcpyAsync(base_[rank_], flags.data(), flags.size() * sizeof(uint32_t),
                        cudaMemcpyHostToDevice, rescue_) == cudaSuccess) {
      cudaStreamSynchronize(rescue_);
    }
  } catch (...) {  // the runtime is gone (the process is ending): nothing left to release
  }
  cudaGetLastError();
}

}  // namespace kiln::dist::internal

#endif  // KILN_WITH_NCCL
