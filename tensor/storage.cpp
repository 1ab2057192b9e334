#include "tensor/storage.h"

#include <array>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "tensor/env_switch.h"
#include "tensor/error.h"

namespace kiln {

StorageImpl::StorageImpl(void* data, size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (deleter_) deleter_(data_);
}

namespace {

// Large CPU blocks are cached after free and reused for requests of the same rounded size:
// glibc returns big blocks to the OS (munmap) and hands out fresh pages that fault on first
// touch, which costs more than the elementwise loops writing into them. The cache holds at
// most kMaxCachedBytes (KILN_CPU_CACHE_MB overrides); empty_cpu_cache() releases it.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kCacheMin = size_t{1} << 20;  // below this malloc is cheap enough

  // KILN_CPU_CACHE_MB is read once, when the first CPU block is allocated.
  CpuAllocator() {
    const internal::EnvInt cache_mb("KILN_CPU_CACHE_MB", static_cast<int64_t>(max_cached_ >> 20), 0,
                                    int64_t{1} << 24);
    max_cached_ = static_cast<size_t>(cache_mb.get()) << 20;
  }
  ~CpuAllocator() override { release_all(); }

  Storage allocate(size_t nbytes, Device device) override {
    const size_t rounded = round(nbytes);
    void* p = nullptr;
    if (rounded >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = cache_.find(rounded);
      if (it != cache_.end()) {
        p = it->second;
        cache_.erase(it);
        cached_bytes_ -= rounded;
      }
    }
    if (p == nullptr) p = std::aligned_alloc(kAlign, rounded);
    KILN_CHECK(p != nullptr, "[allocate] out of CPU memory: failed to allocate ", nbytes, " bytes");
    return std::make_shared<StorageImpl>(p, nbytes, device,
                                         [this, rounded](void* q) { release(q, rounded); });
  }

  void release(void* p, size_t rounded) {
    if (rounded >= kCacheMin) {
      std::lock_guard<std::mutex> lock(mu_);
      if (cached_bytes_ + rounded <= max_cached_) {
        cache_.emplace(rounded, p);
        cached_bytes_ += rounded;
        return;
      }
    }
    std::free(p);
  }

  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [size, p] : cache_) std::free(p);
    cache_.clear();
    cached_bytes_ = 0;
  }

  size_t cached_bytes() {
    std::lock_guard<std::mutex> lock(mu_);
    return cached_bytes_;
  }

 private:
  static size_t round(size_t nbytes) {
    // Big blocks round to 64 KiB so that sizes that differ a little still share entries.
    const size_t unit = nbytes >= kCacheMin ? size_t{1} << 16 : kAlign;
    return (std::max<size_t>(nbytes, 1) + unit - 1) / unit * unit;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> cache_;
  size_t cached_bytes_ = 0;
  size_t max_cached_ = size_t{1} << 30;
};

CpuAllocator& cpu_allocator() {
  // Never destroyed: storages freed during static destruction still find it.
  static CpuAllocator* a = new CpuAllocator();
  return *a;
}

class MetaAllocator final : public Allocator {
 public:
  Storage allocate(size_t nbytes, Device device) override {
    return std::make_shared<StorageImpl>(nullptr, nbytes, device, nullptr);
  }
};

std::array<Allocator*, kNumDeviceTypes>& allocators() {
  static MetaAllocator meta;
  static std::array<Allocator*, kNumDeviceTypes> table = {&cpu_allocator(), nullptr, &meta};
  return table;
}

}  // namespace

void set_allocator(DeviceType type, Allocator* allocator) {
  allocators()[static_cast<int>(type)] = allocator;
}

Allocator* get_allocator(DeviceType type) { return allocators()[static_cast<int>(type)]; }

size_t cpu_cached_bytes() { return cpu_allocator().cached_bytes(); }
void empty_cpu_cache() { cpu_allocator().release_all(); }

Storage allocate_storage(size_t nbytes, Device device) {
  Allocator* a = get_allocator(device.type());
  KILN_CHECK(a != nullptr, "[allocate] no allocator for device ", device.str(),
             " (was kiln built with CUDA, and is a GPU present?)");
  return a->allocate(nbytes, device);
}

}  // namespace kiln
