#include "tensor/dtype.h"

#include <atomic>

namespace kiln {

size_t element_size(ScalarType t) {
  return visit_dtype(t, []<typename T>(TypeTag<T>) { return sizeof(T); });
}

std::string_view dtype_name(ScalarType t) {
  switch (t) {
    case kBool: return "bool";
    case kUInt8: return "uint8";
    case kInt32: return "int32";
    case kInt64: return "int64";
    case kHalf: return "float16";
    case kBFloat16: return "bfloat16";
    case kFloat: return "float32";
    case kDouble: return "float64";
  }
  return "unknown";
}

std::ostream& operator<<(std::ostream& os, ScalarType t) { return os << dtype_name(t); }

ScalarType promote_types(ScalarType a, ScalarType b) {
  if (a == b) return a;
  const bool fa = is_floating_point(a), fb = is_floating_point(b);
  if (fa != fb) return fa ? a : b;  // float wins over int and bool
  if (fa) {
    if (is_reduced_float(a) && is_reduced_float(b)) return kFloat;  // half + bfloat16
    auto rank = [](ScalarType t) { return t == kDouble ? 3 : t == kFloat ? 2 : 1; };
    return rank(a) >= rank(b) ? a : b;
  }
  if (a == kBool) return b;
  if (b == kBool) return a;
  // uint8 < int32 < int64: every signed type here holds all of uint8's values.
  auto rank = [](ScalarType t) { return t == kInt64 ? 3 : t == kInt32 ? 2 : 1; };
  return rank(a) >= rank(b) ? a : b;
}

namespace {
std::atomic<ScalarType> g_default_dtype{kFloat};
}

ScalarType default_dtype() { return g_default_dtype.load(std::memory_order_relaxed); }

void set_default_dtype(ScalarType t) {
  KILN_CHECK(is_floating_point(t), "[set_default_dtype] expected a floating-point dtype, got ",
             dtype_name(t));
  g_default_dtype.store(t, std::memory_order_relaxed);
}

}  // namespace kiln
