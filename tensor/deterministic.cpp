#include "tensor/deterministic.h"

#include <atomic>

namespace kiln {
namespace {
std::atomic<bool> g_deterministic{false};
}  // namespace

void use_deterministic_algorithms(bool enabled) {
  g_deterministic.store(enabled, std::memory_order_relaxed);
}

bool are_deterministic_algorithms_enabled() {
  return g_deterministic.load(std::memory_order_relaxed);
}

}  // namespace kiln
