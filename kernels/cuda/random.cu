// CUDA kernels of the random fills uniform_, normal_, random_ and bernoulli_, and of
// multinomial and randperm (CPU: kernels/cpu/random.cpp; what both share, the fills' generators
// and the ops' attributes included: kernels/random_fn.h). Each thread of a fill computes one
// Philox block with the functions of tensor/random.h and writes the elements of that block,
// following the mapping documented there, so a tensor filled on the GPU holds the same numbers as
// one filled on the CPU with the same seed: bit for bit for uniform_, random_ and bernoulli_ (the
// arithmetic is spelled with round-to-nearest intrinsics so that nvcc does not contract it into
// fused multiply-adds, which the CPU does not use), and within an ulp or two for normal_, whose
// log, sin and cos come from CUDA's math library rather than glibc's.
//
// multinomial and randperm follow the same table: multinomial with replacement builds each
// row's running sum in the CPU's order (one thread per row, in double) and binary-searches it
// per draw, so its draws are the CPU's exactly; without replacement it ranks the categories by
// p / Exp(1) keys with a stable descending row sort (sort.cuh), whose -log comes from CUDA's
// library (an ulp from glibc's, which could swap two categories whose keys are that close).
// randperm sorts the indices by their 64-bit keys with a stable radix sort: the CPU's
// (key, index) order, bit for bit.
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/sort.cuh"
#include "kernels/random_fn.h"
#include "tensor/random.h"

namespace kiln::cuda {
namespace {

using loops::ErrorFlag;
using loops::FlagView;
using loops::Geometry;

using scalar::from_int;
using Stream = scalar::PhiloxStream;

// One thread per Philox block: gen(block, vals, first_index, count) makes the `count` (<= K)
// values of elements first_index..; they go to row-major positions of `out` (any strides).
template <typename T, int K, typename Gen>
__global__ void fill_blocks_kernel(T* out, int64_t n, bool dense, Geometry<1> g, Gen gen) {
  const int64_t nblocks = (n + K - 1) / K;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nblocks;
       b += step) {
    const int64_t i0 = b * K;
    const int count = static_cast<int>(n - i0 < K ? n - i0 : K);
    T vals[K];
    gen(static_cast<uint64_t>(b), vals, i0, count);
    for (int k = 0; k < count; ++k) {
      int64_t off = i0 + k;
      if (!dense) {
        int64_t o[1];
        loops::offsets<int64_t, 1>(g, i0 + k, o);
        off = o[0];
      }
      out[off] = vals[k];
    }
  }
}

template <typename T, int K, typename Gen>
void fill_blocks(const Tensor& out, const Gen& gen) {
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const Shape strides[1] = {to_shape(out.strides())};
  const Geometry<1> g = loops::make_geometry<1>(out.sizes(), strides, "random");
  const int64_t nblocks = (n + K - 1) / K;
  fill_blocks_kernel<T, K><<<loops::grid_for(nblocks), loops::kThreads, 0, current_stream()>>>(
      static_cast<T*>(out.data_ptr()), n, out.is_contiguous(), g, gen);
  KILN_CUDA_LAUNCH_CHECK("fill_blocks_kernel");
}

// The device half of scalar::RandomKernels (kernels/random_fn.h).
struct CudaRandom {
  template <typename T, int K, typename Gen>
  static void fill(const Tensor& out, const Gen& gen) {
    fill_blocks<T, K>(out, gen);
  }
  static void bernoulli_tensor(OpCall& c, Stream s);
  static void multinomial(OpCall& c, const scalar::MultinomialArgs& args);
  static void randperm(OpCall& c, Stream s);
};

// --- bernoulli_ with a tensor of probabilities ------------------------------------------------

// Probabilities per element: `probs` is a contiguous double tensor of out's shape.
template <typename T>
struct BernoulliTensor {
  Stream s;
  const double* probs;
  FlagView flag;
  __device__ void operator()(uint64_t b, T* v, int64_t i0, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      const double q = probs[i0 + k];
      if (!(q >= 0.0 && q <= 1.0)) flag.raise(i0 + k);
      v[k] = from_int<T>(scalar::bernoulli(w.w[k], q) ? 1 : 0);
    }
  }
};

void CudaRandom::bernoulli_tensor(OpCall& c, Stream s) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  // p as double, as the CPU reads it (through opmath_t), laid out like out.
  const Tensor& p = c.input(1);
  const Tensor on_device = p.is_cuda() ? p : p.to(out.device());
  const Tensor probs = loops::as_dtype(on_device, kDouble).expand(out.sizes()).contiguous();
  const ErrorFlag flag(out.device());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    fill_blocks<T, 4>(
        out, BernoulliTensor<T>{s, static_cast<const double*>(probs.data_ptr()), flag.view()});
  });
  int64_t at = 0;
  if (flag.raised(&at)) {
    double q = 0;
    KILN_CUDA_CHECK(cudaMemcpy(&q, static_cast<const double*>(probs.data_ptr()) + at, sizeof(q),
                               cudaMemcpyDeviceToHost));
    scalar::fail_bernoulli_probability(q, at);
  }
}

// --- multinomial ------------------------------------------------------------------------------

// What the row scan of multinomial checks, as the CPU kernel does (error codes in the flag's
// value: code + 4 * detail).
enum MultinomialError : int64_t { kBadProbability = 1, kZeroSum = 2, kTooFewPositive = 3 };

// The probabilities of a [rows, cats] view (row stride 0 for a 1-d tensor), read as double
// through P's arithmetic type, as the CPU reads them.
template <typename P>
struct ProbRows {
  const P* p;
  int64_t row_stride, cat_stride;
  __device__ double operator()(int64_t r, int64_t k) const {
    return static_cast<double>(static_cast<opmath_t<P>>(p[r * row_stride + k * cat_stride]));
  }
};

// One thread per row, in the CPU's order: checks the row, and (with replacement) writes its
// running sums (cdf), total and last positive category.
template <typename P>
__global__ void multinomial_scan_kernel(ProbRows<P> probs, int64_t rows, int64_t cats,
                                        int64_t num_samples, bool replacement, double* cdf,
                                        double* totals, int64_t* last_positive, FlagView flag) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows;
       r += step) {
    double total = 0;
    int64_t positive = 0, last = 0;
    bool bad = false;
    for (int64_t k = 0; k < cats; ++k) {
      const double q = probs(r, k);
      bad = bad || !(::isfinite(q) && q >= 0.0);
      if (q > 0) {
        ++positive;
        last = k;
      }
      total = scalar::add_rn(total, q);
      if (replacement) cdf[r * cats + k] = total;
    }
    if (bad) {
      flag.raise(kBadProbability);
    } else if (!(total > 0.0)) {
      flag.raise(kZeroSum + 4 * r);
    } else if (!replacement && positive < num_samples) {
      flag.raise(kTooFewPositive + 4 * positive);
    }
    if (replacement) {
      totals[r] = total;
      last_positive[r] = last;
    }
  }
}

// Draw j = r * num_samples + s: the first category whose running sum exceeds u * total.
__global__ void multinomial_draw_kernel(int64_t* out, Stream s, int64_t rows, int64_t cats,
                                        int64_t num_samples, const double* cdf,
                                        const double* totals, const int64_t* last_positive) {
  const int64_t n = rows * num_samples;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    const int64_t r = j / num_samples;
    const double target = scalar::mul_rn(scalar::draw53(s, j, false), totals[r]);
    // upper_bound: the first k with cdf[k] > target (cats when there is none).
    const double* row = cdf + r * cats;
    int64_t lo = 0, hi = cats;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (row[mid] > target) {
        hi = mid;
      } else {
        lo = mid + 1;
      }
    }
    out[j] = lo < last_positive[r] ? lo : last_positive[r];
  }
}

// Without replacement: the ordered key of p / Exp(1) for key j = r * cats + k, and 0 (below
// every real key) for zero-probability categories, which are never drawn.
template <typename P>
__global__ void multinomial_keys_kernel(uint64_t* keys, ProbRows<P> probs, Stream s, int64_t rows,
                                        int64_t cats) {
  const int64_t n = rows * cats;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    const double q = probs(j / cats, j % cats);
    if (q == 0.0) {
      keys[j] = 0;
      continue;
    }
    keys[j] = internal::ordered_key(scalar::exp_key(q, scalar::draw53(s, j, true)));
  }
}

// out[r, s] = the s-th sorted column of row r.
template <typename C>
__global__ void first_columns_kernel(int64_t* out, const C* columns, int64_t rows, int64_t cats,
                                     int64_t num_samples) {
  const int64_t n = rows * num_samples;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    out[j] = static_cast<int64_t>(columns[(j / num_samples) * cats + j % num_samples]);
  }
}

void CudaRandom::multinomial(OpCall& c, const scalar::MultinomialArgs& args) {
  const Tensor& probs = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t num_samples = args.num_samples, rows = args.rows, cats = args.cats;
  const bool replacement = args.replacement, batched = args.batched;
  const Stream s = args.s;
  if (rows == 0) return;
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  const Device device = out.device();
  const ErrorFlag flag(device);
  int64_t* dst = static_cast<int64_t*>(out.data_ptr());
  Tensor cdf, totals, last_positive;
  if (replacement) {
    cdf = loops::empty_on({rows * cats}, kDouble, device);
    totals = loops::empty_on({rows}, kDouble, device);
    last_positive = loops::empty_on({rows}, kInt64, device);
  }
  visit_floating(probs.dtype(), "multinomial", [&]<typename P>(TypeTag<P>) {
    const ProbRows<P> pr{static_cast<const P*>(probs.data_ptr()), batched ? probs.stride(0) : 0,
                         probs.stride(-1)};
    multinomial_scan_kernel<P><<<loops::grid_for(rows, 128), 128, 0, stream>>>(
        pr, rows, cats, num_samples, replacement,
        replacement ? static_cast<double*>(cdf.data_ptr()) : nullptr,
        replacement ? static_cast<double*>(totals.data_ptr()) : nullptr,
        replacement ? static_cast<int64_t*>(last_positive.data_ptr()) : nullptr, flag.view());
    KILN_CUDA_LAUNCH_CHECK("multinomial_scan_kernel");
    int64_t code = 0;
    if (flag.raised(&code)) {
      if (code % 4 == kBadProbability) scalar::fail_multinomial_probability();
      if (code % 4 == kZeroSum) scalar::fail_multinomial_sum(code / 4);
      scalar::fail_multinomial_too_few(code / 4, num_samples);
    }
    if (replacement) {
      const int64_t n = rows * num_samples;
      multinomial_draw_kernel<<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
          dst, s, rows, cats, num_samples, static_cast<const double*>(cdf.data_ptr()),
          static_cast<const double*>(totals.data_ptr()),
          static_cast<const int64_t*>(last_positive.data_ptr()));
      KILN_CUDA_LAUNCH_CHECK("multinomial_draw_kernel");
      return;
    }
    const int64_t n = rows * cats;
    Tensor keys = internal::device_bytes(n * 8, device);
    multinomial_keys_kernel<P><<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
        static_cast<uint64_t*>(keys.data_ptr()), pr, s, rows, cats);
    KILN_CUDA_LAUNCH_CHECK("multinomial_keys_kernel");
    const Tensor columns = internal::sort_positions(keys.data_ptr(), 8, rows, cats,
                                                    /*descending=*/true, device);
    const int64_t m = rows * num_samples;
    if (columns.dtype() == kInt32) {
      first_columns_kernel<int32_t><<<loops::grid_for(m), loops::kThreads, 0, stream>>>(
          dst, static_cast<const int32_t*>(columns.data_ptr()), rows, cats, num_samples);
    } else {
      first_columns_kernel<int64_t><<<loops::grid_for(m), loops::kThreads, 0, stream>>>(
          dst, static_cast<const int64_t*>(columns.data_ptr()), rows, cats, num_samples);
    }
    KILN_CUDA_LAUNCH_CHECK("first_columns_kernel");
  });
}

// --- randperm ---------------------------------------------------------------------------------

// keys[i] = the 64-bit word pair i % 2 of block i / 2.
__global__ void randperm_keys_kernel(uint64_t* keys, Stream s, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const philox::Words w = s.block(static_cast<uint64_t>(i / 2));
    const int k = static_cast<int>(i % 2);
    keys[i] = philox::bits64(w.w[2 * k], w.w[2 * k + 1]);
  }
}

template <typename T, typename C>
__global__ void randperm_write_kernel(T* out, const C* order, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    out[i] = from_int<T>(static_cast<int64_t>(order[i]));
  }
}

void CudaRandom::randperm(OpCall& c, Stream s) {
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  Tensor keys = internal::device_bytes(n * 8, out.device());
  randperm_keys_kernel<<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
      static_cast<uint64_t*>(keys.data_ptr()), s, n);
  KILN_CUDA_LAUNCH_CHECK("randperm_keys_kernel");
  // A stable ascending sort of the keys: ties keep the lower index first, the CPU's order.
  const Tensor order = internal::sort_positions(keys.data_ptr(), 8, 1, n, false, out.device());
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if (order.dtype() == kInt32) {
      randperm_write_kernel<T, int32_t><<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const int32_t*>(order.data_ptr()), n);
    } else {
      randperm_write_kernel<T, int64_t><<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const int64_t*>(order.data_ptr()), n);
    }
    KILN_CUDA_LAUNCH_CHECK("randperm_write_kernel");
  });
}

}  // namespace

// --- CUDA graphs: the replay's Philox base (runtime.h, GraphRng) --------------------------------

namespace {
__global__ void write_word_kernel(uint64_t* word, uint64_t value) { *word = value; }
__global__ void add_word_kernel(uint64_t* word, uint64_t value) { *word += value; }
}  // namespace

namespace internal {
void write_device_word(int device, uint64_t* word, uint64_t value) {
  DeviceGuard guard(device);
  write_word_kernel<<<1, 1, 0, current_stream()>>>(word, value);
  KILN_CUDA_LAUNCH_CHECK("write_word_kernel");
}
void add_device_word(int device, uint64_t* word, uint64_t value) {
  DeviceGuard guard(device);
  add_word_kernel<<<1, 1, 0, current_stream()>>>(word, value);
  KILN_CUDA_LAUNCH_CHECK("add_word_kernel");
}
}  // namespace internal

#define KILN_REGISTER_RANDOM(op, fn) \
  KILN_REGISTER_KERNEL(op, kCUDA, scalar::RandomKernels<CudaRandom>::fn);
KILN_RANDOM_OPS(KILN_REGISTER_RANDOM)
#undef KILN_REGISTER_RANDOM

}  // namespace kiln::cuda
