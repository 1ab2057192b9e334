// CPU kernels of the random ops (CUDA: kernels/cuda/random.cu; what both share, the fills'
// generators and the ops' attributes included: kernels/random_fn.h). Each element's value depends
// only on (seed, offset, its row-major index), through the mapping documented in tensor/random.h,
// so the results do not depend on the thread count and match the CUDA kernels that follow the
// same table.
#include "tensor/random.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/random_fn.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

using scalar::from_int;
using Stream = scalar::PhiloxStream;

// Walks the elements of a tensor in row-major order from a starting index, tracking the
// element offset (in elements, not bytes) for any strides.
class Cursor {
 public:
  Cursor(IntArrayRef sizes, IntArrayRef strides, int64_t start)
      : sizes_(to_shape(sizes)), strides_(to_shape(strides)), idx_(sizes.size(), 0) {
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      idx_[d] = start % sizes_[d];
      start /= sizes_[d];
      offset_ += idx_[d] * strides_[d];
    }
  }
  int64_t offset() const { return offset_; }
  void next() {
    for (int64_t d = static_cast<int64_t>(sizes_.size()) - 1; d >= 0; --d) {
      if (++idx_[d] < sizes_[d]) {
        offset_ += strides_[d];
        return;
      }
      offset_ -= (sizes_[d] - 1) * strides_[d];
      idx_[d] = 0;
    }
  }

 private:
  Shape sizes_, strides_, idx_;
  int64_t offset_ = 0;
};

// Fills `out` (any strides) block by block: gen(block, vals, first_index, count) writes the
// `count` (<= K) values of elements first_index.. of Philox block `block`. Blocks are split
// across threads; every element's value depends on its index only.
template <typename T, int K, typename Gen>
void fill_blocks(const Tensor& out, Gen&& gen) {
  const int64_t n = out.numel();
  if (n == 0) return;
  T* base = out.data_ptr<T>();
  const int64_t nblocks = (n + K - 1) / K;
  const bool dense = out.is_contiguous();
  internal::parallel_for(0, nblocks, internal::kGrainSize / K, [&](int64_t bb, int64_t be) {
    T vals[K];
    if (dense) {
      for (int64_t b = bb; b < be; ++b) {
        const int64_t i0 = b * K;
        const int count = static_cast<int>(std::min<int64_t>(K, n - i0));
        gen(b, vals, i0, count);
        for (int k = 0; k < count; ++k) base[i0 + k] = vals[k];
      }
      return;
    }
    Cursor cur(out.sizes(), out.strides(), bb * K);
    for (int64_t b = bb; b < be; ++b) {
      const int64_t i0 = b * K;
      const int count = static_cast<int>(std::min<int64_t>(K, n - i0));
      gen(b, vals, i0, count);
      for (int k = 0; k < count; ++k) {
        base[cur.offset()] = vals[k];
        cur.next();
      }
    }
  });
}

// The device half of scalar::RandomKernels (kernels/random_fn.h).
struct CpuRandom {
  template <typename T, int K, typename Gen>
  static void fill(const Tensor& out, const Gen& gen) {
    fill_blocks<T, K>(out, gen);
  }

  // Probabilities per element: p (broadcast to out's shape) read as double, checking range.
  static void bernoulli_tensor(OpCall& c, Stream s) {
    const Tensor& out = c.outputs[0];
    const Tensor& p = c.input(1);
    KILN_CHECK(p.is_cpu(), "[bernoulli_] expected probabilities on cpu, got ", p.device().str());
    const int64_t n = out.numel();
    std::vector<double> probs(static_cast<size_t>(n));
    visit_floating(p.dtype(), "bernoulli_", [&]<typename P>(TypeTag<P>) {
      const P* pp = p.data_ptr<P>();
      Shape strides = broadcast_byte_strides(p, out.sizes());
      for (int64_t& st : strides) st /= static_cast<int64_t>(sizeof(P));
      Cursor cur(out.sizes(), strides, 0);
      for (int64_t i = 0; i < n; ++i, cur.next()) {
        const double q = static_cast<double>(static_cast<opmath_t<P>>(pp[cur.offset()]));
        if (!(q >= 0.0 && q <= 1.0)) scalar::fail_bernoulli_probability(q, i);
        probs[static_cast<size_t>(i)] = q;
      }
    });
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      const T one = from_int<T>(1), zero = from_int<T>(0);
      fill_blocks<T, 4>(out, [&](int64_t b, T* v, int64_t i0, int count) {
        const philox::Words w = s.block(static_cast<uint64_t>(b));
        for (int k = 0; k < count; ++k) {
          v[k] = scalar::bernoulli(w.w[k], probs[static_cast<size_t>(i0 + k)]) ? one : zero;
        }
      });
    });
  }

  static void multinomial(OpCall& c, const scalar::MultinomialArgs& args);
  static void randperm(OpCall& c, Stream s);
};

void CpuRandom::multinomial(OpCall& c, const scalar::MultinomialArgs& args) {
  const Tensor& probs = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t num_samples = args.num_samples, rows = args.rows, cats = args.cats;
  const Stream s = args.s;
  const int64_t row_stride = args.batched ? probs.stride(0) : 0;
  const int64_t cat_stride = probs.stride(-1);
  int64_t* dst = out.data_ptr<int64_t>();
  visit_floating(probs.dtype(), "multinomial", [&]<typename P>(TypeTag<P>) {
    const P* src = probs.data_ptr<P>();
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / std::max(cats, num_samples));
    internal::parallel_for(0, rows, grain, [&](int64_t rb, int64_t re) {
      std::vector<double> pv(static_cast<size_t>(cats)), cdf(static_cast<size_t>(cats));
      std::vector<std::pair<double, int64_t>> scores;
      for (int64_t r = rb; r < re; ++r) {
        double total = 0;
        int64_t positive = 0, last_positive = 0;
        for (int64_t k = 0; k < cats; ++k) {
          const double q =
              static_cast<double>(static_cast<opmath_t<P>>(src[r * row_stride + k * cat_stride]));
          if (!(std::isfinite(q) && q >= 0.0)) scalar::fail_multinomial_probability();
          if (q > 0) {
            ++positive;
            last_positive = k;
          }
          total += q;
          pv[static_cast<size_t>(k)] = q;
          cdf[static_cast<size_t>(k)] = total;
        }
        if (!(total > 0.0)) scalar::fail_multinomial_sum(r);
        int64_t* row_out = dst + r * num_samples;
        if (args.replacement) {
          for (int64_t smp = 0; smp < num_samples; ++smp) {
            const double target =
                scalar::mul_rn(scalar::draw53(s, r * num_samples + smp, false), total);
            const int64_t k = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
            row_out[smp] = std::min(k, last_positive);
          }
          continue;
        }
        if (positive < num_samples) scalar::fail_multinomial_too_few(positive, num_samples);
        // Sampling without replacement: the categories with the largest p / Exp(1) keys, in
        // order, have the distribution of successive draws without replacement.
        scores.clear();
        for (int64_t k = 0; k < cats; ++k) {
          const double q = pv[static_cast<size_t>(k)];
          if (q == 0.0) continue;  // never drawn
          scores.emplace_back(scalar::exp_key(q, scalar::draw53(s, r * cats + k, true)), k);
        }
        auto better = [](const std::pair<double, int64_t>& a, const std::pair<double, int64_t>& b) {
          return a.first > b.first || (a.first == b.first && a.second < b.second);
        };
        std::partial_sort(scores.begin(), scores.begin() + num_samples, scores.end(), better);
        for (int64_t smp = 0; smp < num_samples; ++smp) {
          row_out[smp] = scores[static_cast<size_t>(smp)].second;
        }
      }
    });
  });
}

void CpuRandom::randperm(OpCall& c, Stream s) {
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  std::vector<uint64_t> keys(static_cast<size_t>(n));
  internal::parallel_for(0, (n + 1) / 2, internal::kGrainSize / 2, [&](int64_t bb, int64_t be) {
    for (int64_t b = bb; b < be; ++b) {
      const philox::Words w = s.block(static_cast<uint64_t>(b));
      keys[static_cast<size_t>(2 * b)] = philox::bits64(w.w[0], w.w[1]);
      if (2 * b + 1 < n) keys[static_cast<size_t>(2 * b + 1)] = philox::bits64(w.w[2], w.w[3]);
    }
  });
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const uint64_t ka = keys[static_cast<size_t>(a)], kb = keys[static_cast<size_t>(b)];
    return ka < kb || (ka == kb && a < b);
  });
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    T* p = out.data_ptr<T>();
    for (int64_t i = 0; i < n; ++i) p[i] = from_int<T>(order[static_cast<size_t>(i)]);
  });
}

}  // namespace

#define KILN_REGISTER_RANDOM(op, fn) \
  KILN_REGISTER_KERNEL(op, kCPU, scalar::RandomKernels<CpuRandom>::fn);
KILN_RANDOM_OPS(KILN_REGISTER_RANDOM)
#undef KILN_REGISTER_RANDOM

}  // namespace kiln::cpu
