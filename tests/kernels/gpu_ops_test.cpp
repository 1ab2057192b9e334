// Tests of the CUDA kernels of the generic ops (kernels/cuda/{unary,binary,index,join,factory,
// random}.cu; reductions: gpu_reduce_test.cpp, softmax: gpu_softmax_test.cpp) against the CPU
// kernels: the same op on the same random CPU
// inputs, run on the CPU and on the GPU (x.cuda()), must agree bit for bit for integer, bool
// and data-movement results and within a few ulps for float math. Sizes are odd (1, 7, 1000,
// 65537), inputs include transposed, sliced and broadcast views, 0-d tensors and wrapped
// Scalars, and every dtype the op supports. Suites are named Gpu* (ctest label gpu) and skip
// without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::expect_same;
using test::kAllDtypes;
using test::kFloatDtypes;
using test::kNumericDtypes;
using test::layouts;
using test::name_of;
using test::random_cpu;
using test::to_gpu_like;
using test::Tol;
using test::tol_for;

using test::GpuTest;

class GpuUnary : public GpuTest {};
class GpuBinary : public GpuTest {};
class GpuRandom : public GpuTest {};
class GpuFactory : public GpuTest {};
class GpuIndex : public GpuTest {};
class GpuJoin : public GpuTest {};
class GpuAutograd : public GpuTest {};

const std::vector<Shape> kShapes = {{}, {1}, {7}, {1000}, {65537}, {33, 17}};

// --- Unary -----------------------------------------------------------------------------------

struct UnaryCase {
  std::string name;
  std::function<Tensor(const Tensor&)> fn;
  std::vector<ScalarType> dtypes;
};

TEST_F(GpuUnary, EveryOpEveryDtypeAndLayout) {
  const std::vector<UnaryCase> cases = {
      {"exp", [](const Tensor& x) { return x.exp(); }, kAllDtypes},
      {"log", [](const Tensor& x) { return x.log(); }, kAllDtypes},
      {"log1p", [](const Tensor& x) { return x.log1p(); }, kFloatDtypes},
      {"expm1", [](const Tensor& x) { return x.expm1(); }, kFloatDtypes},
      {"sqrt", [](const Tensor& x) { return x.sqrt(); }, kAllDtypes},
      {"rsqrt", [](const Tensor& x) { return x.rsqrt(); }, kFloatDtypes},
      {"sin", [](const Tensor& x) { return x.sin(); }, kFloatDtypes},
      {"cos", [](const Tensor& x) { return x.cos(); }, kFloatDtypes},
      {"tanh", [](const Tensor& x) { return x.tanh(); }, kNumericDtypes},
      {"sigmoid", [](const Tensor& x) { return x.sigmoid(); }, kFloatDtypes},
      {"erf", [](const Tensor& x) { return x.erf(); }, kFloatDtypes},
      {"reciprocal", [](const Tensor& x) { return x.reciprocal(); }, kFloatDtypes},
      {"silu", [](const Tensor& x) { return x.silu(); }, kFloatDtypes},
      {"gelu", [](const Tensor& x) { return x.gelu(); }, kFloatDtypes},
      {"gelu_tanh", [](const Tensor& x) { return x.gelu("tanh"); }, kFloatDtypes},
      {"neg", [](const Tensor& x) { return x.neg(); }, kNumericDtypes},
      {"abs", [](const Tensor& x) { return x.abs(); }, kNumericDtypes},
      {"relu", [](const Tensor& x) { return x.relu(); }, kNumericDtypes},
      {"floor", [](const Tensor& x) { return x.floor(); }, kNumericDtypes},
      {"ceil", [](const Tensor& x) { return x.ceil(); }, kNumericDtypes},
      {"round", [](const Tensor& x) { return x.round(); }, kNumericDtypes},
      {"sign", [](const Tensor& x) { return x.sign(); }, kAllDtypes},
      {"square", [](const Tensor& x) { return x.square(); }, kAllDtypes},
      {"logical_not", [](const Tensor& x) { return x.logical_not(); }, kAllDtypes},
      {"bitwise_not", [](const Tensor& x) { return ~x; }, {kInt64, kInt32, kBool}},
      {"pow 2", [](const Tensor& x) { return x.pow(2); }, kNumericDtypes},
      {"pow 3", [](const Tensor& x) { return x.pow(3); }, kNumericDtypes},
      {"pow 0.5", [](const Tensor& x) { return x.pow(0.5); }, kNumericDtypes},
      {"pow -1", [](const Tensor& x) { return x.pow(-1); }, kFloatDtypes},
      {"pow -0.5", [](const Tensor& x) { return x.pow(-0.5); }, kFloatDtypes},
      {"pow -2", [](const Tensor& x) { return x.pow(-2); }, kFloatDtypes},
      {"pow 1.7", [](const Tensor& x) { return x.pow(1.7); }, kFloatDtypes},
      {"pow 5 (int)", [](const Tensor& x) { return x.pow(5); }, {kInt64, kInt32}},
  };
  uint64_t seed = 1;
  for (const UnaryCase& uc : cases) {
    for (ScalarType dt : uc.dtypes) {
      for (const Shape& shape : kShapes) {
        const Tensor x = random_cpu(shape, dt, seed++, -4, 4);
        const Tensor expected = uc.fn(x);
        for (const auto& [layout, xv] : layouts(x)) {
          const Tensor got = uc.fn(to_gpu_like(layout, x));
          EXPECT_TRUE(got.is_cuda());
          expect_match(got, expected, tol_for(expected.dtype()),
                       name_of(uc.name, dt, shape, layout));
        }
      }
    }
  }
}

TEST_F(GpuUnary, SpecialValues) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Tensor x = tensor({0.0, -0.0, inf, -inf, nan, 1e-30, -1e30, 0.5, -0.5, 1.5, 2.5, -2.5},
                          TensorOptions(kDouble));
  for (ScalarType dt : kFloatDtypes) {
    const Tensor xd = x.to(dt);
    const Tensor g = xd.cuda();
    for (auto fn : std::vector<std::function<Tensor(const Tensor&)>>{
             [](const Tensor& t) { return t.exp(); }, [](const Tensor& t) { return t.log(); },
             [](const Tensor& t) { return t.sqrt(); }, [](const Tensor& t) { return t.sigmoid(); },
             [](const Tensor& t) { return t.tanh(); }, [](const Tensor& t) { return t.round(); },
             [](const Tensor& t) { return t.sign(); }, [](const Tensor& t) { return t.relu(); },
             [](const Tensor& t) { return t.abs(); },
             [](const Tensor& t) { return t.reciprocal(); },
             [](const Tensor& t) { return t.silu(); }}) {
      expect_match(fn(g), fn(xd), tol_for(dt), std::string("special ") + dtype_name(dt).data());
    }
  }
}

TEST_F(GpuUnary, InPlaceOnViews) {
  for (ScalarType dt : kFloatDtypes) {
    const Tensor x = random_cpu({40, 30}, dt, 11, 0.1, 4);
    Tensor cpu_base = x.clone();
    Tensor gpu_base = x.cuda();
    // A transposed slice of each: the kernels write through strides.
    Tensor cv = cpu_base.t().slice(0, 3, 20);
    Tensor gv = gpu_base.t().slice(0, 3, 20);
    cv.exp_().sqrt_().neg_().relu_();
    gv.exp_().sqrt_().neg_().relu_();
    expect_match(gpu_base, cpu_base, tol_for(dt), std::string("in place ") + dtype_name(dt).data());
    Tensor cv2 = cpu_base.slice(1, 0, std::nullopt, 3);
    Tensor gv2 = gpu_base.slice(1, 0, std::nullopt, 3);
    cv2.neg_();
    gv2.neg_();
    expect_match(gpu_base, cpu_base, tol_for(dt), "neg_ strided");
  }
  for (ScalarType dt : {kInt32, kInt64}) {
    const Tensor x = random_cpu({17, 9}, dt, 12, -50, 50);
    Tensor c = x.clone(), g = x.cuda();
    c.t().neg_().relu_();
    g.t().neg_().relu_();
    expect_same(g, c, "int in place");
  }
}

// --- Binary ----------------------------------------------------------------------------------

struct BinaryCase {
  std::string name;
  std::function<Tensor(const Tensor&, const Tensor&)> fn;
  std::vector<ScalarType> dtypes;
  bool nonzero_rhs = false;  // integer division: keep the divisor away from zero
};

// gelu_backward(a, b; approximate) with a and b broadcast to one shape.
std::function<Tensor(const Tensor&, const Tensor&)> gelu_backward_of(std::string approximate) {
  return [approximate](const Tensor& a, const Tensor& b) {
    static const OpDef& op = KILN_OP(gelu_backward);
    const Shape s = broadcast_shapes(a.sizes(), b.sizes(), "gelu_backward");
    return call_op1(op, {a.expand(s), b.expand(s)}, {approximate});
  };
}

std::vector<BinaryCase> binary_cases() {
  return {
      {"add", [](const Tensor& a, const Tensor& b) { return a + b; }, kAllDtypes},
      {"add alpha", [](const Tensor& a, const Tensor& b) { return a.add(b, 3); }, kNumericDtypes},
      {"sub", [](const Tensor& a, const Tensor& b) { return a - b; }, kNumericDtypes},
      {"sub alpha", [](const Tensor& a, const Tensor& b) { return a.sub(b, 2); }, kNumericDtypes},
      {"mul", [](const Tensor& a, const Tensor& b) { return a * b; }, kAllDtypes},
      {"div", [](const Tensor& a, const Tensor& b) { return a / b; }, kFloatDtypes},
      {"div int", [](const Tensor& a, const Tensor& b) { return a / b; }, {kInt64, kInt32}, true},
      {"div trunc", [](const Tensor& a, const Tensor& b) { return a.div(b, "trunc"); },
       kNumericDtypes, true},
      {"div floor", [](const Tensor& a, const Tensor& b) { return a.div(b, "floor"); },
       kNumericDtypes, true},
      {"pow", [](const Tensor& a, const Tensor& b) { return a.abs().pow(b); }, kNumericDtypes},
      {"maximum", [](const Tensor& a, const Tensor& b) { return a.maximum(b); }, kAllDtypes},
      {"minimum", [](const Tensor& a, const Tensor& b) { return a.minimum(b); }, kAllDtypes},
      {"atan2", [](const Tensor& a, const Tensor& b) { return a.atan2(b); }, kNumericDtypes},
      {"eq", [](const Tensor& a, const Tensor& b) { return a.eq(b); }, kAllDtypes},
      {"ne", [](const Tensor& a, const Tensor& b) { return a.ne(b); }, kAllDtypes},
      {"lt", [](const Tensor& a, const Tensor& b) { return a.lt(b); }, kAllDtypes},
      {"le", [](const Tensor& a, const Tensor& b) { return a.le(b); }, kAllDtypes},
      {"gt", [](const Tensor& a, const Tensor& b) { return a.gt(b); }, kAllDtypes},
      {"ge", [](const Tensor& a, const Tensor& b) { return a.ge(b); }, kAllDtypes},
      {"logical_and", [](const Tensor& a, const Tensor& b) { return a.logical_and(b); },
       kAllDtypes},
      {"logical_or", [](const Tensor& a, const Tensor& b) { return a.logical_or(b); }, kAllDtypes},
      {"logical_xor", [](const Tensor& a, const Tensor& b) { return a.logical_xor(b); },
       kAllDtypes},
      {"isclose",
       [](const Tensor& a, const Tensor& b) { return isclose(a, b.to(a.dtype()), 0.3, 0.1); },
       kAllDtypes},
      {"lerp", [](const Tensor& a, const Tensor& b) { return a.lerp(b, 0.3); }, kFloatDtypes},
      {"lerp 0.8", [](const Tensor& a, const Tensor& b) { return a.lerp(b, 0.8); }, kFloatDtypes},
      {"lerp tensor", [](const Tensor& a, const Tensor& b) { return a.lerp(b, (a - b).sigmoid()); },
       kFloatDtypes},
      {"where", [](const Tensor& a, const Tensor& b) { return where(a.gt(b), a, b); }, kAllDtypes},
      // gelu's gradient op (grad, self): both broadcast to one shape first (its meta rule takes
      // equal shapes), so expanded operands come through too.
      {"gelu_backward", gelu_backward_of("none"), kFloatDtypes},
      {"gelu_backward tanh", gelu_backward_of("tanh"), kFloatDtypes},
  };
}

// Shape pairs: same shape, broadcast both ways, 0-d with n-d.
const std::vector<std::pair<Shape, Shape>> kShapePairs = {
    {{1}, {1}},          {{7}, {7}},       {{65537}, {65537}}, {{1000}, {}},     {{}, {1000}},
    {{7, 1, 5}, {3, 1}}, {{33, 17}, {17}}, {{}, {}},           {{4, 1}, {1, 9}},
};

Tensor random_operand(IntArrayRef shape, ScalarType dt, uint64_t seed, bool nonzero) {
  Tensor t = random_cpu(shape, dt, seed, -5, 5);
  if (nonzero && dt != kBool) {
    // |t| + 1 with the sign of t (t >= 0 -> positive): never zero.
    const Tensor one = ones(t.sizes(), TensorOptions(dt));
    t = where(t.ge(0), t.abs() + one, -(t.abs() + one));
  }
  return t;
}

TEST_F(GpuBinary, EveryOpEveryDtypeShapeAndLayout) {
  uint64_t seed = 100;
  for (const BinaryCase& bc : binary_cases()) {
    for (ScalarType dt : bc.dtypes) {
      for (const auto& [sa, sb] : kShapePairs) {
        const Tensor a = random_operand(sa, dt, seed++, false);
        const Tensor b = random_operand(sb, dt, seed++, bc.nonzero_rhs);
        const Tensor expected = bc.fn(a, b);
        for (const auto& [layout, av] : layouts(a)) {
          const Tensor got = bc.fn(to_gpu_like(layout, a), b.cuda());
          EXPECT_TRUE(got.is_cuda());
          expect_match(got, expected, tol_for(expected.dtype()),
                       name_of(bc.name, dt, sa, layout) + " with " + shape_str(sb));
        }
      }
    }
  }
}

TEST_F(GpuBinary, MixedDtypesPromote) {
  const std::vector<std::pair<ScalarType, ScalarType>> pairs = {
      {kFloat, kHalf},  {kHalf, kBFloat16},   {kInt32, kFloat}, {kBool, kInt64},
      {kInt32, kInt64}, {kBFloat16, kDouble}, {kBool, kHalf}};
  uint64_t seed = 500;
  for (const auto& [ta, tb] : pairs) {
    const Tensor a = random_operand({7, 33}, ta, seed++, false);
    const Tensor b = random_operand({33}, tb, seed++, true);
    const Tensor ga = a.cuda(), gb = b.cuda();
    const std::string what = std::string(dtype_name(ta)) + "+" + std::string(dtype_name(tb));
    const Tensor e1 = a + b, e2 = a * b, e3 = a / b, e4 = a.lt(b), e5 = a.maximum(b);
    expect_match(ga + gb, e1, tol_for(e1.dtype()), what + " add");
    expect_match(ga * gb, e2, tol_for(e2.dtype()), what + " mul");
    expect_match(ga / gb, e3, tol_for(e3.dtype()), what + " div");
    expect_same(ga.lt(gb), e4, what + " lt");
    expect_match(ga.maximum(gb), e5, tol_for(e5.dtype()), what + " maximum");
  }
}

TEST_F(GpuBinary, ScalarOperands) {
  uint64_t seed = 700;
  for (ScalarType dt : kAllDtypes) {
    const Tensor a = random_operand({1000}, dt, seed++, false);
    const Tensor g = a.cuda();
    const std::string d(dtype_name(dt));
    auto check = [&](const Tensor& got, const Tensor& expected, const std::string& what) {
      EXPECT_TRUE(got.is_cuda()) << what;
      expect_match(got, expected, tol_for(expected.dtype()), d + " " + what);
    };
    check(g * 0.1, a * 0.1, "* 0.1");
    check(g + 3, a + 3, "+ 3");
    check(g.add(2.5, 2), a.add(2.5, 2), "add(2.5, alpha 2)");
    check(g / 4, a / 4, "/ 4");
    check(g.eq(1), a.eq(1), "== 1");
    check(g.lt(0.1), a.lt(0.1), "< 0.1");
    check(g.gt(true), a.gt(true), "> true");
    check(where(g.gt(0), g, 2.5), where(a.gt(0), a, 2.5), "where scalar b");
    check(where(g.gt(0), -1, g), where(a.gt(0), -1, a), "where scalar a");
    if (dt != kBool) {
      check(pow(2.0, g.to(kFloat) * 0.25), pow(2.0, a.to(kFloat) * 0.25), "2 ** x");
      check(g.clamp(-1, 2), a.clamp(-1, 2), "clamp(-1, 2)");
      check(g.clamp(std::nullopt, 0.5), a.clamp(std::nullopt, 0.5), "clamp max 0.5");
      check(g.clamp_min(1), a.clamp_min(1), "clamp min 1");
      check(g - 1, a - 1, "- 1");
    }
    // A 0-d GPU tensor takes part like a scalar: its dtype is read at opmath precision.
    const Tensor s = full({}, 0.3, TensorOptions(kDouble));
    check(g * s.cuda(), a * s, "* 0-d double tensor");
    check(s.cuda() - g.to(is_floating_point(dt) ? dt : kFloat),
          s - a.to(is_floating_point(dt) ? dt : kFloat), "0-d tensor - x");
    check(g.eq(s.cuda().to(dt)), a.eq(s.to(dt)), "== 0-d tensor");
  }
  // Scalars of both ranks with 0-d operands.
  const Tensor z = full({}, 1.25, TensorOptions(kHalf));
  expect_match(z.cuda() * 3, z * 3, tol_for(kHalf), "0-d * 3");
  expect_match(z.cuda() + z.cuda(), z + z, tol_for(kHalf), "0-d + 0-d");
}

TEST_F(GpuBinary, InPlaceForms) {
  uint64_t seed = 900;
  for (ScalarType dt : kNumericDtypes) {
    const Tensor x = random_operand({20, 30}, dt, seed++, false);
    const Tensor y = random_operand({30}, dt, seed++, true);
    Tensor c = x.clone(), g = x.cuda();
    Tensor cv = c.slice(0, 1, 15), gv = g.slice(0, 1, 15);
    const Scalar step = is_floating_point(dt) ? Scalar(1.5) : Scalar(1);
    cv.add_(y, 2).sub_(y).mul_(y).add_(step).mul_(2);
    gv.add_(y.cuda(), 2).sub_(y.cuda()).mul_(y.cuda()).add_(step).mul_(2);
    if (is_floating_point(dt)) {
      cv.div_(y).div_(3).clamp_(-2, 2).lerp_(y.expand_as(cv), 0.25);
      gv.div_(y.cuda()).div_(3).clamp_(-2, 2).lerp_(y.cuda().expand_as(gv), 0.25);
    } else {
      cv.clamp_(-20, std::nullopt);
      gv.clamp_(-20, std::nullopt);
    }
    expect_match(g, c, tol_for(dt), std::string("in place ") + dtype_name(dt).data());
  }
  // The result type differs from self's: int32 += int64 computes in int64 and casts.
  const Tensor i32 = random_cpu({65537}, kInt32, 31, -100, 100);
  const Tensor i64 = random_cpu({65537}, kInt64, 32, -100, 100);
  Tensor c = i32.clone(), g = i32.cuda();
  c.add_(i64);
  g.add_(i64.cuda());
  expect_same(g, c, "int32 += int64");
  Tensor f = random_cpu({999}, kHalf, 33), gf = f.cuda();
  f.mul_(random_cpu({999}, kFloat, 34));
  gf.mul_(random_cpu({999}, kFloat, 34).cuda());
  expect_match(gf, f, tol_for(kHalf), "half *= float");
}

TEST_F(GpuBinary, ErrorsMatchTheCpu) {
  const Tensor a = tensor({4, 5, 6}, TensorOptions(kInt64)).cuda();
  const Tensor b = tensor({1, 0, 2}, TensorOptions(kInt64)).cuda();
  EXPECT_KILN_ERROR(a.div(b, "floor"), "integer division by zero");
  EXPECT_KILN_ERROR(a.div(0, "trunc"), "integer division by zero");
  // The device is still usable afterwards.
  expect_same(a.div(2, "floor"), tensor({2, 2, 3}, TensorOptions(kInt64)), "after error");
  EXPECT_KILN_ERROR(a + tensor({1, 2, 3}, TensorOptions(kInt64)), "same device");
}

TEST_F(GpuBinary, WideAndNonMergeableViews) {
  // Five dims of which none merge (permuted), against the CPU.
  const Tensor x = random_cpu({3, 4, 5, 6, 7}, kFloat, 41);
  const Tensor y = random_cpu({7, 1, 5, 1, 3}, kFloat, 42);
  const Tensor xp = x.permute({4, 2, 0, 3, 1});
  const Tensor gx = x.cuda().permute({4, 2, 0, 3, 1});
  const Tensor e2 = xp + y.permute({0, 2, 4, 1, 3}).sum({3, 4}, true);
  const Tensor g2 = gx + y.cuda().permute({0, 2, 4, 1, 3}).sum({3, 4}, true);
  expect_match(g2, e2, tol_for(kFloat), "permuted + broadcast");
}

// --- Random ------------------------------------------------------------------------------------

// The same call on the CPU and on the GPU after the same seed.
template <typename F>
void same_stream(uint64_t seed, F&& fill, const std::string& what, Tol tol = {0, 0}) {
  manual_seed(seed);
  const Tensor c = fill(Device(kCPU));
  manual_seed(seed);
  const Tensor g = fill(Device(kCUDA));
  EXPECT_TRUE(g.is_cuda()) << what;
  expect_match(g, c, tol, what);
}

TEST_F(GpuRandom, SameNumbersAsTheCpu) {
  const std::vector<Shape> shapes = {{}, {1}, {7}, {1000}, {65537}, {33, 17}};
  uint64_t seed = 5000;
  for (const Shape& shape : shapes) {
    for (ScalarType dt : kFloatDtypes) {
      const std::string what = std::string(dtype_name(dt)) + " " + shape_str(shape);
      same_stream(
          seed++,
          [&](Device d) { return empty(shape, TensorOptions(dt).device(d)).uniform_(-2, 3); },
          "uniform_ " + what);
      same_stream(
          seed++, [&](Device d) { return rand(shape, TensorOptions(dt).device(d)); },
          "rand " + what);
      // normal_ uses log, sin and cos from different libraries: within float ulps.
      const Tol ntol = dt == kDouble  ? Tol{1e-13, 1e-13}
                       : dt == kFloat ? Tol{1e-5, 1e-5}
                                      : tol_for(dt);
      same_stream(
          seed++,
          [&](Device d) { return empty(shape, TensorOptions(dt).device(d)).normal_(0.5, 2); },
          "normal_ " + what, ntol);
    }
    for (ScalarType dt : kAllDtypes) {
      const std::string what = std::string(dtype_name(dt)) + " " + shape_str(shape);
      same_stream(
          seed++,
          [&](Device d) { return empty(shape, TensorOptions(dt).device(d)).bernoulli_(0.3); },
          "bernoulli_ " + what);
      if (dt != kBool) {
        const int64_t low = dt == kUInt8 ? 0 : -5;
        same_stream(
            seed++, [&](Device d) { return randint(low, 17, shape, TensorOptions(dt).device(d)); },
            "randint " + what);
      }
    }
    same_stream(
        seed++,
        [&](Device d) {
          return randint(-(int64_t{1} << 40), int64_t{1} << 41, shape,
                         TensorOptions(kInt64).device(d));
        },
        "randint wide " + shape_str(shape));
    same_stream(
        seed++,
        [&](Device d) {
          const Tensor p = rand(shape, TensorOptions(kFloat)).to(d);
          return bernoulli(p);
        },
        "bernoulli(p) " + shape_str(shape));
  }
}

TEST_F(GpuRandom, StridedTargetsGetLogicalOrder) {
  same_stream(
      5500,
      [](Device d) {
        Tensor base = zeros({8, 9}, TensorOptions(kFloat).device(d));
        base.t().uniform_(0, 1);
        return base;
      },
      "uniform_ transposed");
  same_stream(
      5501,
      [](Device d) {
        Tensor base = zeros({10, 12}, TensorOptions(kInt64).device(d));
        Tensor v = base.slice(1, 1, std::nullopt, 2);
        v.bernoulli_(0.5);
        return base;
      },
      "bernoulli_ strided");
  same_stream(
      5502,
      [](Device d) {
        const Tensor p = rand({4, 1}, TensorOptions(kDouble)).to(d);
        return bernoulli(p.expand({4, 6}).contiguous());
      },
      "bernoulli broadcast p");
  const Tensor bad = tensor({0.5, 1.5}, TensorOptions(kFloat)).cuda();
  EXPECT_KILN_ERROR(bernoulli(bad), "expected all probabilities in [0, 1]");
}

// --- Factories ---------------------------------------------------------------------------------

TEST_F(GpuFactory, ArangeLinspaceEye) {
  const TensorOptions g = TensorOptions().device(Device(kCUDA));
  for (ScalarType dt : kNumericDtypes) {
    const TensorOptions c = TensorOptions(dt);
    const TensorOptions gd = TensorOptions(dt).device(Device(kCUDA));
    expect_same(arange(0, 1000, 3, gd), arange(0, 1000, 3, c),
                "arange int " + std::string(dtype_name(dt)));
    expect_same(arange(-2.5, 7.25, 0.37, gd), arange(-2.5, 7.25, 0.37, c),
                "arange float " + std::string(dtype_name(dt)));
    expect_same(arange(65537, gd), arange(65537, c), "arange n " + std::string(dtype_name(dt)));
    expect_same(linspace(-1, 3, 101, gd), linspace(-1, 3, 101, c),
                "linspace " + std::string(dtype_name(dt)));
  }
  expect_same(arange(10, g), arange(10), "arange default dtype");
  expect_same(arange(0.5, 3.0, 0.25, g), arange(0.5, 3.0, 0.25), "arange float default");
  for (ScalarType dt : kAllDtypes) {
    const TensorOptions gd = TensorOptions(dt).device(Device(kCUDA));
    expect_same(eye(7, gd), eye(7, TensorOptions(dt)), "eye " + std::string(dtype_name(dt)));
    expect_same(eye(3, 130, gd), eye(3, 130, TensorOptions(dt)), "eye 3x130");
    expect_same(eye(0, 4, gd), eye(0, 4, TensorOptions(dt)), "eye 0x4");
  }
}

// --- Indexing ----------------------------------------------------------------------------------

TEST_F(GpuIndex, IndexSelectAndEmbedding) {
  uint64_t seed = 6000;
  for (ScalarType dt : kAllDtypes) {
    const Tensor x = random_cpu({13, 65, 3}, dt, seed++);
    for (ScalarType it : {kInt64, kInt32}) {
      for (int64_t d : {0, 1, 2, -1}) {
        const int64_t n = x.size(d);
        const Tensor idx = random_cpu({29}, it, seed++, 0, static_cast<double>(n - 1));
        const std::string what = std::string(dtype_name(dt)) + " idx " +
                                 std::string(dtype_name(it)) + " dim " + std::to_string(d);
        expect_same(x.cuda().index_select(d, idx.cuda()), x.index_select(d, idx),
                    "index_select " + what);
        // A non-contiguous source and index.
        const Tensor xt = x.transpose(0, 2);
        const Tensor gt = x.cuda().transpose(0, 2);
        const Tensor idx2 =
            random_cpu({2, 17}, it, seed++, 0, static_cast<double>(xt.size(d) - 1)).t();
        expect_same(gt.index_select(d, idx2.cuda().reshape({-1})),
                    xt.index_select(d, idx2.reshape({-1})), "index_select view " + what);
      }
    }
    const Tensor s = random_cpu({}, dt, seed++);
    const Tensor zero = tensor({0}, TensorOptions(kInt64));
    expect_same(s.cuda().index_select(0, zero.cuda()), s.index_select(0, zero), "index_select 0-d");
  }
  for (ScalarType dt : kFloatDtypes) {
    const Tensor w = random_cpu({1000, 65}, dt, seed++);
    for (ScalarType it : {kInt64, kInt32}) {
      const Tensor idx = random_cpu({7, 33}, it, seed++, 0, 999);
      expect_same(embedding(w.cuda(), idx.cuda()), embedding(w, idx), "embedding");
      expect_same(embedding(w.cuda().t().contiguous().t(), idx.cuda().t()), embedding(w, idx.t()),
                  "embedding views");
    }
  }
  const Tensor w = random_cpu({10, 4}, kFloat, 6100).cuda();
  EXPECT_KILN_ERROR(embedding(w, tensor({1, 10}, TensorOptions(kInt64)).cuda()),
                    "index 10 is out of bounds for dimension 0 with size 10");
  EXPECT_KILN_ERROR(w.index_select(1, tensor({-1}, TensorOptions(kInt64)).cuda()),
                    "out of bounds for dimension 1 with size 4");
  // The device still works after a reported bad index.
  expect_same(w.index_select(1, tensor({3, 0}, TensorOptions(kInt64)).cuda()),
              w.cpu().index_select(1, tensor({3, 0}, TensorOptions(kInt64))), "after error");
  // index_add reports a bad index, unless the caller vouches for its indices
  // (TrustedIndicesScope: embedding's backward, which does not wait for the device); the rows in
  // range are added either way.
  const Tensor bad = tensor({1, 10}, TensorOptions(kInt64)).cuda();
  const Tensor rows = ones({2, 4}).cuda();
  EXPECT_KILN_ERROR(zeros({10, 4}).cuda().index_add_(0, bad, rows),
                    "index 10 is out of bounds for dimension 0 with size 10");
  {
    cuda::internal::TrustedIndicesScope trusted;
    Tensor t = zeros({10, 4}).cuda();
    t.index_add_(0, bad, rows);
    EXPECT_EQ(t.cpu().sum().item<double>(), 4.0);
    EXPECT_EQ(t.cpu()[1].sum().item<double>(), 4.0);
  }
  EXPECT_FALSE(cuda::internal::indices_trusted);
  // An embedding's gradient through the trusted path: the CPU's.
  const Tensor table = random_cpu({50, 8}, kFloat, 6200);
  const Tensor ids = random_cpu({6, 5}, kInt64, 6201, 0, 49);
  Tensor tg = table.cuda().detach().requires_grad_(true);
  Tensor tc = table.detach().requires_grad_(true);
  embedding(tg, ids.cuda()).square().sum().backward();
  embedding(tc, ids).square().sum().backward();
  expect_match(tg.grad(), tc.grad(), Tol{1e-5, 1e-6}, "embedding backward");
}

// scatter_add and index_add accumulate with atomics in another order than the CPU, rounding to
// the dtype after each addition.
Tol accumulate_tol(ScalarType dt) {
  switch (dt) {
    case kFloat:
      return {1e-5, 1e-5};
    case kHalf:
      return {5e-3, 2e-2};
    case kBFloat16:
      return {5e-2, 1.5e-1};
    default:
      return tol_for(dt);
  }
}

TEST_F(GpuIndex, GatherScatter) {
  uint64_t seed = 7000;
  for (ScalarType dt : kAllDtypes) {
    const Tensor x = random_cpu({11, 37, 5}, dt, seed++);
    for (int64_t d : {0, 1, 2}) {
      Shape ishape = {7, 20, 4};
      ishape[d] = 9;
      const Tensor idx = random_cpu(ishape, kInt64, seed++, 0, static_cast<double>(x.size(d) - 1));
      const std::string what = std::string(dtype_name(dt)) + " dim " + std::to_string(d);
      expect_same(x.cuda().gather(d, idx.cuda()), x.gather(d, idx), "gather " + what);
      const Tensor src = random_cpu(ishape, dt, seed++);
      // Repeated indices: the last write wins along each row, as on the CPU.
      expect_same(x.cuda().scatter(d, idx.cuda(), src.cuda()), x.scatter(d, idx, src),
                  "scatter " + what);
      expect_same(x.cuda().scatter(d, idx.cuda(), 2), x.scatter(d, idx, 2),
                  "scatter value " + what);
      const Tensor ea = x.scatter_add(d, idx, src);
      expect_match(x.cuda().scatter_add(d, idx.cuda(), src.cuda()), ea, accumulate_tol(dt),
                   "scatter_add " + what);
      Tensor c = x.clone(), g = x.cuda();
      c.transpose(0, 2).scatter_add_(2 - d, idx.transpose(0, 2), src.transpose(0, 2));
      g.transpose(0, 2).scatter_add_(2 - d, idx.cuda().transpose(0, 2), src.cuda().transpose(0, 2));
      expect_match(g, c, accumulate_tol(dt), "scatter_add_ views " + what);
      Tensor c2 = x.clone(), g2 = x.cuda();
      c2.scatter_(d, idx, src);
      g2.scatter_(d, idx.cuda(), src.cuda());
      expect_same(g2, c2, "scatter_ " + what);
    }
  }
  const Tensor x = random_cpu({4, 5}, kFloat, 7100).cuda();
  EXPECT_KILN_ERROR(x.gather(1, tensor({{5}}, TensorOptions(kInt64)).cuda()),
                    "index 5 is out of bounds for dimension 1 with size 5");
  EXPECT_KILN_ERROR(x.scatter(0, tensor({{4}}, TensorOptions(kInt64)).cuda(), 1.0),
                    "out of bounds");
}

TEST_F(GpuIndex, IndexAdd) {
  uint64_t seed = 8000;
  for (ScalarType dt : kAllDtypes) {
    const Tensor x = random_cpu({13, 21, 3}, dt, seed++);
    for (ScalarType it : {kInt64, kInt32}) {
      for (int64_t d : {0, 1, 2}) {
        Shape sshape = to_shape(x.sizes());
        sshape[d] = 50;  // more sources than slots: repeated indices accumulate
        const Tensor src = random_cpu(sshape, dt, seed++);
        const Tensor idx = random_cpu({50}, it, seed++, 0, static_cast<double>(x.size(d) - 1));
        const std::string what = std::string(dtype_name(dt)) + " dim " + std::to_string(d);
        const Tol tol = accumulate_tol(dt);
        expect_match(x.cuda().index_add(d, idx.cuda(), src.cuda()), x.index_add(d, idx, src), tol,
                     "index_add " + what);
        if (dt != kBool) {
          const Scalar alpha = is_floating_point(dt) ? Scalar(0.5) : Scalar(3);
          expect_match(x.cuda().index_add(d, idx.cuda(), src.cuda(), alpha),
                       x.index_add(d, idx, src, alpha), tol, "index_add alpha " + what);
        }
        Tensor c = x.clone(), g = x.cuda();
        c.transpose(0, 1).index_add_(d == 0 ? 1 : d == 1 ? 0 : 2, idx, src.transpose(0, 1));
        g.transpose(0, 1).index_add_(d == 0   ? 1
                                     : d == 1 ? 0
                                              : 2,
                                     idx.cuda(), src.cuda().transpose(0, 1));
        expect_match(g, c, tol, "index_add_ views " + what);
      }
    }
  }
}

// index_add of floats is deterministic (embedding's backward; bit-exact resume needs it): many
// repeats of few indices, as an embedding gradient has, give the same bits on every run, and the
// sums (in f32, rounded once) stay within one rounding of an f64 reference.
TEST_F(GpuIndex, IndexAddIsDeterministic) {
  uint64_t seed = 9500;
  for (ScalarType dt : {kFloat, kBFloat16, kHalf}) {
    const Tensor src = random_cpu({16384, 96}, dt, seed++, -1, 1);
    const Tensor idx = random_cpu({16384}, kInt64, seed++, 0, 40);
    const Tensor base = zeros({48, 96}, TensorOptions().dtype(dt));
    const Tensor first = base.cuda().index_add(0, idx.cuda(), src.cuda(), 0.5);
    const std::string what = std::string(dtype_name(dt));
    for (int run = 0; run < 3; ++run) {
      expect_same(base.cuda().index_add(0, idx.cuda(), src.cuda(), 0.5), first.cpu(),
                  "index_add run " + std::to_string(run) + " " + what);
    }
    const Tensor want = base.to(kDouble).index_add(0, idx, src.to(kDouble), 0.5);
    const double eps = dt == kFloat ? 1e-5 : dt == kHalf ? 1e-3 : 8e-3;
    expect_match(first.cpu().to(kDouble), want, Tol{eps, 1e-3}, "index_add vs f64 " + what);
    // Along another dim, through a transposed source.
    const Tensor src_t = random_cpu({96, 4096}, dt, seed++, -1, 1);
    const Tensor idx_t = random_cpu({4096}, kInt32, seed++, 0, 9);
    const Tensor base_t = zeros({96, 10}, TensorOptions().dtype(dt));
    const Tensor a = base_t.cuda().index_add(1, idx_t.cuda(), src_t.cuda().t().contiguous().t());
    expect_same(base_t.cuda().index_add(1, idx_t.cuda(), src_t.cuda()), a.cpu(),
                "index_add dim 1 " + what);
    expect_match(a.cpu().to(kDouble), base_t.to(kDouble).index_add(1, idx_t, src_t.to(kDouble)),
                 Tol{eps, 1e-3}, "index_add dim 1 vs f64 " + what);
  }
}

// Dense rows (an embedding's backward) take a kernel of their own, a block per run of equal
// indices and 16-byte packs; it must give the bits of the per-element kernel, which a misaligned
// output (one element into a wider buffer) still takes. Rows wider than a block (4104 bf16: three
// blocks across, the last partly used) and runs of repeats included.
TEST_F(GpuIndex, IndexAddRowsKernelMatchesPerElementKernel) {
  uint64_t seed = 9700;
  for (ScalarType dt : {kFloat, kBFloat16, kHalf, kDouble}) {
    for (int64_t width : {int64_t{40}, int64_t{4104}}) {
      const Tensor src = random_cpu({600, width}, dt, seed++, -1, 1).cuda();
      const Tensor idx = random_cpu({600}, kInt64, seed++, 0, 30).cuda();
      const Tensor rows = zeros({31, width}, TensorOptions(dt).device(kCUDA));
      rows.index_add_(0, idx, src, 0.5);
      const Tensor wide = zeros({31, width + 1}, TensorOptions(dt).device(kCUDA));
      Tensor elements = wide.narrow(1, 1, width);
      elements.index_add_(0, idx, src, 0.5);
      const std::string what = std::string(dtype_name(dt)) + " width " + std::to_string(width);
      expect_same(elements, rows.cpu(), "index_add rows " + what);
      expect_match(rows.cpu().to(kDouble),
                   zeros({31, width}, TensorOptions(kDouble))
                       .index_add(0, idx.cpu(), src.cpu().to(kDouble), 0.5),
                   Tol{dt == kFloat || dt == kDouble ? 1e-5 : 2e-2, 1e-3}, "index_add f64 " + what);
    }
  }
}

// The floating-point index_add sorts its index on the bits of the indexed dim's size only (three
// radix passes for 70000 rows). The sums must still run in position order within each row: the
// bits of a reference that adds each row's sources in order in f32 and rounds once, for valid
// indices of both widths spread over the rows and runs of repeats; out-of-range and negative
// indices are still errors.
TEST_F(GpuIndex, IndexAddOnTheIndexBitsKeepsPositionOrder) {
  uint64_t seed = 9800;
  const int64_t rows = 70000, n = 6000;
  for (ScalarType dt : {kFloat, kBFloat16}) {
    for (ScalarType it : {kInt64, kInt32}) {
      for (int64_t width : {int64_t{8}, int64_t{3}}) {  // dense 16-byte packs; the per-element path
        const Tensor src = random_cpu({n, width}, dt, seed++, -1, 1);
        // Half the entries on 5 rows (long runs), half anywhere, the largest row included.
        Tensor idx = random_cpu({n}, kInt64, seed++, 0, static_cast<double>(rows - 1));
        const Tensor few = random_cpu({n / 2}, kInt64, seed++, 0, 4).mul(13997);
        idx.narrow(0, 0, n / 2).copy_(few);
        idx.narrow(0, n - 1, 1).fill_(rows - 1);
        idx = idx.to(it);
        const Tensor base = random_cpu({rows, width}, dt, seed++, -1, 1);
        Tensor want = base.to(kFloat).clone();  // to(kFloat) of a float tensor is base itself
        {
          Tensor acc = zeros({rows, width}, TensorOptions(kFloat));
          const Tensor s = src.to(kFloat);
          const std::vector<int64_t> at = idx.to(kInt64).to_vector<int64_t>();
          auto* a = acc.data_ptr<float>();
          const auto* sp = s.data_ptr<float>();
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t k = 0; k < width; ++k) a[at[j] * width + k] += sp[j * width + k];
          }
          auto* w = want.data_ptr<float>();
          for (int64_t i = 0; i < rows * width; ++i) w[i] += a[i];
        }
        const std::string what = std::string(dtype_name(dt)) + " " + std::string(dtype_name(it)) +
                                 " width " + std::to_string(width);
        expect_same(base.cuda().index_add(0, idx.cuda(), src.cuda()), want.to(dt),
                    "index_add " + what);
      }
    }
  }
  const Tensor src = random_cpu({4, 8}, kFloat, seed++).cuda();
  const Tensor base = zeros({rows, 8}, TensorOptions(kFloat).device(kCUDA));
  EXPECT_KILN_ERROR(
      base.index_add(0, tensor(std::vector<int64_t>{3, rows, 5, 1}, kInt64).cuda(), src),
      "index 70000 is out of bounds for dimension 0 with size 70000");
  EXPECT_KILN_ERROR(
      base.index_add(0, tensor(std::vector<int64_t>{3, 2, -2, 1}, kInt64).cuda(), src),
      "index -2 is out of bounds");
}

TEST_F(GpuIndex, MaskedFillAndTriangles) {
  uint64_t seed = 9000;
  for (ScalarType dt : kAllDtypes) {
    const Tensor x = random_cpu({7, 33}, dt, seed++);
    const Tensor m = random_cpu({33}, kBool, seed++);
    expect_same(x.cuda().masked_fill(m.cuda(), 1), x.masked_fill(m, 1), "masked_fill broadcast");
    const Tensor m7 = random_cpu({7}, kBool, seed++);
    expect_same(x.cuda().masked_fill(m7.cuda().unsqueeze(1).expand({7, 33}), 0),
                x.masked_fill(m7.unsqueeze(1).expand({7, 33}), 0), "masked_fill expanded mask");
    expect_same(x.cuda().t().masked_fill(m.cuda().unsqueeze(1), -1),
                x.t().masked_fill(m.unsqueeze(1), -1), "masked_fill transposed self");
    Tensor c = x.clone(), g = x.cuda();
    c.t().masked_fill_(m.unsqueeze(1), 0);
    g.t().masked_fill_(m.cuda().unsqueeze(1), 0);
    expect_same(g, c, "masked_fill_ " + std::string(dtype_name(dt)));
    const Tensor cpu_mask0 = tensor(true);
    expect_same(x.cuda().masked_fill(cpu_mask0, 2), x.masked_fill(cpu_mask0, 2),
                "masked_fill with a CPU 0-d mask");
    const Tensor b = random_cpu({3, 9, 13}, dt, seed++);
    for (int64_t diag : {-2, 0, 1, 20}) {
      expect_same(b.cuda().triu(diag), b.triu(diag), "triu " + std::to_string(diag));
      expect_same(b.cuda().tril(diag), b.tril(diag), "tril " + std::to_string(diag));
      expect_same(b.cuda().transpose(1, 2).triu(diag), b.transpose(1, 2).triu(diag), "triu view");
      expect_same(b.cuda().transpose(0, 2).tril(diag), b.transpose(0, 2).tril(diag), "tril view");
    }
  }
}

// --- cat ---------------------------------------------------------------------------------------

TEST_F(GpuJoin, Cat) {
  uint64_t seed = 9500;
  for (ScalarType dt : kAllDtypes) {
    const Tensor a = random_cpu({4, 7, 5}, dt, seed++);
    const Tensor b = random_cpu({4, 3, 5}, dt, seed++);
    const Tensor c = random_cpu({4, 1, 5}, dt, seed++);
    expect_same(cat({a.cuda(), b.cuda(), c.cuda()}, 1), cat({a, b, c}, 1), "cat dim 1");
    expect_same(cat({a.cuda(), a.cuda()}, 0), cat({a, a}, 0), "cat dim 0");
    expect_same(cat({a.cuda(), a.cuda().transpose(0, 2).contiguous().transpose(0, 2)}, 2),
                cat({a, a}, 2), "cat dim 2 with a view");
    expect_same(cat({b.cuda(), zeros({4, 0, 5}, TensorOptions(dt)).cuda(), b.cuda()}, -2),
                cat({b, zeros({4, 0, 5}, TensorOptions(dt)), b}, -2), "cat with empty");
  }
  const Tensor h = random_cpu({65537}, kHalf, 9600), f = random_cpu({3}, kFloat, 9601);
  expect_same(cat({h.cuda(), f.cuda()}), cat({h, f}), "cat promotes");
}

// --- Autograd through the GPU kernels ----------------------------------------------------------

// Gradients of loss(x, y) w.r.t. x and y, computed on `device`.
std::pair<Tensor, Tensor> grads(const Tensor& x0, const Tensor& y0, Device device,
                                const std::function<Tensor(const Tensor&, const Tensor&)>& loss) {
  Tensor x = x0.to(device).detach().requires_grad_(true);
  Tensor y = y0.to(device).detach().requires_grad_(true);
  loss(x, y).backward();
  return {x.grad(), y.grad()};
}

TEST_F(GpuAutograd, BackwardMatchesTheCpu) {
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&, const Tensor&)>>>
      losses = {
          {"mul sum", [](const Tensor& x, const Tensor& y) { return (x * y).sum(); }},
          {"broadcast div mean",
           [](const Tensor& x, const Tensor& y) {
             return (x / (y.sum({0}, true).abs() + 1)).mean();
           }},
          {"softmax", [](const Tensor& x, const Tensor& y) { return (x.softmax(1) * y).sum(); }},
          {"log_softmax",
           [](const Tensor& x, const Tensor& y) { return (x.log_softmax(0) * y).sum(); }},
          {"exp tanh sigmoid",
           [](const Tensor& x, const Tensor& y) {
             return (x.exp() + y.tanh() * x.sigmoid()).sum();
           }},
          {"gelu silu",
           [](const Tensor& x, const Tensor& y) { return (x.gelu() * y.silu()).sum(); }},
          {"var norm",
           [](const Tensor& x, const Tensor& y) { return x.var({1}).sum() + y.norm(); }},
          {"where clamp",
           [](const Tensor& x, const Tensor& y) {
             return where(x.gt(y), x, y.clamp(-0.5, 0.5)).sum();
           }},
          {"amax logsumexp",
           [](const Tensor& x, const Tensor& y) {
             return x.amax({1}).sum() + y.logsumexp({0}).sum();
           }},
          {"cat cumsum",
           [](const Tensor& x, const Tensor& y) {
             return cat({x, y}, 0).cumsum(1).pow(2).mean();
           }},
      };
  const Tensor x = random_cpu({37, 129}, kFloat, 10000, -1, 1);
  const Tensor y = random_cpu({37, 129}, kFloat, 10001, -1, 1);
  for (const auto& [name, loss] : losses) {
    const auto [cx, cy] = grads(x, y, Device(kCPU), loss);
    const auto [gx, gy] = grads(x, y, Device(kCUDA), loss);
    ASSERT_TRUE(gx.is_cuda()) << name;
    expect_match(gx, cx, {1e-4, 1e-6}, name + " dx");
    expect_match(gy, cy, {1e-4, 1e-6}, name + " dy");
  }
}

TEST_F(GpuAutograd, EmbeddingAndGatherBackward) {
  const Tensor w0 = random_cpu({100, 16}, kFloat, 10100);
  const Tensor idx = random_cpu({8, 33}, kInt64, 10101, 0, 99);
  const Tensor cols = random_cpu({100, 40}, kInt64, 10102, 0, 15);
  auto run = [&](Device d) {
    Tensor w = w0.to(d).detach().requires_grad_(true);
    const Tensor e = embedding(w, idx.to(d));
    (e * e).sum().backward();
    Tensor v = w0.to(d).detach().requires_grad_(true);
    (v.gather(1, cols.to(d)) * 1.5).sum().backward();
    Tensor u = w0.to(d).detach().requires_grad_(true);
    u.index_select(0, idx.reshape({-1}).to(d)).pow(2).sum().backward();
    return std::make_tuple(w.grad(), v.grad(), u.grad());
  };
  const auto [cw, cv, cu] = run(Device(kCPU));
  const auto [gw, gv, gu] = run(Device(kCUDA));
  expect_match(gw, cw, {1e-5, 1e-6}, "embedding backward");
  expect_match(gv, cv, {1e-5, 1e-6}, "gather backward");
  expect_match(gu, cu, {1e-5, 1e-6}, "index_select backward");
}

}  // namespace
}  // namespace kiln
