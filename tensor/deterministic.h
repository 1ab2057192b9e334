// Deterministic algorithms, as torch.use_deterministic_algorithms: when enabled, ops choose only
// kernels whose results do not depend on the order in which GPU threads run, so that the same
// program on the same inputs gives the same bits every time (bit-exact resume of a CUDA run).
//
//   kiln::use_deterministic_algorithms(true);      // process-wide
//   ... train ...                                  // kiln pretrain --deterministic does this
//
// What it changes (the rest of kiln is deterministic either way):
//   - flash_attention_backward on CUDA: the flash kernels (hand and cuDNN) accumulate dQ across
//     key blocks with float atomics. With deterministic algorithms they refuse, and the op's
//     decomposition runs instead (tensor/ops/attention.cpp: the scores of one layer materialised
//     for its backward, [B, H, T, S] in f32; slower and larger, but ordered).
// Always deterministic, whatever the setting: index_add of floats on CUDA (embedding's backward:
// a sorted pass), reductions, norms, cross-entropy, the optimizers, cuBLASLt's GEMMs (fixed
// algorithm per shape on one GPU model: matmul autotuning, kernels/cuda.h, is ignored in the
// mode, since a timed choice may differ from run to run).
// Not covered (order-dependent with floats on CUDA in either mode, as in PyTorch): scatter_add
// and index_put_ with accumulate.
#pragma once

namespace kiln {

void use_deterministic_algorithms(bool enabled);
bool are_deterministic_algorithms_enabled();

// Sets the mode for a scope and restores the previous one.
class DeterministicGuard {
 public:
  explicit DeterministicGuard(bool enabled) : previous_(are_deterministic_algorithms_enabled()) {
    use_deterministic_algorithms(enabled);
  }
  ~DeterministicGuard() { use_deterministic_algorithms(previous_); }
  DeterministicGuard(const DeterministicGuard&) = delete;
  DeterministicGuard& operator=(const DeterministicGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace kiln
