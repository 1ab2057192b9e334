// kiln::cuda in a build without CUDA: no device is available, and the functions that need one
// say so. Compiled instead of kernels/cuda/runtime.cpp when KILN_WITH_CUDA is off (CMake
// leaves this file out of CUDA builds).
#include <atomic>
#include <string>

#include "kernels/cuda/runtime.h"
#include "tensor/error.h"

namespace kiln::cuda {
namespace {

constexpr const char* kReason = "kiln was built without CUDA (configure with -DKILN_CUDA=ON)";

[[noreturn]] void unavailable(const char* op) { KILN_FAIL("[", op, "] no CUDA device: ", kReason); }

}  // namespace

bool is_available() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return kReason; }

int current_device() { unavailable("current_device"); }
void set_device(int) { unavailable("set_device"); }
void synchronize(int) { unavailable("synchronize"); }
MemoryStats memory_stats(int) { unavailable("memory_stats"); }
void reset_peak_memory_stats(int) { unavailable("reset_peak_memory_stats"); }
void empty_cache(int) { unavailable("empty_cache"); }

// The flag is kept so that code setting it runs unchanged; nothing launches in this build.
namespace {
std::atomic<bool> g_launch_sync{false};
}  // namespace
bool launch_sync() { return g_launch_sync.load(std::memory_order_relaxed); }
void set_launch_sync(bool enabled) { g_launch_sync.store(enabled, std::memory_order_relaxed); }

}  // namespace kiln::cuda
