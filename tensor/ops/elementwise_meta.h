// Meta helpers shared by elementwise ops: PyTorch's type promotion over operands of different
// priority, the casting rule of in-place ops, and scalars wrapped as 0-d tensors.
//
//   ResultTypeBuilder r;
//   r.add(self).add(min_scalar);                 // tensors and Scalars, any number
//   ScalarType common = r.result();              // torch.result_type over all of them
//   check_inplace_result("add_", self, shape, common);   // broadcast and can_cast checks
//
// Scalar operands of binary ops travel as 0-d tensors made by wrap_scalar() (so each op stays
// one registry op for tensor and scalar forms). A 0-d tensor alone ranks above a scalar in
// promotion, so wrappers compute the common dtype with the Scalar and pass it to the op as an
// attribute; meta rules use that attribute when present. Internal to kiln's op families.
#pragma once

#include <optional>
#include <string_view>

#include "tensor/registry.h"
#include "tensor/tensor.h"

namespace kiln::internal {

// The dtype fused ops compute and return their statistics in (losses, lse, norms' mean and
// rstd): f64 for f64 inputs, f32 otherwise.
inline ScalarType compute_dtype(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

// torch.result_type's three priorities: dimensioned tensors, then 0-d tensors, then scalars.
// A lower-priority operand only matters when its category (bool < integral < floating) is
// higher than the result so far.
class ResultTypeBuilder {
 public:
  ResultTypeBuilder& add(const Tensor& t);
  // A wrapped number: a floating Scalar counts as the default dtype, an integer as int64.
  ResultTypeBuilder& add(const Scalar& s);
  ScalarType result() const;

 private:
  std::optional<ScalarType> dim_, zero_, wrapped_;
};

// torch.can_cast: a floating result never goes into an integral tensor, nor a non-bool result
// into a bool tensor.
bool can_cast(ScalarType from, ScalarType to);

// The names PyTorch's messages use for dtypes: "Float", "Long", "BFloat16" ...
std::string_view legacy_type_name(ScalarType t);

// A 0-d CPU tensor holding `s` exactly: bool, int64 or float64 (narrowed by the op's kernel).
Tensor wrap_scalar(const Scalar& s);

// The common dtype of a binary op's inputs 0 and 1: attribute `attr` when the wrapper passed
// one (scalar operands), torch.result_type of the two tensors otherwise.
ScalarType binary_common_dtype(const OpCall& c, size_t attr);

// Checks an in-place op writing a `result`-typed value of broadcast shape `shape` into `self`:
// the shape must stay, the dtype must be castable, and self must not have elements that
// share memory (expanded tensors).
void check_inplace_result(std::string_view op, const Tensor& self, IntArrayRef shape,
                          ScalarType result);

// Whether some element of `a` and some element of `b` may share memory: the same storage and
// intersecting byte ranges (gaps between strided elements are not looked into).
bool memory_overlaps(const Tensor& a, const Tensor& b);

// Fails when `input` partially overlaps `self` in memory (an in-place op would read elements
// it already wrote); identical views are fine.
void check_no_partial_overlap(std::string_view op, const Tensor& self, const Tensor& input);

}  // namespace kiln::internal
