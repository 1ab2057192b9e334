// Shapes and strides: the small integer vectors every tensor carries, and the rules on them
// (contiguous strides, broadcasting, dim wrapping) that ops share.
#pragma once

#include <cstdint>
#include <string>

#include "absl/container/inlined_vector.h"
#include "absl/types/span.h"

namespace kiln {

// Sizes or strides, stored inline up to 5 dims (no allocation for typical tensors).
using Shape = absl::InlinedVector<int64_t, 5>;
// A read-only view of sizes passed to ops: accepts Shape, std::vector and {2, 3} literals.
using IntArrayRef = absl::Span<const int64_t>;

inline Shape to_shape(IntArrayRef s) { return Shape(s.begin(), s.end()); }
// "[2, 3]"
std::string shape_str(IntArrayRef sizes);
int64_t numel_of(IntArrayRef sizes);
Shape contiguous_strides(IntArrayRef sizes);
// True when (sizes, strides) describe a C-contiguous layout (size-1 dims may have any stride).
bool is_contiguous_layout(IntArrayRef sizes, IntArrayRef strides);
// Maps a possibly negative dim into [0, ndim); fails naming `op` when out of range. A 0-d
// tensor accepts dims -1 and 0, as PyTorch.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// The broadcast shape of a and b (numpy rules); fails naming `op` and both shapes.
Shape broadcast_shapes(IntArrayRef a, IntArrayRef b, const char* op);
// Resolves one -1 in `sizes` so that the product equals numel; fails naming `op`.
Shape infer_size(IntArrayRef sizes, int64_t numel, const char* op);
// A sorted set of wrapped dims; empty `dims` means all dims. Duplicates fail naming `op`.
Shape reduction_dims(IntArrayRef dims, int64_t ndim, const char* op);

}  // namespace kiln
