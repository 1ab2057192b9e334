// kiln::Device: where a tensor's memory lives: the CPU, a CUDA GPU, or nowhere ("meta",
// the proxies the compiler's tracer runs on, which carry shape and dtype but no data).
//
//   kiln::Device("cuda:1"), kiln::Device(kiln::kCUDA, 0), kiln::kCPU
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>

namespace kiln {

enum class DeviceType : int8_t { CPU, CUDA, Meta };
inline constexpr int kNumDeviceTypes = 3;
inline constexpr DeviceType kCPU = DeviceType::CPU;
inline constexpr DeviceType kCUDA = DeviceType::CUDA;
inline constexpr DeviceType kMeta = DeviceType::Meta;

class Device {
 public:
  Device(DeviceType type, int index = -1);  // NOLINT: kiln::kCPU converts implicitly
  explicit Device(std::string_view spec);    // "cpu", "cuda", "cuda:0", "meta"
  Device(const char* spec) : Device(std::string_view(spec)) {}  // NOLINT

  DeviceType type() const { return type_; }
  // -1 means "the current device" for CUDA; CPU and meta have no index.
  int index() const { return index_; }
  bool is_cpu() const { return type_ == kCPU; }
  bool is_cuda() const { return type_ == kCUDA; }
  bool is_meta() const { return type_ == kMeta; }
  std::string str() const;

  bool operator==(const Device& o) const { return type_ == o.type_ && index_ == o.index_; }

 private:
  DeviceType type_;
  int index_;
};

std::string_view device_type_name(DeviceType t);
std::ostream& operator<<(std::ostream& os, const Device& d);

}  // namespace kiln
