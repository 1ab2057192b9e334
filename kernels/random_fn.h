// The random ops (uniform_, normal_, random_, bernoulli_, multinomial, randperm) written once for
// the CPU kernels (kernels/cpu/random.cpp) and the CUDA kernels (kernels/cuda/random.cu): the
// transforms from the Philox words of tensor/random.h to element values, the per-block generators
// of the fills, the decoding of the ops' attributes and the list of the ops. A tensor filled on
// either device holds the same numbers for the same seed and offset: bit for bit, except where
// normal_ and multinomial's keys call log, sin and cos (glibc's on the host, CUDA's on the
// device, an ulp or two apart).
//
//   const scalar::PhiloxStream s{seed, offset};
//   const philox::Words w = s.block(b);
//   v[k] = scalar::uniform_float<T>(w.w[k], from_f, range, to, from_t);
//
// A device file supplies what differs (how a fill walks the blocks, bernoulli_ with a tensor of
// probabilities, multinomial, randperm) as a `Backend` type, and registers RandomKernels<Backend>:
//
//   struct CpuRandom {
//     // Runs gen(block, vals, first_index, count) for every Philox block of `out` (any
//     // strides): it makes the `count` (<= K) values of elements first_index.. of the block.
//     template <typename T, int K, typename Gen>
//     static void fill(const Tensor& out, const Gen& gen);
//     static void bernoulli_tensor(OpCall& c, PhiloxStream s);  // p per element: input 1
//     static void multinomial(OpCall& c, const MultinomialArgs& args);
//     static void randperm(OpCall& c, PhiloxStream s);
//   };
//   #define REGISTER(op, fn) KILN_REGISTER_KERNEL(op, kCPU, scalar::RandomKernels<CpuRandom>::fn);
//   KILN_RANDOM_OPS(REGISTER)
//
// On the device the arithmetic is spelled with round-to-nearest intrinsics (add_rn, mul_rn) so
// that nvcc does not contract it into fused multiply-adds, which the CPU does not use.
// Internal to kernels/.
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernels/cuda/runtime.h"
#include "kernels/scalar_fn.h"
#include "tensor/dtype.h"
#include "tensor/error.h"
#include "tensor/random.h"
#include "tensor/registry.h"

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

// The Philox stream of one random op: its seed and the offset of its first block. In a CUDA graph
// (stream_of during a capture) `base` is a device word holding the replay's base offset, which
// the kernel adds to `offset` (then relative to it): each replay draws new numbers.
struct PhiloxStream {
  uint64_t seed;
  uint64_t offset;
  const uint64_t* base = nullptr;
  KILN_SCALAR_HD philox::Words block(uint64_t b) const {
    return philox::block(seed, offset + b + (base != nullptr ? *base : 0));
  }
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

// --- The ops' glue --------------------------------------------------------------------------

// Every random op and its kernel in RandomKernels: X(op, function).
#define KILN_RANDOM_OPS(X)    \
  X(uniform_, uniform)        \
  X(normal_, normal)          \
  X(random_, random)          \
  X(bernoulli_, bernoulli)    \
  X(multinomial, multinomial) \
  X(randperm, randperm)

// The seed and offset are the last two attributes of every random op. While this thread
// captures a CUDA graph of a program with random ops (kernels/cuda/runtime.h, GraphRng), the
// offset is taken relative to the capture's base and the kernel reads the base at each replay.
inline PhiloxStream stream_of(const OpCall& c) {
  const size_t n = c.attrs.size();
  PhiloxStream s{static_cast<uint64_t>(c.attr<int64_t>(n - 2)),
                 static_cast<uint64_t>(c.attr<int64_t>(n - 1))};
  if (const cuda::internal::GraphRng* g = cuda::internal::capture_rng();
      g != nullptr && s.offset >= g->base) {
    s.offset -= g->base;
    s.base = g->word;
  }
  return s;
}

// The generators of the fills: gen(block, vals, first_index, count) writes the `count` values of
// elements first_index.. of Philox block `block` (first_index: for per-element inputs).

struct UniformDouble {
  PhiloxStream s;
  double from, to, range;
  KILN_SCALAR_HD void operator()(uint64_t b, double* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      v[k] = uniform_double(w.w[2 * k], w.w[2 * k + 1], from, to, range);
    }
  }
};

template <typename T>
struct UniformFloat {
  PhiloxStream s;
  float from_f, range;
  double to;
  T from_t;
  KILN_SCALAR_HD void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) v[k] = uniform_float<T>(w.w[k], from_f, range, to, from_t);
  }
};

struct NormalDouble {
  PhiloxStream s;
  double mean, stdev;
  KILN_SCALAR_HD void operator()(uint64_t b, double* v, int64_t, int count) const {
    normal_double(s.block(b), mean, stdev, v, count);
  }
};

template <typename T>
struct NormalFloat {
  PhiloxStream s;
  float mean, stdev;
  KILN_SCALAR_HD void operator()(uint64_t b, T* v, int64_t, int count) const {
    normal_float<T>(s.block(b), mean, stdev, v, count);
  }
};

// random_int of one word (ranges up to 2^32, 4 values a block) or of a word pair (2 a block).
template <typename T, bool kWide>
struct RandomInt {
  PhiloxStream s;
  int64_t low;
  uint64_t range;
  KILN_SCALAR_HD void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      const uint64_t x = kWide ? philox::bits64(w.w[2 * k], w.w[2 * k + 1]) : uint64_t{w.w[k]};
      v[k] = from_int<T>(random_int(x, low, range));
    }
  }
};

// bernoulli_ with one probability for every element.
template <typename T>
struct BernoulliScalar {
  PhiloxStream s;
  double p;
  KILN_SCALAR_HD void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) v[k] = from_int<T>(bernoulli(w.w[k], p) ? 1 : 0);
  }
};

// multinomial's attributes, and its input's layout as [rows, cats] (one row for a 1-d input).
struct MultinomialArgs {
  int64_t num_samples;
  bool replacement;
  PhiloxStream s;
  bool batched;
  int64_t rows, cats;
};

inline MultinomialArgs multinomial_args(const OpCall& c) {
  const Tensor& probs = c.input(0);
  const bool batched = probs.dim() == 2;
  return {c.attr<int64_t>(0),          c.attr<bool>(1), stream_of(c), batched,
          batched ? probs.size(0) : 1, probs.size(-1)};
}

// The errors of the ops' value checks, the same on both devices.
[[noreturn]] inline void fail_bernoulli_probability(double p, int64_t at) {
  KILN_FAIL("[bernoulli_] expected all probabilities in [0, 1], got ", p, " at element ", at);
}
[[noreturn]] inline void fail_multinomial_probability() {
  KILN_FAIL("[multinomial] probability tensor contains either inf, nan or element < 0");
}
[[noreturn]] inline void fail_multinomial_sum(int64_t row) {
  KILN_FAIL("[multinomial] invalid multinomial distribution (sum of probabilities <= 0) in row ",
            row);
}
[[noreturn]] inline void fail_multinomial_too_few(int64_t positive, int64_t num_samples) {
  KILN_FAIL(
      "[multinomial] invalid multinomial distribution (with replacement=False, not enough "
      "non-negative category to sample): ",
      positive, " categories with nonzero probability, ", num_samples, " samples");
}

// The kernels of the random ops on the device that `Backend` describes (see the banner).
template <typename Backend>
struct RandomKernels {
  static void uniform(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const double from = c.attr<double>(0), to = c.attr<double>(1);
    const PhiloxStream s = stream_of(c);
    visit_floating(out.dtype(), "uniform_", [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, double>) {
        Backend::template fill<double, 2>(out, UniformDouble{s, from, to, to - from});
      } else {
        const float from_f = static_cast<float>(from);
        Backend::template fill<T, 4>(
            out, UniformFloat<T>{s, from_f, static_cast<float>(to - from), to, T(from_f)});
      }
    });
  }

  static void normal(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const double mean = c.attr<double>(0), stdev = c.attr<double>(1);
    const PhiloxStream s = stream_of(c);
    visit_floating(out.dtype(), "normal_", [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, double>) {
        Backend::template fill<double, 2>(out, NormalDouble{s, mean, stdev});
      } else {
        Backend::template fill<T, 4>(
            out, NormalFloat<T>{s, static_cast<float>(mean), static_cast<float>(stdev)});
      }
    });
  }

  static void random(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const int64_t low = c.attr<int64_t>(0), high = c.attr<int64_t>(1);
    const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
    const PhiloxStream s = stream_of(c);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      if (range <= (uint64_t{1} << 32)) {
        Backend::template fill<T, 4>(out, RandomInt<T, false>{s, low, range});
      } else {
        Backend::template fill<T, 2>(out, RandomInt<T, true>{s, low, range});
      }
    });
  }

  static void bernoulli(OpCall& c) {
    const Tensor& out = c.outputs[0];
    const PhiloxStream s = stream_of(c);
    if (c.inputs.size() != 1) {
      Backend::bernoulli_tensor(c, s);
      return;
    }
    const double p = c.attr<double>(0);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      Backend::template fill<T, 4>(out, BernoulliScalar<T>{s, p});
    });
  }

  static void multinomial(OpCall& c) { Backend::multinomial(c, multinomial_args(c)); }
  static void randperm(OpCall& c) { Backend::randperm(c, stream_of(c)); }
};

}  // namespace kiln::scalar
