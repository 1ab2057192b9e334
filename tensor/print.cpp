// operator<< for tensors, in PyTorch's repr format.
#include <cmath>
#include <iomanip>
#include <sstream>

#include "tensor/ops.h"

namespace kiln {
namespace {

void print_rec(std::ostream& os, const std::vector<double>& v, IntArrayRef sizes, int64_t dim,
               int64_t& pos, bool is_float, int indent) {
  if (dim == static_cast<int64_t>(sizes.size())) {
    const double x = v[pos++];
    if (is_float) {
      os << x;
    } else {
      os << static_cast<int64_t>(x);
    }
    return;
  }
  os << "[";
  for (int64_t i = 0; i < sizes[dim]; ++i) {
    if (i > 0) {
      os << ",";
      if (dim + 1 < static_cast<int64_t>(sizes.size())) {
        os << "\n" << std::string(indent + dim + 1, ' ');
      } else {
        os << " ";
      }
    }
    print_rec(os, v, sizes, dim + 1, pos, is_float, indent);
  }
  os << "]";
}

}  // namespace

std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "[ Tensor (undefined) ]";
  std::ostringstream body;
  if (t.is_meta()) {
    body << "...";
  } else {
    const std::vector<double> v = t.to_vector<double>();
    int64_t pos = 0;
    print_rec(body, v, t.sizes(), 0, pos, t.is_floating_point(), 7);
  }
  os << "tensor(" << body.str();
  if (t.dtype() != default_dtype() && t.dtype() != kInt64 && t.dtype() != kBool) {
    os << ", dtype=kiln." << dtype_name(t.dtype());
  }
  if (!t.is_cpu()) os << ", device='" << t.device().str() << "'";
  return os << ")";
}

}  // namespace kiln
