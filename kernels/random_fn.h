// The transforms of the random ops (uniform_, normal_, random_, bernoulli_, multinomial): from
// the Philox words of tensor/random.h to element values, shared by the CPU kernels
// (kernels/cpu/random.cpp) and the CUDA kernels (kernels/cuda/random.cu) so that a tensor filled
// on either holds the same numbers for the same seed and offset: bit for bit, except where
// normal_ and multinomial's keys call log, sin and cos (glibc's on the host, CUDA's on the
// device, an ulp or two apart).
//
//   const scalar::PhiloxStream s{seed, offset};
//   const philox::Words w = s.block(b);
//   v[k] = scalar::uniform_float<T>(w.w[k], from_f, range, to, from_t);
//
// On the device the arithmetic is spelled with round-to-nearest intrinsics (add_rn, mul_rn) so
// that nvcc does not contract it into fused multiply-adds, which the CPU does not use.
// Internal to kernels/.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/scalar_fn.h"
#include "tensor/dtype.h"
#include "tensor/random.h"

namespace kiln::scalar {

inline constexpr double kTwoPi = 6.283185307179586;

// a + b, a * b and a / b rounded to nearest, never fused.
KILN_SCALAR_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_SCALAR_HD double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
KILN_SCALAR_HD double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
KILN_SCALAR_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KILN_SCALAR_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The Philox stream of one random op: its seed and the offset of its first block.
struct PhiloxStream {
  uint64_t seed;
  uint64_t offset;
  KILN_SCALAR_HD philox::Words block(uint64_t b) const { return philox::block(seed, offset + b); }
};

// An integer value as element type T.
template <typename T>
KILN_SCALAR_HD T from_int(int64_t v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v != 0;
  } else if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

// uniform_ of doubles: the value of word pair (lo, hi) in [from, to).
KILN_SCALAR_HD double uniform_double(uint32_t lo, uint32_t hi, double from, double to,
                                     double range) {
  const double x = add_rn(from, mul_rn(range, philox::uniform53(lo, hi)));
  return x >= to ? from : x;
}

// uniform_ of f32/f16/bf16: the value of word w in [from, to).
template <typename T>
KILN_SCALAR_HD T uniform_float(uint32_t w, float from_f, float range, double to, T from_t) {
  const T x = T(add_rn(from_f, mul_rn(range, philox::uniform24(w))));
  // Rounding to the dtype may reach `to`: wrap to `from`, as PyTorch's CUDA kernel.
  return static_cast<double>(static_cast<float>(x)) >= to ? from_t : x;
}

// normal_ of doubles: the `count` (1 or 2) values of one block (Box-Muller).
KILN_SCALAR_HD void normal_double(const philox::Words& w, double mean, double stdev, double* v,
                                  int count) {
  const double r = math::sqrt(mul_rn(-2.0, math::log(philox::open53(w.w[0], w.w[1]))));
  const double t = mul_rn(kTwoPi, philox::uniform53(w.w[2], w.w[3]));
  v[0] = add_rn(mean, mul_rn(stdev, mul_rn(r, math::cos(t))));
  if (count > 1) v[1] = add_rn(mean, mul_rn(stdev, mul_rn(r, math::sin(t))));
}

// normal_ of f32/f16/bf16: the `count` (<= 4) values of one block (two Box-Muller pairs).
template <typename T>
KILN_SCALAR_HD void normal_float(const philox::Words& w, float mean, float stdev, T* v, int count) {
  float z[4];
  for (int pair = 0; pair < 2; ++pair) {
    const float r = math::sqrt(mul_rn(-2.0f, math::log(philox::open24(w.w[2 * pair]))));
    const float t = mul_rn(static_cast<float>(kTwoPi), philox::uniform24(w.w[2 * pair + 1]));
    z[2 * pair] = mul_rn(r, math::cos(t));
    z[2 * pair + 1] = mul_rn(r, math::sin(t));
  }
  for (int k = 0; k < count; ++k) v[k] = T(add_rn(mean, mul_rn(stdev, z[k])));
}

// random_: low + x mod range, in unsigned arithmetic so that the full int64 range does not
// overflow.
KILN_SCALAR_HD int64_t random_int(uint64_t x, int64_t low, uint64_t range) {
  return static_cast<int64_t>(static_cast<uint64_t>(low) + x % range);
}

// bernoulli_: whether word w draws a 1 with probability p.
KILN_SCALAR_HD bool bernoulli(uint32_t w, double p) { return philox::uniform32(w) < p; }

// multinomial's draw j: the 53-bit uniform of word pair j % 2 of block j / 2, in [0, 1) or
// (open) in (0, 1].
KILN_SCALAR_HD double draw53(const PhiloxStream& s, int64_t j, bool open) {
  const philox::Words w = s.block(static_cast<uint64_t>(j / 2));
  const int k = static_cast<int>(j % 2);
  return open ? philox::open53(w.w[2 * k], w.w[2 * k + 1])
              : philox::uniform53(w.w[2 * k], w.w[2 * k + 1]);
}

// multinomial without replacement: the key p / Exp(1) of a category of probability q, with
// u = draw53(open) its uniform; the largest keys, in order, are successive draws.
KILN_SCALAR_HD double exp_key(double q, double u) { return div_rn(q, -math::log(u)); }

}  // namespace kiln::scalar
