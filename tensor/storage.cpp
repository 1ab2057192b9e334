#include "tensor/storage.h"

#include <array>
#include <cstdlib>
#include <new>

#include "tensor/error.h"

namespace kiln {

StorageImpl::StorageImpl(void* data, size_t nbytes, Device device, Deleter deleter)
    : data_(data), nbytes_(nbytes), device_(device), deleter_(std::move(deleter)) {}

StorageImpl::~StorageImpl() {
  if (deleter_) deleter_(data_);
}

namespace {

class CpuAllocator final : public Allocator {
 public:
  Storage allocate(size_t nbytes, Device device) override {
    constexpr size_t kAlign = 64;
    const size_t rounded = (std::max<size_t>(nbytes, 1) + kAlign - 1) / kAlign * kAlign;
    void* p = std::aligned_alloc(kAlign, rounded);
    KILN_CHECK(p != nullptr, "[allocate] out of CPU memory: failed to allocate ", nbytes, " bytes");
    return std::make_shared<StorageImpl>(p, nbytes, device, [](void* q) { std::free(q); });
  }
};

class MetaAllocator final : public Allocator {
 public:
  Storage allocate(size_t nbytes, Device device) override {
    return std::make_shared<StorageImpl>(nullptr, nbytes, device, nullptr);
  }
};

std::array<Allocator*, kNumDeviceTypes>& allocators() {
  static CpuAllocator cpu;
  static MetaAllocator meta;
  static std::array<Allocator*, kNumDeviceTypes> table = {&cpu, nullptr, &meta};
  return table;
}

}  // namespace

void set_allocator(DeviceType type, Allocator* allocator) {
  allocators()[static_cast<int>(type)] = allocator;
}

Allocator* get_allocator(DeviceType type) { return allocators()[static_cast<int>(type)]; }

Storage allocate_storage(size_t nbytes, Device device) {
  Allocator* a = get_allocator(device.type());
  KILN_CHECK(a != nullptr, "[allocate] no allocator for device ", device.str(),
             " (was kiln built with CUDA, and is a GPU present?)");
  return a->allocate(nbytes, device);
}

}  // namespace kiln
