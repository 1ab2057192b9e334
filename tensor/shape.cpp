#include "tensor/shape.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_join.h"
#include "tensor/error.h"

namespace kiln {

std::string shape_str(IntArrayRef sizes) {
  return absl::StrCat("[", absl::StrJoin(sizes, ", "), "]");
}

int64_t numel_of(IntArrayRef sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (s == 0) return 0;
  }
  for (int64_t s : sizes) {
    KILN_CHECK(!__builtin_mul_overflow(n, s, &n), "[shape] ", shape_str(sizes),
               " has more elements than an int64 can count");
  }
  return n;
}

Shape contiguous_strides(IntArrayRef sizes) {
  Shape strides(sizes.size());
  int64_t stride = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    strides[i] = stride;
    KILN_CHECK(!__builtin_mul_overflow(stride, std::max<int64_t>(sizes[i], 1), &stride),
               "[shape] the strides of ", shape_str(sizes), " overflow an int64");
  }
  return strides;
}

int64_t layout_extent(IntArrayRef sizes, IntArrayRef strides, const char* op) {
  KILN_CHECK(sizes.size() == strides.size(), "[", op, "] sizes ", shape_str(sizes),
             " and strides ", shape_str(strides), " have different lengths");
  int64_t extent = 1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    KILN_CHECK(sizes[i] >= 0 && strides[i] >= 0, "[", op, "] negative size or stride in ",
               shape_str(sizes), " / ", shape_str(strides));
    if (sizes[i] == 0) return 0;
  }
  for (size_t i = 0; i < sizes.size(); ++i) {
    int64_t span = 0;
    KILN_CHECK(!__builtin_mul_overflow(sizes[i] - 1, strides[i], &span) &&
                   !__builtin_add_overflow(extent, span, &extent),
               "[", op, "] sizes ", shape_str(sizes), " with strides ", shape_str(strides),
               " span more elements than an int64 can count");
  }
  return extent;
}

size_t nbytes_of(IntArrayRef sizes, size_t element_size, const char* op) {
  int64_t bytes = 0;
  KILN_CHECK(!__builtin_mul_overflow(numel_of(sizes), static_cast<int64_t>(element_size), &bytes),
             "[", op, "] ", shape_str(sizes), " of ", element_size,
             "-byte elements is more bytes than an int64 can count");
  return static_cast<size_t>(bytes);
}

Shape dense_strides_like(IntArrayRef sizes, IntArrayRef strides) {
  const size_t n = sizes.size();
  std::vector<size_t> order;  // the dims of size > 1, outermost first
  for (size_t d = 0; d < n; ++d) {
    if (sizes[d] == 1) continue;
    if (strides[d] < 0 || strides[d] == 0) return contiguous_strides(sizes);
    order.push_back(d);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return strides[a] > strides[b]; });
  Shape out(n, 0);
  int64_t stride = 1;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    out[*it] = stride;
    stride *= std::max<int64_t>(sizes[*it], 1);
  }
  // Size-1 dims: the stride of the next dim times its size, as contiguous_strides gives.
  for (size_t i = n; i-- > 0;) {
    if (sizes[i] != 1) continue;
    out[i] = i + 1 < n ? out[i + 1] * std::max<int64_t>(sizes[i + 1], 1) : 1;
  }
  return out;
}

bool is_contiguous_layout(IntArrayRef sizes, IntArrayRef strides) {
  int64_t expected = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    if (sizes[i] == 0) return true;
    if (sizes[i] != 1 && strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t n = std::max<int64_t>(ndim, 1);
  KILN_CHECK(dim >= -n && dim < n, "[", op, "] dim ", dim, " is out of range for a tensor with ",
             ndim, " dims (expected a dim in [", -n, ", ", n - 1, "])");
  return dim < 0 ? dim + n : dim;
}

Shape broadcast_shapes(IntArrayRef a, IntArrayRef b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t sa = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t sb = i < n - b.size() ? 1 : b[i - (n - b.size())];
    KILN_CHECK(sa == sb || sa == 1 || sb == 1, "[", op, "] shapes ", shape_str(a), " and ",
               shape_str(b), " cannot be broadcast together (dim ", i, ": ", sa, " vs ", sb, ")");
    out[i] = sa == 1 ? sb : sa;
  }
  return out;
}

Shape infer_size(IntArrayRef sizes, int64_t numel, const char* op) {
  Shape out(sizes.begin(), sizes.end());
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == -1) {
      KILN_CHECK(infer < 0, "[", op, "] only one dimension can be inferred, got ",
                 shape_str(sizes));
      infer = static_cast<int>(i);
    } else {
      KILN_CHECK(sizes[i] >= 0, "[", op, "] invalid size ", sizes[i], " in ", shape_str(sizes));
      KILN_CHECK(!__builtin_mul_overflow(known, sizes[i], &known), "[", op, "] shape ",
                 shape_str(sizes), " has more elements than an int64 can count");
    }
  }
  if (infer >= 0) {
    KILN_CHECK(known != 0 && numel % known == 0, "[", op, "] shape ", shape_str(sizes),
               " is invalid for input of size ", numel);
    out[infer] = numel / known;
  } else {
    KILN_CHECK(known == numel, "[", op, "] shape ", shape_str(sizes),
               " is invalid for input of size ", numel);
  }
  return out;
}

Shape reduction_dims(IntArrayRef dims, int64_t ndim, const char* op) {
  Shape out;
  if (dims.empty()) {
    for (int64_t i = 0; i < ndim; ++i) out.push_back(i);
    return out;
  }
  for (int64_t d : dims) out.push_back(wrap_dim(d, ndim, op));
  std::sort(out.begin(), out.end());
  KILN_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), "[", op, "] dim ",
             *std::adjacent_find(out.begin(), out.end()), " appears more than once in ",
             shape_str(dims));
  if (ndim == 0) out.clear();  // dims 0 / -1 of a 0-d tensor reduce nothing
  return out;
}

}  // namespace kiln
