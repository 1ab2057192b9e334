#include "tensor/storage.h"

#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <new>

#include "tensor/error.h"

namespace kiln {

StorageImpl::StorageImpl(void* data, size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (deleter_) deleter_(data_);
}

namespace {

// The CPU cache's limit in MiB: KILN_CPU_CACHE_MB, an integer from 0 (no cache) to 2^24, or
// `fallback` when the variable is unset or empty.
size_t cpu_cache_limit_mb(size_t fallback) {
  const char* value = std::getenv("KILN_CPU_CACHE_MB");
  if (value == nullptr || *value == '\0') return fallback;
  constexpr size_t kMax = size_t{1} << 24;
  const char* end = value + std::strlen(value);
  size_t mb = 0;
  const auto [ptr, ec] = std::from_chars(value, end, mb);
  KILN_CHECK(ec == std::errc() && ptr == end && mb <= kMax,
             "[allocate] KILN_CPU_CACHE_MB must be an integer from 0 to ", kMax,
             " (unset or empty for the default), got '", value, "'");
  return mb;
}

// Large CPU blocks are cached after free and reused for requests of the same rounded size:
// glibc returns big blocks to the OS (munmap) and hands out fresh pages that fault on first
// touch, which costs more than the elementwise loops writing into them. The cache holds at
// most 1 GiB (KILN_CPU_CACHE_MB overrides); empty_cpu_cache() releases it.
class CpuAllocator final : public Allocator {
 public:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kCacheMin = size_t{1} << 20;  // below this malloc is cheap enough

  ~CpuAllocator() override { release_all(); }

  Storage allocate(size_t nbytes, Device device) override {
    max_cached();  // reads KILN_CPU_CACHE_MB at the first allocation: a bad value fails here
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
      if (cached_bytes_ + rounded <= max_cached()) {
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
  // The cache's limit in bytes. KILN_CPU_CACHE_MB is read once, at the first CPU allocation
  // (the allocator itself is built at load time, where an error could not be caught); while it
  // is malformed every allocation fails.
  static size_t max_cached() {
    static const size_t limit = cpu_cache_limit_mb(size_t{1} << 10) << 20;
    return limit;
  }

  static size_t round(size_t nbytes) {
    // Big blocks round to 64 KiB so that sizes that differ a little still share entries.
    const size_t unit = nbytes >= kCacheMin ? size_t{1} << 16 : kAlign;
    return (std::max<size_t>(nbytes, 1) + unit - 1) / unit * unit;
  }

  std::mutex mu_;
  std::multimap<size_t, void*> cache_;
  size_t cached_bytes_ = 0;
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
