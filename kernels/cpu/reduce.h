// The shared loop of the CPU reduction kernels (sum, mean, amax, argmax, var, norm, ...).
//
// Every reduction is brought to one shape: a contiguous [A, R, K] block whose middle dim R is
// reduced, giving A * K outputs in output order (output (a, k) is element a * K + k). A
// contiguous input (or a dense permuted one, such as a transpose) whose reduced dims form one
// run in memory needs no copy: reducing the innermost dims is the row case (K = 1), reducing
// outer dims the column case (A = 1). Anything else (reduced dims interleaved with kept ones,
// sliced or expanded inputs) is permuted so that the reduced dims come last and copied once,
// which turns it into the row case.
//
// A reducer says how to fold one element into an accumulator and how to finish it:
//
//   struct SumReducer {
//     using acc_t = double;
//     acc_t init() const { return 0; }
//     void step(acc_t& a, float x, int64_t r) const { a += x; }   // r: index along R
//     acc_t merge(acc_t a, acc_t b) const { return a + b; }       // a covers lower r than b
//     void finish(const acc_t& a, int64_t out_index) const { out[out_index] = a; }
//   };
//
// merge lets a row be split into independent lanes (so that the inner loop vectorises) and
// lets a long reduction be split across threads; the split points do not depend on the
// thread count, so results are reproducible. Internal to kernels/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>

#include "tensor/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {

struct ReduceBlock {
  Tensor input;  // of the original dtype; its data is the [A, R, K] block
  int64_t outer = 1;
  int64_t reduced = 1;
  int64_t inner = 1;
};

// `dims`: the sorted, wrapped dims to reduce (empty reduces nothing). With `index_order`, the
// position along R is the row-major index over the reduced dims (as argmax reports it);
// without, reduced elements may be visited in memory order.
ReduceBlock reduce_block(const Tensor& t, IntArrayRef dims, bool index_order = false);

namespace reduce_internal {

inline constexpr int kLanes = 8;               // independent accumulators in a row
inline constexpr int64_t kColumnBlock = 2048;  // outputs per accumulator array in the column case
inline constexpr int64_t kSplitChunk = 32768;  // elements per task when R is split

// Folds x[0, n) (element i at index r0 + i along R) into one accumulator.
template <typename T, typename Red>
typename Red::acc_t reduce_row(const Red& red, const T* x, int64_t n, int64_t r0) {
  using Acc = typename Red::acc_t;
  int64_t i = 0;
  Acc a = red.init();
  if (n >= 2 * kLanes) {
    Acc lanes[kLanes];
    for (int j = 0; j < kLanes; ++j) lanes[j] = red.init();
    for (; i + kLanes <= n; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) red.step(lanes[j], x[i + j], r0 + i + j);
    }
    a = lanes[0];
    for (int j = 1; j < kLanes; ++j) a = red.merge(a, lanes[j]);
  }
  for (; i < n; ++i) red.step(a, x[i], r0 + i);
  return a;
}

// Folds rows [r0, r1) of columns [k0, k0 + kn) of block `a` into acc[0, kn).
template <typename T, typename Red>
void reduce_columns(const Red& red, const T* x, int64_t R, int64_t K, int64_t a, int64_t r0,
                    int64_t r1, int64_t k0, int64_t kn, typename Red::acc_t* acc) {
  for (int64_t kk = 0; kk < kn; ++kk) acc[kk] = red.init();
  for (int64_t r = r0; r < r1; ++r) {
    const T* row = x + (a * R + r) * K + k0;
    for (int64_t kk = 0; kk < kn; ++kk) red.step(acc[kk], row[kk], r);
  }
}

}  // namespace reduce_internal

// Reduces the contiguous [A, R, K] block `x` with `red`, calling red.finish once per output.
template <typename T, typename Red>
void reduce_loop(const Red& red, const T* x, int64_t A, int64_t R, int64_t K) {
  using Acc = typename Red::acc_t;
  using kiln::internal::kGrainSize;
  using kiln::internal::parallel_for;
  const int64_t outputs = A * K;
  if (outputs == 0) return;
  if (R == 0) {
    for (int64_t i = 0; i < outputs; ++i) red.finish(red.init(), i);
    return;
  }
  const int64_t kb = K == 1 ? 1 : std::min(K, reduce_internal::kColumnBlock);
  const int64_t kblocks = (K + kb - 1) / kb;

  // Few outputs over much data: split R into fixed chunks, reduce them in parallel, merge.
  if (outputs < 4 * static_cast<int64_t>(get_num_threads()) && R * K >= 2 * kGrainSize) {
    const int64_t chunk = std::max<int64_t>(1, reduce_internal::kSplitChunk / K);
    const int64_t nchunks = (R + chunk - 1) / chunk;
    // Not std::vector: Acc may be bool.
    std::unique_ptr<Acc[]> partial(new Acc[nchunks * outputs]);
    parallel_for(0, nchunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t c = cb; c < ce; ++c) {
        const int64_t r0 = c * chunk, r1 = std::min(R, r0 + chunk);
        Acc* p = partial.get() + c * outputs;
        for (int64_t a = 0; a < A; ++a) {
          if (K == 1) {
            p[a] = reduce_internal::reduce_row(red, x + a * R + r0, r1 - r0, r0);
          } else {
            reduce_internal::reduce_columns(red, x, R, K, a, r0, r1, 0, K, p + a * K);
          }
        }
      }
    });
    for (int64_t i = 0; i < outputs; ++i) {
      Acc acc = partial[i];
      for (int64_t c = 1; c < nchunks; ++c) acc = red.merge(acc, partial[c * outputs + i]);
      red.finish(acc, i);
    }
    return;
  }

  if (K == 1) {
    parallel_for(0, A, std::max<int64_t>(1, kGrainSize / R), [&](int64_t b, int64_t e) {
      for (int64_t a = b; a < e; ++a)
        red.finish(reduce_internal::reduce_row(red, x + a * R, R, 0), a);
    });
    return;
  }
  parallel_for(0, A * kblocks, std::max<int64_t>(1, kGrainSize / (R * kb)),
               [&](int64_t b, int64_t e) {
                 std::unique_ptr<Acc[]> acc(new Acc[kb]);
                 for (int64_t t = b; t < e; ++t) {
                   const int64_t a = t / kblocks, k0 = (t % kblocks) * kb;
                   const int64_t kn = std::min(kb, K - k0);
                   reduce_internal::reduce_columns(red, x, R, K, a, 0, R, k0, kn, acc.get());
                   for (int64_t kk = 0; kk < kn; ++kk) red.finish(acc[kk], a * K + k0 + kk);
                 }
               });
}

}  // namespace kiln::cpu
