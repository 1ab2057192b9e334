// TensorOptions: the dtype, device and requires_grad a factory creates a tensor with, in
// libtorch's builder spelling:
//
//   kiln::zeros({2, 3}, kiln::dtype(kiln::kBFloat16).device(kiln::kCPU).requires_grad(true));
//   kiln::ones({4}, kiln::kInt64);      // a dtype or a device converts to options
#pragma once

#include <optional>

#include "tensor/device.h"
#include "tensor/dtype.h"

namespace kiln {

class TensorOptions {
 public:
  TensorOptions() = default;
  TensorOptions(ScalarType d) : dtype_(d) {}  // NOLINT: implicit as in libtorch
  TensorOptions(Device d) : device_(d) {}     // NOLINT
  TensorOptions(DeviceType d) : device_(Device(d)) {}  // NOLINT

  TensorOptions dtype(ScalarType d) const { auto o = *this; o.dtype_ = d; return o; }
  TensorOptions device(Device d) const { auto o = *this; o.device_ = d; return o; }
  TensorOptions requires_grad(bool r) const { auto o = *this; o.requires_grad_ = r; return o; }

  ScalarType dtype() const { return dtype_.value_or(default_dtype()); }
  Device device() const { return device_.value_or(Device(kCPU)); }
  bool requires_grad() const { return requires_grad_; }
  bool has_dtype() const { return dtype_.has_value(); }
  bool has_device() const { return device_.has_value(); }

 private:
  std::optional<ScalarType> dtype_;
  std::optional<Device> device_;
  bool requires_grad_ = false;
};

inline TensorOptions dtype(ScalarType d) { return TensorOptions().dtype(d); }
inline TensorOptions device(Device d) { return TensorOptions().device(d); }
inline TensorOptions requires_grad(bool r = true) { return TensorOptions().requires_grad(r); }

}  // namespace kiln
