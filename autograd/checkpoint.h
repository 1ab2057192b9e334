// Activation checkpointing, as torch.utils.checkpoint (the reentrant form): the function's
// forward runs without recording a graph, so none of its intermediate activations are kept; the
// backward runs the function again (with grad mode on, from the same random-number state, so
// dropout draws the same mask) and differentiates the recomputed graph.
//
//   Tensor h = kiln::checkpoint([&](const Tensor& x) { return block(x); }, x);
//   std::vector<Tensor> ys = kiln::checkpoint(fn, std::vector<Tensor>{a, b});
//
// Gradients reach the inputs and every tensor the function captured (parameters accumulate
// their .grad during the recomputation's backward, as in PyTorch). Inside kiln::compile the
// same happens on proxies: the recomputation is traced into the backward, so a compiled step
// keeps what the checkpoint drops.
//
// Pitfalls: the function must compute the same thing when run again (no reads of state that
// changes in between); inputs the function modifies in place are not supported.
#pragma once

#include <functional>
#include <type_traits>
#include <vector>

#include "tensor/tensor.h"

namespace kiln {

using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// The general form: tensors in, tensors out.
std::vector<Tensor> checkpoint(const CheckpointFn& fn, const std::vector<Tensor>& inputs);

// One tensor in, one tensor out (or more inputs: checkpoint(fn, a, b) with fn(a, b)).
template <typename F, typename... Ts>
requires(std::is_same_v<std::decay_t<Ts>, Tensor>&&...) Tensor
    checkpoint(F&& fn, const Ts&... inputs) {
  auto wrapped = [&fn](const std::vector<Tensor>& in) {
    return [&]<size_t... I>(std::index_sequence<I...>) { return std::vector<Tensor>{fn(in[I]...)}; }
    (std::index_sequence_for<Ts...>{});
  };
  return checkpoint(CheckpointFn(wrapped), std::vector<Tensor>{inputs...}).at(0);
}

}  // namespace kiln
