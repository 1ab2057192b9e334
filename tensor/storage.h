// Storage: a refcounted block of memory on one device, shared by a tensor and its views.
//
// The storage also holds the version counter: in-place ops bump it so that autograd can tell
// that a tensor saved for backward was modified. Views share it through the storage.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

#include "tensor/device.h"

namespace kiln {

class StorageImpl {
 public:
  using Deleter = std::function<void(void*)>;

  // Takes ownership of `data` (freed by `deleter`; a null deleter leaves it to the caller).
  StorageImpl(void* data, size_t nbytes, Device device, Deleter deleter);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

  // Page-locked host memory (Tensor::pin_memory): copies to and from a GPU can be asynchronous.
  bool is_pinned() const { return pinned_; }
  void set_pinned(bool pinned) { pinned_ = pinned; }

  // A proxy (kiln::compile's tracer): a storage of `nbytes` on `device` that has no memory,
  // so that ops run on it for their shapes, dtypes and devices only (data() is null).
  bool is_proxy() const { return proxy_; }
  void set_proxy(bool proxy) { proxy_ = proxy; }
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

 private:
  void* data_;
  size_t nbytes_;
  Device device_;
  Deleter deleter_;
  bool pinned_ = false;
  bool proxy_ = false;
  std::atomic<uint64_t> version_{0};
};

using Storage = std::shared_ptr<StorageImpl>;

// Device allocators. A backend (CUDA) installs its allocator at load time.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Storage allocate(size_t nbytes, Device device) = 0;
};
void set_allocator(DeviceType type, Allocator* allocator);
Allocator* get_allocator(DeviceType type);

// Bytes of freed CPU blocks kept for reuse, and releasing them to the system.
size_t cpu_cached_bytes();
void empty_cpu_cache();

// Allocates `nbytes` on `device` (64-byte aligned on the CPU); fails if no backend is built.
Storage allocate_storage(size_t nbytes, Device device);
// A proxy storage (StorageImpl::is_proxy): no memory, any device, even one not built or present.
inline Storage proxy_storage(size_t nbytes, Device device) {
  auto s = std::make_shared<StorageImpl>(nullptr, nbytes, device, nullptr);
  s->set_proxy(true);
  return s;
}

}  // namespace kiln
