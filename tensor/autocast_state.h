// The thread-local autocast state: which device types autocast is on for in this thread, and
// the dtype of their lower-precision ops. kiln::AutocastGuard (nn/autocast.h, the public API)
// sets it; the autocast dispatch handler and ops with autocast-aware checks (matmul, linear)
// read it.
//
//   if (kiln::is_autocast_enabled(a.device().type())) { ... }  // a's device type is autocast
//   kiln::ScalarType t = kiln::autocast_dtype(kiln::kCUDA);      // kBFloat16 unless set
//
// It lives in tensor/ so that tensor ops can read it without depending on nn/.
#pragma once

#include "tensor/device.h"
#include "tensor/dtype.h"

namespace kiln {

// Whether autocast is on for ops on `device` tensors in this thread.
bool is_autocast_enabled(DeviceType device);
// The dtype the lower-precision ops run in on `device` (kBFloat16 when no guard set one).
ScalarType autocast_dtype(DeviceType device);

namespace internal {
// Sets this thread's autocast state for `device` (AutocastGuard, which checks the arguments).
void set_autocast_state(DeviceType device, bool enabled, ScalarType dtype);
// Whether autocast is on for any device type in this thread: the dispatch handler's fast test.
bool any_autocast_enabled();
}  // namespace internal

}  // namespace kiln
