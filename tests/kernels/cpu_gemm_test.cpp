// kernels/cpu/gemm.h: every instruction set's build of the CPU matrix product that this CPU runs,
// against a plain f64 triple loop, over storage orders, leading dimensions wider than the
// matrix, row strides of c, odd and tiny sizes, alpha, and accumulation into c; the attention
// kernel's exp and tanh loops, the gated MLPs' packet exp; and the choice.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "tensor/parallel.h"
#include "test_util.h"

namespace kiln::cpu {
namespace {

struct Case {
  int64_t n, k, p;
  bool a_row, b_row;
  int64_t pad;  // extra elements in each leading dimension
  double alpha;
};

// Element (r, c) of a [rows, cols] operand stored row- or column-major with leading dim ld.
int64_t at(bool row_major, int64_t ld, int64_t r, int64_t c) {
  return row_major ? r * ld + c : c * ld + r;
}

template <typename T, typename F>
void check(const char* isa, F gemm, const Case& t, double tol) {
  std::mt19937 rng(static_cast<unsigned>(t.n * 131 + t.k * 17 + t.p));
  std::uniform_real_distribution<double> u(-1, 1);
  const int64_t lda = (t.a_row ? t.k : t.n) + t.pad, ldb = (t.b_row ? t.p : t.k) + t.pad;
  const int64_t ldc = t.p + t.pad;
  std::vector<T> a(static_cast<size_t>(lda * (t.a_row ? t.n : t.k) + 1));
  std::vector<T> b(static_cast<size_t>(ldb * (t.b_row ? t.k : t.p) + 1));
  std::vector<T> c(static_cast<size_t>(ldc * t.n + 1));
  for (T& x : a) x = static_cast<T>(u(rng));
  for (T& x : b) x = static_cast<T>(u(rng));
  for (T& x : c) x = static_cast<T>(u(rng));  // c is added to, padding included (kept)
  const std::vector<T> c0 = c;
  gemm(c.data(), ldc, a.data(), t.a_row, lda, b.data(), t.b_row, ldb, t.n, t.k, t.p,
       static_cast<T>(t.alpha));
  for (int64_t r = 0; r < t.n; ++r) {
    for (int64_t col = 0; col < ldc; ++col) {
      const size_t i = static_cast<size_t>(r * ldc + col);
      if (col >= t.p) {  // padding of c: untouched
        ASSERT_EQ(std::memcmp(&c[i], &c0[i], sizeof(T)), 0) << isa << " wrote c's padding";
        continue;
      }
      double want = 0, mag = 0;
      for (int64_t e = 0; e < t.k; ++e) {
        const double x = static_cast<double>(a[static_cast<size_t>(at(t.a_row, lda, r, e))]) *
                         static_cast<double>(b[static_cast<size_t>(at(t.b_row, ldb, e, col))]);
        want += x;
        mag += std::abs(x);
      }
      want = static_cast<double>(c0[i]) + t.alpha * want;
      ASSERT_NEAR(static_cast<double>(c[i]), want, tol * (1 + std::abs(t.alpha) * mag))
          << isa << " n " << t.n << " k " << t.k << " p " << t.p << " a_row " << t.a_row
          << " b_row " << t.b_row << " at (" << r << ", " << col << ")";
    }
  }
  EXPECT_EQ(std::memcmp(&c.back(), &c0.back(), sizeof(T)), 0) << isa << " wrote past c";
}

const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    std::vector<Case> v;
    for (bool ar : {true, false}) {
      for (bool br : {true, false}) {
        v.push_back({1, 1, 1, ar, br, 0, 1.0});
        v.push_back({3, 5, 7, ar, br, 2, -0.5});
        v.push_back({17, 33, 65, ar, br, 0, 1.0});
        v.push_back({64, 256, 48, ar, br, 3, 2.0});
        v.push_back({131, 67, 250, ar, br, 1, 1.0});  // past the register tiles in every dim
      }
    }
    v.push_back({300, 300, 300, true, false, 0, 1.0});  // large enough for Eigen's threads
    return v;
  }();
  return all;
}

TEST(CpuGemm, EveryBuildMatchesF64Loops) {
  const std::vector<GemmVariant> variants = gemm_variants();
  ASSERT_FALSE(variants.empty());
  EXPECT_EQ(std::string(variants.back().isa), "baseline");
  for (const GemmVariant& v : variants) {
    for (const Case& t : cases()) {
      check<float>(v.isa, v.f32, t, 2e-6);
      check<double>(v.isa, v.f64, t, 1e-14);
    }
  }
}

// The attention kernel's vector loops in every build: exp(x - shift) and its sum, and
// cap * tanh(x / cap), against std:: in f64, over lengths that leave every tail and the range
// softmax sees (x - max <= 0, down to where exp underflows).
TEST(CpuGemm, EveryBuildsExpAndTanhMatchStd) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  for (const GemmVariant& v : gemm_variants()) {
    for (int64_t n : {1, 3, 7, 16, 17, 33, 100, 1000}) {
      std::vector<float> x(static_cast<size_t>(n));
      for (float& e : x) e = u(rng);
      x[0] = -110.0f;  // exp underflows to 0 (or a denormal) after the shift
      const float shift = 25.0f;
      std::vector<float> y = x;
      const float sum = v.exp_sum(y.data(), n, shift);
      double want_sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        // The shift is subtracted in f32 (as by the kernel): exp of that difference.
        const double want = std::exp(static_cast<double>(x[static_cast<size_t>(i)] - shift));
        want_sum += want;
        ASSERT_NEAR(y[static_cast<size_t>(i)], want, 4e-7 * want + 1e-37)
            << v.isa << " exp at " << i << " of " << n << ", x " << x[static_cast<size_t>(i)];
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum + 1e-37) << v.isa << " n " << n;
      std::vector<float> t = x;
      v.tanh_cap(t.data(), n, 5.0f);
      for (int64_t i = 0; i < n; ++i) {
        const double want = 5.0 * std::tanh(static_cast<double>(x[static_cast<size_t>(i)]) / 5.0);
        ASSERT_NEAR(t[static_cast<size_t>(i)], want, 2e-6 * (1 + std::abs(want)))
            << v.isa << " tanh at " << i << " of " << n;
      }
    }
    EXPECT_EQ(v.exp_sum(nullptr, 0, 1.0f), 0.0f) << v.isa;
    // The same bits wherever the row lies (Eigen would peel unaligned heads off to scalar exp).
    std::vector<float> base(64), y0, y1(70);
    for (float& e : base) e = u(rng);
    y0 = base;
    const float s0 = v.exp_sum(y0.data(), 64, 3.0f);
    for (int64_t off = 1; off < 6; ++off) {
      std::copy(base.begin(), base.end(), y1.begin() + off);
      const float s1 = v.exp_sum(y1.data() + off, 64, 3.0f);
      EXPECT_EQ(std::memcmp(&s0, &s1, sizeof(float)), 0) << v.isa << " offset " << off;
      EXPECT_EQ(std::memcmp(y0.data(), y1.data() + off, 64 * sizeof(float)), 0)
          << v.isa << " offset " << off;
    }
  }
}

// A packet function f applied to the first n of x one packet into a longer array (a packet of
// 1.0 before them) gives the bits `whole` got from f over x (n = 1 and 4 packets).
void expect_same_bits_one_packet_later(const char* isa, void (*f)(float*, int64_t), const float* x,
                                       const float* whole) {
  alignas(64) float shifted[5 * kPacketFloats];
  for (int64_t n : {kPacketFloats, 4 * kPacketFloats}) {
    std::copy(x, x + n, shifted + kPacketFloats);
    std::fill(shifted, shifted + kPacketFloats, 1.0f);
    f(shifted, n + kPacketFloats);
    EXPECT_EQ(std::memcmp(shifted + kPacketFloats, whole, n * sizeof(float)), 0) << isa << " " << n;
  }
}

// The gated MLPs' packet exp: every build against std::exp in f64, over whole packets (overflow
// to inf, underflow to 0 included); each element's bits depend on its value only, not on its
// lane, position or the call's length; the entry point refuses a length that is not whole
// packets and an unaligned array.
TEST(CpuGemm, EveryBuildsPacketExp) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> u(-30.0f, 30.0f);
  constexpr int64_t kN = 256;
  alignas(64) float x[kN], e[kN];
  for (float& v : x) v = u(rng);
  x[0] = -110.0f;  // underflows
  x[1] = 100.0f;   // overflows to inf
  x[2] = 0.0f;
  x[3] = -0.0f;
  x[4] = 1e-8f;
  for (const GemmVariant& v : gemm_variants()) {
    std::copy(x, x + kN, e);
    v.packet_exp(e, kN);
    for (int64_t i = 0; i < kN; ++i) {
      const double want = std::exp(static_cast<double>(x[i]));
      if (std::isinf(static_cast<float>(want))) {
        EXPECT_TRUE(std::isinf(e[i]) && e[i] > 0) << v.isa << " exp(" << x[i] << ") = " << e[i];
      } else {
        ASSERT_NEAR(e[i], want, 4e-7 * want + 1e-37) << v.isa << " exp(" << x[i] << ")";
      }
    }
    // The same values one packet later, in a shorter call: the same bits.
    expect_same_bits_one_packet_later(v.isa, v.packet_exp, x, e);
  }
  EXPECT_KILN_ERROR(
      packet_exp(e, 17),
      "[packet_exp] needs a 64-byte aligned array of a multiple of 16 floats, got 17");
  EXPECT_KILN_ERROR(packet_exp(e + 1, 16), "[packet_exp] needs a 64-byte aligned array");
  packet_exp(e, 0);  // nothing to do
}

// gelu's gradient's packet erf: every build against std::erf in f64 (to within a few ulp of
// the result, absolute near 0), saturating at +-1; the same bits one packet later in a shorter
// call; the entry point's checks.
TEST(CpuGemm, EveryBuildsPacketErf) {
  std::mt19937 rng(10);
  std::uniform_real_distribution<float> u(-6.0f, 6.0f);
  constexpr int64_t kN = 256;
  alignas(64) float x[kN], e[kN];
  for (float& v : x) v = u(rng);
  x[0] = -1e30f;
  x[1] = 1e30f;
  x[2] = 0.0f;
  x[3] = 1e-8f;
  x[4] = -3e-3f;
  for (const GemmVariant& v : gemm_variants()) {
    std::copy(x, x + kN, e);
    v.packet_erf(e, kN);
    for (int64_t i = 0; i < kN; ++i) {
      const double want = std::erf(static_cast<double>(x[i]));
      ASSERT_NEAR(e[i], want, 5e-7 * std::abs(want) + 1e-12) << v.isa << " erf(" << x[i] << ")";
    }
    expect_same_bits_one_packet_later(v.isa, v.packet_erf, x, e);
  }
  EXPECT_KILN_ERROR(packet_erf(e, 17), "[packet_erf] needs a 64-byte aligned array");
  packet_erf(e, 0);
}

TEST(CpuGemm, SerialAndThreadedAgree) {
  const int threads = get_num_threads();
  for (const GemmVariant& v : gemm_variants()) {
    set_num_threads(1);
    check<float>(v.isa, v.f32, {300, 200, 260, true, true, 0, 1.0}, 2e-6);
    set_num_threads(std::max(2, threads));
    check<float>(v.isa, v.f32, {300, 200, 260, true, true, 0, 1.0}, 2e-6);
  }
  set_num_threads(threads);
}

TEST(CpuGemm, TheChosenBuildIsTheWidestThisCpuRuns) {
  const std::vector<GemmVariant> variants = gemm_variants();
  EXPECT_EQ(std::string(gemm_isa()), variants.front().isa);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  // On x86-64 the wider builds are compiled (CMakeLists.txt): a CPU with AVX2 and FMA runs one.
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    EXPECT_NE(std::string(gemm_isa()), "baseline");
  }
#endif
  // The entry point runs the chosen build.
  std::vector<float> a = {1, 2, 3, 4}, b = {5, 6, 7, 8}, c(4, 0.0f);
  gemm(c.data(), 2, a.data(), {true, 2}, b.data(), {true, 2}, 2, 2, 2, 1.0f);
  EXPECT_EQ(c, (std::vector<float>{19, 22, 43, 50}));
  gemm(c.data(), 2, a.data(), {false, 2}, b.data(), {true, 2}, 2, 2, 2, -1.0f);  // a^T
  EXPECT_EQ(c, (std::vector<float>{19 - 26, 22 - 30, 43 - 38, 50 - 44}));
}

}  // namespace
}  // namespace kiln::cpu
