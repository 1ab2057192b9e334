// kernels/int_div.h: the multiply-shift division of 32-bit indices against `/` and `%`, for
// every divisor up to 2^12 on edge and random numerators, the powers of two and their
// neighbours up to 2^31, random divisors, and the numerators at the top of the range (2^31 - 1).
#include "kernels/int_div.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "tensor/error.h"

namespace kiln::internal {
namespace {

constexpr uint32_t kMaxN = (uint32_t{1} << 31) - 1;

// Checks n / d and n % d for numerators around 0, around multiples of d, near 2^31 and random.
void check_divisor(uint32_t d, std::mt19937& rng) {
  const IntDivider div(d);
  std::vector<uint32_t> ns = {0, 1, 2, d - 1, d, d + 1, kMaxN, kMaxN - 1, kMaxN - d};
  const uint32_t top = kMaxN / d * d;  // the largest multiple of d in range
  ns.push_back(top);
  if (top > 0) ns.push_back(top - 1);
  std::uniform_int_distribution<uint32_t> any(0, kMaxN);
  for (int i = 0; i < 64; ++i) ns.push_back(any(rng));
  for (uint32_t n : ns) {
    if (n > kMaxN) continue;
    uint32_t q = 0, r = 0;
    div.divmod(n, q, r);
    ASSERT_EQ(q, n / d) << "n = " << n << ", d = " << d;
    ASSERT_EQ(r, n % d) << "n = " << n << ", d = " << d;
    ASSERT_EQ(div.div(n), n / d) << "n = " << n << ", d = " << d;
  }
}

TEST(IntDivider, SmallDivisors) {
  std::mt19937 rng(7);
  for (uint32_t d = 1; d <= 4096; ++d) check_divisor(d, rng);
}

TEST(IntDivider, PowersOfTwoAndNeighbours) {
  std::mt19937 rng(11);
  for (int s = 0; s <= 31; ++s) {
    const uint64_t p = uint64_t{1} << s;
    for (uint64_t d : {p - 1, p, p + 1}) {
      if (d >= 1 && d <= (uint64_t{1} << 31)) check_divisor(static_cast<uint32_t>(d), rng);
    }
  }
}

TEST(IntDivider, RandomDivisors) {
  std::mt19937 rng(13);
  std::uniform_int_distribution<uint32_t> any(1, uint32_t{1} << 31);
  for (int i = 0; i < 2000; ++i) check_divisor(any(rng), rng);
}

TEST(IntDivider, EveryNumeratorOfSmallDivisors) {
  // Exhaustive over the first 2^20 numerators for the divisors of Llama shapes' index math.
  for (uint32_t d : {3u, 4u, 6u, 7u, 12u, 32u, 48u, 100u, 1000u, 2048u, 3072u}) {
    const IntDivider div(d);
    for (uint32_t n = 0; n < (1u << 20); ++n) ASSERT_EQ(div.div(n), n / d) << n << " / " << d;
  }
}

TEST(IntDivider, RejectsOutOfRange) {
  EXPECT_THROW(IntDivider(0), Error);
  EXPECT_THROW(IntDivider((int64_t{1} << 31) + 1), Error);
  EXPECT_NO_THROW(IntDivider(int64_t{1} << 31));
}

}  // namespace
}  // namespace kiln::internal
