#include "tensor/tensor.h"

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {

Tensor& Tensor::operator=(const Tensor& src) && {
  copy_(src);
  return *this;
}

Tensor& Tensor::operator=(const Scalar& value) && {
  fill_(value);
  return *this;
}

int64_t Tensor::size(int64_t d) const { return sizes()[wrap_dim(d, dim(), "size")]; }

int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim(), "stride")]; }

void* Tensor::data_ptr() const {
  KILN_CHECK(defined(), "[data_ptr] the tensor is undefined");
  KILN_CHECK(!is_meta(), "[data_ptr] a meta tensor of shape ", shape_str(sizes()),
             " has no data (is this a proxy inside kiln::compile? move data access out of the "
             "compiled function)");
  return impl()->data();
}

Scalar Tensor::item() const {
  KILN_CHECK(defined(), "[item] the tensor is undefined");
  KILN_CHECK(numel() == 1, "[item] a Tensor with ", numel(),
             " elements cannot be converted to a Scalar (shape ", shape_str(sizes()), ")");
  const Tensor c = is_cpu() ? *this : to(Device(kCPU));
  return visit_dtype(dtype(), [&]<typename T>(TypeTag<T>) -> Scalar {
    return Scalar(*static_cast<const T*>(c.data_ptr()));
  });
}

std::string Tensor::str() const {
  std::ostringstream os;
  os << *this;
  return os.str();
}

}  // namespace kiln
