// Tests of the CUDA kernels of the generic ops (kernels/cuda/{unary,binary,reduce,softmax,
// index,join,factory,random}.cu) against the CPU kernels: the same op on the same random CPU
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
#include "kernels/cuda/softmax.h"
#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::expect_same;
using test::kAllDtypes;
using test::kFloatDtypes;
using test::kNumericDtypes;
using test::random_cpu;
using test::Tol;

using test::GpuTest;

class GpuUnary : public GpuTest {};
class GpuBinary : public GpuTest {};
class GpuReduce : public GpuTest {};
class GpuSoftmax : public GpuTest {};
class GpuRandom : public GpuTest {};
class GpuFactory : public GpuTest {};
class GpuIndex : public GpuTest {};
class GpuJoin : public GpuTest {};
class GpuAutograd : public GpuTest {};

// Tolerances of float math that CUDA's library computes within an ulp or two of glibc's.
Tol tol_for(ScalarType dtype) {
  switch (dtype) {
    case kFloat:
      return {2e-5, 1e-6};
    case kDouble:
      return {1e-12, 1e-13};
    case kHalf:
      return {2e-3, 1e-3};
    case kBFloat16:
      return {1.6e-2, 1e-2};
    default:
      return {0, 0};
  }
}

// x (CPU) in several layouts with the same values: contiguous, and for 1-d and 2-d tensors a
// strided view (every other element of a larger tensor) or a transposed one.
std::vector<std::pair<std::string, Tensor>> layouts(const Tensor& x) {
  std::vector<std::pair<std::string, Tensor>> out = {{"contiguous", x}};
  if (x.dim() == 2) out.push_back({"transposed", x.t().contiguous().t()});
  if (x.dim() == 1 && x.numel() > 1) {
    const Tensor wide = cat({x.unsqueeze(1), x.unsqueeze(1)}, 1).reshape({-1});
    out.push_back({"strided", wide.slice(0, 0, std::nullopt, 2)});
  }
  return out;
}

// A CPU tensor's GPU copy with the same layout (the CUDA copy of a strided view is contiguous,
// so views are re-made on the GPU from a copy of their base when the layout matters).
Tensor to_gpu_like(const std::string& layout, const Tensor& x) {
  if (layout == "transposed") return x.t().contiguous().cuda().t();
  if (layout == "strided") {
    const Tensor wide = cat({x.unsqueeze(1), x.unsqueeze(1)}, 1).reshape({-1}).cuda();
    return wide.slice(0, 0, std::nullopt, 2);
  }
  return x.cuda();
}

const std::vector<Shape> kShapes = {{}, {1}, {7}, {1000}, {65537}, {33, 17}};

std::string name_of(const std::string& op, ScalarType dt, const Shape& shape,
                    const std::string& layout) {
  return op + " " + std::string(dtype_name(dt)) + " " + shape_str(shape) + " " + layout;
}

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

// --- Reductions ------------------------------------------------------------------------------

// Float reductions accumulate in float on the GPU and in double on the CPU: the tolerance grows
// with the number of reduced elements.
Tol reduce_tol(ScalarType dt, int64_t reduced) {
  Tol t = tol_for(dt);
  if (dt == kFloat) t = {1e-5, 1e-6 * std::sqrt(static_cast<double>(reduced) + 1) * 4};
  if (dt == kDouble) t = {1e-11, 1e-11};
  return t;
}

struct ReduceShape {
  Shape shape;
  std::vector<Shape> dims;  // each entry one call; {} = all dims
};

const std::vector<ReduceShape> kReduceShapes = {
    {{}, {{}}},
    {{1}, {{}, {0}}},
    {{7}, {{0}}},
    {{1000}, {{}}},
    {{65537}, {{}}},                          // one long row: the multi-block path
    {{3, 65537}, {{1}, {0}}},                 // few long rows; long columns of width 65537
    {{65537, 3}, {{0}, {1}}},                 // narrow columns over a long R (split), short rows
    {{37, 129}, {{1}, {0}, {}}},              // warp rows, columns
    {{5, 7, 9}, {{1}, {0, 2}, {2}, {0, 1}}},  // middle dim, interleaved dims (copied)
    {{4, 5000}, {{1}}},                       // block rows without a split
};

TEST_F(GpuReduce, SumMeanProdExtremaEveryDtype) {
  uint64_t seed = 2000;
  for (const ReduceShape& rs : kReduceShapes) {
    for (ScalarType dt : kAllDtypes) {
      const Tensor x = random_cpu(rs.shape, dt, seed++, -1, 1);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (const Shape& dims : rs.dims) {
          for (bool keepdim : {false, true}) {
            const std::string what = name_of("", dt, rs.shape, layout) + " dims " +
                                     shape_str(dims) + (keepdim ? " keepdim" : "");
            int64_t reduced = 1;
            for (int64_t d : dims) reduced *= x.size(d);
            if (dims.empty()) reduced = x.numel();
            const Tensor es = x.sum(dims, keepdim);
            expect_match(g.sum(dims, keepdim), es, reduce_tol(es.dtype(), reduced), "sum " + what);
            if (is_floating_point(dt)) {
              const Tensor em = x.mean(dims, keepdim);
              expect_match(g.mean(dims, keepdim), em, reduce_tol(dt, reduced), "mean " + what);
            }
            expect_same(g.amax(dims, keepdim), x.amax(dims, keepdim), "amax " + what);
            expect_same(g.amin(dims, keepdim), x.amin(dims, keepdim), "amin " + what);
            if (dims.size() == 1) {
              const int64_t d = dims[0];
              if (dt != kBool) {
                expect_same(g.argmax(d, keepdim), x.argmax(d, keepdim), "argmax " + what);
                expect_same(g.argmin(d, keepdim), x.argmin(d, keepdim), "argmin " + what);
              }
              const auto [gv, gi] = g.max(d, keepdim);
              const auto [cv, ci] = x.max(d, keepdim);
              expect_same(gv, cv, "max values " + what);
              expect_same(gi, ci, "max indices " + what);
              const auto [gv2, gi2] = g.min(d, keepdim);
              const auto [cv2, ci2] = x.min(d, keepdim);
              expect_same(gv2, cv2, "min values " + what);
              expect_same(gi2, ci2, "min indices " + what);
              expect_same(g.all(d, keepdim), x.all(d, keepdim), "all " + what);
              expect_same(g.any(d, keepdim), x.any(d, keepdim), "any " + what);
            }
          }
        }
        expect_same(g.max(), x.max(), "max() " + name_of("", dt, rs.shape, layout));
        expect_same(g.min(), x.min(), "min() " + name_of("", dt, rs.shape, layout));
        expect_same(g.all(), x.all(), "all() " + name_of("", dt, rs.shape, layout));
        expect_same(g.any(), x.any(), "any() " + name_of("", dt, rs.shape, layout));
        if (dt != kBool) {
          expect_same(g.argmax(), x.argmax(), "argmax() " + name_of("", dt, rs.shape, layout));
          expect_same(g.argmin(), x.argmin(), "argmin() " + name_of("", dt, rs.shape, layout));
        }
      }
    }
  }
}

TEST_F(GpuReduce, ProdAndDtypeArgument) {
  uint64_t seed = 2500;
  for (ScalarType dt : kNumericDtypes) {
    const Tensor x = is_floating_point(dt) ? random_cpu({9, 61}, dt, seed++, 0.8, 1.2)
                                           : random_cpu({9, 61}, dt, seed++, -2, 2);
    for (int64_t d : {0, 1}) {
      const Tensor e = x.prod(d);
      expect_match(x.cuda().prod(d), e, reduce_tol(e.dtype(), 61),
                   "prod " + std::string(dtype_name(dt)));
    }
    const Tensor e = x.prod();
    expect_match(x.cuda().prod(), e, {1e-3, 1e-6}, "prod() " + std::string(dtype_name(dt)));
  }
  const Tensor i = random_cpu({1000}, kInt32, 2600, -100, 100);
  expect_same(i.cuda().sum({0}, false, kInt32), i.sum({0}, false, kInt32), "sum int32 dtype");
  const Tensor h = random_cpu({1000}, kHalf, 2601);
  expect_match(h.cuda().sum({0}, false, kFloat), h.sum({0}, false, kFloat),
               reduce_tol(kFloat, 1000), "sum half as float");
  expect_match(h.cuda().mean({}, false, kDouble), h.mean({}, false, kDouble),
               reduce_tol(kDouble, 1000), "mean half as double");
}

TEST_F(GpuReduce, VarStdNormLogsumexp) {
  uint64_t seed = 3000;
  for (const ReduceShape& rs : kReduceShapes) {
    for (ScalarType dt : kFloatDtypes) {
      const Tensor x = random_cpu(rs.shape, dt, seed++, -2, 2);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (const Shape& dims : rs.dims) {
          int64_t reduced = 1;
          for (int64_t d : dims) reduced *= x.size(d);
          if (dims.empty()) reduced = x.numel();
          const Tol tol = reduce_tol(dt, reduced);
          const Tol loose = {tol.rtol * 10, tol.atol * 10};
          const std::string what = name_of("", dt, rs.shape, layout) + " dims " + shape_str(dims);
          for (int64_t correction : {0, 1}) {
            expect_match(g.var(dims, correction), x.var(dims, correction), loose, "var " + what);
            expect_match(g.std(dims, correction, true), x.std(dims, correction, true), loose,
                         "std " + what);
          }
          for (double p : {0.0, 1.0, 2.0, 3.0, 0.5, std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()}) {
            expect_match(g.norm(p, dims), x.norm(p, dims), loose,
                         "norm " + std::to_string(p) + " " + what);
          }
          if (!dims.empty()) {
            expect_match(g.logsumexp(dims), x.logsumexp(dims), loose, "logsumexp " + what);
          }
        }
      }
    }
  }
  // Infinities and NaN in logsumexp and the extrema.
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor s =
      tensor({{-inf, -inf, -inf}, {1.0, inf, 2.0}, {1.0, std::nan(""), 3.0}, {-inf, 0.5, -inf}},
             TensorOptions(kFloat));
  expect_match(s.cuda().logsumexp({1}), s.logsumexp({1}), tol_for(kFloat), "logsumexp inf/nan");
  expect_same(s.cuda().amax({1}), s.amax({1}), "amax nan");
  expect_same(s.cuda().argmax(1), s.argmax(1), "argmax nan");
  expect_same(s.cuda().argmin(1), s.argmin(1), "argmin nan");
  // Empty reductions.
  const Tensor empty_rows = zeros({3, 0}, TensorOptions(kFloat));
  expect_same(empty_rows.cuda().sum({1}), empty_rows.sum({1}), "sum over nothing");
  expect_match(empty_rows.cuda().mean({1}), empty_rows.mean({1}), tol_for(kFloat), "mean nothing");
  expect_same(empty_rows.cuda().logsumexp({1}), empty_rows.logsumexp({1}), "lse over nothing");
  EXPECT_KILN_ERROR(empty_rows.cuda().amax({1}), "[amax]");
}

TEST_F(GpuReduce, Cumsum) {
  uint64_t seed = 3500;
  for (ScalarType dt : kAllDtypes) {
    for (const Shape& shape : std::vector<Shape>{{}, {1}, {7}, {65537}, {33, 17}, {5, 7, 9}}) {
      const Tensor x = random_cpu(shape, dt, seed++, -2, 2);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (int64_t d = 0; d < std::max<int64_t>(x.dim(), 1); ++d) {
          const Tensor e = x.cumsum(d);
          const int64_t len = x.dim() == 0 ? 1 : x.size(d);
          expect_match(g.cumsum(d), e, reduce_tol(e.dtype(), len),
                       name_of("cumsum", dt, shape, layout) + " dim " + std::to_string(d));
        }
      }
    }
  }
}

// Full reductions (one wave of blocks over 16-byte-aligned chunks, merged by one block) and long
// row reductions read with 16-byte loads after a scalar head: odd lengths and views at odd
// element offsets, against the CPU; argmax/argmin ties must keep the lowest index. The sum of a
// full reduction is deterministic: two runs agree bit for bit.
TEST_F(GpuReduce, VectorisedRowsAndFullReductions) {
  uint64_t seed = 5200;
  const std::vector<Shape> shapes = {
      {1, (int64_t{1} << 22) + 5}, {1, 1000003}, {64, 8193}, {300, 5001}, {100, 4095}, {7, 33}};
  for (ScalarType dt : kAllDtypes) {
    for (const Shape& shape : shapes) {
      const int64_t A = shape[0], R = shape[1];
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{5}}) {
        // Few distinct values for the 16-bit types and integers: many ties for argmax.
        const Tensor base = random_cpu({A * R + offset}, dt, seed++, -2, 2);
        const Tensor x = base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = base.cuda().slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, shape, "offset " + std::to_string(offset));
        const Tensor all_sum = x.sum();
        expect_match(g.sum(), all_sum, reduce_tol(all_sum.dtype(), A * R), "sum() " + what);
        const Tensor row_sum = x.sum({1});
        expect_match(g.sum({1}), row_sum, reduce_tol(row_sum.dtype(), R), "sum rows " + what);
        expect_same(g.amax({}), x.amax({}), "amax() " + what);
        expect_same(g.amin({1}), x.amin({1}), "amin rows " + what);
        expect_same(g.any(1), x.any(1), "any rows " + what);
        expect_same(g.all(), x.all(), "all() " + what);
        if (dt != kBool) {
          expect_same(g.argmax(), x.argmax(), "argmax() " + what);
          expect_same(g.argmin(), x.argmin(), "argmin() " + what);
          expect_same(g.argmax(1), x.argmax(1), "argmax rows " + what);
          const auto [gv, gi] = g.min(1);
          const auto [cv, ci] = x.min(1);
          expect_same(gv, cv, "min values " + what);
          expect_same(gi, ci, "min indices " + what);
        }
        if (is_floating_point(dt)) {
          const Tol tol = reduce_tol(dt, A * R);
          const Tol loose = {tol.rtol * 10, tol.atol * 10};
          expect_match(g.mean(), x.mean(), tol, "mean() " + what);
          expect_match(g.var({}, 1), x.var({}, 1), loose, "var() " + what);
          expect_match(g.norm(2.0, {1}), x.norm(2.0, {1}), loose, "norm rows " + what);
          expect_match(g.logsumexp({1}), x.logsumexp({1}), loose, "logsumexp rows " + what);
          expect_same(g.sum(), g.sum().cpu(), "sum() deterministic " + what);
        }
      }
    }
  }
}

// Row reductions read in 16-byte packs (8 bf16/f16, 4 f32, 2 f64, 16 bool) after a scalar head,
// with a scalar tail, for every reducer: rows whose length is and is not a multiple of the pack
// (every row then starts at another alignment), views at odd element offsets, a non-contiguous
// view (copied first) and a transposed one, each row kernel: the warp kernel (rows up to 4096) and
// the block kernel at each of its thread counts (64 to 512, chosen by the bytes of a row or chunk:
// 5000 bf16 128 threads, 8192 bf16 256, 8192 f32 512, the chunks of split rows 64 and more), on
// 300 rows (no split) and on few rows (split into chunks). NaN, +inf and -inf sit in the head, the
// tail and the middle of some rows for the reducers whose results they define (extrema,
// argmax/argmin: the first NaN and the lowest index of equal values win); prod and var/std get
// clean inputs. The CPU results are computed once per input. (Other thread counts per row length:
// the kernel lab, benchmarks/lab/reduce_lab.cu.)
TEST_F(GpuReduce, PackedRowsEveryReducerAndRowKernel) {
  struct Check {
    std::string what;
    std::function<Tensor(const Tensor&)> fn;  // applied to the CPU and the GPU input
    Tol tol;                                  // {0, 0}: bit for bit
  };
  struct Case {
    int64_t A, R;
  };
  // 300 rows fill a GPU of up to 150 multiprocessors without a split; fewer rows of the block
  // kernel are split when longer than 4096 (40 x 4101: two chunks; 3 x 70001: about 18).
  const std::vector<Case> cases = {{300, 8192}, {300, 8199}, {300, 5000}, {40, 4096},
                                   {40, 4101},  {300, 37},   {3, 70001}};
  const double inf = std::numeric_limits<double>::infinity();
  uint64_t seed = 6000;
  for (ScalarType dt : kAllDtypes) {
    const bool fp = is_floating_point(dt);
    for (const Case& c : cases) {
      const int64_t A = c.A, R = c.R;
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        // A flat buffer viewed at `offset` elements as [A, R], with special values for floats.
        auto make = [&](double lo, double hi, bool special) {
          Tensor base = random_cpu({A * R + offset}, fp ? kDouble : dt, seed++, lo, hi);
          if (fp && special) {
            double* p = base.data_ptr<double>() + offset;
            p[1 * R + R - 1] = std::nan("");  // row 1: NaN in the tail
            p[2 * R + 0] = inf;               // row 2: +inf in the head
            p[0 * R + R / 2] = -inf;          // row 0: -inf in the middle
            p[0 * R + R / 3] = std::nan("");  // and a NaN before it
          }
          return fp ? base.to(dt) : base;
        };
        const Tensor xbase = make(-2, 2, true);
        const Tensor gbase = xbase.cuda();
        const Tensor x = xbase.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = gbase.slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string name = name_of("", dt, {A, R}, "offset " + std::to_string(offset));
        const Tol sum_tol = reduce_tol(fp ? dt : kInt64, R);
        // Extrema are exact, but a 16-bit NaN may come back with another payload (the GPU's cvt
        // writes the canonical NaN): floats are compared as values, NaN matching NaN.
        const Tol exact = fp ? Tol{0, 1e-300} : Tol{0, 0};
        std::vector<Check> checks = {
            {"sum", [](const Tensor& t) { return t.sum({1}); }, sum_tol},
            {"amax", [](const Tensor& t) { return t.amax({1}); }, exact},
            {"amin", [](const Tensor& t) { return t.amin({1}, true); }, exact},
            {"max values", [](const Tensor& t) { return std::get<0>(t.max(1)); }, exact},
            {"max indices", [](const Tensor& t) { return std::get<1>(t.max(1)); }, {0, 0}},
            {"min values", [](const Tensor& t) { return std::get<0>(t.min(1)); }, exact},
            {"min indices", [](const Tensor& t) { return std::get<1>(t.min(1)); }, {0, 0}},
            {"all", [](const Tensor& t) { return t.all(1); }, {0, 0}},
            {"any", [](const Tensor& t) { return t.any(1); }, {0, 0}},
        };
        if (dt != kBool) {
          checks.push_back({"argmax", [](const Tensor& t) { return t.argmax(1); }, {0, 0}});
          checks.push_back({"argmin", [](const Tensor& t) { return t.argmin(1, true); }, {0, 0}});
        }
        if (fp) {
          const Tol loose = {sum_tol.rtol * 10, sum_tol.atol * 10};
          checks.push_back({"mean", [](const Tensor& t) { return t.mean({1}); }, sum_tol});
          checks.push_back({"logsumexp", [](const Tensor& t) { return t.logsumexp({1}); }, loose});
          for (double p : {0.0, 1.0, 2.0, 3.0, inf, -inf}) {
            checks.push_back({"norm " + std::to_string(p),
                              [p](const Tensor& t) { return t.norm(p, {1}); }, loose});
          }
        }
        // The CPU results, once.
        std::vector<Tensor> expected;
        for (const Check& ch : checks) expected.push_back(ch.fn(x));
        // prod over values near 1 (no overflow in float), var/std over clean values.
        Tensor xp, gp, xv, gv, ep, evar, estd;
        if (fp) {
          const Tensor pbase = make(0.97, 1.03, false), vbase = make(-2, 2, false);
          xp = pbase.slice(0, offset, offset + A * R).reshape({A, R});
          gp = pbase.cuda().slice(0, offset, offset + A * R).reshape({A, R});
          xv = vbase.slice(0, offset, offset + A * R).reshape({A, R});
          gv = vbase.cuda().slice(0, offset, offset + A * R).reshape({A, R});
          ep = xp.prod(1);
          evar = xv.var({1}, 1);
          estd = xv.std({1}, 0, true);
        }
        // A non-contiguous view (every row a prefix of a longer row; copied before the kernel)
        // and a transposed one (reduced over its dim 0, which is contiguous in memory).
        const Tensor wide = random_cpu({A, R + 3}, dt, seed++, -2, 2);
        const Tensor xn = wide.narrow(1, 1, R);
        const Tensor gn = wide.cuda().narrow(1, 1, R);
        const Tensor en = xn.sum({1}), en_max = xn.amax({1}), et = x.t().sum({0});
        const Tensor en_arg = dt == kBool ? Tensor() : xn.argmax(1);
        const Tensor et_arg = dt == kBool ? Tensor() : x.t().argmin(0);

        const std::string& what = name;
        for (size_t i = 0; i < checks.size(); ++i) {
          expect_match(checks[i].fn(g), expected[i], checks[i].tol, checks[i].what + " " + what);
        }
        if (fp) {
          Tol ptol = sum_tol;
          if (dt == kFloat) ptol = {1e-4, 1e-6};
          expect_match(gp.prod(1), ep, ptol, "prod " + what);
          const Tol vtol = {sum_tol.rtol * 10, sum_tol.atol * 10};
          expect_match(gv.var({1}, 1), evar, vtol, "var " + what);
          expect_match(gv.std({1}, 0, true), estd, vtol, "std " + what);
        }
        expect_match(gn.sum({1}), en, sum_tol, "sum narrow " + what);
        expect_same(gn.amax({1}), en_max, "amax narrow " + what);
        expect_match(g.t().sum({0}), et, sum_tol, "sum transposed " + what);
        if (dt != kBool) {
          expect_same(gn.argmax(1), en_arg, "argmax narrow " + what);
          expect_same(g.t().argmin(0), et_arg, "argmin transposed " + what);
        }
      }
    }
  }
}

// --- Softmax -----------------------------------------------------------------------------------

TEST_F(GpuSoftmax, RowsColumnsAndDtypes) {
  uint64_t seed = 4000;
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{}, 0},          {{1}, 0},        {{7}, 0},      {{9, 1000}, -1}, {{3, 5000}, 1},
      {{2, 70000}, -1}, {{4, 33, 5}, 1}, {{33, 17}, 0}, {{65537}, 0},    {{6, 1024}, 1}};
  for (ScalarType dt : kFloatDtypes) {
    for (const auto& [shape, dim] : cases) {
      const Tensor x = random_cpu(shape, dt, seed++, -8, 8);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        const std::string what = name_of("", dt, shape, layout) + " dim " + std::to_string(dim);
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        expect_match(g.softmax(dim), x.softmax(dim), tol, "softmax " + what);
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        expect_match(g.log_softmax(dim), x.log_softmax(dim), ltol, "log_softmax " + what);
      }
    }
  }
  // An integer input with a dtype, a half input computed as float, rows of -inf.
  const Tensor i = random_cpu({5, 9}, kInt64, 4100, -5, 5);
  expect_match(i.cuda().softmax(1, kFloat), i.softmax(1, kFloat), {1e-5, 1e-7}, "int as float");
  const Tensor h = random_cpu({5, 9}, kHalf, 4101);
  expect_match(h.cuda().log_softmax(0, kFloat), h.log_softmax(0, kFloat), {1e-5, 1e-5},
               "half as float");
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor s = tensor({{-inf, -inf, -inf}, {1.0, -inf, 2.0}}, TensorOptions(kFloat));
  expect_match(s.cuda().softmax(1), s.softmax(1), {1e-6, 1e-7}, "softmax -inf");
  expect_match(s.cuda().log_softmax(1), s.log_softmax(1), {1e-6, 1e-7}, "log_softmax -inf");
}

// Long rows: rows cached in shared memory (up to about 100000 16-bit elements), longer rows in
// two passes (online max and sum); 16-byte accesses after a scalar head, so rows of odd length
// and views at odd element offsets (every row aligned differently from the output) matter.
// Entries of -inf, +inf and nan, and whole rows of -inf, as on the CPU.
TEST_F(GpuSoftmax, LongRowsAlignmentAndInfinities) {
  uint64_t seed = 4200;
  const double inf = std::numeric_limits<double>::infinity();
  // 16-bit rows up to 100003 elements are cached in shared memory, f32 up to 32768 and more (the
  // device's limit); 150001 elements take the online path in every dtype.
  const std::vector<Shape> shapes = {{3, 32768}, {3, 100003}, {5, 4097},  {4, 1025},
                                     {3, 32769}, {2, 60001},  {5, 150001}};
  for (ScalarType dt : kFloatDtypes) {
    for (const Shape& shape : shapes) {
      const int64_t A = shape[0], R = shape[1];
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        // Values in double with special entries, then the dtype; the rows are a view at
        // `offset` elements into a larger buffer (on the CPU and on the GPU alike).
        Tensor base = random_cpu({A * R + offset}, kDouble, seed++, -12, 12).contiguous();
        double* p = base.data_ptr<double>() + offset;
        p[R / 3] = -inf;  // row 0: one -inf
        if (A > 1) {
          for (int64_t r = 0; r < R; r += 7) p[R + r] = -inf;  // row 1: many -inf
        }
        if (A > 2) {
          for (int64_t r = 0; r < R; ++r) p[2 * R + r] = -inf;  // row 2: all -inf (nan)
        }
        if (A > 3) p[3 * R + R - 1] = inf;  // row 3: +inf (nan)
        if (A > 4) p[4 * R + 5] = std::nan("");
        const Tensor cpu_base = base.to(dt);
        const Tensor gpu_base = cpu_base.cuda();
        const Tensor x = cpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = gpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, shape, "offset " + std::to_string(offset));
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        expect_match(g.softmax(1), x.softmax(1), tol, "softmax " + what);
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        // f64: the CPU adds each of the R terms exp(x - max) to a running sum near 1, rounding
        // each at 2^-53, so its log(sum) (the whole of log_softmax at the maximum of a row whose
        // other terms are tiny, row 0) is only good to about R * 2^-53 absolute; the GPU sums
        // partial sums first (measured: 1.1e-13 apart at R = 32771).
        if (dt == kDouble) ltol = {1e-12, static_cast<double>(R) * 0x1p-53};
        expect_match(g.log_softmax(-1), x.log_softmax(-1), ltol, "log_softmax " + what);
      }
    }
  }
  // A half input computed as float over long rows (the kernel sees the float copy).
  const Tensor h = random_cpu({3, 40000}, kHalf, 4300, -8, 8);
  expect_match(h.cuda().softmax(1, kFloat), h.softmax(1, kFloat), {1e-5, 1e-7},
               "half as float, long rows");
}

// The shared-memory kernel (the row read once: on sm_90 by a bulk copy of its 16-byte-aligned
// body, the scalar head and tail by the threads): many rows at once (several blocks per
// multiprocessor), row lengths that are and are not a multiple of the 16-byte pack (every row
// then starts at another alignment), views at odd element offsets (x aligned differently from
// y), the row maximum in the scalar head or in the tail, rows of equal values, values more than
// 87 below the maximum (exp under 2^-126), -inf entries, and a non-contiguous input (copied
// first), against the CPU; both load paths (the bulk copy of the ops on sm_90, and the loads
// through registers of earlier GPUs, through kernels/cuda/softmax.h), with the threads per row
// the row length gives (128 to 512; other counts: the kernel lab). f64 rows of 32768 and more
// take the online kernel.
TEST_F(GpuSoftmax, SharedMemoryRowsPackedAndScalarEnds) {
  uint64_t seed = 4400;
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    int64_t A, R;
    std::vector<ScalarType> dtypes;
  };
  const std::vector<Case> cases = {
      {400, 32768, {kBFloat16, kHalf}},  // three 64 KiB rows per multiprocessor
      {9, 32771, kFloatDtypes},         {12, 2056, kFloatDtypes},
      {7, 1031, kFloatDtypes},          {6, 12345, kFloatDtypes},
  };
  for (const Case& c : cases) {
    const int64_t A = c.A, R = c.R;
    for (ScalarType dt : c.dtypes) {
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{5}}) {
        if (A > 100 && offset == 5) continue;  // the large case: aligned and one misaligned view
        Tensor base = random_cpu({A * R + offset}, kDouble, seed++, -12, 12).contiguous();
        double* p = base.data_ptr<double>() + offset;
        p[0] = 40;                                               // row 0: maximum first (head)
        p[1 * R + R - 1] = 40;                                   // row 1: maximum last (tail)
        for (int64_t r = 0; r < R; ++r) p[2 * R + r] = 1.5;      // row 2: all equal
        p[3 * R + 1] = 100;                                      // row 3: others far below
        for (int64_t r = 2; r < R; r += 5) p[4 * R + r] = -inf;  // row 4: many -inf
        const Tensor cpu_base = base.to(dt);
        const Tensor x = cpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = cpu_base.cuda().slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, {A, R}, "offset " + std::to_string(offset));
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        // f64: the CPU adds each of the R terms exp(x - max) to a running sum near 1, rounding
        // each at 2^-53, so its log(sum) (the whole of log_softmax at the maximum of a row whose
        // other terms are tiny, row 0) is only good to about R * 2^-53 absolute; the GPU sums
        // partial sums first (measured: 1.1e-13 apart at R = 32771).
        if (dt == kDouble) ltol = {1e-12, static_cast<double>(R) * 0x1p-53};
        const Tensor es = x.softmax(1), el = x.log_softmax(-1);
        // Rows that are not contiguous: each a prefix of a longer row.
        const bool narrow = offset == 1 && A < 100;
        const Tensor xn = x.narrow(1, 0, R - 2), gn = g.narrow(1, 0, R - 2);
        const Tensor ens = narrow ? xn.softmax(1) : Tensor();
        const Tensor enl = narrow ? xn.log_softmax(1) : Tensor();
        // The ops (the bulk copy on sm_90).
        expect_match(g.softmax(1), es, tol, "softmax " + what);
        expect_match(g.log_softmax(-1), el, ltol, "log_softmax " + what);
        if (narrow) {
          expect_match(gn.softmax(1), ens, tol, "softmax narrow " + what);
          expect_match(gn.log_softmax(1), enl, ltol, "log_softmax narrow " + what);
        }
#if defined(KILN_WITH_CUDA)
        // The loads through registers.
        using cuda::internal::SoftmaxRowLoad;
        auto by_registers = [&](const Tensor& t, bool log) {
          const Tensor out = empty(t.sizes(), TensorOptions(t.dtype()).device(t.device()));
          cuda::internal::softmax_forward(t, 1, log, out, SoftmaxRowLoad::kRegisters);
          return out;
        };
        const std::string how = what + " registers";
        expect_match(by_registers(g, false), es, tol, "softmax " + how);
        expect_match(by_registers(g, true), el, ltol, "log_softmax " + how);
        if (narrow) {
          expect_match(by_registers(gn, false), ens, tol, "softmax narrow " + how);
          expect_match(by_registers(gn, true), enl, ltol, "log_softmax narrow " + how);
        }
#endif
      }
    }
  }
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
        same_stream(
            seed++, [&](Device d) { return randint(-5, 17, shape, TensorOptions(dt).device(d)); },
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
