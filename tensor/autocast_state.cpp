// The thread-local autocast state (see autocast_state.h).
#include "tensor/autocast_state.h"

#include <array>

namespace kiln {
namespace {

struct State {
  bool enabled = false;
  ScalarType dtype = kBFloat16;
};

struct ThreadState {
  std::array<State, kNumDeviceTypes> devices{};
  int enabled_count = 0;  // how many device types are enabled
};

thread_local ThreadState t_state;

}  // namespace

bool is_autocast_enabled(DeviceType device) {
  return t_state.devices[static_cast<int>(device)].enabled;
}

ScalarType autocast_dtype(DeviceType device) {
  return t_state.devices[static_cast<int>(device)].dtype;
}

namespace internal {

void set_autocast_state(DeviceType device, bool enabled, ScalarType dtype) {
  State& s = t_state.devices[static_cast<int>(device)];
  t_state.enabled_count += static_cast<int>(enabled) - static_cast<int>(s.enabled);
  s.enabled = enabled;
  s.dtype = dtype;
}

bool any_autocast_enabled() { return t_state.enabled_count != 0; }

}  // namespace internal
}  // namespace kiln
