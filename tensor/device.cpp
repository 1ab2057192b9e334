#include "tensor/device.h"

#include <charconv>

#include "tensor/error.h"

namespace kiln {

Device::Device(DeviceType type, int index) : type_(type), index_(type == kCUDA ? index : -1) {
  KILN_CHECK(index >= -1, "[Device] device index must be >= 0, got ", index);
  if (type_ == kCUDA && index_ < 0) index_ = 0;
}

Device::Device(std::string_view spec) : type_(kCPU), index_(-1) {
  const auto colon = spec.find(':');
  const std::string_view kind = spec.substr(0, colon);
  if (kind == "cpu") {
    type_ = kCPU;
  } else if (kind == "cuda") {
    type_ = kCUDA;
    index_ = 0;
  } else if (kind == "meta") {
    type_ = kMeta;
  } else {
    KILN_FAIL("[Device] unknown device '", spec, "' (expected cpu, cuda, cuda:N or meta)");
  }
  if (colon != std::string_view::npos) {
    const std::string_view num = spec.substr(colon + 1);
    int idx = -1;
    auto [ptr, ec] = std::from_chars(num.data(), num.data() + num.size(), idx);
    KILN_CHECK(ec == std::errc() && ptr == num.data() + num.size() && idx >= 0,
               "[Device] bad device index in '", spec, "'");
    KILN_CHECK(type_ == kCUDA, "[Device] only cuda devices take an index, got '", spec, "'");
    index_ = idx;
  }
}

std::string_view device_type_name(DeviceType t) {
  switch (t) {
    case kCPU: return "cpu";
    case kCUDA: return "cuda";
    case kMeta: return "meta";
  }
  return "unknown";
}

std::string Device::str() const {
  std::string s(device_type_name(type_));
  if (type_ == kCUDA) s += ":" + std::to_string(index_);
  return s;
}

std::ostream& operator<<(std::ostream& os, const Device& d) { return os << d.str(); }

}  // namespace kiln
