// The Philox generator and the random ops: known-answer vectors, the documented element ->
// counter mapping, reproducibility (seeds, thread counts, strided targets, trace replay),
// statistics on 1M samples with fixed seeds, dtypes and errors.
#include "tensor/random.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <set>
#include <thread>
#include <vector>

#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

struct Moments {
  double mean = 0, std = 0, min = 0, max = 0;
};

Moments moments(const std::vector<double>& v) {
  Moments m;
  m.min = *std::min_element(v.begin(), v.end());
  m.max = *std::max_element(v.begin(), v.end());
  for (double x : v) m.mean += x;
  m.mean /= static_cast<double>(v.size());
  for (double x : v) m.std += (x - m.mean) * (x - m.mean);
  m.std = std::sqrt(m.std / static_cast<double>(v.size() - 1));
  return m;
}

// Restores the thread count a test changes.
class ThreadGuard {
 public:
  ThreadGuard() : n_(get_num_threads()) {}
  ~ThreadGuard() { set_num_threads(n_); }

 private:
  int n_;
};

// Runs an in-place random op on `t` the way the public wrappers do: reserve, then dispatch.
void run_random_op(const char* name, Tensor t, absl::InlinedVector<Attr, 4> attrs, uint64_t blocks,
                   const Tensor& extra = {}) {
  const RngState st = philox_reserve(blocks);
  OpCall call;
  call.op = &Registry::get().op(name);
  call.inputs = {t};
  if (extra.defined()) call.inputs.push_back(extra);
  call.attrs = std::move(attrs);
  call.attrs.push_back(static_cast<int64_t>(st.seed));
  call.attrs.push_back(static_cast<int64_t>(st.offset));
  dispatch(call);
}

void random_into(Tensor t, int64_t low, int64_t high) {
  run_random_op("random_", t, {low, high}, static_cast<uint64_t>((t.numel() + 3) / 4));
}

TEST(RandomTest, PhiloxKnownAnswerVectors) {
  // Random123's kat_vectors for philox4x32_10.
  philox::Words a = philox::philox4x32_10(0, 0, 0, 0, 0, 0);
  EXPECT_EQ(a.w[0], 0x6627e8d5u);
  EXPECT_EQ(a.w[1], 0xe169c58du);
  EXPECT_EQ(a.w[2], 0xbc57ac4cu);
  EXPECT_EQ(a.w[3], 0x9b00dbd8u);
  const uint32_t f = 0xffffffffu;
  philox::Words b = philox::philox4x32_10(f, f, f, f, f, f);
  EXPECT_EQ(b.w[0], 0x408f276du);
  EXPECT_EQ(b.w[1], 0x41c83b0eu);
  EXPECT_EQ(b.w[2], 0xa20bc7c6u);
  EXPECT_EQ(b.w[3], 0x6d5451fdu);
  philox::Words c = philox::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u,
                                          0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(c.w[0], 0xd16cfe09u);
  EXPECT_EQ(c.w[1], 0x94fdccebu);
  EXPECT_EQ(c.w[2], 0x5001e420u);
  EXPECT_EQ(c.w[3], 0x24126ea1u);
  // block(): counter (lo, hi, 0, 0), key (seed lo, seed hi).
  philox::Words d = philox::block(0xa4093822ull | (0x299f31d0ull << 32), 0x85a308d3243f6a88ull);
  philox::Words e = philox::philox4x32_10(0x243f6a88u, 0x85a308d3u, 0, 0, 0xa4093822u, 0x299f31d0u);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(d.w[k], e.w[k]);
}

TEST(RandomTest, UniformFollowsTheDocumentedMapping) {
  const uint64_t seed = 0x123456789abcdefull;
  manual_seed(seed);
  EXPECT_EQ(initial_seed(), seed);
  Tensor x = rand({9});
  EXPECT_EQ(get_rng_state().offset, 3u);  // ceil(9 / 4) blocks
  const std::vector<float> v = x.to_vector<float>();
  for (int64_t i = 0; i < 9; ++i) {
    const philox::Words w = philox::block(seed, static_cast<uint64_t>(i / 4));
    EXPECT_EQ(v[i], philox::uniform24(w.w[i % 4])) << i;
  }
  // The next call continues at offset 3; f64 uses two words per element.
  Tensor y = rand({5}, kFloat64);
  EXPECT_EQ(get_rng_state().offset, 6u);
  const std::vector<double> vy = y.to_vector<double>();
  for (int64_t i = 0; i < 5; ++i) {
    const philox::Words w = philox::block(seed, 3 + static_cast<uint64_t>(i / 2));
    const int k = static_cast<int>(i % 2);
    EXPECT_EQ(vy[i], philox::uniform53(w.w[2 * k], w.w[2 * k + 1])) << i;
  }
}

TEST(RandomTest, NormalRandintBernoulliFollowTheDocumentedMapping) {
  const uint64_t seed = 99;
  manual_seed(seed);
  const std::vector<float> z = randn({6}).to_vector<float>();
  for (int64_t i = 0; i < 6; ++i) {
    const philox::Words w = philox::block(seed, static_cast<uint64_t>(i / 4));
    const int pair = static_cast<int>(i % 4) / 2;
    const double r = std::sqrt(-2.0 * std::log(static_cast<double>(philox::open24(w.w[2 * pair]))));
    const double t = 2 * std::numbers::pi * philox::uniform24(w.w[2 * pair + 1]);
    const double expect = i % 2 == 0 ? r * std::cos(t) : r * std::sin(t);
    EXPECT_NEAR(z[i], expect, 1e-5) << i;
  }
  EXPECT_EQ(get_rng_state().offset, 2u);
  const std::vector<double> zd = randn({3}, kFloat64).to_vector<double>();
  for (int64_t i = 0; i < 3; ++i) {
    const philox::Words w = philox::block(seed, 2 + static_cast<uint64_t>(i / 2));
    const double r = std::sqrt(-2.0 * std::log(philox::open53(w.w[0], w.w[1])));
    const double t = 2 * std::numbers::pi * philox::uniform53(w.w[2], w.w[3]);
    EXPECT_NEAR(zd[i], i % 2 == 0 ? r * std::cos(t) : r * std::sin(t), 1e-12) << i;
  }
  EXPECT_EQ(get_rng_state().offset, 4u);
  const std::vector<int64_t> ri = randint(-5, 12, {5}).to_vector<int64_t>();
  for (int64_t i = 0; i < 5; ++i) {
    const philox::Words w = philox::block(seed, 4 + static_cast<uint64_t>(i / 4));
    EXPECT_EQ(ri[i], -5 + static_cast<int64_t>(w.w[i % 4] % 17)) << i;
  }
  EXPECT_EQ(get_rng_state().offset, 6u);
  const std::vector<float> bv = bernoulli(zeros({7}), 0.5).to_vector<float>();
  for (int64_t i = 0; i < 7; ++i) {
    const philox::Words w = philox::block(seed, 6 + static_cast<uint64_t>(i / 4));
    EXPECT_EQ(bv[i], philox::uniform32(w.w[i % 4]) < 0.5 ? 1.0f : 0.0f) << i;
  }
  EXPECT_EQ(get_rng_state().offset, 8u);
}

TEST(RandomTest, SameSeedSameNumbersDifferentSeedsDiffer) {
  manual_seed(7);
  const auto a = randn({1000}).to_vector<float>();
  const auto a2 = randn({1000}).to_vector<float>();
  manual_seed(7);
  const auto b = randn({1000}).to_vector<float>();
  manual_seed(8);
  const auto c = randn({1000}).to_vector<float>();
  EXPECT_EQ(a, b);
  EXPECT_NE(a, a2);  // the stream moves on
  EXPECT_NE(a, c);
  // Saving and restoring the state replays the stream.
  manual_seed(11);
  rand({5});
  const RngState st = get_rng_state();
  const auto d = rand({100}).to_vector<float>();
  set_rng_state(st);
  EXPECT_EQ(rand({100}).to_vector<float>(), d);
}

// Every op's numbers with one thread equal those with two (tensors large enough to split).
TEST(RandomTest, SameNumbersForAnyThreadCount) {
  ThreadGuard guard;
  const int64_t n = 300001;
  auto draw = [&]() {
    manual_seed(1234);
    std::vector<std::vector<double>> r;
    r.push_back(rand({n}).to_vector<double>());
    r.push_back(rand({n}, kFloat64).to_vector<double>());
    r.push_back(randn({n}).to_vector<double>());
    r.push_back(randn({n}, kBFloat16).to_vector<double>());
    r.push_back(randint(-3, 1000, {n}).to_vector<double>());
    r.push_back(bernoulli(full({n}, 0.3)).to_vector<double>());
    Tensor strided = zeros({n / 100, 300}).slice(1, 0, 300, 3);
    strided.uniform_(-1, 1);
    r.push_back(strided.to_vector<double>());
    r.push_back(multinomial(ones({200, 1000}), 10, false).to_vector<double>());
    r.push_back(multinomial(ones({200, 1000}), 10, true).to_vector<double>());
    r.push_back(randperm(n).to_vector<double>());
    return r;
  };
  set_num_threads(1);
  const auto one = draw();
  set_num_threads(2);
  const auto two = draw();
  ASSERT_EQ(one.size(), two.size());
  for (size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], two[i]) << "draw " << i;
}

TEST(RandomTest, StridedTargetsGetTheValuesOfTheirLogicalOrder) {
  manual_seed(3);
  Tensor t = empty({4, 6}).t();  // [6, 4], not contiguous
  ASSERT_FALSE(t.is_contiguous());
  t.normal_(1, 2);
  manual_seed(3);
  Tensor u = empty({6, 4}).normal_(1, 2);
  EXPECT_EQ(t.to_vector<float>(), u.to_vector<float>());
  // A view with steps writes only its elements.
  Tensor x = zeros({10}, kFloat64);
  x.slice(0, 1, 10, 2).uniform_(5, 6);
  const auto v = x.to_vector<double>();
  for (int i = 0; i < 10; ++i) {
    if (i % 2 == 0) {
      EXPECT_EQ(v[i], 0.0);
    } else {
      EXPECT_GE(v[i], 5.0);
      EXPECT_LT(v[i], 6.0);
    }
  }
  // random_ (randint's op) into a transposed int32 view.
  Tensor ri = zeros({3, 5}, kInt32).t();
  manual_seed(4);
  random_into(ri, 0, 7);
  manual_seed(4);
  Tensor expect = randint(0, 7, {5, 3}, kInt32);
  EXPECT_EQ(ri.to_vector<int32_t>(), expect.to_vector<int32_t>());
}

TEST(RandomTest, ZeroDimAndEmpty) {
  manual_seed(0);
  Tensor s = rand({});
  EXPECT_EQ(s.dim(), 0);
  const float v = s.item<float>();
  EXPECT_GE(v, 0.0f);
  EXPECT_LT(v, 1.0f);
  const uint64_t before = get_rng_state().offset;
  Tensor e = randn({0, 3});
  EXPECT_EQ(e.numel(), 0);
  EXPECT_EQ(get_rng_state().offset, before);  // nothing drawn, nothing reserved
  EXPECT_EQ(randperm(0).numel(), 0);
}

TEST(RandomTest, UniformStatistics) {
  manual_seed(2024);
  const int64_t n = 1000000;
  const Moments m = moments(rand({n}).to_vector<double>());
  // sigma of the mean: sqrt(1/12) / 1000 = 2.9e-4.
  EXPECT_NEAR(m.mean, 0.5, 1.5e-3);
  EXPECT_NEAR(m.std, std::sqrt(1.0 / 12.0), 1e-3);
  EXPECT_GE(m.min, 0.0);
  EXPECT_LT(m.max, 1.0);
  Tensor w = empty({n}, kFloat64).uniform_(-2, 3);
  const Moments mw = moments(w.to_vector<double>());
  EXPECT_NEAR(mw.mean, 0.5, 5 * 5 * 2.9e-4);
  EXPECT_NEAR(mw.std, 5 * std::sqrt(1.0 / 12.0), 5e-3);
  EXPECT_GE(mw.min, -2.0);
  EXPECT_LT(mw.max, 3.0);
  // Each tenth of the range holds about a tenth of the values.
  std::vector<int64_t> bins(10, 0);
  for (double x : w.to_vector<double>()) ++bins[static_cast<size_t>((x + 2) * 2)];
  for (int64_t b : bins) EXPECT_NEAR(static_cast<double>(b), n / 10.0, 5 * 300.0);
}

TEST(RandomTest, NormalStatistics) {
  manual_seed(77);
  const int64_t n = 1000000;
  const std::vector<double> v = randn({n}).to_vector<double>();
  const Moments m = moments(v);
  EXPECT_NEAR(m.mean, 0.0, 5e-3);  // 5 sigma of the mean
  EXPECT_NEAR(m.std, 1.0, 4e-3);
  int64_t within1 = 0, within2 = 0;
  for (double x : v) {
    within1 += std::abs(x) < 1.0;
    within2 += std::abs(x) < 2.0;
  }
  EXPECT_NEAR(within1 / static_cast<double>(n), 0.682689, 2.5e-3);
  EXPECT_NEAR(within2 / static_cast<double>(n), 0.954500, 1.5e-3);
  const Moments md = moments(empty({n}, kFloat64).normal_(3, 2).to_vector<double>());
  EXPECT_NEAR(md.mean, 3.0, 1e-2);
  EXPECT_NEAR(md.std, 2.0, 8e-3);
  // std 0 gives the mean exactly.
  const Moments m0 = moments(empty({10}).normal_(1.5, 0).to_vector<double>());
  EXPECT_EQ(m0.min, 1.5);
  EXPECT_EQ(m0.max, 1.5);
}

TEST(RandomTest, RandintCoversTheRange) {
  manual_seed(5);
  const int64_t n = 1000000;
  const std::vector<int64_t> v = randint(-3, 7, {n}).to_vector<int64_t>();
  std::vector<int64_t> counts(10, 0);
  for (int64_t x : v) {
    ASSERT_GE(x, -3);
    ASSERT_LT(x, 7);
    ++counts[static_cast<size_t>(x + 3)];
  }
  // Each value has probability 0.1: sigma = 300.
  for (int64_t c : counts) EXPECT_NEAR(static_cast<double>(c), n / 10.0, 5 * 300.0);
  Tensor h = randint(10, {4, 5});
  EXPECT_EQ(h.dtype(), kInt64);
  EXPECT_EQ(to_shape(h.sizes()), (Shape{4, 5}));
  // A range above 2^32 uses 64 bits per element.
  const int64_t big = int64_t{1} << 40;
  const std::vector<int64_t> vb = randint(-big, big, {100000}).to_vector<int64_t>();
  double mean = 0;
  for (int64_t x : vb) {
    ASSERT_GE(x, -big);
    ASSERT_LT(x, big);
    mean += static_cast<double>(x) / static_cast<double>(big);
  }
  EXPECT_NEAR(mean / 100000.0, 0.0, 5 * 0.58 / std::sqrt(100000.0));
  // The whole int64 range.
  const auto full_range =
      randint(std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), {1000})
          .to_vector<int64_t>();
  EXPECT_GT(*std::max_element(full_range.begin(), full_range.end()), int64_t{1} << 60);
  EXPECT_LT(*std::min_element(full_range.begin(), full_range.end()), -(int64_t{1} << 60));
  // Other dtypes.
  for (ScalarType dt : {kInt32, kFloat, kDouble, kHalf, kBFloat16}) {
    const auto vd = randint(-4, 4, {1000}, dt).to_vector<double>();
    EXPECT_EQ(randint(2, {1}, dt).dtype(), dt);
    std::set<double> seen(vd.begin(), vd.end());
    EXPECT_EQ(seen.size(), 8u) << dtype_name(dt);
    EXPECT_EQ(*seen.begin(), -4.0);
    EXPECT_EQ(*seen.rbegin(), 3.0);
  }
  const auto vbool = randint(0, 2, {1000}, kBool).to_vector<double>();
  EXPECT_EQ(std::set<double>(vbool.begin(), vbool.end()).size(), 2u);
}

TEST(RandomTest, BernoulliFrequencies) {
  manual_seed(6);
  const int64_t n = 1000000;
  Tensor t = empty({n}).bernoulli_(0.3);
  const Moments m = moments(t.to_vector<double>());
  EXPECT_NEAR(m.mean, 0.3, 5 * std::sqrt(0.21 / n));
  EXPECT_EQ(m.min, 0.0);
  EXPECT_EQ(m.max, 1.0);
  // p = 0 and p = 1 are exact; other dtypes hold 0/1.
  EXPECT_EQ(moments(empty({1000}, kInt32).bernoulli_(0.0).to_vector<double>()).max, 0.0);
  EXPECT_EQ(moments(empty({1000}, kBool).bernoulli_(1.0).to_vector<double>()).min, 1.0);
  EXPECT_NEAR(moments(empty({100000}, kBFloat16).bernoulli_().to_vector<double>()).mean, 0.5,
              5 * 0.5 / std::sqrt(1e5));
  // Per-element probabilities: column k has probability k / 4, broadcast over rows.
  Tensor p = tensor({0.0, 0.25, 0.5, 0.75, 1.0}, kFloat64);
  Tensor out = empty({200000, 5});
  run_random_op("bernoulli_", out, {std::monostate{}}, (out.numel() + 3) / 4, p);
  const auto ov = out.to_vector<double>();
  for (int k = 0; k < 5; ++k) {
    double freq = 0;
    for (int64_t r = 0; r < 200000; ++r) freq += ov[static_cast<size_t>(r * 5 + k)];
    freq /= 200000;
    EXPECT_NEAR(freq, k / 4.0, 5 * std::sqrt(0.25 / 200000)) << k;
  }
  // kiln::bernoulli(p) and Tensor::bernoulli: same dtype and shape as p.
  Tensor probs = full({100000}, 0.8, kFloat64);
  Tensor b = probs.bernoulli();
  EXPECT_EQ(b.dtype(), kFloat64);
  EXPECT_NEAR(moments(b.to_vector<double>()).mean, 0.8, 5 * std::sqrt(0.16 / 1e5));
  Tensor b2 = bernoulli(full({2, 3}, 1.0, kHalf).t());
  EXPECT_EQ(to_shape(b2.sizes()), (Shape{3, 2}));
  EXPECT_EQ(moments(b2.to_vector<double>()).min, 1.0);
  Tensor b3 = bernoulli(zeros({4}, kInt32), 1.0);
  EXPECT_EQ(b3.dtype(), kInt32);
  EXPECT_EQ(b3.to_vector<int32_t>(), (std::vector<int32_t>{1, 1, 1, 1}));
}

TEST(RandomTest, MultinomialWithReplacementMatchesProbs) {
  manual_seed(8);
  const int64_t n = 1000000;
  // Unnormalised weights are fine, zero-weight categories are never drawn.
  Tensor w = tensor({1.0, 0.0, 2.0, 3.0, 4.0});
  Tensor s = multinomial(w, n, true);
  EXPECT_EQ(s.dtype(), kInt64);
  EXPECT_EQ(to_shape(s.sizes()), (Shape{n}));
  std::vector<int64_t> counts(5, 0);
  for (int64_t k : s.to_vector<int64_t>()) ++counts[static_cast<size_t>(k)];
  EXPECT_EQ(counts[1], 0);
  const double probs[] = {0.1, 0.0, 0.2, 0.3, 0.4};
  for (int k = 0; k < 5; ++k) {
    const double sigma = std::sqrt(n * probs[k] * (1 - probs[k]));
    EXPECT_NEAR(static_cast<double>(counts[k]), n * probs[k], 5 * sigma + 1e-9) << k;
  }
  // 2-D: one distribution per row; f64 and bf16 probabilities.
  Tensor rows = tensor({{0.0, 1.0, 0.0}, {0.5, 0.0, 0.5}}, kBFloat16);
  Tensor r = rows.multinomial(1000, true);
  EXPECT_EQ(to_shape(r.sizes()), (Shape{2, 1000}));
  const auto rv = r.to_vector<int64_t>();
  int64_t zeros_in_row1 = 0;
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(rv[i], 1);
    EXPECT_NE(rv[1000 + i], 1);
    zeros_in_row1 += rv[1000 + i] == 0;
  }
  EXPECT_NEAR(static_cast<double>(zeros_in_row1), 500.0, 5 * std::sqrt(250.0));
}

TEST(RandomTest, MultinomialWithoutReplacement) {
  manual_seed(9);
  // Each row: distinct indices; asking for all categories gives a permutation.
  Tensor probs = rand({64, 10}, kFloat64);
  Tensor s = multinomial(probs, 10, false);
  const auto sv = s.to_vector<int64_t>();
  for (int64_t r = 0; r < 64; ++r) {
    std::set<int64_t> seen(sv.begin() + r * 10, sv.begin() + r * 10 + 10);
    EXPECT_EQ(seen.size(), 10u);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), 9);
  }
  // The first draw follows the probabilities; the second draw never repeats the first, and
  // given a first draw, it follows the renormalised rest (p = [0.5, 0.3, 0.2]: after 0, draws 1
  // with probability 0.6).
  const int64_t n = 200000;
  Tensor p = tensor({0.5, 0.3, 0.2}).expand({n, 3});
  const auto d = multinomial(p, 2, false).to_vector<int64_t>();
  std::vector<double> first(3, 0);
  double after0 = 0, after0_is1 = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t a = d[2 * i], b = d[2 * i + 1];
    ASSERT_NE(a, b);
    first[a] += 1;
    if (a == 0) {
      after0 += 1;
      after0_is1 += b == 1;
    }
  }
  const double ps[] = {0.5, 0.3, 0.2};
  for (int k = 0; k < 3; ++k) {
    EXPECT_NEAR(first[k] / n, ps[k], 5 * std::sqrt(ps[k] * (1 - ps[k]) / n)) << k;
  }
  EXPECT_NEAR(after0_is1 / after0, 0.6, 5 * std::sqrt(0.24 / after0));
  // Zero-probability categories are never drawn.
  const auto z = multinomial(tensor({0.0, 1.0, 0.0, 2.0}), 2, false).to_vector<int64_t>();
  EXPECT_EQ(std::set<int64_t>(z.begin(), z.end()), (std::set<int64_t>{1, 3}));
}

TEST(RandomTest, RandpermIsAPermutation) {
  manual_seed(10);
  const auto p = randperm(1000).to_vector<int64_t>();
  std::vector<int64_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 1000; ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_FALSE(std::is_sorted(p.begin(), p.end()));
  EXPECT_NE(randperm(1000).to_vector<int64_t>(), p);
  manual_seed(10);
  EXPECT_EQ(randperm(1000).to_vector<int64_t>(), p);
  // Each position is uniform over the values: the mean of position 0 over many permutations.
  double mean0 = 0;
  for (int t = 0; t < 2000; ++t) mean0 += randperm(10).to_vector<double>()[0];
  EXPECT_NEAR(mean0 / 2000, 4.5, 5 * std::sqrt(8.25 / 2000));
  for (ScalarType dt : {kInt32, kFloat, kDouble, kHalf, kBFloat16}) {
    Tensor q = randperm(200, dt);
    EXPECT_EQ(q.dtype(), dt);
    auto qv = q.to_vector<double>();
    std::sort(qv.begin(), qv.end());
    for (int64_t i = 0; i < 200; ++i) EXPECT_EQ(qv[i], static_cast<double>(i));
  }
}

TEST(RandomTest, ReducedAndDoublePrecisionDtypes) {
  manual_seed(12);
  for (ScalarType dt : {kHalf, kBFloat16, kDouble}) {
    Tensor u = rand({200000}, dt);
    EXPECT_EQ(u.dtype(), dt);
    const Moments mu = moments(u.to_vector<double>());
    EXPECT_NEAR(mu.mean, 0.5, 3e-3) << dtype_name(dt);
    EXPECT_GE(mu.min, 0.0);
    EXPECT_LT(mu.max, 1.0) << dtype_name(dt);  // values that round to 1 wrap to 0
    Tensor z = randn({200000}, dt);
    const Moments mz = moments(z.to_vector<double>());
    EXPECT_NEAR(mz.mean, 0.0, 1.5e-2) << dtype_name(dt);
    EXPECT_NEAR(mz.std, 1.0, 1.5e-2) << dtype_name(dt);
    EXPECT_EQ(rand_like(z).dtype(), dt);
    EXPECT_EQ(randn_like(z, kFloat).dtype(), kFloat);
  }
  // A narrow range near 1 in bf16 rounds up to `to` often: never returned.
  Tensor b = empty({100000}, kBFloat16).uniform_(0.99, 1.0);
  const Moments mb = moments(b.to_vector<double>());
  EXPECT_LT(mb.max, 1.0);
  EXPECT_GE(mb.min, 0.98);
  // Requested gradients and shapes.
  Tensor g = randn({2, 3}, requires_grad(true));
  EXPECT_TRUE(g.requires_grad());
  EXPECT_EQ(to_shape(g.sizes()), (Shape{2, 3}));
  Tensor m = rand({2, 3}, Device(kMeta));
  EXPECT_TRUE(m.is_meta());
}

// A random op carries its seed and offset, so a recorded call replays the same numbers.
OpCall g_recorded;
TEST(RandomTest, RecordedCallsReplayTheSameNumbers) {
  static const DispatchHandler recorder{[](const OpCall& call) { return call.name() == "normal_"; },
                                        [](OpCall& call) {
                                          g_recorded = call;
                                          dispatch_after(call, DispatchKey::Trace);
                                        }};
  set_dispatch_handler(DispatchKey::Trace, &recorder);
  Tensor a = randn({3, 5});
  set_dispatch_handler(DispatchKey::Trace, nullptr);
  ASSERT_EQ(g_recorded.attrs.size(), 4u);
  rand({100});  // moves the global stream on
  OpCall replay = g_recorded;
  Tensor b = empty({3, 5});
  replay.inputs = {b};
  dispatch(replay);
  EXPECT_EQ(a.to_vector<float>(), b.to_vector<float>());
}

TEST(RandomTest, ConcurrentCallsReserveDisjointRanges) {
  manual_seed(13);
  std::vector<std::vector<float>> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&results, t] { results[t] = rand({1000}).to_vector<float>(); });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(get_rng_state().offset, 1000u);
  // The four calls took the four ranges of 250 blocks, in some order.
  manual_seed(13);
  std::vector<std::vector<float>> serial;
  for (int t = 0; t < 4; ++t) serial.push_back(rand({1000}).to_vector<float>());
  std::sort(results.begin(), results.end());
  std::sort(serial.begin(), serial.end());
  EXPECT_EQ(results, serial);
}

TEST(RandomTest, ErrorsNameTheOp) {
  EXPECT_KILN_ERROR(rand({2}, kInt64), "[rand]");
  EXPECT_KILN_ERROR(randn({2}, kInt32), "[randn]");
  EXPECT_KILN_ERROR(rand_like(zeros({2}, kInt64)), "[rand]");
  EXPECT_KILN_ERROR(zeros({2}, kInt64).uniform_(), "[uniform_] expected a floating-point");
  EXPECT_KILN_ERROR(zeros({2}).uniform_(1, 0), "[uniform_] expects to return a [from, to)");
  EXPECT_KILN_ERROR(zeros({2}).uniform_(0, INFINITY), "[uniform_]");
  EXPECT_KILN_ERROR(zeros({2}, kHalf).uniform_(-1e5, 1e5), "[uniform_]");
  EXPECT_KILN_ERROR(zeros({2}, kInt32).normal_(), "[normal_] expected a floating-point");
  EXPECT_KILN_ERROR(zeros({2}).normal_(0, -1), "[normal_] expects std >= 0.0");
  EXPECT_KILN_ERROR(zeros({2}).bernoulli_(1.5), "[bernoulli_] expects p to be in [0, 1]");
  EXPECT_KILN_ERROR(zeros({2}).bernoulli_(-0.1), "[bernoulli_]");
  EXPECT_KILN_ERROR(bernoulli(zeros({2}, kInt64)), "[bernoulli]");
  EXPECT_KILN_ERROR(bernoulli(full({2}, 1.5)), "[bernoulli_] expected all probabilities");
  EXPECT_KILN_ERROR(bernoulli(full({2}, NAN)), "[bernoulli_]");
  EXPECT_KILN_ERROR(zeros({1}).expand({4}).uniform_(), "[uniform_] unsupported operation");
  EXPECT_KILN_ERROR(randint(5, 5, {2}), "[randint]");
  EXPECT_KILN_ERROR(randint(0, {2}), "[randint]");
  EXPECT_KILN_ERROR(randint(0, 300, {2}, kBFloat16), "[random_] the range [0, 300)");
  EXPECT_KILN_ERROR(randint(0, 3, {2}, kBool), "[random_]");
  EXPECT_KILN_ERROR(randint(0, int64_t{1} << 40, {2}, kInt32), "[random_]");
  EXPECT_KILN_ERROR(multinomial(ones({2, 2, 2}), 1), "[multinomial] prob_dist must be 1 or 2 dim");
  EXPECT_KILN_ERROR(multinomial(ones({}), 1), "[multinomial] prob_dist must be 1 or 2 dim");
  EXPECT_KILN_ERROR(multinomial(ones({3}, kInt64), 1), "[multinomial] expected a floating-point");
  EXPECT_KILN_ERROR(multinomial(ones({0}), 1), "[multinomial] number of categories");
  EXPECT_KILN_ERROR(multinomial(ones({3}), 0), "[multinomial] cannot sample n_sample <= 0");
  EXPECT_KILN_ERROR(multinomial(ones({3}), 4), "[multinomial] cannot sample n_sample (4) >");
  EXPECT_KILN_ERROR(multinomial(tensor({1.0, -1.0}), 1, true), "[multinomial] probability tensor");
  EXPECT_KILN_ERROR(multinomial(tensor({1.0, NAN}), 1), "[multinomial] probability tensor");
  EXPECT_KILN_ERROR(multinomial(tensor({1.0, INFINITY}), 1), "[multinomial] probability tensor");
  EXPECT_KILN_ERROR(multinomial(tensor({{1.0, 1.0}, {0.0, 0.0}}), 1, true),
                    "[multinomial] invalid multinomial distribution (sum of probabilities <= 0)");
  EXPECT_KILN_ERROR(multinomial(tensor({1.0, 0.0, 0.0}), 2, false),
                    "[multinomial] invalid multinomial distribution (with replacement=False");
  EXPECT_KILN_ERROR(randperm(-1), "[randperm] n must be non-negative");
  EXPECT_KILN_ERROR(randperm(3000, kHalf), "[randperm] n must be at most 2048");
  EXPECT_KILN_ERROR(randperm(3, kBool), "[randperm]");
}

}  // namespace
}  // namespace kiln
