// TensorImpl: what a Tensor handle points to: a storage, and how to read it (sizes, strides,
// storage offset, dtype). Views are TensorImpls that share one storage. Users see Tensor;
// TensorImpl is for kernels and the runtime.
#pragma once

#include <cstdint>
#include <memory>

#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/shape.h"
#include "tensor/storage.h"

namespace kiln {

namespace autograd {
struct AutogradMeta;  // defined by autograd/; tensor/ only carries the pointer
}  // namespace autograd

class TensorImpl {
 public:
  TensorImpl(Storage storage, Shape sizes, Shape strides, int64_t storage_offset, ScalarType dtype);

  const Shape& sizes() const { return sizes_; }
  const Shape& strides() const { return strides_; }
  int64_t storage_offset() const { return storage_offset_; }
  ScalarType dtype() const { return dtype_; }
  Device device() const { return storage_->device(); }
  int64_t dim() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t numel() const { return numel_; }
  bool is_contiguous() const { return is_contiguous_; }
  const Storage& storage() const { return storage_; }

  // Address of element 0 (null for meta tensors).
  void* data() const {
    return storage_->data() == nullptr
               ? nullptr
               : static_cast<char*>(storage_->data()) + storage_offset_ * element_size(dtype_);
  }

  uint64_t version() const { return storage_->version(); }
  void bump_version() { storage_->bump_version(); }

  // Points this impl at `other`'s data (storage, sizes, strides, offset, dtype), keeping its
  // own autograd state: every handle to this tensor sees the new data (libtorch's set_data).
  void set_data(const TensorImpl& other) {
    storage_ = other.storage_;
    sizes_ = other.sizes_;
    strides_ = other.strides_;
    storage_offset_ = other.storage_offset_;
    numel_ = other.numel_;
    dtype_ = other.dtype_;
    is_contiguous_ = other.is_contiguous_;
  }

  bool requires_grad() const { return requires_grad_; }
  void set_requires_grad(bool r) { requires_grad_ = r; }
  const std::shared_ptr<autograd::AutogradMeta>& autograd_meta() const { return autograd_meta_; }
  void set_autograd_meta(std::shared_ptr<autograd::AutogradMeta> m) { autograd_meta_ = std::move(m); }

 private:
  Storage storage_;
  Shape sizes_;
  Shape strides_;
  int64_t storage_offset_;
  int64_t numel_;
  ScalarType dtype_;
  bool is_contiguous_;
  bool requires_grad_ = false;
  std::shared_ptr<autograd::AutogradMeta> autograd_meta_;
};

}  // namespace kiln
