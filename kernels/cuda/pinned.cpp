// The pinned host memory cache behind Tensor::pin_memory and non-blocking device-to-host copies
// (internal::allocate_pinned, record_pinned_use: kernels/cuda/runtime.h).
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/storage.h"

namespace kiln::cuda::internal {
namespace {

// Blocks from cudaHostAlloc, rounded up to a power of two and kept after their tensor dies for
// the next request of that size. A block an asynchronous copy still uses (events recorded by
// record_pinned_use) is reused only once those events have completed.
class PinnedCache {
 public:
  Storage allocate(size_t nbytes) {
    require_device(0, "pin_memory");
    const size_t size = round(nbytes);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      collect_locked();
      auto it = free_.find(size);
      if (it != free_.end()) {
        p = it->second;
        free_.erase(it);
      }
    }
    if (p == nullptr) {
      cudaError_t err = cudaHostAlloc(&p, size, cudaHostAllocDefault);
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        release_free();
        err = cudaHostAlloc(&p, size, cudaHostAllocDefault);
      }
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        KILN_FAIL("[pin_memory] out of pinned host memory: tried to allocate ",
                  mib_text(static_cast<int64_t>(size)), "; ", mib_text(cached_bytes()), " pinned by kiln");
      }
      KILN_CUDA_CHECK(err);
      std::lock_guard<std::mutex> lock(mu_);
      sizes_[p] = size;
      total_ += static_cast<int64_t>(size);
    }
    auto storage =
        std::make_shared<StorageImpl>(p, nbytes, Device(kCPU), [this](void* q) { release(q); });
    storage->set_pinned(true);
    return storage;
  }

  void record_use(const void* ptr, cudaStream_t stream) {
    cudaEvent_t ev = nullptr;
    KILN_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    KILN_CUDA_CHECK(cudaEventRecord(ev, stream));
    std::lock_guard<std::mutex> lock(mu_);
    auto& events = uses_[const_cast<void*>(ptr)];
    prune(events);
    events.push_back(ev);
  }

  int64_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return total_;
  }

  // Frees the blocks no tensor and no queued copy uses.
  void release_free() {
    std::lock_guard<std::mutex> lock(mu_);
    collect_locked();
    for (auto& [size, p] : free_) {
      if (cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
      sizes_.erase(p);
      total_ -= static_cast<int64_t>(size);
    }
    free_.clear();
  }

 private:
  static size_t round(size_t n) {
    size_t size = 512;
    while (size < n) size <<= 1;
    return size;
  }

  // Drops the completed events of one block's list; true when none is left.
  static bool prune(std::vector<cudaEvent_t>& events) {
    size_t kept = 0;
    for (cudaEvent_t ev : events) {
      const cudaError_t q = cudaEventQuery(ev);
      if (q == cudaErrorNotReady) {
        events[kept++] = ev;
      } else {
        if (q != cudaSuccess) (void)cudaGetLastError();
        (void)cudaEventDestroy(ev);
      }
    }
    events.resize(kept);
    return kept == 0;
  }

  // Moves dead blocks whose copies are done to the free list.
  void collect_locked() {
    size_t kept = 0;
    for (void* p : dying_) {
      auto it = uses_.find(p);
      if (it == uses_.end() || prune(it->second)) {
        if (it != uses_.end()) uses_.erase(it);
        free_.emplace(sizes_[p], p);
      } else {
        dying_[kept++] = p;
      }
    }
    dying_.resize(kept);
  }

  // The deleter of a pinned storage: never throws.
  void release(void* p) {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = uses_.find(p);
      if (it != uses_.end() && !prune(it->second)) {
        dying_.push_back(p);
        return;
      }
      if (it != uses_.end()) uses_.erase(it);
      free_.emplace(sizes_[p], p);
    } catch (...) {
    }
  }

  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::unordered_map<void*, size_t> sizes_;  // every block, by address
  std::unordered_map<void*, std::vector<cudaEvent_t>> uses_;
  std::vector<void*> dying_;
  int64_t total_ = 0;
};

PinnedCache& pinned_cache() {
  static PinnedCache* cache = new PinnedCache();  // never destroyed, like the device states
  return *cache;
}

}  // namespace

Storage allocate_pinned(size_t nbytes) { return pinned_cache().allocate(nbytes); }

void record_pinned_use(const StorageImpl& storage, CUstream_st* stream) {
  pinned_cache().record_use(storage.data(), stream);
}

int64_t pinned_cached_bytes() { return pinned_cache().cached_bytes(); }

void empty_pinned_cache() { pinned_cache().release_free(); }

}  // namespace kiln::cuda::internal
