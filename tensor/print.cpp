// operator<< for tensors, in the format of Python PyTorch's repr (torch/_tensor_str.py with the
// default print options: precision 4, line width 80, threshold 1000, 3 edge items):
//
//   tensor([[ 1.5000, -2.0000],
//           [ 0.2500,     nan]], dtype=kiln.float64, requires_grad=True)
//
// One formatter per tensor picks the style from the (summarised) values: integers print
// plainly; floats print as `1.` when all finite values are integers, with 4 decimals
// otherwise, and in scientific notation when the finite nonzero magnitudes span more than
// 1000x or exceed 1e8 (or, with decimals, fall below 1e-4). Every element is right-aligned to
// the widest, rows wrap at 80 columns, and tensors over 1000 elements show the first and last
// 3 entries of each dim around `...`. A tensor with a grad_fn prints requires_grad=True (the
// grad_fn name is not shown yet).
#include <cmath>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "tensor/ops.h"

namespace kiln {
namespace {

constexpr int kPrecision = 4;
constexpr int kLineWidth = 80;
constexpr int64_t kEdgeItems = 3;
constexpr int64_t kThreshold = 1000;

std::string printf_double(const char* fmt, double v) {
  char buf[64];
  const int n = std::snprintf(buf, sizeof(buf), fmt, kPrecision, v);
  return std::string(buf, static_cast<size_t>(n));
}

// Python's spelling of non-finite floats (printf may write "-nan").
bool nonfinite_str(double v, std::string& out) {
  if (std::isnan(v)) {
    out = "nan";
  } else if (std::isinf(v)) {
    out = v > 0 ? "inf" : "-inf";
  } else {
    return false;
  }
  return true;
}

std::string fixed_str(double v, int precision) {
  std::string s;
  if (nonfinite_str(v, s)) return s;
  char buf[400];
  const int n = std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return std::string(buf, static_cast<size_t>(n));
}

std::string sci_str(double v) {
  std::string s;
  if (nonfinite_str(v, s)) return s;
  return printf_double("%.*e", v);
}

// The tensor's elements on the host, row-major, as doubles (floating dtypes) or int64.
struct HostData {
  bool floating = false;
  bool boolean = false;
  Shape sizes;
  Shape strides;  // contiguous
  std::vector<double> f;
  std::vector<int64_t> i;
};

class Formatter {
 public:
  Formatter(const HostData& d, const std::vector<int64_t>& shown) : d_(d) {
    if (!d.floating) {
      for (int64_t k : shown) max_width_ = std::max(max_width_, static_cast<int>(plain(k).size()));
      return;
    }
    std::vector<double> vals;
    for (int64_t k : shown) {
      const double v = d.f[static_cast<size_t>(k)];
      if (std::isfinite(v) && v != 0.0) vals.push_back(v);
    }
    if (vals.empty()) return;
    double lo = std::abs(vals[0]), hi = lo;
    for (double v : vals) {
      lo = std::min(lo, std::abs(v));
      hi = std::max(hi, std::abs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    if (int_mode_) {
      sci_mode_ = hi / lo > 1000.0 || hi > 1.0e8;
    } else {
      sci_mode_ = hi / lo > 1000.0 || hi > 1.0e8 || lo < 1.0e-4;
    }
    for (double v : vals) {
      const int len = sci_mode_   ? static_cast<int>(sci_str(v).size())
                      : int_mode_ ? static_cast<int>(fixed_str(v, 0).size()) + 1
                                  : static_cast<int>(fixed_str(v, kPrecision).size());
      max_width_ = std::max(max_width_, len);
    }
  }

  int width() const { return max_width_; }

  // Element k, padded on the left to the common width.
  std::string format(int64_t k) const {
    std::string s;
    if (!d_.floating) {
      s = plain(k);
    } else {
      const double v = d_.f[static_cast<size_t>(k)];
      if (sci_mode_) {
        s = sci_str(v);
      } else if (int_mode_) {
        s = fixed_str(v, 0);
        if (std::isfinite(v)) s += ".";
      } else {
        s = fixed_str(v, kPrecision);
      }
    }
    if (static_cast<int>(s.size()) < max_width_) s.insert(0, max_width_ - s.size(), ' ');
    return s;
  }

 private:
  std::string plain(int64_t k) const {
    const int64_t v = d_.i[static_cast<size_t>(k)];
    if (d_.boolean) return v != 0 ? "True" : "False";
    return std::to_string(v);
  }

  const HostData& d_;
  bool int_mode_ = true;
  bool sci_mode_ = false;
  int max_width_ = 1;
};

// The element offsets that will be printed (all, or the edges of each dim when summarising).
void shown_offsets(const HostData& d, size_t dim, int64_t offset, bool summarize,
                   std::vector<int64_t>& out) {
  if (dim == d.sizes.size()) {
    out.push_back(offset);
    return;
  }
  const int64_t n = d.sizes[dim];
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && n > 2 * kEdgeItems && i == kEdgeItems) i = n - kEdgeItems;
    shown_offsets(d, dim + 1, offset + i * d.strides[dim], summarize, out);
  }
}

std::string vector_str(const HostData& d, const Formatter& fmt, int64_t offset, int indent,
                       bool summarize) {
  const int64_t n = d.sizes.back();
  const int64_t stride = d.strides.back();
  const int element_length = fmt.width() + 2;
  const int64_t per_line = std::max(1, (kLineWidth - indent) / element_length);
  std::vector<std::string> items;
  for (int64_t i = 0; i < n; ++i) {
    if (summarize && n > 2 * kEdgeItems && i == kEdgeItems) {
      items.push_back(" ...");
      i = n - kEdgeItems;
    }
    items.push_back(fmt.format(offset + i * stride));
  }
  std::string s = "[";
  for (size_t k = 0; k < items.size(); ++k) {
    if (k > 0) {
      s += k % per_line == 0 ? ",\n" + std::string(indent + 1, ' ') : ", ";
    }
    s += items[k];
  }
  return s + "]";
}

std::string tensor_str(const HostData& d, const Formatter& fmt, size_t dim, int64_t offset,
                       int indent, bool summarize) {
  const size_t ndim = d.sizes.size();
  if (ndim == 0) return fmt.format(offset);
  if (dim + 1 == ndim) return vector_str(d, fmt, offset, indent, summarize);
  const int64_t n = d.sizes[dim];
  const std::string sep = "," + std::string(ndim - dim - 1, '\n') + std::string(indent + 1, ' ');
  std::string s = "[";
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) s += sep;
    if (summarize && n > 2 * kEdgeItems && i == kEdgeItems) {
      s += "..." + sep;
      i = n - kEdgeItems;
    }
    s += tensor_str(d, fmt, dim + 1, offset + i * d.strides[dim], indent + 1, summarize);
  }
  return s + "]";
}

// Python's str() of a shape tuple: (), (3,), (2, 0).
std::string tuple_str(IntArrayRef sizes) {
  std::string s = "(";
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (k > 0) s += ", ";
    s += std::to_string(sizes[k]);
  }
  if (sizes.size() == 1) s += ",";
  return s + ")";
}

std::string body_str(const Tensor& t, int indent) {
  HostData d;
  d.sizes = to_shape(t.sizes());
  d.strides = contiguous_strides(t.sizes());
  d.floating = t.is_floating_point();
  d.boolean = t.dtype() == kBool;
  if (d.floating) {
    d.f = t.to_vector<double>();
  } else {
    d.i = t.to_vector<int64_t>();
  }
  const bool summarize = t.numel() > kThreshold;
  std::vector<int64_t> shown;
  shown_offsets(d, 0, 0, summarize, shown);
  const Formatter fmt(d, shown);
  return tensor_str(d, fmt, 0, 0, indent, summarize);
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "[ Tensor (undefined) ]";
  KILN_CHECK(!t.impl()->storage()->is_proxy(), "[print] prints the values of a tensor of shape ",
             shape_str(t.sizes()),
             " while kiln::compile traces the function, when values are "
             "not known yet: return the tensor from the compiled function and print it outside");
  const std::string prefix = "tensor(";
  const int indent = static_cast<int>(prefix.size());
  std::vector<std::string> suffixes;
  if (!t.is_cpu()) suffixes.push_back("device='" + t.device().str() + "'");
  const std::string dtype_suffix = "dtype=kiln." + std::string(dtype_name(t.dtype()));
  std::string body;
  if (t.is_meta()) {
    suffixes.push_back("size=" + tuple_str(t.sizes()));
    if (t.dtype() != default_dtype()) suffixes.push_back(dtype_suffix);
    body = "...";
  } else if (t.numel() == 0) {
    // As PyTorch: the shape unless it is (0,), and the dtype, which no element shows.
    if (t.dim() != 1) suffixes.push_back("size=" + tuple_str(t.sizes()));
    if (t.dtype() != default_dtype()) suffixes.push_back(dtype_suffix);
    body = "[]";
  } else {
    if (t.dtype() != default_dtype() && t.dtype() != kInt64 && t.dtype() != kBool) {
      suffixes.push_back(dtype_suffix);
    }
    body = body_str(t, indent);
  }
  if (t.requires_grad()) suffixes.push_back("requires_grad=True");

  // Suffixes go on the last line unless they would pass the line width.
  std::string s = prefix + body;
  const size_t nl = s.rfind('\n');
  int64_t last_line_len = static_cast<int64_t>(s.size()) -
                          (nl == std::string::npos ? -1 : static_cast<int64_t>(nl)) + 1;
  for (const std::string& suffix : suffixes) {
    const int64_t len = static_cast<int64_t>(suffix.size());
    if (last_line_len + len + 2 > kLineWidth) {
      s += ",\n" + std::string(indent, ' ') + suffix;
      last_line_len = indent + len;
    } else {
      s += ", " + suffix;
      last_line_len += len + 2;
    }
  }
  return os << s << ")";
}

}  // namespace kiln
