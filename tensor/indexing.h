// Indexing in libtorch's kiln::indexing spelling:
//
//   using namespace kiln::indexing;
//   t.index({Slice(0, 2), None, Ellipsis, 1});   // t[0:2, None, ..., 1]
//   t.index({mask});                             // boolean mask
//   t.index({idx_tensor});                       // advanced indexing with int64 indices
//   t.index_put_({Slice(), 0}, 5);               // t[:, 0] = 5
//
// Integers and slices give views; tensors (advanced indexing) give copies, as in PyTorch.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>
#include <variant>

#include "tensor/tensor.h"

namespace kiln::indexing {

struct NoneIndexType {};
struct EllipsisIndexType {};
inline constexpr NoneIndexType None{};
inline constexpr EllipsisIndexType Ellipsis{};

// A bound of a Slice: an integer, or None / nullopt for "from the start" / "to the end", as
// Python's t[1:] is Slice(1, None).
class SliceBound {
 public:
  SliceBound(std::nullopt_t) {}   // NOLINT: implicit by design
  SliceBound(NoneIndexType) {}    // NOLINT
  template <typename I>
    requires(std::is_integral_v<I> && !std::is_same_v<I, bool>)
  SliceBound(I v) : v_(static_cast<int64_t>(v)) {}  // NOLINT
  SliceBound(std::optional<int64_t> v) : v_(v) {}   // NOLINT
  const std::optional<int64_t>& value() const { return v_; }

 private:
  std::optional<int64_t> v_;
};

class Slice {
 public:
  Slice(SliceBound start = std::nullopt, SliceBound stop = std::nullopt,
        SliceBound step = std::nullopt)
      : start_(start.value()), stop_(stop.value()), step_(step.value().value_or(1)) {}
  std::optional<int64_t> start() const { return start_; }
  std::optional<int64_t> stop() const { return stop_; }
  int64_t step() const { return step_; }

 private:
  std::optional<int64_t> start_, stop_;
  int64_t step_;
};

class TensorIndex {
 public:
  TensorIndex(NoneIndexType) : v_(NoneIndexType{}) {}          // NOLINT
  TensorIndex(EllipsisIndexType) : v_(EllipsisIndexType{}) {}  // NOLINT
  TensorIndex(int64_t i) : v_(i) {}                            // NOLINT
  TensorIndex(int i) : v_(static_cast<int64_t>(i)) {}          // NOLINT
  TensorIndex(bool b) : v_(b) {}                               // NOLINT
  TensorIndex(Slice s) : v_(s) {}                              // NOLINT
  TensorIndex(Tensor t) : v_(std::move(t)) {}                  // NOLINT

  bool is_none() const { return std::holds_alternative<NoneIndexType>(v_); }
  bool is_ellipsis() const { return std::holds_alternative<EllipsisIndexType>(v_); }
  bool is_integer() const { return std::holds_alternative<int64_t>(v_); }
  bool is_boolean() const { return std::holds_alternative<bool>(v_); }
  bool is_slice() const { return std::holds_alternative<Slice>(v_); }
  bool is_tensor() const { return std::holds_alternative<Tensor>(v_); }
  int64_t integer() const { return std::get<int64_t>(v_); }
  bool boolean() const { return std::get<bool>(v_); }
  const Slice& slice() const { return std::get<Slice>(v_); }
  const Tensor& tensor() const { return std::get<Tensor>(v_); }

 private:
  std::variant<NoneIndexType, EllipsisIndexType, int64_t, bool, Slice, Tensor> v_;
};

}  // namespace kiln::indexing
