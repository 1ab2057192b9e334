// fused_cuda's code generator (compiler/fused_cuda_codegen.h): each member of a region as a
// storage-typed expression of its inputs' names.
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
      fn = approx != nullptr && *approx == "tanh" ? "f_gelu_tanh" : "f_gelu_exact";
    } else if (n == "rsqrt" || n == "sigmoid" || n == "silu" || n == "reciprocal") {
      fn = "f_" + n;
    } else {
      fn = "math::" + n;
    }
    return from_m(fn + "(" + x + ")", out);
  }
  if (numeric_unary_ops().contains(n)) {
    const std::string x0 = read_as(op, 0, out);
    if (out == kBool) return x0;  // sign of bools
    const std::string x = to_m(x0, out);
    const bool integral = !is_float(out);
    const bool unsigned_t = out == kUInt8;
    const std::string u = utype(out);
    std::string e;
    if (n == "neg") {
      e = integral ? "wrapping_neg<" + mc + ", " + u + ">(" + x + ")" : "-" + x;
    } else if (n == "abs") {
      e = unsigned_t ? x
          : integral
              ? "(" + x + " < 0 ? wrapping_neg<" + mc + ", " + u + ">(" + x + ") : " + x + ")"
              : "math::abs(" + x + ")";
    } else if (n == "relu") {
      e = unsigned_t ? x : "(" + x + " < " + mc + "(0) ? " + mc + "(0) : " + x + ")";
    } else if (n == "sign") {
      const std::string neg = unsigned_t ? "false" : "(" + x + " < " + mc + "(0))";
      e = "static_cast<" + mc + ">((" + mc + "(0) < " + x + ") - " + neg + ")";
    } else if (n == "square") {
      e = integral ? "wrapping_mul<" + mc + ", " + u + ">(" + x + ", " + x + ")" : x + " * " + x;
    } else if (n == "floor" || n == "ceil") {
      e = integral ? x : "math::" + n + "(" + x + ")";
    } else {  // round
      e = integral ? x : "math::round_half_even(" + x + ")";
    }
    return from_m(e, out);
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
      return "int_pow_scalar<" + mc + ", " + utype(out) + ">(" + x0 + ", " + k + ")";
    }
    const std::string x = to_m(x0, out);
    std::string r;
    switch (scalar::pow_kind(e.toDouble())) {
      case scalar::PowKind::kSquare:
        r = x + " * " + x;
        break;
      case scalar::PowKind::kCube:
        r = "f_pow_cube(" + x + ")";
        break;
      case scalar::PowKind::kSqrt:
        r = "math::sqrt(" + x + ")";
        break;
      case scalar::PowKind::kRsqrt:
        r = "f_rsqrt(" + x + ")";
        break;
      case scalar::PowKind::kReciprocal:
        r = "f_reciprocal(" + x + ")";
        break;
      case scalar::PowKind::kInvSquare:
        r = "f_pow_inv_square(" + x + ")";
        break;
      case scalar::PowKind::kGeneral: {
        const std::string k = m == kDouble ? constant_of(e.toDouble())
                                           : constant_of(static_cast<float>(e.toDouble()));
        r = "math::pow(" + x + ", " + k + ")";
        break;
      }
    }
    return from_m(r, out);
  }
  if (arithmetic_ops().contains(n) || compare_ops().contains(n) || logical_ops().contains(n)) {
    return binary_expr(op, out);
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
    return from_m("f_clamp(" + to_m(read_as(op, 0, out), out) + ", " + lo + ", " + hi + ")", out);
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
    return from_m("f_lerp<" + mc + ">(" + s + ", " + e + ", " + w + ")", out);
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
      e = "(" + x + " / " + y + ")";
    } else if (std::get<std::string>(op.attrs[0]) == "floor") {
      e = "f_floor_div<" + mc + ">(" + x + ", " + y + ")";
    } else {
      e = "math::trunc(" + x + " / " + y + ")";
    }
  } else if (n == "pow") {
    if (is_float(t)) {
      e = "math::pow(" + x + ", " + y + ")";
    } else {
      e = std::string("int_pow<") + (t == kUInt8 ? "false" : "true") + ", " + mc + ", " + utype(t) +
          ">(" + x + ", " + y + ")";
    }
  } else if (n == "maximum" || n == "minimum") {
    e = std::string("f_max_min<") + (n == "maximum" ? "true" : "false") + ", " + mc + ">(" + x +
        ", " + y + ")";
  } else if (n == "atan2") {
    e = "math::atan2(" + x + ", " + y + ")";
  } else if (const auto it = compare_ops().find(n); it != compare_ops().end()) {
    e = "(" + x + " " + std::string(it->second) + " " + y + ")";
  } else {
    const std::string p = "(" + x + " != " + mc + "(0))", q = "(" + y + " != " + mc + "(0))";
    e = "(" + p + (n == "logical_and" ? " && " : n == "logical_or" ? " || " : " != ") + q + ")";
  }
  return from_m(e, out);
}

}  // namespace kiln::compiler::internal
