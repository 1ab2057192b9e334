#include "tensor/tensor_impl.h"

namespace kiln {

TensorImpl::TensorImpl(Storage storage, Shape sizes, Shape strides, int64_t storage_offset,
                       ScalarType dtype)
    : storage_(std::move(storage)),
      sizes_(std::move(sizes)),
      strides_(std::move(strides)),
      storage_offset_(storage_offset),
      numel_(numel_of(sizes_)),
      dtype_(dtype),
      is_contiguous_(is_contiguous_layout(sizes_, strides_)) {}

}  // namespace kiln
