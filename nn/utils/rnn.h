// Variable-length sequences for RNN, LSTM and GRU, as torch::nn::utils::rnn: a PackedSequence
// holds a batch of sequences of different lengths without their padding, and the layers'
// forward_with_packed_input runs each sequence only over its own steps.
//
//   namespace rnn = kiln::nn::utils::rnn;
//   // x [T, B, 8] padded, lengths {5, 3, 2} (an int64 CPU tensor or a vector).
//   auto packed = rnn::pack_padded_sequence(x, lengths, /*batch_first=*/false,
//                                           /*enforce_sorted=*/false);
//   auto [out_packed, state] = lstm->forward_with_packed_input(packed);
//   auto [out, out_lengths] = rnn::pad_packed_sequence(out_packed);   // out [T, B, H]
//
// Layout (PyTorch's): data holds the sequences time step by time step, at each step the
// batch_sizes[t] sequences still running, longest first; batch_sizes is an int64 CPU tensor.
// With enforce_sorted = false the batch is sorted by decreasing length first and sorted_indices /
// unsorted_indices record the permutation; states given to and returned by the layers are in the
// caller's batch order. Gradients flow through packing and padding.
//
// Pitfalls: lengths must be positive; with enforce_sorted (the default, as libtorch's) they must
// also be non-increasing.
#pragma once

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::nn::utils::rnn {

class PackedSequence {
 public:
  PackedSequence() = default;
  // data [sum(lengths), *], batch_sizes [T] (int64, CPU); the indices undefined when sorted.
  explicit PackedSequence(Tensor data, Tensor batch_sizes, Tensor sorted_indices = {},
                          Tensor unsorted_indices = {});

  const Tensor& data() const { return data_; }
  const Tensor& batch_sizes() const { return batch_sizes_; }
  const Tensor& sorted_indices() const { return sorted_indices_; }
  const Tensor& unsorted_indices() const { return unsorted_indices_; }
  bool is_cuda() const { return data_.is_cuda(); }
  // The same sequence with data (and the indices) on `device` or in `dtype`.
  PackedSequence to(Device device) const;
  PackedSequence to(ScalarType dtype) const;

 private:
  Tensor data_, batch_sizes_, sorted_indices_, unsorted_indices_;
};

// input [T, B, *] ([B, T, *] with batch_first); lengths [B] (int64 on the CPU).
PackedSequence pack_padded_sequence(Tensor input, Tensor lengths, bool batch_first = false,
                                    bool enforce_sorted = true);
PackedSequence pack_padded_sequence(Tensor input, const std::vector<int64_t>& lengths,
                                    bool batch_first = false, bool enforce_sorted = true);

// The inverse: (padded [T, B, *] ([B, T, *] with batch_first), lengths [B] int64) in the
// original batch order, positions past a sequence's end filled with padding_value; T is
// total_length when given (at least the longest sequence).
std::tuple<Tensor, Tensor> pad_packed_sequence(const PackedSequence& sequence,
                                               bool batch_first = false, double padding_value = 0.0,
                                               std::optional<int64_t> total_length = std::nullopt);

// Stacks sequences [L_i, *] into [max L, N, *] ([N, max L, *] with batch_first), padded.
Tensor pad_sequence(const std::vector<Tensor>& sequences, bool batch_first = false,
                    double padding_value = 0.0);

// pack_padded_sequence(pad_sequence(sequences), their lengths).
PackedSequence pack_sequence(const std::vector<Tensor>& sequences, bool enforce_sorted = true);

}  // namespace kiln::nn::utils::rnn
