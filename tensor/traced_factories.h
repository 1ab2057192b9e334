// full() (and zeros / ones, built on it) and empty_like() allocate with the `empty` op instead of
// directly while kiln::compile traces on this thread, so that the tracer records the allocation
// and the tensor is a proxy like every other traced value (a zeros() buffer or the output of
// bernoulli() made inside a compiled step is made afresh by every run, in the run's shapes).
// empty() and tensor() stay real allocations: the host writes values into them, and such
// tensors are the program's constants. Internal to kiln.
#pragma once

namespace kiln::internal {

// Whether this thread's factories dispatch the `empty` op (set by the tracer).
bool factories_traced();

class TracedFactoriesScope {
 public:
  TracedFactoriesScope();
  ~TracedFactoriesScope();
  TracedFactoriesScope(const TracedFactoriesScope&) = delete;
  TracedFactoriesScope& operator=(const TracedFactoriesScope&) = delete;

 private:
  bool previous_;
};

}  // namespace kiln::internal
