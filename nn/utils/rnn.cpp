// PackedSequence and its packing and padding (nn/utils/rnn.h); the layers' packed forward is in
// nn/modules/rnn.cpp.
#include "nn/utils/rnn.h"

#include <algorithm>
#include <numeric>
#include <sstream>

#include "tensor/ops.h"
#include "tensor/tensor_data.h"

namespace kiln::nn::utils::rnn {

namespace {

std::string list_str(const std::vector<int64_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) s << (i ? ", " : "") << v[i];
  s << "]";
  return s.str();
}

std::vector<int64_t> int64_values(const Tensor& t, const char* op, const char* what) {
  KILN_CHECK(t.defined() && t.dim() == 1, "[", op, "] ", what, " must be a 1-D tensor, got ",
             t.defined() ? shape_str(t.sizes()) : std::string("an undefined tensor"));
  KILN_CHECK(t.dtype() == kInt64 && t.device().is_cpu(), "[", op, "] ", what,
             " must be an int64 CPU tensor, got ", dtype_name(t.dtype()), " on ", t.device().str());
  return t.contiguous().to_vector<int64_t>();
}

Tensor int64_tensor(const std::vector<int64_t>& v, Device device = Device(kCPU)) {
  return kiln::tensor(v, TensorOptions(kInt64)).to(device);
}

// [rows, *trailing] of padding_value, in `like`'s dtype and device.
Tensor padding(const Tensor& like, int64_t rows, double padding_value) {
  std::vector<int64_t> sizes(like.sizes().begin(), like.sizes().end());
  sizes[0] = rows;
  return kiln::full(sizes, padding_value, like.options());
}

}  // namespace

PackedSequence::PackedSequence(Tensor data, Tensor batch_sizes, Tensor sorted_indices,
                               Tensor unsorted_indices)
    : data_(std::move(data)),
      batch_sizes_(std::move(batch_sizes)),
      sorted_indices_(std::move(sorted_indices)),
      unsorted_indices_(std::move(unsorted_indices)) {
  const std::vector<int64_t> bs = int64_values(batch_sizes_, "PackedSequence", "batch_sizes");
  KILN_CHECK(data_.defined() && data_.dim() >= 1, "[PackedSequence] data must have a dim");
  const int64_t total = std::accumulate(bs.begin(), bs.end(), int64_t{0});
  KILN_CHECK(total == data_.size(0), "[PackedSequence] batch_sizes ", list_str(bs), " sum to ",
             total, " but data has ", data_.size(0), " rows");
  KILN_CHECK(sorted_indices_.defined() == unsorted_indices_.defined(),
             "[PackedSequence] sorted_indices and unsorted_indices must both be given, or neither");
}

PackedSequence PackedSequence::to(Device device) const {
  const auto move = [&](const Tensor& t) { return t.defined() ? t.to(device) : t; };
  return PackedSequence(data_.to(device), batch_sizes_, move(sorted_indices_),
                        move(unsorted_indices_));
}

PackedSequence PackedSequence::to(ScalarType dtype) const {
  return PackedSequence(data_.to(dtype), batch_sizes_, sorted_indices_, unsorted_indices_);
}

PackedSequence pack_padded_sequence(Tensor input, Tensor lengths, bool batch_first,
                                    bool enforce_sorted) {
  return pack_padded_sequence(std::move(input),
                              int64_values(lengths, "pack_padded_sequence", "lengths"), batch_first,
                              enforce_sorted);
}

PackedSequence pack_padded_sequence(Tensor input, const std::vector<int64_t>& lengths,
                                    bool batch_first, bool enforce_sorted) {
  KILN_CHECK(input.defined() && input.dim() >= 2,
             "[pack_padded_sequence] expected an input of at least 2 dims ([T, B, *]), got ",
             input.defined() ? shape_str(input.sizes()) : std::string("an undefined tensor"));
  if (batch_first) input = input.transpose(0, 1);
  const int64_t steps = input.size(0), batch = input.size(1);
  KILN_CHECK(static_cast<int64_t>(lengths.size()) == batch, "[pack_padded_sequence] ",
             lengths.size(), " lengths for a batch of ", batch);
  KILN_CHECK(batch > 0, "[pack_padded_sequence] the batch is empty");
  for (const int64_t len : lengths) {
    KILN_CHECK(len > 0 && len <= steps, "[pack_padded_sequence] lengths ", list_str(lengths),
               " must lie within [1, ", steps, "] (the padded length)");
  }
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  Tensor sorted_indices, unsorted_indices;
  if (enforce_sorted) {
    KILN_CHECK(std::is_sorted(lengths.begin(), lengths.end(), std::greater<>()),
               "[pack_padded_sequence] lengths ", list_str(lengths),
               " must be sorted in decreasing order; pass enforce_sorted = false to sort them");
  } else {
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
    std::vector<int64_t> inverse(batch);
    for (int64_t i = 0; i < batch; ++i) inverse[order[i]] = i;
    sorted_indices = int64_tensor(order, input.device());
    unsorted_indices = int64_tensor(inverse, input.device());
    input = input.index_select(1, sorted_indices);
  }
  // Longest first: at step t the first batch_sizes[t] sequences are still running.
  const int64_t longest = lengths[order[0]];
  std::vector<int64_t> batch_sizes(longest, 0);
  std::vector<Tensor> rows;
  for (int64_t t = 0; t < longest; ++t) {
    for (const int64_t len : lengths) batch_sizes[t] += len > t ? 1 : 0;
    rows.push_back(input.select(0, t).narrow(0, 0, batch_sizes[t]));
  }
  return PackedSequence(kiln::cat(rows, 0), int64_tensor(batch_sizes), sorted_indices,
                        unsorted_indices);
}

std::tuple<Tensor, Tensor> pad_packed_sequence(const PackedSequence& sequence, bool batch_first,
                                               double padding_value,
                                               std::optional<int64_t> total_length) {
  const std::vector<int64_t> bs =
      int64_values(sequence.batch_sizes(), "pad_packed_sequence", "batch_sizes");
  KILN_CHECK(!bs.empty(), "[pad_packed_sequence] the sequence is empty");
  const int64_t longest = static_cast<int64_t>(bs.size()), batch = bs[0];
  const int64_t steps = total_length.value_or(longest);
  KILN_CHECK(steps >= longest, "[pad_packed_sequence] total_length ", steps,
             " is shorter than the longest sequence (", longest, ")");
  const Tensor& data = sequence.data();
  std::vector<Tensor> rows;
  int64_t offset = 0;
  for (int64_t t = 0; t < longest; ++t) {
    Tensor row = data.narrow(0, offset, bs[t]);
    if (bs[t] < batch) row = kiln::cat({row, padding(data, batch - bs[t], padding_value)}, 0);
    rows.push_back(row);
    offset += bs[t];
  }
  for (int64_t t = longest; t < steps; ++t) rows.push_back(padding(data, batch, padding_value));
  Tensor padded = kiln::stack(rows, 0);
  std::vector<int64_t> lengths(batch, 0);
  for (int64_t b = 0; b < batch; ++b) {
    for (const int64_t n : bs) lengths[b] += n > b ? 1 : 0;
  }
  if (sequence.unsorted_indices().defined()) {
    padded = padded.index_select(1, sequence.unsorted_indices());
    const std::vector<int64_t> unsorted = sequence.unsorted_indices().to(kCPU).to_vector<int64_t>();
    std::vector<int64_t> original(batch);
    for (int64_t i = 0; i < batch; ++i) original[i] = lengths[unsorted[i]];
    lengths = original;
  }
  if (batch_first) padded = padded.transpose(0, 1);
  return {padded, int64_tensor(lengths)};
}

Tensor pad_sequence(const std::vector<Tensor>& sequences, bool batch_first, double padding_value) {
  KILN_CHECK(!sequences.empty(), "[pad_sequence] no sequences given");
  int64_t longest = 0;
  for (size_t i = 0; i < sequences.size(); ++i) {
    const Tensor& s = sequences[i];
    KILN_CHECK(s.defined() && s.dim() >= 1, "[pad_sequence] sequence ", i, " has no dims");
    KILN_CHECK(s.sizes().subspan(1) == sequences[0].sizes().subspan(1), "[pad_sequence] sequence ",
               i, " has shape ", shape_str(s.sizes()), ", sequence 0 has ",
               shape_str(sequences[0].sizes()), ": all but the first dim must match");
    longest = std::max(longest, s.size(0));
  }
  std::vector<Tensor> padded;
  for (const Tensor& s : sequences) {
    padded.push_back(s.size(0) == longest
                         ? s
                         : kiln::cat({s, padding(s, longest - s.size(0), padding_value)}, 0));
  }
  return kiln::stack(padded, batch_first ? 0 : 1);
}

PackedSequence pack_sequence(const std::vector<Tensor>& sequences, bool enforce_sorted) {
  std::vector<int64_t> lengths;
  for (const Tensor& s : sequences) lengths.push_back(s.defined() && s.dim() >= 1 ? s.size(0) : 0);
  return pack_padded_sequence(pad_sequence(sequences), lengths, /*batch_first=*/false,
                              enforce_sorted);
}

}  // namespace kiln::nn::utils::rnn
