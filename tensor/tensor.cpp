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
  void* data = impl()->data();
  if (data == nullptr) {  // the checks cost nothing on the kernels' path
    KILN_CHECK(!impl()->storage()->is_proxy(), "[data_ptr] reads the values of a tensor of shape ",
               shape_str(sizes()),
               " while kiln::compile traces the function, when values are not "
               "known yet: return the tensor from the compiled function and read it outside");
    KILN_CHECK(!is_meta(), "[data_ptr] a meta tensor of shape ", shape_str(sizes()),
               " has no data");
  }
  return data;
}

Scalar Tensor::item() const {
  KILN_CHECK(defined(), "[item] the tensor is undefined");
  KILN_CHECK(!impl()->storage()->is_proxy(),
             "[item] reads a tensor's value while kiln::compile "
             "traces the function, when values are not known yet: return the tensor from the "
             "compiled function and call item() outside it, or keep the computation in tensor ops "
             "(e.g. where/clamp instead of an if on the value)");
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
