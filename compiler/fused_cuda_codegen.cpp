// fused_cuda's code generator (compiler/fused_cuda_codegen.h): the type helpers and the ops it
// writes. Plain C++ (no CUDA header): it runs, and is tested, on machines without a GPU.
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {

// --- Types ---------------------------------------------------------------------------------------

std::string ctype(ScalarType t) {
  switch (t) {
    case kBool:
      return "bool";
    case kUInt8:
      return "u8";
    case kInt32:
      return "int";
    case kInt64:
      return "i64";
    case kHalf:
      return "f16";
    case kBFloat16:
      return "bf16";
    case kFloat:
      return "float";
    case kDouble:
      return "double";
  }
  return "?";
}

std::string bits_fn(ScalarType t) {
  switch (t) {
    case kBool:
      return "kbits_bool";
    case kUInt8:
      return "kbits_u8";
    case kInt32:
      return "kbits_i32";
    case kInt64:
      return "kbits_i64";
    case kHalf:
      return "kbits_f16";
    case kBFloat16:
      return "kbits_bf16";
    case kFloat:
      return "kbits_float";
    case kDouble:
      return "kbits_double";
  }
  return "?";
}

ScalarType opmath(ScalarType t) { return is_reduced_float(t) ? kFloat : t; }
bool is_float(ScalarType t) { return is_floating_point(t); }

// A storage value as its opmath value (static_cast<opmath_t<T>>).
std::string to_m(const std::string& x, ScalarType t) {
  return is_reduced_float(t) ? "kf(" + x + ")" : x;
}

// An opmath-typed (or promoted) expression cast to storage type t (static_cast<T>, T(float)).
std::string from_m(const std::string& e, ScalarType t) {
  if (t == kBFloat16) return "kbf(" + e + ")";
  if (t == kHalf) return "kh(" + e + ")";
  return "static_cast<" + ctype(t) + ">(" + e + ")";
}

// scalar::convert<D, S>: through S's opmath type. The identity when S == D (as_dtype's no-op).
std::string convert(const std::string& x, ScalarType from, ScalarType to) {
  if (from == to) return x;
  const std::string m = to_m(x, from);
  const ScalarType mt = opmath(from);
  if (to == kBool) return "(" + m + " != " + ctype(mt) + "(0))";
  if (to == kBFloat16) return "kbf(static_cast<float>(" + m + "))";
  if (to == kHalf) return "kh(static_cast<float>(" + m + "))";
  if (to == kUInt8) return "scalar::to_uint8(" + m + ")";
  return "static_cast<" + ctype(to) + ">(" + m + ")";
}

// torch.result_type of two values (tensor/ops/binary.cpp's ResultTypeBuilder): dimensioned
// tensors first, then 0-d ones, a lower group counting only for a higher category.
ScalarType result_type_of(const Trace& t, int a, int b) {
  auto category = [](ScalarType s) { return s == kBool ? 0 : is_floating_point(s) ? 2 : 1; };
  std::optional<ScalarType> dim, zero;
  for (int v : {a, b}) {
    const TensorSpec& s = t.value(v).spec;
    std::optional<ScalarType>& acc = s.sizes.empty() ? zero : dim;
    acc = acc ? promote_types(*acc, s.dtype) : s.dtype;
  }
  if (!dim) return *zero;
  if (!zero || category(*zero) <= category(*dim)) return *dim;
  return promote_types(*dim, *zero);
}

bool has_attr(const BoundOp& op, size_t i) {
  return i < op.attrs.size() && !std::holds_alternative<std::monostate>(op.attrs[i]);
}

// The common dtype of a binary op (binary_common_dtype): attribute `at` or the result type.
ScalarType common_dtype(const Trace& t, const BoundOp& op, size_t at) {
  if (const auto* d = attr_if<ScalarType>(op, at)) return *d;
  return result_type_of(t, op.inputs[0], op.inputs[1]);
}

const absl::flat_hash_set<std::string_view>& float_unary_ops() {
  static const absl::flat_hash_set<std::string_view> ops = {
      "exp", "log",  "log1p",   "expm1", "sqrt", "rsqrt",      "sin",
      "cos", "tanh", "sigmoid", "silu",  "erf",  "reciprocal", "gelu"};
  return ops;
}
const absl::flat_hash_set<std::string_view>& numeric_unary_ops() {
  static const absl::flat_hash_set<std::string_view> ops = {"neg",    "abs",   "relu", "sign",
                                                            "square", "floor", "ceil", "round"};
  return ops;
}
const absl::flat_hash_set<std::string_view>& arithmetic_ops() {
  static const absl::flat_hash_set<std::string_view> ops = {"add", "sub",     "mul",     "div",
                                                            "pow", "maximum", "minimum", "atan2"};
  return ops;
}
const absl::flat_hash_map<std::string_view, std::string_view>& compare_ops() {
  static const absl::flat_hash_map<std::string_view, std::string_view> ops = {
      {"eq", "=="}, {"ne", "!="}, {"lt", "<"}, {"le", "<="}, {"gt", ">"}, {"ge", ">="}};
  return ops;
}
const absl::flat_hash_set<std::string_view>& logical_ops() {
  static const absl::flat_hash_set<std::string_view> ops = {"logical_and", "logical_or",
                                                            "logical_xor"};
  return ops;
}

}  // namespace kiln::compiler::internal
