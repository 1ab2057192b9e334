// Reductions and cumsum against plain f64 loops: every dims combination of a 3-D tensor (with
// negative dims, keepdim, non-contiguous inputs), every dtype, 0-d and empty tensors, tensors
// large enough to split across threads, NaN behaviour and every misuse.
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <bit>
#include <cmath>
#include <functional>
#include <limits>
#include <random>

#include "test_util.h"

namespace kiln {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

Tensor from_values(std::vector<double> v, IntArrayRef sizes, ScalarType dtype = kDouble) {
  return from_blob(v.data(), sizes, kDouble).clone().to(dtype);
}

std::vector<double> random_values(int64_t n, uint32_t seed, double lo = -2, double hi = 2) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dist(gen);
  return v;
}

Tensor random_tensor(IntArrayRef sizes, uint32_t seed, ScalarType dtype = kDouble) {
  return from_values(random_values(numel_of(sizes), seed), sizes, dtype);
}

// The reference: the elements of `t` grouped by output position (kept dims in row-major order),
// each group in row-major order of the reduced dims, then each group folded with a function.
struct Groups {
  Shape sizes;
  std::vector<std::vector<double>> groups;
};
struct Reference {
  Shape sizes;
  std::vector<double> values;
};
Groups group(const Tensor& t, const std::vector<int64_t>& dims, bool keepdim) {
  const int64_t nd = t.dim();
  const int64_t m = std::max<int64_t>(nd, 1);
  std::vector<bool> red(static_cast<size_t>(nd), dims.empty());
  for (int64_t d : dims) red[(d % m + m) % m] = true;
  Groups g;
  int64_t outputs = 1;
  for (int64_t d = 0; d < nd; ++d) {
    if (!red[d]) {
      g.sizes.push_back(t.size(d));
      outputs *= t.size(d);
    } else if (keepdim) {
      g.sizes.push_back(1);
    }
  }
  g.groups.resize(static_cast<size_t>(outputs));
  const std::vector<double> v = t.to_vector<double>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    int64_t rem = i, out = 0, scale = 1;
    for (int64_t d = nd - 1; d >= 0; --d) {
      const int64_t idx = rem % t.size(d);
      rem /= t.size(d);
      if (!red[d]) {
        out += idx * scale;
        scale *= t.size(d);
      }
    }
    g.groups[out].push_back(v[i]);
  }
  return g;
}
Reference fold(const Groups& g, const std::function<double(const std::vector<double>&)>& fn) {
  Reference r{g.sizes, {}};
  for (const auto& x : g.groups) r.values.push_back(fn(x));
  return r;
}
Reference reference(const Tensor& t, const std::vector<int64_t>& dims, bool keepdim,
                    const std::function<double(const std::vector<double>&)>& fn) {
  return fold(group(t, dims, keepdim), fn);
}

double ref_sum(const std::vector<double>& g) {
  double s = 0;
  for (double x : g) s += x;
  return s;
}
double ref_mean(const std::vector<double>& g) { return ref_sum(g) / g.size(); }
double ref_prod(const std::vector<double>& g) {
  double p = 1;
  for (double x : g) p *= x;
  return p;
}
double ref_max(const std::vector<double>& g) {
  double m = -kInf;
  for (double x : g) m = std::isnan(x) || std::isnan(m) ? kNaN : std::max(m, x);
  return m;
}
double ref_min(const std::vector<double>& g) {
  double m = kInf;
  for (double x : g) m = std::isnan(x) || std::isnan(m) ? kNaN : std::min(m, x);
  return m;
}
double ref_argmax(const std::vector<double>& g) {
  size_t best = 0;
  for (size_t i = 1; i < g.size(); ++i) {
    if (std::isnan(g[best])) break;
    if (std::isnan(g[i]) || g[i] > g[best]) best = i;
  }
  return static_cast<double>(best);
}
double ref_argmin(const std::vector<double>& g) {
  size_t best = 0;
  for (size_t i = 1; i < g.size(); ++i) {
    if (std::isnan(g[best])) break;
    if (std::isnan(g[i]) || g[i] < g[best]) best = i;
  }
  return static_cast<double>(best);
}
std::function<double(const std::vector<double>&)> ref_var(int64_t correction, bool take_sqrt) {
  return [=](const std::vector<double>& g) {
    const double m = ref_mean(g);
    double ss = 0;
    for (double x : g) ss += (x - m) * (x - m);
    const double v = ss / std::max<double>(0, static_cast<double>(g.size()) - correction);
    return take_sqrt ? std::sqrt(v) : v;
  };
}
std::function<double(const std::vector<double>&)> ref_norm(double p) {
  return [=](const std::vector<double>& g) {
    if (std::isinf(p)) {
      double m = p > 0 ? 0 : kInf;
      for (double x : g) m = p > 0 ? std::max(m, std::abs(x)) : std::min(m, std::abs(x));
      return m;
    }
    double s = 0;
    for (double x : g) s += p == 0 ? (x != 0) : std::pow(std::abs(x), p);
    return p == 0 ? s : std::pow(s, 1 / p);
  };
}
double ref_logsumexp(const std::vector<double>& g) {
  double s = 0;
  for (double x : g) s += std::exp(x);
  return std::log(s);
}
double ref_all(const std::vector<double>& g) {
  for (double x : g) {
    if (x == 0) return 0;
  }
  return 1;
}
double ref_any(const std::vector<double>& g) {
  for (double x : g) {
    if (x != 0) return 1;
  }
  return 0;
}

void expect_matches(const Tensor& got, const Reference& want, double rtol, double atol,
                    const std::string& what) {
  ASSERT_EQ(to_shape(got.sizes()), want.sizes) << what;
  const std::vector<double> v = got.to_vector<double>();
  ASSERT_EQ(v.size(), want.values.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(want.values[i])) {
      EXPECT_TRUE(std::isnan(v[i])) << what << " at " << i;
    } else if (std::isinf(want.values[i])) {
      EXPECT_EQ(v[i], want.values[i]) << what << " at " << i;
    } else {
      EXPECT_NEAR(v[i], want.values[i], atol + rtol * std::abs(want.values[i]))
          << what << " at " << i;
    }
  }
}

// Every subset of {0, 1, 2} (the empty one means all dims), spelled with positive and negative
// dims, in a scrambled order.
std::vector<std::vector<int64_t>> dim_sets_3d() {
  return {{}, {0}, {-2}, {2}, {1, 0}, {0, -1}, {2, 1}, {-1, 0, 1}};
}

// The 3-D inputs the combination tests run on: contiguous, permuted, and sliced with a step.
std::vector<std::pair<std::string, Tensor>> layouts_3d(uint32_t seed, ScalarType dtype) {
  Tensor base = random_tensor({4, 5, 6}, seed, dtype);
  return {
      {"contiguous", base},
      {"permuted", random_tensor({6, 4, 5}, seed + 1, dtype).permute({1, 2, 0})},
      {"sliced", random_tensor({4, 10, 7}, seed + 2, dtype).slice(1, 0, 10, 2).narrow(2, 1, 6)}};
}

std::string label(const std::string& op, const std::string& layout,
                  const std::vector<int64_t>& dims, bool keepdim) {
  std::string s = op + " " + layout + " dims " + shape_str(dims);
  return s + (keepdim ? " keepdim" : "");
}

TEST(ReduceTest, EveryDimsCombinationMatchesReference) {
  for (const auto& [name, t] : layouts_3d(1, kDouble)) {
    for (const auto& dims : dim_sets_3d()) {
      for (bool keepdim : {false, true}) {
        // `name` is a structured binding: captured by name for clang before 16.
        const auto l = [&, &name = name](const std::string& op) {
          return label(op, name, dims, keepdim);
        };
        expect_matches(t.sum(dims, keepdim), reference(t, dims, keepdim, ref_sum), 1e-12, 1e-12,
                       l("sum"));
        expect_matches(t.mean(dims, keepdim), reference(t, dims, keepdim, ref_mean), 1e-12, 1e-12,
                       l("mean"));
        expect_matches(t.amax(dims, keepdim), reference(t, dims, keepdim, ref_max), 0, 0,
                       l("amax"));
        expect_matches(t.amin(dims, keepdim), reference(t, dims, keepdim, ref_min), 0, 0,
                       l("amin"));
        expect_matches(t.logsumexp(dims, keepdim), reference(t, dims, keepdim, ref_logsumexp),
                       1e-12, 1e-12, l("logsumexp"));
        for (int64_t correction : {0, 1}) {
          expect_matches(t.var(dims, correction, keepdim),
                         reference(t, dims, keepdim, ref_var(correction, false)), 1e-10, 1e-12,
                         l("var"));
          expect_matches(t.std(dims, correction, keepdim),
                         reference(t, dims, keepdim, ref_var(correction, true)), 1e-10, 1e-12,
                         l("std"));
        }
        for (double p : {2.0, 1.0, kInf, -kInf, 0.0, 3.0, 0.5}) {
          expect_matches(t.norm(p, dims, keepdim), reference(t, dims, keepdim, ref_norm(p)), 1e-10,
                         1e-12, l("norm p=" + std::to_string(p)));
        }
      }
    }
  }
}

TEST(ReduceTest, ProdAllAnyOverEveryDimsCombination) {
  // Values near 1 keep products of 120 elements in range; zeros exercise all/any.
  std::vector<double> v = random_values(120, 7, 0.8, 1.2);
  std::vector<double> z(120, 1.0);
  for (size_t i = 0; i < z.size(); i += 13) z[i] = 0;
  const Tensor x = from_values(v, {4, 5, 6});
  const Tensor b = from_values(z, {4, 5, 6}, kBool);
  const Tensor bt = from_values(z, {6, 4, 5}, kBool).permute({1, 2, 0});
  for (const auto& dims : dim_sets_3d()) {
    for (bool keepdim : {false, true}) {
      const std::string l = label("", "", dims, keepdim);
      expect_matches(x.transpose(0, 2).prod(dims.empty() ? 0 : dims[0], keepdim),
                     reference(x.transpose(0, 2), {dims.empty() ? 0 : dims[0]}, keepdim, ref_prod),
                     1e-12, 0, "prod" + l);
      for (const Tensor& t : {b, bt}) {
        std::vector<int64_t> one{dims.empty() ? 1 : dims[0]};
        Tensor all = t.all(one[0], keepdim), any = t.any(one[0], keepdim);
        EXPECT_EQ(all.dtype(), kBool);
        EXPECT_EQ(any.dtype(), kBool);
        expect_matches(all, reference(t, one, keepdim, ref_all), 0, 0, "all" + l);
        expect_matches(any, reference(t, one, keepdim, ref_any), 0, 0, "any" + l);
      }
    }
  }
  EXPECT_FALSE(b.all().item<bool>());
  EXPECT_TRUE(b.any().item<bool>());
  EXPECT_TRUE(ones({3}, kBool).all().item<bool>());
  EXPECT_FALSE(zeros({3}, kFloat).any().item<bool>());
  // Float inputs: NaN counts as true, as in PyTorch.
  EXPECT_TRUE(from_values({kNaN, 1}, {2}, kFloat).all().item<bool>());
  EXPECT_EQ(to_shape(b.all(-1, true).sizes()), (Shape{4, 5, 1}));
}

TEST(ReduceTest, MaxMinWithIndicesAndArgmaxOverEveryDim) {
  // Few distinct values force ties, which must resolve to the first occurrence.
  std::vector<double> v = random_values(120, 3, 0, 4);
  for (double& x : v) x = std::floor(x);
  const Tensor base = from_values(v, {4, 5, 6});
  for (const Tensor& t : {base, base.permute({2, 0, 1}), base.slice(1, 1, 5, 2)}) {
    for (int64_t dim : {0, 1, 2, -1, -3}) {
      for (bool keepdim : {false, true}) {
        const std::string l = label("", "", {dim}, keepdim);
        auto [values, indices] = t.max(dim, keepdim);
        expect_matches(values, reference(t, {dim}, keepdim, ref_max), 0, 0, "max" + l);
        EXPECT_EQ(indices.dtype(), kInt64);
        expect_matches(indices, reference(t, {dim}, keepdim, ref_argmax), 0, 0, "max idx" + l);
        auto [mvalues, mindices] = t.min(dim, keepdim);
        expect_matches(mvalues, reference(t, {dim}, keepdim, ref_min), 0, 0, "min" + l);
        expect_matches(mindices, reference(t, {dim}, keepdim, ref_argmin), 0, 0, "min idx" + l);
        expect_matches(t.argmax(dim, keepdim), reference(t, {dim}, keepdim, ref_argmax), 0, 0,
                       "argmax" + l);
        expect_matches(t.argmin(dim, keepdim), reference(t, {dim}, keepdim, ref_argmin), 0, 0,
                       "argmin" + l);
      }
    }
    // No dim: over the flattened tensor.
    const Tensor am = t.argmax();
    EXPECT_EQ(am.dim(), 0);
    EXPECT_EQ(am.item<int64_t>(), static_cast<int64_t>(ref_argmax(t.to_vector<double>())));
    EXPECT_EQ(t.argmin().item<int64_t>(), static_cast<int64_t>(ref_argmin(t.to_vector<double>())));
    EXPECT_EQ(to_shape(t.argmax(std::nullopt, true).sizes()), (Shape{1, 1, 1}));
    EXPECT_EQ(t.max().item<double>(), ref_max(t.to_vector<double>()));
    EXPECT_EQ(t.min().item<double>(), ref_min(t.to_vector<double>()));
  }
}

TEST(ReduceTest, NanPropagatesAndWins) {
  const Tensor t = from_values({1, kNaN, 5, kNaN, -kInf, 7}, {2, 3}, kFloat);
  EXPECT_TRUE(std::isnan(t.max().item<float>()));
  EXPECT_TRUE(std::isnan(t.min().item<float>()));
  EXPECT_EQ(t.argmax().item<int64_t>(), 1);  // the first NaN
  EXPECT_EQ(t.argmin().item<int64_t>(), 1);
  auto [values, indices] = t.max(1);
  const auto vv = values.to_vector<float>();
  EXPECT_TRUE(std::isnan(vv[0]) && std::isnan(vv[1]));
  EXPECT_EQ(indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0}));
  auto [mins, min_indices] = t.min(0);
  EXPECT_EQ(min_indices.to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 0}));
  EXPECT_TRUE(std::isnan(mins.to_vector<float>()[0]));
  EXPECT_EQ(mins.to_vector<float>()[2], 5.0f);
  EXPECT_TRUE(std::isnan(t.amax({0}).to_vector<float>()[1]));
  EXPECT_TRUE(std::isnan(t.sum().item<float>()));
  EXPECT_TRUE(std::isnan(t.logsumexp({}).item<float>()));
  // NaN placed past the lanes and chunks of a long row is still found first.
  std::vector<double> v(100000, 1.0);
  v[77777] = kNaN;
  v[88888] = kNaN;
  v[5] = 3.0;
  const Tensor big = from_values(v, {100000}, kFloat);
  EXPECT_EQ(big.argmax().item<int64_t>(), 77777);
  EXPECT_TRUE(std::isnan(big.amax().item<float>()));
  EXPECT_EQ(big.slice(0, 0, 77777).argmax().item<int64_t>(), 5);
}

// amax and amin have one result whatever the order of reduction (IEEE 754-2019's maximum and
// minimum): +0 is larger than -0 wherever the zeros stand, and NaN wins. So the compiler's row
// kernels, which reduce in their own order, give eager's bits.
TEST(ReduceTest, AmaxAminOfZerosAndNanDoNotDependOnOrder) {
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    const std::string what = std::string(dtype_name(dt));
    for (const std::vector<double>& v : std::vector<std::vector<double>>{
             {-0.0, 0.0}, {0.0, -0.0}, {-1.0, -0.0, 0.0, -0.0}, {0.0, -0.0, -0.0, -2.0}}) {
      // Long enough that the CPU reduces it in chunks, lanes and threads, zeros in every place.
      std::vector<double> big;
      for (int i = 0; i < 50000; ++i) big.insert(big.end(), v.begin(), v.end());
      for (const Tensor& t : {from_values(v, {static_cast<int64_t>(v.size())}, dt),
                              from_values(big, {static_cast<int64_t>(big.size())}, dt)}) {
        const double mx = t.amax().to(kDouble).item<double>();
        EXPECT_EQ(mx, 0.0) << what;
        EXPECT_FALSE(std::signbit(mx)) << what << ": amax of -0 and +0 is +0";
        const double mn = t.amin().to(kDouble).item<double>();
        if (v.front() == -1.0 || v.back() == -2.0) continue;  // amin is -1 or -2
        EXPECT_EQ(mn, 0.0) << what;
        EXPECT_TRUE(std::signbit(mn)) << what << ": amin of -0 and +0 is -0";
      }
    }
    const Tensor only_negative_zeros = from_values({-0.0, -0.0}, {2}, dt);
    EXPECT_TRUE(std::signbit(only_negative_zeros.amax().to(kDouble).item<double>())) << what;
    const Tensor with_nan = from_values({1.0, kNaN, -kInf, kNaN, 0.0}, {5}, dt);
    EXPECT_TRUE(std::isnan(with_nan.amax().to(kDouble).item<double>())) << what;
    EXPECT_TRUE(std::isnan(with_nan.amin().to(kDouble).item<double>())) << what;
    // Down the columns too (another loop of the CPU kernel): [-0, +0, -inf] and [+0, -0, NaN].
    const Tensor cols = from_values({-0.0, 0.0, 0.0, -0.0, -kInf, kNaN}, {3, 2}, dt);
    const Tensor cmax = cols.amax({0}).to(kDouble), cmin = cols.amin({0}).to(kDouble);
    EXPECT_EQ(cmax.to_vector<double>()[0], 0.0) << what;
    EXPECT_FALSE(std::signbit(cmax.to_vector<double>()[0])) << what;
    EXPECT_TRUE(std::isnan(cmax.to_vector<double>()[1])) << what;
    EXPECT_EQ(cmin.to_vector<double>()[0], -kInf) << what;
    EXPECT_TRUE(std::isnan(cmin.to_vector<double>()[1])) << what;
  }
  // A NaN result is the device's canonical NaN on the CPU too (the same bits as on the GPU).
  const Tensor f = from_values({1.0, kNaN, 2.0}, {3}, kFloat);
  EXPECT_EQ(std::bit_cast<uint32_t>(f.amax().item<float>()), 0x7fffffffu);
  EXPECT_EQ(std::bit_cast<uint32_t>(f.amin().item<float>()), 0x7fffffffu);
  const Tensor d = from_values({1.0, kNaN, 2.0}, {3}, kDouble);
  EXPECT_EQ(std::bit_cast<uint64_t>(d.amax().item<double>()), 0x7fffffffffffffffu);
  // Integers and bool as before.
  EXPECT_EQ(from_values({3, -7, 5}, {3}, kLong).amin().item<int64_t>(), -7);
  EXPECT_EQ(from_values({0, 1, 0}, {3}, kBool).amax().item<bool>(), true);
}

TEST(ReduceTest, DtypesAndResultTypes) {
  const std::vector<double> v{1, 2, 3, 4, -5, 6};
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    const Tensor t = from_values(v, {2, 3}, dt);
    EXPECT_EQ(t.sum().dtype(), dt);
    EXPECT_EQ(t.sum().item<double>(), 11);
    EXPECT_EQ(t.sum({1}).to_vector<double>(), (std::vector<double>{6, 5}));
    EXPECT_EQ(t.mean({0}).to_vector<double>(), (std::vector<double>{2.5, -1.5, 4.5}));
    EXPECT_EQ(t.prod().item<double>(), -720);
    EXPECT_EQ(t.amax().item<double>(), 6);
    EXPECT_EQ(t.amin({1}).to_vector<double>(), (std::vector<double>{1, -5}));
    EXPECT_EQ(t.argmax(1).to_vector<int64_t>(), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(t.var().dtype(), dt);
    EXPECT_NEAR(t.var({}, 0).item<double>(), 91.0 / 6 - (11.0 / 6) * (11.0 / 6), 0.05);
    EXPECT_NEAR(t.norm().item<double>(), std::sqrt(91.0), 0.05);
    EXPECT_EQ(t.logsumexp({1}).dtype(), dt);
    EXPECT_EQ(t.cumsum(1).to_vector<double>(), (std::vector<double>{1, 3, 6, 4, -1, 5}));
    EXPECT_EQ(t.sum({}, false, kDouble).dtype(), kDouble);
  }
  for (ScalarType dt : {kInt32, kInt64}) {
    const Tensor t = from_values(v, {2, 3}, dt);
    EXPECT_EQ(t.sum().dtype(), kInt64);
    EXPECT_EQ(t.sum({0}).to_vector<int64_t>(), (std::vector<int64_t>{5, -3, 9}));
    EXPECT_EQ(t.prod().dtype(), kInt64);
    EXPECT_EQ(t.prod(1).to_vector<int64_t>(), (std::vector<int64_t>{6, -120}));
    EXPECT_EQ(t.amax().dtype(), dt);
    EXPECT_EQ(t.amax({0}).to_vector<int64_t>(), (std::vector<int64_t>{4, 2, 6}));
    EXPECT_EQ(t.min().item<int64_t>(), -5);
    EXPECT_EQ(t.mean({}, false, kFloat).item<float>(), 11.0f / 6);
    EXPECT_EQ(t.sum({}, false, kFloat).dtype(), kFloat);
    EXPECT_EQ(t.cumsum(0).dtype(), kInt64);
    EXPECT_EQ(t.cumsum(0, kFloat).dtype(), kFloat);
    EXPECT_EQ(t.cumsum(0).to_vector<int64_t>(), (std::vector<int64_t>{1, 2, 3, 5, -3, 9}));
    EXPECT_EQ(t.logsumexp({1}).dtype(), kFloat);  // integers promote to the default dtype
    EXPECT_NEAR(t.logsumexp({1}).to_vector<double>()[0], ref_logsumexp({1, 2, 3}), 1e-6);
  }
  // int32 sums accumulate in int64 without overflow.
  const Tensor big_ints = full({4}, int64_t{2000000000}, kInt32);
  EXPECT_EQ(big_ints.sum().item<int64_t>(), 8000000000);
  // bool sums count.
  const Tensor b = from_values({1, 0, 1, 1}, {2, 2}, kBool);
  EXPECT_EQ(b.sum().dtype(), kInt64);
  EXPECT_EQ(b.sum().item<int64_t>(), 3);
  EXPECT_EQ(b.sum({1}).to_vector<int64_t>(), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(b.amax({1}).dtype(), kBool);
  EXPECT_EQ(b.amin({1}).to_vector<bool>(), (std::vector<bool>{false, true}));
  auto [bv, bi] = b.max(0);
  EXPECT_EQ(bv.to_vector<bool>(), (std::vector<bool>{true, true}));
  EXPECT_EQ(bi.to_vector<int64_t>(), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(b.cumsum(1).to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1, 2}));
  // f16 input summed in double: 4096 halves of 1 give 4096 exactly (f16 accumulation stalls at
  // 2048).
  EXPECT_EQ(ones({4096}, kHalf).sum().item<float>(), 4096.0f);
  EXPECT_EQ(ones({4096}, kBFloat16).sum().item<float>(), 4096.0f);
}

TEST(ReduceTest, ZeroDimInputs) {
  const Tensor s = scalar_tensor(2.5, kFloat);
  for (int64_t dim : {0, -1}) {
    EXPECT_EQ(s.sum({dim}).dim(), 0);
    EXPECT_EQ(s.sum({dim}, true).dim(), 0);
    EXPECT_EQ(s.sum({dim}).item<float>(), 2.5f);
    auto [v, i] = s.max(dim);
    EXPECT_EQ(v.item<float>(), 2.5f);
    EXPECT_EQ(i.item<int64_t>(), 0);
    EXPECT_EQ(s.argmin(dim).item<int64_t>(), 0);
    EXPECT_EQ(s.cumsum(dim).item<float>(), 2.5f);
    EXPECT_EQ(s.prod(dim).item<float>(), 2.5f);
    EXPECT_EQ(s.all(dim).item<bool>(), true);
  }
  EXPECT_EQ(s.sum().item<float>(), 2.5f);
  EXPECT_EQ(s.mean().item<float>(), 2.5f);
  EXPECT_EQ(s.max().item<float>(), 2.5f);
  EXPECT_EQ(s.argmax().item<int64_t>(), 0);
  EXPECT_TRUE(std::isnan(s.var().item<float>()));  // one element, correction 1: 0 / 0
  EXPECT_EQ(s.var({}, 0).item<float>(), 0.0f);
  EXPECT_EQ(s.norm(1).item<float>(), 2.5f);
  EXPECT_FLOAT_EQ(s.logsumexp({}).item<float>(), 2.5f);
  EXPECT_KILN_ERROR(s.sum({1}), "[sum]");
  EXPECT_KILN_ERROR(s.max(2), "[max_dim]");
}

TEST(ReduceTest, EmptyTensors) {
  const Tensor e = zeros({0, 3}, kFloat);
  EXPECT_EQ(to_shape(e.sum({0}).sizes()), (Shape{3}));
  EXPECT_EQ(e.sum({0}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(e.sum().item<float>(), 0.0f);
  EXPECT_EQ(e.prod(0).to_vector<float>(), (std::vector<float>{1, 1, 1}));
  for (float m : e.mean({0}).to_vector<float>()) EXPECT_TRUE(std::isnan(m));
  for (float m : e.var({0}).to_vector<float>()) EXPECT_TRUE(std::isnan(m));
  EXPECT_EQ(e.logsumexp({0}).to_vector<float>()[0], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(e.norm(2, {0}).to_vector<float>(), (std::vector<float>{0, 0, 0}));
  EXPECT_EQ(e.all(0).to_vector<bool>(), (std::vector<bool>{true, true, true}));
  EXPECT_EQ(e.any(0).to_vector<bool>(), (std::vector<bool>{false, false, false}));
  EXPECT_EQ(zeros({0, 3}, kInt32).sum().item<int64_t>(), 0);
  // Reducing a non-empty dim of an empty tensor is fine for every op.
  EXPECT_EQ(to_shape(e.amax({1}).sizes()), (Shape{0}));
  EXPECT_EQ(to_shape(e.amax({1}, true).sizes()), (Shape{0, 1}));
  EXPECT_EQ(to_shape(std::get<1>(e.max(1)).sizes()), (Shape{0}));
  EXPECT_EQ(to_shape(e.argmin(1).sizes()), (Shape{0}));
  EXPECT_EQ(to_shape(e.norm(kInf, {1}).sizes()), (Shape{0}));
  EXPECT_EQ(to_shape(e.cumsum(0).sizes()), (Shape{0, 3}));
  EXPECT_EQ(to_shape(e.cumsum(1).sizes()), (Shape{0, 3}));
  // Ops without an identity refuse to reduce over nothing.
  EXPECT_KILN_ERROR(e.amax({0}), "[amax] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.amin(), "[amin] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.max(), "[max] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.min(), "[min] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.max(0), "[max_dim] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.min(0), "[min_dim] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.argmax(), "[argmax] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.argmin(0), "[argmin] cannot reduce over a zero-size dimension");
  EXPECT_KILN_ERROR(e.norm(kInf), "[norm]");
  EXPECT_KILN_ERROR(e.norm(-kInf, {0}), "[norm]");
}

TEST(ReduceTest, ExpandedInput) {
  const Tensor row = from_values({1, 2, 3}, {1, 3});
  const Tensor x = row.expand({4, 3});
  EXPECT_EQ(x.sum({0}).to_vector<double>(), (std::vector<double>{4, 8, 12}));
  EXPECT_EQ(x.sum({1}).to_vector<double>(), (std::vector<double>{6, 6, 6, 6}));
  EXPECT_EQ(x.var({0}).to_vector<double>(), (std::vector<double>{0, 0, 0}));
  EXPECT_EQ(x.argmax(0).to_vector<int64_t>(), (std::vector<int64_t>{0, 0, 0}));
  EXPECT_EQ(x.cumsum(0).to_vector<double>()[9], 4.0);  // row 3, column 0
}

TEST(ReduceTest, LogSumExpIsStable) {
  const Tensor t =
      from_values({1000, 1000, -1000, -kInf, -kInf, -kInf, kInf, 1, 2}, {3, 3}, kFloat);
  const auto v = t.logsumexp({1}).to_vector<float>();
  EXPECT_NEAR(v[0], 1000 + std::log(2.0), 1e-3);
  EXPECT_EQ(v[1], -std::numeric_limits<float>::infinity());  // a row of -inf
  EXPECT_EQ(v[2], std::numeric_limits<float>::infinity());
  EXPECT_NEAR(from_values({-1000, -1000}, {2}).logsumexp({0}).item<double>(), -1000 + std::log(2.0),
              1e-9);
  // Two +inf in a row stay +inf (not inf - inf).
  EXPECT_EQ(from_values({kInf, kInf, 0}, {3}).logsumexp({0}).item<double>(), kInf);
}

TEST(ReduceTest, VarianceIsNumericallyStable) {
  // A large offset destroys the naive sum-of-squares formula; Welford in double does not.
  std::vector<double> v = random_values(10000, 11, -1, 1);
  for (double& x : v) x += 1e6;
  const Tensor t = from_values(v, {10000}, kFloat);
  const double want = ref_var(1, false)(t.to_vector<double>());
  EXPECT_NEAR(t.var().item<double>(), want, 1e-4 * want);
  EXPECT_NEAR(t.std({0}, 0).item<double>(), std::sqrt(ref_var(0, false)(t.to_vector<double>())),
              1e-4);
  // correction larger than the count divides by max(0, N - correction) = 0.
  EXPECT_TRUE(std::isinf(from_values({1, 2}, {2}).var({}, 2).item<double>()));
}

TEST(ReduceTest, LargeTensorsSplitAcrossThreads) {
  // Whole-tensor f32 sum over more than 1M elements, against a double reference.
  const int64_t n = (1 << 20) + 12345;
  std::vector<double> v = random_values(n, 5, 0, 1);
  const Tensor big = from_values(v, {n}, kFloat);
  const std::vector<double> vf = big.to_vector<double>();
  double want = 0;
  for (double x : vf) want += x;
  EXPECT_NEAR(big.sum().item<double>(), want, 1e-7 * want);
  EXPECT_NEAR(big.mean().item<double>(), want / n, 1e-7);
  // [512, 256]: above the thresholds that split rows, columns and long reductions across threads.
  const Tensor m = big.slice(0, 0, 1 << 17).view({512, 256});
  // Row (many outputs), column, split-R row and split-R column paths, then a strided path.
  for (const auto& [t, dims] :
       std::vector<std::pair<Tensor, std::vector<int64_t>>>{{m, {1}},
                                                            {m, {0}},
                                                            {m.view({2, -1}), {1}},
                                                            {m.view({-1, 2}), {0}},
                                                            {m.view({8, 64, 256}), {0, 2}},
                                                            {m.t(), {1}},
                                                            {m.view({4, 128, 256}), {1}}}) {
    const std::string l = shape_str(t.sizes()) + " dims " + shape_str(dims);
    const Groups g = group(t, dims, false);
    expect_matches(t.sum(dims), fold(g, ref_sum), 1e-6, 1e-6, "sum " + l);
    expect_matches(t.amax(dims), fold(g, ref_max), 0, 0, "amax " + l);
    expect_matches(t.var(dims), fold(g, ref_var(1, false)), 1e-5, 1e-7, "var " + l);
    expect_matches(t.logsumexp(dims), fold(g, ref_logsumexp), 1e-6, 1e-6, "logsumexp " + l);
    if (dims.size() == 1) {
      expect_matches(t.argmin(dims[0]), fold(g, ref_argmin), 0, 0, "argmin " + l);
    }
  }
  // cumsum over a long dim and across many columns.
  const Tensor cs = m.cumsum(0);
  const auto cv = cs.to_vector<double>();
  const auto mv = m.to_vector<double>();
  double acc = 0;
  for (int64_t r = 0; r < 512; ++r) {
    acc += mv[r * 256 + 17];
    ASSERT_NEAR(cv[r * 256 + 17], acc, 1e-4);
  }
  const auto rowsum = m.cumsum(1).select(1, 255).to_vector<double>();
  const auto want_rows = reference(m, {1}, false, ref_sum).values;
  for (size_t i = 0; i < rowsum.size(); ++i) ASSERT_NEAR(rowsum[i], want_rows[i], 1e-4);
}

TEST(ReduceTest, CumsumMatchesReference) {
  for (const auto& [name, t] : layouts_3d(21, kDouble)) {
    for (int64_t dim : {0, 1, 2, -1, -2}) {
      const Tensor got = t.cumsum(dim);
      ASSERT_EQ(to_shape(got.sizes()), to_shape(t.sizes()));
      const int64_t d = (dim + 3) % 3;
      const auto in = t.contiguous().to_vector<double>();
      const auto out = got.to_vector<double>();
      const int64_t inner = d == 2 ? 1 : (d == 1 ? t.size(2) : t.size(1) * t.size(2));
      for (int64_t i = 0; i < t.numel(); ++i) {
        const int64_t pos = (i / inner) % t.size(d);
        const double want = pos == 0 ? in[i] : 0.0;
        if (pos == 0) {
          ASSERT_DOUBLE_EQ(out[i], want) << name << " dim " << dim;
        } else {
          ASSERT_NEAR(out[i], out[i - inner] + in[i], 1e-12) << name << " dim " << dim;
        }
      }
    }
  }
  const Tensor h = from_values({0.5, 0.25, 0.125}, {3}, kHalf);
  EXPECT_EQ(h.cumsum(0).dtype(), kHalf);
  EXPECT_EQ(h.cumsum(0).to_vector<float>(), (std::vector<float>{0.5f, 0.75f, 0.875f}));
  EXPECT_EQ(h.cumsum(0, kDouble).dtype(), kDouble);
}

TEST(ReduceTest, Errors) {
  const Tensor t = zeros({2, 3, 4});
  EXPECT_KILN_ERROR(t.sum({3}), "[sum]");
  EXPECT_KILN_ERROR(t.sum({-4}), "[sum]");
  EXPECT_KILN_ERROR(t.sum({1, -2}), "[sum] dim 1 appears more than once");
  EXPECT_KILN_ERROR(t.mean({0, 0}), "[mean]");
  EXPECT_KILN_ERROR(t.amax({5}), "[amax]");
  EXPECT_KILN_ERROR(t.amin({2, 2}), "[amin]");
  EXPECT_KILN_ERROR(t.prod(3), "[prod]");
  EXPECT_KILN_ERROR(t.max(3), "[max_dim]");
  EXPECT_KILN_ERROR(t.min(-4), "[min_dim]");
  EXPECT_KILN_ERROR(t.argmax(3), "[argmax]");
  EXPECT_KILN_ERROR(t.argmin(-5), "[argmin]");
  EXPECT_KILN_ERROR(t.var({0, 0}), "[var]");
  EXPECT_KILN_ERROR(t.std({7}), "[std]");
  EXPECT_KILN_ERROR(t.norm(2, {3}), "[norm]");
  EXPECT_KILN_ERROR(t.logsumexp({3}), "[logsumexp]");
  EXPECT_KILN_ERROR(t.all(3), "[all]");
  EXPECT_KILN_ERROR(t.any(-4), "[any]");
  EXPECT_KILN_ERROR(t.cumsum(3), "[cumsum]");
  const Tensor i = zeros({2, 3}, kInt64);
  EXPECT_KILN_ERROR(i.mean(), "[mean] could not infer output dtype");
  EXPECT_KILN_ERROR(t.mean({}, false, kInt64), "[mean] could not infer output dtype");
  EXPECT_KILN_ERROR(i.var(), "[var] expected a floating-point input");
  EXPECT_KILN_ERROR(i.std(), "[std] expected a floating-point input");
  EXPECT_KILN_ERROR(i.norm(), "[norm] expected a floating-point input");
  EXPECT_KILN_ERROR(zeros({2}, kBool).argmax(), "[argmax]");
}

}  // namespace
}  // namespace kiln
