// The global Philox generator: a seed and the next free block counter, behind a mutex so that
// ops called from several threads reserve disjoint ranges of the stream.
#include "tensor/random.h"

#include <mutex>

#include "tensor/error.h"

namespace kiln {
namespace {

struct GlobalGenerator {
  std::mutex mu;
  RngState state;
};

GlobalGenerator& generator() {
  static GlobalGenerator g;
  return g;
}

}  // namespace

void manual_seed(uint64_t seed) { set_rng_state(RngState{seed, 0}); }

uint64_t initial_seed() {
  GlobalGenerator& g = generator();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.state.seed;
}

RngState get_rng_state() {
  GlobalGenerator& g = generator();
  std::lock_guard<std::mutex> lock(g.mu);
  return g.state;
}

void set_rng_state(RngState state) {
  GlobalGenerator& g = generator();
  std::lock_guard<std::mutex> lock(g.mu);
  g.state = state;
}

RngState philox_reserve(uint64_t blocks) {
  GlobalGenerator& g = generator();
  std::lock_guard<std::mutex> lock(g.mu);
  const RngState reserved = g.state;
  g.state.offset += blocks;
  return reserved;
}

}  // namespace kiln
