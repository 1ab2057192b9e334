// fused_cuda's code generator (compiler/fused_cuda_codegen.h): each member of a region as a
// storage-typed expression of its inputs' names.
#include <cctype>

#include "compiler/fused_cuda_codegen.h"
#include "kernels/scalar_fn.h"

namespace kiln::compiler::internal {

std::string Generator::constant(ScalarType t, uint64_t bits) {
  const std::string name = "k" + std::to_string(constants_.size());
  constants_.push_back({t, bits});
  return name;
}

// Input j of `op` read as a value of storage dtype `as`.
std::string Generator::read_as(const BoundOp& op, size_t j, ScalarType as) {
  const int v = op.inputs[j];
  return convert(var(v), spec(v).dtype, as);
}

namespace {

// The functor of kernels/scalar_fn.h that eager's unary kernel of `op` applies.
std::string functor_name(const std::string& op) {
  static const absl::flat_hash_map<std::string_view, std::string_view> names = {
      {"exp", "Exp"},
      {"log", "Log"},
      {"log1p", "Log1p"},
      {"expm1", "Expm1"},
      {"sqrt", "Sqrt"},
      {"rsqrt", "Rsqrt"},
      {"sin", "Sin"},
      {"cos", "Cos"},
      {"tanh", "Tanh"},
      {"sigmoid", "Sigmoid"},
      {"silu", "Silu"},
      {"erf", "Erf"},
      {"reciprocal", "Reciprocal"},
      {"neg", "Neg"},
      {"abs", "Abs"},
      {"relu", "Relu"},
      {"sign", "Sign"},
      {"square", "Square"},
      {"floor", "Floor"},
      {"ceil", "Ceil"},
      {"round", "Round"}};
  const auto it = names.find(op);
  KILN_CHECK(it != names.end(), "[fused_cuda] internal: no functor for ", op);
  return std::string(it->second);
}

}  // namespace

// The storage-typed expression of one member.
std::string Generator::member_expr(const BoundOp& op) {
  const std::string& n = op.name();
  const ScalarType out = spec(op.outputs[0]).dtype;
  const ScalarType m = opmath(out);
  const std::string mc = ctype(m);
  if (float_unary_ops().contains(n)) {
    const std::string x = to_m(read_as(op, 0, out), out);
    std::string fn;
    if (n == "gelu") {
      const auto* approx = attr_if<std::string>(op, 0);
      fn = approx != nullptr && *approx == "tanh" ? "GeluTanh" : "GeluExact";
    } else if (n == "exp" && fast_.contains(op.outputs[0])) {
      // ex2.approx: within 2 + 1.2 |x| ulp of exp(x) (2^-16 relative at |x| = 100), results
      // below 2^-126 flushed to zero: far below a 16-bit rounding.
      return "__expf(" + x + ")";
    } else if (n == "exp" && out == kBFloat16) {
      // x is a bf16 value (read_as rounds the input to bf16) and the result is rounded to bf16.
      return from_m("kexp_bf16(" + x + ")", out);
    } else {
      fn = functor_name(n);
    }
    return from_m("scalar::" + fn + "::apply<" + mc + ">(" + x + ")", out);
  }
  if (numeric_unary_ops().contains(n)) {
    const std::string x0 = read_as(op, 0, out);
    if (out == kBool) return x0;  // sign of bools
    const std::string x = to_m(x0, out);
    return from_m("scalar::" + functor_name(n) + "::apply<" + mc + ">(" + x + ")", out);
  }
  if (n == "logical_not") {
    const ScalarType in = spec(op.inputs[0]).dtype;
    return "(" + to_m(var(op.inputs[0]), in) + " == " + ctype(opmath(in)) + "(0))";
  }
  if (n == "bitwise_not") {
    const std::string x = read_as(op, 0, out);
    return out == kBool ? "!" + x : "static_cast<" + ctype(out) + ">(~" + x + ")";
  }
  if (n == "pow_tensor_scalar") {
    const Scalar& e = std::get<Scalar>(op.attrs[0]);
    const std::string x0 = read_as(op, 0, out);
    if (!is_float(out)) {
      const std::string k = constant(kInt64, bits_of(e.toLong()));
      return "scalar::int_pow_scalar<" + mc + ">(" + x0 + ", " + k + ")";
    }
    const std::string x = to_m(x0, out);
    // kernels/unary_fn.h's FloatPowScalar: pow_scalar of the exponent's kind (the exponent is
    // read by the general kind only).
    std::string kind, k = mc + "(0)";
    switch (scalar::pow_kind(e.toDouble())) {
      case scalar::PowKind::kSquare:
        kind = "kSquare";
        break;
      case scalar::PowKind::kCube:
        kind = "kCube";
        break;
      case scalar::PowKind::kSqrt:
        kind = "kSqrt";
        break;
      case scalar::PowKind::kRsqrt:
        kind = "kRsqrt";
        break;
      case scalar::PowKind::kReciprocal:
        kind = "kReciprocal";
        break;
      case scalar::PowKind::kInvSquare:
        kind = "kInvSquare";
        break;
      case scalar::PowKind::kGeneral:
        kind = "kGeneral";
        k = m == kDouble ? constant_of(e.toDouble())
                         : constant_of(static_cast<float>(e.toDouble()));
        break;
    }
    const std::string r =
        "scalar::pow_scalar<scalar::PowKind::" + kind + ", " + mc + ">(" + x + ", " + k + ")";
    return from_m(r, out);
  }
  if (arithmetic_ops().contains(n) || compare_ops().contains(n) || logical_ops().contains(n)) {
    return binary_expr(op, out);
  }
  if (n == "gelu_backward") {  // kernels/binary_fn.h's GeluBackwardFn, as eager computes it
    const std::string fn =
        *attr_if<std::string>(op, 0) == "tanh" ? "GeluTanhGrad" : "GeluExactGrad";
    const std::string g = to_m(read_as(op, 0, out), out);
    const std::string x = to_m(read_as(op, 1, out), out);
    return from_m("(" + g + " * scalar::" + fn + "::apply<" + mc + ">(" + x + "))", out);
  }
  if (n == "where") {
    const ScalarType dt = has_attr(op, 0) ? std::get<ScalarType>(op.attrs[0])
                                          : result_type_of(t_, op.inputs[1], op.inputs[2]);
    return "(" + read_as(op, 0, kBool) + " ? " + read_as(op, 1, dt) + " : " + read_as(op, 2, dt) +
           ")";
  }
  if (n == "clamp") {
    std::string lo, hi;
    visit_dtype(out, [&]<typename T>(TypeTag<T>) {
      if constexpr (!std::is_same_v<T, bool>) {
        using M = opmath_t<T>;
        const M l =
            has_attr(op, 0) ? M(std::get<Scalar>(op.attrs[0]).to<T>()) : scalar::clamp_lowest<M>();
        const M h =
            has_attr(op, 1) ? M(std::get<Scalar>(op.attrs[1]).to<T>()) : scalar::clamp_highest<M>();
        lo = constant_of(l);
        hi = constant_of(h);
      }
    });
    return from_m(
        "scalar::clamp<" + mc + ">(" + to_m(read_as(op, 0, out), out) + ", " + lo + ", " + hi + ")",
        out);
  }
  if (n == "lerp") {
    const std::string s = to_m(read_as(op, 0, out), out), e = to_m(read_as(op, 1, out), out);
    std::string w;
    if (op.inputs.size() == 3) {
      w = to_m(read_as(op, 2, out), out);
    } else if (m == kDouble) {
      w = constant_of(std::get<Scalar>(op.attrs[0]).to<double>());
    } else {
      w = constant_of(std::get<Scalar>(op.attrs[0]).to<float>());
    }
    return from_m("scalar::lerp<" + mc + ">(" + s + ", " + e + ", " + w + ")", out);
  }
  if (n == "to_copy") return read_as(op, 0, out);
  KILN_FAIL("[fused_cuda] internal: no expression for ", n);
}

// The binary ops of kernels/binary_fn.h: T the common dtype, a 0-d operand read as opmath
// (arithmetic) or rounded to T (comparisons, logical ops), f on opmath values, cast to out.
std::string Generator::binary_expr(const BoundOp& op, ScalarType out) {
  const std::string& n = op.name();
  const bool arithmetic = arithmetic_ops().contains(n);
  ScalarType t;
  if (n == "add" || n == "sub") {
    t = common_dtype(t_, op, 1);
  } else if (n == "div") {
    t = has_attr(op, 0) ? common_dtype(t_, op, 1) : out;  // true division: out's float dtype
  } else if (n == "atan2") {
    t = out;
  } else if (logical_ops().contains(n)) {
    t = result_type_of(t_, op.inputs[0], op.inputs[1]);
  } else {
    t = common_dtype(t_, op, 0);
  }
  const ScalarType m = opmath(t);
  const ScalarType s = arithmetic ? m : t;  // how a 0-d operand is read
  const bool a0 = spec(op.inputs[0]).sizes.empty(), b0 = spec(op.inputs[1]).sizes.empty();
  const ScalarType as_a = !b0 && a0 ? s : t;
  const ScalarType as_b = b0 ? s : t;
  const std::string x = to_m(read_as(op, 0, as_a), as_a);
  const std::string y = to_m(read_as(op, 1, as_b), as_b);
  const std::string mc = ctype(m);
  std::string e;
  if (n == "add" || n == "sub") {
    Scalar alpha = std::get<Scalar>(op.attrs[0]);
    if (n == "sub") alpha = -alpha;
    std::string k;
    visit_dtype(m, [&]<typename M>(TypeTag<M>) { k = constant_of(alpha.to<M>()); });
    e = "f_add<" + mc + ">(" + x + ", " + y + ", " + k + ")";
  } else if (n == "mul") {
    e = "(" + x + " * " + y + ")";
  } else if (n == "div") {
    if (!has_attr(op, 0)) {
      // bf16 values (t is out) divided by one of the row's: through the row's reciprocal; in
      // float for 16-bit values, by its reciprocal (within an ulp of the quotient).
      const bool by_row = !a0 && !b0 && per_row_.contains(op.inputs[1]);
      if (by_row && out == kBFloat16) {
        e = "kdiv_row_bf16(" + x + ", " + y + ")";
      } else if (by_row && fast_.contains(op.outputs[0])) {
        e = "(" + x + " * (1.0f / " + y + "))";
      } else {
        e = "(" + x + " / " + y + ")";
      }
    } else if (std::get<std::string>(op.attrs[0]) == "floor") {
      e = "scalar::floor_div_float<" + mc + ">(" + x + ", " + y + ")";
    } else {
      e = "scalar::math::trunc(" + x + " / " + y + ")";
    }
  } else if (n == "pow") {
    if (is_float(t)) {
      e = "scalar::math::pow(" + x + ", " + y + ")";
    } else {
      e = "scalar::int_pow<" + mc + ">(" + x + ", " + y + ")";
    }
  } else if (n == "maximum" || n == "minimum") {
    e = std::string("scalar::max_min<") + (n == "maximum" ? "true" : "false") + ", " + mc + ">(" +
        x + ", " + y + ")";
  } else if (n == "atan2") {
    e = "scalar::math::atan2(" + x + ", " + y + ")";
  } else if (const auto it = compare_ops().find(n); it != compare_ops().end()) {
    e = "(" + x + " " + std::string(it->second) + " " + y + ")";
  } else {
    const std::string p = "(" + x + " != " + mc + "(0))", q = "(" + y + " != " + mc + "(0))";
    e = "(" + p + (n == "logical_and" ? " && " : n == "logical_or" ? " || " : " != ") + q + ")";
  }
  return from_m(e, out);
}

namespace {

// `e` with each name of `names` replaced by its text.
std::string substituted(const std::string& e,
                        const absl::flat_hash_map<std::string, std::string>& names) {
  std::string out;
  for (size_t a = 0; a < e.size();) {
    if (!std::isalpha(static_cast<unsigned char>(e[a])) && e[a] != '_') {
      out += e[a++];
      continue;
    }
    size_t b = a;
    while (b < e.size() && (std::isalnum(static_cast<unsigned char>(e[b])) || e[b] == '_')) ++b;
    const std::string word = e.substr(a, b - a);
    const auto it = names.find(word);
    out += it != names.end() ? it->second : word;
    a = b;
  }
  return out;
}

}  // namespace

std::string Generator::pair_expr(size_t i, const absl::flat_hash_map<std::string, std::string>& lo,
                                 const absl::flat_hash_map<std::string, std::string>& hi) const {
  // The expression is "kbf(f)" where its first parenthesis closes last.
  const std::string& e = exprs_[i];
  if (!e.starts_with("kbf(") || e.back() != ')') return "";
  int depth = 0;
  for (size_t c = 3; c + 1 < e.size(); ++c) {
    depth += e[c] == '(' ? 1 : e[c] == ')' ? -1 : 0;
    if (depth == 0) return "";  // closed before the end: "kbf(a) + kbf(b)"
  }
  const std::string f = e.substr(4, e.size() - 5);
  return "kbf2(" + substituted(f, lo) + ", " + substituted(f, hi) + ")";
}

}  // namespace kiln::compiler::internal
