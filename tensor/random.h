// kiln's random numbers: Philox 4x32-10, a counter-based generator, and the global seed/offset.
//
//   kiln::manual_seed(42);
//   auto x = kiln::randn({2, 3});          // same numbers on every run, any thread count
//   auto y = kiln::rand({2, 3}).uniform_(-1, 1);
//
// Counter-based means every number is a pure function of (seed, counter): no state is carried
// from one element to the next, so a CPU loop, a CPU thread pool and a CUDA kernel with one
// thread per element all produce the same stream. The global generator holds only a seed and
// an offset (in Philox blocks). Each random op reserves `blocks` consecutive counters when it is
// called (philox_reserve, thread-safe) and records the seed and the reserved base offset in its
// op attributes, so a recorded trace replays it exactly.
//
// --- Philox 4x32-10 ------------------------------------------------------------------------------
// The bijection of Salmon et al. (SC'11): a 128-bit counter (c0..c3) and a 64-bit key (k0, k1)
// give four 32-bit words. A round multiplies c0 by 0xD2511F53 and c2 by 0xCD9E8D57 (64-bit
// products split into hi/lo) and outputs (hi(c2*M1) ^ c1 ^ k0, lo(c2*M1), hi(c0*M0) ^ c3 ^ k1,
// lo(c0*M0)); the key is bumped by the Weyl constants (0x9E3779B9, 0xBB67AE85) between rounds;
// 10 rounds. Checked against Random123's known-answer vectors in tests/tensor/random_test.cpp.
//
// --- The stream of one op call -------------------------------------------------------------------
// Key (k0, k1) = (low, high 32 bits of the seed). Block b of a call whose reserved base offset
// is `off` is philox(counter = (lo32(off + b), hi32(off + b), 0, 0), key), giving words
// w0..w3. Element i is the i-th element of the target in row-major (logical) order, whatever its
// strides, so a strided view receives the values a contiguous tensor of its shape would.
//
//   uniform24(w)      = (w >> 8) * 2^-24                  in [0, 1), exact in float
//   uniform53(wa, wb) = ((wb << 32 | wa) >> 11) * 2^-53   in [0, 1), exact in double
//   open24(w)         = ((w >> 8) + 1) * 2^-24            in (0, 1]  (the same for 53 bits)
//
// Element i of a call, by op. "4 per block": block i / 4, word w[i % 4]. "2 per block": block
// i / 2, word pair (w[2k], w[2k+1]) with k = i % 2, read as the 64-bit (w[2k+1] << 32 | w[2k]).
//
//   uniform_ f32/f16/bf16   4 per block  from + (to - from) * uniform24(w[i % 4]), in float
//   uniform_ f64            2 per block  from + (to - from) * uniform53(w[2k], w[2k+1])
//   normal_ f32/f16/bf16    4 per block  Box-Muller on the word pair (w0, w1) for i % 4 in {0, 1}
//                                        and (w2, w3) for {2, 3}: r = sqrt(-2 log open24(first)),
//                                        t = 2 pi uniform24(second); z = r cos t for even i % 4,
//                                        r sin t for odd; mean + std * z, in float
//   normal_ f64             2 per block  all four words of block i / 2: u1 = open53(w0, w1),
//                                        u2 = uniform53(w2, w3); z = r cos t for even i, r sin t
//                                        for odd, in double
//   random_, range <= 2^32  4 per block  low + w[i % 4] mod (high - low)
//   random_, range > 2^32   2 per block  low + (64-bit pair) mod (high - low)
//   bernoulli_ (any dtype)  4 per block  1 if w[i % 4] * 2^-32 < p (in double), else 0
//   multinomial, with       2 per block  draw j = row * num_samples + s: u = uniform53 of pair j;
//     replacement                        the first category whose running sum of probs exceeds
//                                        u * row_sum
//   multinomial, without    2 per block  key j = row * categories + c: e = -log(open53 of pair j),
//     replacement                        an Exp(1) draw; the samples are the categories with the
//                                        largest p / e, in decreasing order (ties: lower index
//                                        first); zero-probability categories are never drawn
//   randperm                2 per block  key i = the 64-bit pair i; the result sorts the indices
//                                        by (key, index)
//
// A call uses ceil(n / per_block) blocks and advances the offset by exactly that. Results
// converted to f16/bf16 are rounded from float; a uniform_ value that rounds up to `to` (or past
// it) becomes `from`, as in PyTorch's CUDA kernel, so the range stays [from, to).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define KILN_PHILOX_HD __host__ __device__ __forceinline__
#else
#define KILN_PHILOX_HD inline
#endif

namespace kiln {

// PyTorch's default seed, so an unseeded program is still reproducible from run to run.
inline constexpr uint64_t kDefaultSeed = 67280421310721ull;

// The global generator's state: the seed (the Philox key) and the next free block counter.
struct RngState {
  uint64_t seed = kDefaultSeed;
  uint64_t offset = 0;
};

// Sets the seed and restarts the stream at offset 0 (declared in tensor/ops.h as well).
void manual_seed(uint64_t seed);
uint64_t initial_seed();
RngState get_rng_state();
void set_rng_state(RngState state);

// Reserves `blocks` Philox counters: returns the seed and the base offset to use, and moves
// the global offset past them. Safe to call from several threads at once.
RngState philox_reserve(uint64_t blocks);

namespace philox {

struct Words {
  uint32_t w[4];
};

KILN_PHILOX_HD Words philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                   uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
  }
  return Words{{c0, c1, c2, c3}};
}

// Block `counter` of the stream keyed by `seed` (see the table above).
KILN_PHILOX_HD Words block(uint64_t seed, uint64_t counter) {
  return philox4x32_10(static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0, 0,
                       static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

KILN_PHILOX_HD float uniform24(uint32_t w) {
  return static_cast<float>(w >> 8) * 5.9604644775390625e-8f;  // 2^-24
}
KILN_PHILOX_HD float open24(uint32_t w) {
  return static_cast<float>((w >> 8) + 1u) * 5.9604644775390625e-8f;
}
KILN_PHILOX_HD uint64_t bits64(uint32_t lo, uint32_t hi) {
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
KILN_PHILOX_HD double uniform53(uint32_t lo, uint32_t hi) {
  return static_cast<double>(bits64(lo, hi) >> 11) * 1.1102230246251565e-16;  // 2^-53
}
KILN_PHILOX_HD double open53(uint32_t lo, uint32_t hi) {
  return static_cast<double>((bits64(lo, hi) >> 11) + 1u) * 1.1102230246251565e-16;
}
KILN_PHILOX_HD double uniform32(uint32_t w) {
  return static_cast<double>(w) * 2.3283064365386963e-10;  // 2^-32
}

}  // namespace philox
}  // namespace kiln
