// Elementwise unary ops: every op against an f64 reference (std:: functions) on values in its
// domain, for each floating dtype and layout (contiguous, transposed, strided slice, expanded,
// multi-threaded size), PyTorch's dtype rules, known values, in-place forms and misuse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <kiln/kiln.h>

#include "test_util.h"

namespace kiln {
namespace {

// Deterministic values spread over [lo, hi] in a scrambled order (an LCG), so neighbours
// differ and every vector lane sees a mix.
std::vector<double> spread(int64_t n, double lo, double hi, uint64_t seed = 1) {
  std::vector<double> v(static_cast<size_t>(n));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull;
  for (double& x : v) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    x = lo + (hi - lo) * static_cast<double>(s >> 11) * 0x1p-53;
  }
  return v;
}

Tensor make(std::vector<double> values, IntArrayRef sizes, ScalarType dtype) {
  return from_blob(values.data(), sizes, kDouble).to(dtype, /*copy=*/true);
}

struct Tolerance {
  double rtol, atol;
};

Tolerance tolerance(ScalarType dtype) {
  switch (dtype) {
    case kDouble:
      return {1e-12, 1e-13};
    case kFloat:
      return {1e-5, 1e-6};
    case kHalf:
      return {1e-3, 1e-5};  // one rounding of the float result: 2^-11 relative
    case kBFloat16:
      return {8e-3, 1e-4};  // 2^-8 relative
    default:
      return {0, 0};  // integers are exact
  }
}

// Checks out[i] == ref(in[i]) (in read back in f64, so 16-bit inputs are compared at the
// value they hold) within the tolerance of `dtype`.
void expect_matches(const Tensor& out, const Tensor& in, double (*ref)(double), ScalarType dtype,
                    const std::string& what) {
  ASSERT_EQ(to_shape(out.sizes()), to_shape(in.sizes())) << what;
  const std::vector<double> x = in.to_vector<double>();
  const std::vector<double> y = out.to_vector<double>();
  const Tolerance tol = tolerance(dtype);
  int failures = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double r = ref(x[i]);
    const bool ok = y[i] == r || (std::isnan(r) && std::isnan(y[i])) ||
                    std::abs(y[i] - r) <= tol.atol + tol.rtol * std::abs(r);
    if (!ok && failures++ < 5) {
      ADD_FAILURE() << what << ": at " << i << " input " << x[i] << " got " << y[i]
                    << " expected " << r;
    }
  }
}

using UnaryFn = Tensor (*)(const Tensor&);

struct Case {
  const char* name;
  UnaryFn fn;
  double (*ref)(double);
  double lo, hi;  // the domain the values are drawn from
};

double sigmoid_ref(double x) { return 1 / (1 + std::exp(-x)); }
double gelu_ref(double x) { return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0))); }
double gelu_tanh_ref(double x) {
  return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

const Case kFloatCases[] = {
    {"exp", exp, [](double x) { return std::exp(x); }, -5, 5},
    {"log", log, [](double x) { return std::log(x); }, 0.05, 10},
    {"log1p", log1p, [](double x) { return std::log1p(x); }, -0.9, 10},
    {"expm1", expm1, [](double x) { return std::expm1(x); }, -3, 3},
    {"sqrt", sqrt, [](double x) { return std::sqrt(x); }, 0, 10},
    {"rsqrt", rsqrt, [](double x) { return 1 / std::sqrt(x); }, 0.05, 10},
    {"sin", sin, [](double x) { return std::sin(x); }, -6, 6},
    {"cos", cos, [](double x) { return std::cos(x); }, -6, 6},
    {"tanh", tanh, [](double x) { return std::tanh(x); }, -5, 5},
    {"sigmoid", sigmoid, sigmoid_ref, -10, 10},
    {"gelu", [](const Tensor& t) { return gelu(t); }, gelu_ref, -5, 5},
    {"gelu_tanh", [](const Tensor& t) { return gelu(t, "tanh"); }, gelu_tanh_ref, -5, 5},
    {"silu", silu, [](double x) { return x * sigmoid_ref(x); }, -8, 8},
    {"erf", erf, [](double x) { return std::erf(x); }, -3, 3},
    {"reciprocal", reciprocal, [](double x) { return 1 / x; }, 0.1, 5},
    {"neg", neg, [](double x) { return -x; }, -5, 5},
    {"abs", abs, [](double x) { return std::abs(x); }, -5, 5},
    {"relu", relu, [](double x) { return x < 0 ? 0.0 : x; }, -5, 5},
    {"sign", sign, [](double x) { return double((0 < x) - (x < 0)); }, -5, 5},
    {"floor", floor, [](double x) { return std::floor(x); }, -5, 5},
    {"ceil", ceil, [](double x) { return std::ceil(x); }, -5, 5},
    {"round", round, [](double x) { return std::nearbyint(x); }, -5, 5},
    {"square", square, [](double x) { return x * x; }, -5, 5},
    {"pow_2", [](const Tensor& t) { return pow(t, 2); }, [](double x) { return x * x; }, -4, 4},
    {"pow_3", [](const Tensor& t) { return pow(t, 3); }, [](double x) { return x * x * x; }, -4, 4},
    {"pow_0.5", [](const Tensor& t) { return pow(t, 0.5); }, [](double x) { return std::sqrt(x); },
     0, 9},
    {"pow_-0.5", [](const Tensor& t) { return pow(t, -0.5); },
     [](double x) { return 1 / std::sqrt(x); }, 0.1, 9},
    {"pow_-1", [](const Tensor& t) { return pow(t, -1); }, [](double x) { return 1 / x; }, 0.2, 5},
    {"pow_-2", [](const Tensor& t) { return pow(t, -2); }, [](double x) { return 1 / (x * x); },
     0.5, 5},
    {"pow_2.5", [](const Tensor& t) { return pow(t, 2.5); },
     [](double x) { return std::pow(x, 2.5); }, 0, 4},
    {"pow_0", [](const Tensor& t) { return pow(t, 0); }, [](double) { return 1.0; }, -4, 4},
    {"pow_1", [](const Tensor& t) { return pow(t, 1.0); }, [](double x) { return x; }, -4, 4},
};

constexpr ScalarType kFloatTypes[] = {kFloat, kDouble, kHalf, kBFloat16};

TEST(UnaryTest, EveryOpMatchesReferenceForEveryFloatDtypeAndLayout) {
  for (const Case& c : kFloatCases) {
    for (ScalarType dt : kFloatTypes) {
      const std::string what = std::string(c.name) + " " + std::string(dtype_name(dt));
      // Contiguous (the vectorised path for f32/f64); 37 elements leave a remainder lane.
      const Tensor x = make(spread(37 * 6, c.lo, c.hi), {6, 37}, dt);
      const Tensor y = c.fn(x);
      EXPECT_EQ(y.dtype(), dt) << what;
      expect_matches(y, x, c.ref, dt, what + " contiguous");
      // Transposed and strided-slice inputs run the strided loop.
      const Tensor xt = x.t();
      ASSERT_FALSE(xt.is_contiguous());
      expect_matches(c.fn(xt), xt, c.ref, dt, what + " transposed");
      const Tensor xs = x.slice(1, 1, 37, 3);
      expect_matches(c.fn(xs), xs, c.ref, dt, what + " sliced");
      // An expanded input (stride 0).
      const Tensor xe = x.select(0, 2).expand({3, 37});
      expect_matches(c.fn(xe), xe, c.ref, dt, what + " expanded");
    }
  }
}

// Checks a float32 result element by element against ref(x) computed in f64.
void expect_float_matches(const Tensor& out, const std::vector<float>& x, double (*ref)(double),
                          const std::string& what) {
  ASSERT_EQ(out.dtype(), kFloat) << what;
  ASSERT_TRUE(out.is_contiguous()) << what;
  const float* y = out.data_ptr<float>();
  const Tolerance tol = tolerance(kFloat);
  int failures = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    const double r = ref(x[i]);
    if (!(y[i] == r || std::abs(y[i] - r) <= tol.atol + tol.rtol * std::abs(r)) &&
        failures++ < 5) {
      ADD_FAILURE() << what << ": at " << i << " input " << x[i] << " got " << y[i]
                    << " expected " << r;
    }
  }
}

TEST(UnaryTest, MultiThreadedSizesMatchReference) {
  // 70001 elements: more than two grains of 32768, odd so the last chunk is ragged. Inputs
  // wrap float vectors (from_blob) so the only large loops are the ops under test.
  constexpr int64_t kRows = 263, kCols = 267;
  for (const Case& c : kFloatCases) {
    std::vector<float> v(kRows * kCols);
    const std::vector<double> d = spread(kRows * kCols, c.lo, c.hi, 7);
    std::copy(d.begin(), d.end(), v.begin());
    expect_float_matches(c.fn(from_blob(v.data(), {kRows * kCols}, kFloat)), v, c.ref,
                         std::string(c.name) + " large contiguous");
    // The transpose of a [rows, cols] matrix, read back in its row-major order.
    const Tensor xt = from_blob(v.data(), {kRows, kCols}, kFloat).t();
    std::vector<float> vt(v.size());
    for (int64_t i = 0; i < kCols; ++i) {
      for (int64_t j = 0; j < kRows; ++j) vt[i * kRows + j] = v[j * kCols + i];
    }
    expect_float_matches(c.fn(xt), vt, c.ref, std::string(c.name) + " large transposed");
  }
  // 16-bit floats share one strided loop for all ops; a few ops cover it.
  for (const Case& c : kFloatCases) {
    const std::string name = c.name;
    if (name != "exp" && name != "tanh" && name != "abs" && name != "pow_2.5") continue;
    const Tensor x = make(spread(70001, c.lo, c.hi, 5), {70001}, kBFloat16);
    expect_matches(c.fn(x), x, c.ref, kBFloat16, name + " large bf16");
  }
}

TEST(UnaryTest, SpecialValuesMatchStd) {
  // Infinities, NaN, signed zero and out-of-range inputs on the vectorised (contiguous) and
  // scalar (strided) paths give what the std:: formula gives, to the ulp-level tolerance and
  // without an absolute slack (exp(-inf) must be 0, not a tiny number).
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> special = {0.0, -0.0, inf, -inf, NAN, -200.0, 200.0, 1e-30, -1e-30};
  const int64_t n = static_cast<int64_t>(special.size());
  for (const Case& c : kFloatCases) {
    for (ScalarType dt : {kFloat, kDouble}) {
      const Tensor x = make(special, {n}, dt);
      std::vector<double> doubled;
      for (double v : special) doubled.insert(doubled.end(), {v, 7.0});
      const Tensor strided = make(doubled, {2 * n}, dt).slice(0, 0, 2 * n, 2);
      for (const Tensor& in : {x, strided}) {
        const std::vector<double> y = c.fn(in).to_vector<double>();
        for (int64_t i = 0; i < n; ++i) {
          // The reference in the tensor's precision: f32 results round to float.
          double r = c.ref(special[i]);
          if (dt == kFloat) r = static_cast<float>(r);
          const bool ok = (std::isnan(r) && std::isnan(y[i])) || y[i] == r ||
                          std::abs(y[i] - r) <= tolerance(dt).rtol * std::abs(r);
          EXPECT_TRUE(ok) << c.name << " " << dtype_name(dt)
                          << (in.is_contiguous() ? "" : " strided") << " of " << special[i]
                          << ": got " << y[i] << " expected " << r;
        }
      }
    }
  }
}

TEST(UnaryTest, ZeroDimAndEmptyTensors) {
  for (const Case& c : kFloatCases) {
    const Tensor s = make({1.5}, {}, kFloat);
    const Tensor y = c.fn(s);
    EXPECT_EQ(y.dim(), 0) << c.name;
    EXPECT_NEAR(y.item<double>(), c.ref(1.5), 1e-5) << c.name;
    for (ScalarType dt : {kFloat, kHalf}) {
      const Tensor e = zeros({0, 3}, dt);
      const Tensor ye = c.fn(e);
      EXPECT_EQ(to_shape(ye.sizes()), (Shape{0, 3})) << c.name;
      EXPECT_EQ(ye.numel(), 0) << c.name;
    }
  }
  EXPECT_EQ(to_shape(logical_not(zeros({2, 0})).sizes()), (Shape{2, 0}));
  EXPECT_EQ(logical_not(tensor(0.0)).item<bool>(), true);
  EXPECT_EQ((~zeros({0}, kInt32)).numel(), 0);
  EXPECT_EQ(exp(zeros({0}, kInt64)).dtype(), kFloat);
  EXPECT_EQ(abs(zeros({3, 0}, kInt32)).dtype(), kInt32);
  EXPECT_EQ(abs(tensor(-3)).item<int64_t>(), 3);
}

TEST(UnaryTest, FloatOpsPromoteIntegersAndBoolToDefaultDtype) {
  const Tensor i64 = tensor({1, 2, 3, 4});
  const Tensor i32 = tensor({1, 2, 3, 4}, kInt32);
  const Tensor b = tensor({true, false, true, true});
  const std::vector<double> iv = {1, 2, 3, 4}, bv = {1, 0, 1, 1};
  const UnaryFn float_ops[] = {exp, log, log1p, expm1, sqrt, rsqrt, sin, cos,
                               tanh, sigmoid, erf, reciprocal};
  const char* names[] = {"exp", "log", "log1p", "expm1", "sqrt", "rsqrt", "sin", "cos",
                         "tanh", "sigmoid", "erf", "reciprocal"};
  for (size_t k = 0; k < std::size(float_ops); ++k) {
    const Case* c = nullptr;
    for (const Case& cand : kFloatCases) {
      if (std::string(cand.name) == names[k]) c = &cand;
    }
    ASSERT_NE(c, nullptr);
    for (const Tensor& x : {i64, i32}) {
      const Tensor y = float_ops[k](x);
      EXPECT_EQ(y.dtype(), kFloat) << names[k];
      expect_matches(y, x, c->ref, kFloat, std::string(names[k]) + " of " +
                                               std::string(dtype_name(x.dtype())));
    }
    const Tensor yb = float_ops[k](b);
    EXPECT_EQ(yb.dtype(), kFloat) << names[k];
    expect_matches(yb, b, c->ref, kFloat, std::string(names[k]) + " of bool");
  }
  // The default dtype decides the result.
  set_default_dtype(kDouble);
  EXPECT_EQ(exp(i64).dtype(), kDouble);
  EXPECT_EQ(pow(i64, 0.5).dtype(), kDouble);
  set_default_dtype(kFloat);
}

TEST(UnaryTest, IntegerOpsKeepDtypeAndAreExact) {
  for (ScalarType dt : {kInt32, kInt64}) {
    const Tensor x = tensor({-7, -2, -1, 0, 1, 3, 8}, dt);
    EXPECT_EQ(neg(x).dtype(), dt);
    EXPECT_EQ(neg(x).to_vector<int64_t>(), (std::vector<int64_t>{7, 2, 1, 0, -1, -3, -8}));
    EXPECT_EQ((-x).to_vector<int64_t>(), (std::vector<int64_t>{7, 2, 1, 0, -1, -3, -8}));
    EXPECT_EQ(abs(x).to_vector<int64_t>(), (std::vector<int64_t>{7, 2, 1, 0, 1, 3, 8}));
    EXPECT_EQ(relu(x).to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0, 0, 1, 3, 8}));
    EXPECT_EQ(sign(x).to_vector<int64_t>(), (std::vector<int64_t>{-1, -1, -1, 0, 1, 1, 1}));
    EXPECT_EQ(square(x).to_vector<int64_t>(), (std::vector<int64_t>{49, 4, 1, 0, 1, 9, 64}));
    for (UnaryFn f : {abs, relu, sign, square, floor, ceil, round}) EXPECT_EQ(f(x).dtype(), dt);
    for (UnaryFn f : {floor, ceil, round}) {
      EXPECT_EQ(f(x).to_vector<int64_t>(), x.to_vector<int64_t>());
      EXPECT_FALSE(f(x).is_same(x));  // a copy, not the input
    }
    EXPECT_EQ(pow(x, 3).dtype(), dt);
    EXPECT_EQ(pow(x, 3).to_vector<int64_t>(),
              (std::vector<int64_t>{-343, -8, -1, 0, 1, 27, 512}));
    EXPECT_EQ(pow(x, 0).to_vector<int64_t>(), (std::vector<int64_t>(7, 1)));
    EXPECT_EQ(pow(x, 0.5).dtype(), kFloat);  // a float exponent promotes
    EXPECT_TRUE(std::isnan(pow(x, 0.5).to_vector<float>()[0]));
    EXPECT_EQ(pow(x, 0.5).to_vector<float>()[6], std::sqrt(8.0f));
  }
  // Wrap-around as two's complement, like PyTorch: no UB on the extremes.
  const int64_t lo = std::numeric_limits<int64_t>::min();
  EXPECT_EQ(abs(tensor({lo})).item<int64_t>(), lo);
  EXPECT_EQ(neg(tensor({lo})).item<int64_t>(), lo);
  EXPECT_EQ(square(tensor({65536}, kInt32)).item<int64_t>(), 0);
  EXPECT_EQ(pow(tensor({2}, kInt32), 33).item<int64_t>(), 0);
  EXPECT_EQ(pow(tensor({3}), 5).item<int64_t>(), 243);
  // Non-contiguous integer input.
  const Tensor m = tensor({{1, -2, 3}, {-4, 5, -6}}, kInt32).t();
  EXPECT_EQ(abs(m).to_vector<int64_t>(), (std::vector<int64_t>{1, 4, 2, 5, 3, 6}));
}

TEST(UnaryTest, BoolRules) {
  const Tensor b = tensor({true, false, true});
  EXPECT_EQ(sign(b).dtype(), kBool);
  EXPECT_EQ(sign(b).to_vector<bool>(), (std::vector<bool>{true, false, true}));
  EXPECT_EQ(square(b).dtype(), kInt64);  // square is pow(x, 2): bool with an int -> int64
  EXPECT_EQ(square(b).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(pow(b, 2).dtype(), kInt64);
  EXPECT_EQ(pow(b, 2.0).dtype(), kFloat);
  EXPECT_EQ(logical_not(b).to_vector<bool>(), (std::vector<bool>{false, true, false}));
  EXPECT_EQ((~b).dtype(), kBool);
  EXPECT_EQ((~b).to_vector<bool>(), (std::vector<bool>{false, true, false}));
}

TEST(UnaryTest, LogicalNotAndBitwiseNot) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ScalarType dt : kFloatTypes) {
    const Tensor x = tensor({0.0f, 1.5f, -0.0f, nan, -2.0f}).to(dt);
    const Tensor y = logical_not(x);
    EXPECT_EQ(y.dtype(), kBool);
    EXPECT_EQ(y.to_vector<bool>(), (std::vector<bool>{true, false, true, false, false}));
  }
  const Tensor i = tensor({{0, 3}, {-1, 0}}, kInt32);
  EXPECT_EQ(logical_not(i.t()).to_vector<bool>(), (std::vector<bool>{true, false, false, true}));
  EXPECT_EQ((~i).dtype(), kInt32);
  EXPECT_EQ((~i).to_vector<int64_t>(), (std::vector<int64_t>{-1, -4, 0, -1}));
  EXPECT_EQ((~tensor({5})).item<int64_t>(), -6);
}

TEST(UnaryTest, KnownValues) {
  const Tensor one = tensor({1.0}, kDouble);
  EXPECT_NEAR(gelu(one).item<double>(), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(gelu(one, "tanh").item<double>(), 0.8411919906082768, 1e-15);
  EXPECT_NEAR(one.gelu().item<double>(), 0.8413447460685429, 1e-15);
  EXPECT_NEAR(gelu(tensor({1.0f})).item<double>(), 0.8413447460685429, 1e-7);
  EXPECT_NEAR(gelu(tensor({1.0f}), "tanh").item<double>(), 0.8411919906082768, 1e-7);
  for (ScalarType dt : kFloatTypes) {
    const Tensor r = round(tensor({2.5, -0.5, 0.5, 1.5, -2.5, 3.7, -3.2}).to(dt));
    const std::vector<double> v = r.to_vector<double>();
    EXPECT_EQ(v, (std::vector<double>{2, -0.0, 0, 2, -2, 4, -3})) << dtype_name(dt);
    EXPECT_TRUE(std::signbit(v[1])) << "round(-0.5) is -0 for " << dtype_name(dt);
  }
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Tensor special = tensor({0.0f, -0.0f, inf, -inf, nan});
  const std::vector<float> e = exp(special).to_vector<float>();
  EXPECT_EQ(e[0], 1.0f);
  EXPECT_EQ(e[2], inf);
  EXPECT_EQ(e[3], 0.0f);
  EXPECT_TRUE(std::isnan(e[4]));
  const std::vector<float> l = log(special).to_vector<float>();
  EXPECT_EQ(l[0], -inf);
  EXPECT_EQ(l[2], inf);
  EXPECT_TRUE(std::isnan(log(tensor({-1.0f})).item<float>()));
  EXPECT_TRUE(std::isnan(relu(special).to_vector<float>()[4]));  // NaN passes through
  EXPECT_EQ(sigmoid(special).to_vector<float>()[2], 1.0f);
  EXPECT_EQ(sigmoid(special).to_vector<float>()[3], 0.0f);
  EXPECT_EQ(tanh(special).to_vector<float>()[3], -1.0f);
  EXPECT_EQ(reciprocal(special).to_vector<float>()[0], inf);
  EXPECT_FALSE(std::signbit(abs(special).to_vector<float>()[1]));
  EXPECT_EQ(sign(special).to_vector<float>(), (std::vector<float>{0, 0, 1, -1, 0}));
  EXPECT_EQ(erf(special).to_vector<float>()[2], 1.0f);
}

TEST(UnaryTest, InPlaceFormsWriteThroughViewsAndBumpVersion) {
  const std::vector<double> v = spread(12, -2, 2);
  Tensor base = make(v, {3, 4}, kFloat);
  const uint64_t version = base._version();
  Tensor view = base.t();
  Tensor& r = view.exp_();
  EXPECT_EQ(&r, &view);
  EXPECT_GT(base._version(), version);
  expect_matches(base, make(v, {3, 4}, kFloat), [](double x) { return std::exp(x); }, kFloat,
                 "exp_ through a transposed view");

  Tensor s = make(spread(20, 0, 4), {20}, kDouble);
  const Tensor before = s.clone();
  s.slice(0, 0, 20, 2).sqrt_();
  const std::vector<double> got = s.to_vector<double>(), orig = before.to_vector<double>();
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_DOUBLE_EQ(got[i], i % 2 == 0 ? std::sqrt(orig[i]) : orig[i]) << i;
  }

  Tensor i = tensor({-3, 0, 4}, kInt32);
  i.neg_();
  EXPECT_EQ(i.dtype(), kInt32);
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{3, 0, -4}));
  i.relu_();
  EXPECT_EQ(i.to_vector<int64_t>(), (std::vector<int64_t>{3, 0, 0}));

  Tensor h = tensor({-1.5, 2.0, 0.25}, kBFloat16);
  h.relu_().sqrt_();
  EXPECT_EQ(h.to_vector<float>(), 
            (std::vector<float>{0.0f, static_cast<float>(BFloat16(std::sqrt(2.0f))), 0.5f}));

  // A large in-place op runs on several threads.
  Tensor big = make(spread(70001, -3, 3, 3), {70001}, kFloat);
  const Tensor ref = big.clone();
  big.neg_();
  expect_matches(big, ref, [](double x) { return -x; }, kFloat, "neg_ large");
}

TEST(UnaryTest, MethodsMatchFreeFunctions) {
  const Tensor x = make(spread(10, 0.1, 2), {10}, kFloat);
  EXPECT_EQ(x.exp().to_vector<float>(), exp(x).to_vector<float>());
  EXPECT_EQ(x.sigmoid().to_vector<float>(), sigmoid(x).to_vector<float>());
  EXPECT_EQ(x.pow(2).to_vector<float>(), pow(x, 2).to_vector<float>());
  EXPECT_EQ(x.gelu("tanh").to_vector<float>(), gelu(x, "tanh").to_vector<float>());
  EXPECT_EQ(x.square().to_vector<float>(), square(x).to_vector<float>());
  EXPECT_EQ(x.logical_not().to_vector<bool>(), logical_not(x).to_vector<bool>());
}

TEST(UnaryTest, PowDtypes) {
  const Tensor h = tensor({1.0, 2.0, 4.0}, kHalf);
  EXPECT_EQ(pow(h, 2.5).dtype(), kHalf);  // a floating tensor keeps its dtype
  EXPECT_EQ(pow(h, 2.5).to_vector<float>(), 
            (std::vector<float>{1, static_cast<float>(Half(std::pow(2.0f, 2.5f))), 32}));
  EXPECT_EQ(pow(tensor({2}, kInt32), true).dtype(), kInt32);
  EXPECT_EQ(pow(tensor({2}, kInt32), true).item<int64_t>(), 2);
}

// gelu'(x) in long double, without cancellation: exact Phi(x) + x phi(x) (Phi from erfc);
// tanh s + 2 x u' s (1 - s) with s = sigmoid(2u) = (1 + tanh u) / 2.
long double gelu_grad_ref(long double x, bool tanh_form) {
  if (!tanh_form) {
    return 0.5L * std::erfc(-x / std::sqrt(2.0L)) +
           x * std::exp(-0.5L * x * x) / std::sqrt(2 * 3.14159265358979323846264L);
  }
  const long double k = std::sqrt(2 / 3.14159265358979323846264L), c = 0.044715L;
  const long double u = k * (x + c * x * x * x), du = k * (1 + 3 * c * x * x);
  const long double s = 1 / (1 + std::exp(-2 * u)), s1 = 1 / (1 + std::exp(2 * u));
  return s + 2 * x * du * s * s1;
}

// gelu_backward(grad, self; approximate) = grad * gelu'(self) against the derivative in long
// double, in every floating dtype, contiguous and through a transposed self; the f64 kernel
// against central differences of gelu's own f64 kernel; saturation at huge and infinite inputs
// without NaN; NaN propagating; and the meta rule's errors.
TEST(UnaryTest, GeluBackwardIsTheDerivative) {
  static const OpDef& op = KILN_OP(gelu_backward);
  const std::vector<double> xs = spread(1200, -9, 9, 3), gs = spread(1200, -2, 2, 4);
  for (const char* approximate : {"none", "tanh"}) {
    const bool tanh_form = std::string(approximate) == "tanh";
    for (ScalarType dt : {kDouble, kFloat, kHalf, kBFloat16}) {
      SCOPED_TRACE(std::string(approximate) + " " + std::string(dtype_name(dt)));
      const Tensor x = make(xs, {40, 30}, dt), g = make(gs, {40, 30}, dt);
      const Tensor xt = make(xs, {30, 40}, dt).t();
      for (const Tensor& self : {x, xt}) {
        const Tensor got = call_op1(op, {g, self}, {std::string(approximate)});
        ASSERT_EQ(got.dtype(), dt);
        const std::vector<double> gv = g.to_vector<double>(), xv = self.to_vector<double>();
        const std::vector<double> out = got.to_vector<double>();
        const Tolerance tol = tolerance(dt);
        for (size_t i = 0; i < out.size(); ++i) {
          const double want = static_cast<double>(gv[i] * gelu_grad_ref(xv[i], tanh_form));
          ASSERT_NEAR(out[i], want, tol.rtol * std::abs(want) + tol.atol) << "x = " << xv[i];
        }
      }
    }
    // The op's decomposition (its formula in plain ops) agrees in f64.
    {
      const Tensor x = make(xs, {40, 30}, kDouble), g = make(gs, {40, 30}, kDouble);
      const Tensor kernel = call_op1(op, {g, x}, {std::string(approximate)});
      const Tensor plain = call_decomposition(op, {g, x}, {std::string(approximate)})[0];
      EXPECT_TRUE(allclose(kernel, plain, 1e-12, 1e-13));
    }
    // The derivative of gelu's own kernel, by central differences in f64.
    const Tensor x = make(spread(200, -4, 4, 5), {200}, kDouble);
    const double h = 1e-5;
    const Tensor fd = (gelu(x + h, approximate) - gelu(x - h, approximate)) / (2 * h);
    const Tensor got = call_op1(op, {ones({200}, kDouble), x}, {std::string(approximate)});
    EXPECT_LT((got - fd).abs().max().item<double>(), 1e-9);
    // Saturation: 1 and 0, no inf * 0; NaN stays NaN.
    const double inf = std::numeric_limits<double>::infinity();
    for (ScalarType dt : {kDouble, kFloat}) {
      const Tensor big = make({1e30, -1e30, inf, -inf, 12, std::nan("")}, {6}, dt);
      const std::vector<double> r =
          call_op1(op, {ones({6}, dt), big}, {std::string(approximate)}).to_vector<double>();
      EXPECT_EQ(r[0], 1.0);
      EXPECT_EQ(r[1], 0.0);
      EXPECT_EQ(r[2], 1.0);
      EXPECT_EQ(r[3], 0.0);
      EXPECT_NEAR(r[4], 1.0, 1e-12);
      EXPECT_TRUE(std::isnan(r[5]));
    }
  }
  const Tensor f = ones({2, 3}), d = ones({2, 3}, kDouble), i = ones({2, 3}, kInt64);
  EXPECT_KILN_ERROR(call_op1(op, {f, f}, {std::string("fast")}),
                    "[gelu_backward] approximate must be 'none' or 'tanh', got 'fast'");
  EXPECT_KILN_ERROR(call_op1(op, {f, ones({3, 2})}, {std::string("none")}),
                    "[gelu_backward] grad (float32 [2, 3]) and self (float32 [3, 2]) must have "
                    "the same shape and dtype");
  EXPECT_KILN_ERROR(call_op1(op, {f, d}, {std::string("none")}), "must have the same shape");
  EXPECT_KILN_ERROR(call_op1(op, {i, i}, {std::string("none")}),
                    "[gelu_backward] expected a floating-point self, got int64");
}

TEST(UnaryTest, MisuseNamesTheOp) {
  const Tensor b = tensor({true, false});
  const Tensor i = tensor({1, 2});
  const Tensor f = tensor({1.0, 2.0});
  EXPECT_KILN_ERROR(neg(b), "[neg]");
  EXPECT_KILN_ERROR(-b, "[neg]");
  EXPECT_KILN_ERROR(abs(b), "[abs]");
  EXPECT_KILN_ERROR(relu(b), "[relu]");
  EXPECT_KILN_ERROR(floor(b), "[floor]");
  EXPECT_KILN_ERROR(ceil(b), "[ceil]");
  EXPECT_KILN_ERROR(round(b), "[round]");
  EXPECT_KILN_ERROR(gelu(f, "fast"), "[gelu] approximate must be 'none' or 'tanh', got 'fast'");
  EXPECT_KILN_ERROR(gelu(i), "[gelu]");
  EXPECT_KILN_ERROR(silu(i), "[silu]");
  EXPECT_KILN_ERROR(pow(i, -1), "[pow] integers to negative integer powers");
  EXPECT_KILN_ERROR(pow(b, -2), "[pow]");
  EXPECT_KILN_ERROR(pow(b, true), "[pow]");
  EXPECT_KILN_ERROR(~f, "[bitwise_not]");
  EXPECT_KILN_ERROR(~tensor({1.0}, kBFloat16), "[bitwise_not]");
  Tensor ic = i.clone();
  EXPECT_KILN_ERROR(ic.exp_(), "[exp_] result type float32 can't be cast");
  EXPECT_KILN_ERROR(ic.sqrt_(), "[sqrt_]");
  Tensor bc = b.clone();
  EXPECT_KILN_ERROR(bc.neg_(), "[neg_]");
  EXPECT_KILN_ERROR(bc.relu_(), "[relu_]");
  EXPECT_KILN_ERROR(bc.exp_(), "[exp_]");
  Tensor expanded = tensor({1.0f}).expand({3});
  EXPECT_KILN_ERROR(expanded.exp_(), "[exp_] more than one element");
  // Failed in-place calls leave the tensor untouched.
  EXPECT_EQ(ic.to_vector<int64_t>(), (std::vector<int64_t>{1, 2}));
}

}  // namespace
}  // namespace kiln
