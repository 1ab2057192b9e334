// CUDA kernels of the random fills uniform_, normal_, random_ and bernoulli_, and of
// multinomial and randperm (CPU: kernels/cpu/random.cpp). Each thread of a fill computes one
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

// The seed and offset are the last two attributes of every random op.
Stream stream_of(const OpCall& c) {
  const size_t n = c.attrs.size();
  return {static_cast<uint64_t>(c.attr<int64_t>(n - 2)),
          static_cast<uint64_t>(c.attr<int64_t>(n - 1))};
}

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

// --- uniform_ ---------------------------------------------------------------------------------

struct UniformDouble {
  Stream s;
  double from, to, range;
  __device__ void operator()(uint64_t b, double* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      v[k] = scalar::uniform_double(w.w[2 * k], w.w[2 * k + 1], from, to, range);
    }
  }
};

template <typename T>
struct UniformFloat {
  Stream s;
  float from_f, range;
  double to;
  T from_t;
  __device__ void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      v[k] = scalar::uniform_float<T>(w.w[k], from_f, range, to, from_t);
    }
  }
};

void uniform_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const double from = c.attr<double>(0), to = c.attr<double>(1);
  const Stream s = stream_of(c);
  visit_floating(out.dtype(), "uniform_", [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, double>) {
      fill_blocks<double, 2>(out, UniformDouble{s, from, to, to - from});
    } else {
      const float from_f = static_cast<float>(from);
      fill_blocks<T, 4>(out,
                        UniformFloat<T>{s, from_f, static_cast<float>(to - from), to, T(from_f)});
    }
  });
}

// --- normal_ ----------------------------------------------------------------------------------

struct NormalDouble {
  Stream s;
  double mean, stdev;
  __device__ void operator()(uint64_t b, double* v, int64_t, int count) const {
    scalar::normal_double(s.block(b), mean, stdev, v, count);
  }
};

template <typename T>
struct NormalFloat {
  Stream s;
  float mean, stdev;
  __device__ void operator()(uint64_t b, T* v, int64_t, int count) const {
    scalar::normal_float<T>(s.block(b), mean, stdev, v, count);
  }
};

void normal_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const double mean = c.attr<double>(0), stdev = c.attr<double>(1);
  const Stream s = stream_of(c);
  visit_floating(out.dtype(), "normal_", [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, double>) {
      fill_blocks<double, 2>(out, NormalDouble{s, mean, stdev});
    } else {
      fill_blocks<T, 4>(out,
                        NormalFloat<T>{s, static_cast<float>(mean), static_cast<float>(stdev)});
    }
  });
}

// --- random_ ----------------------------------------------------------------------------------

// scalar::random_int of one word (ranges up to 2^32) or of a word pair.
template <typename T, bool kWide>
struct RandomInt {
  Stream s;
  int64_t low;
  uint64_t range;
  __device__ void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) {
      const uint64_t x = kWide ? philox::bits64(w.w[2 * k], w.w[2 * k + 1]) : uint64_t{w.w[k]};
      v[k] = from_int<T>(scalar::random_int(x, low, range));
    }
  }
};

void random_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const int64_t low = c.attr<int64_t>(0), high = c.attr<int64_t>(1);
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  const Stream s = stream_of(c);
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    if (range <= (uint64_t{1} << 32)) {
      fill_blocks<T, 4>(out, RandomInt<T, false>{s, low, range});
    } else {
      fill_blocks<T, 2>(out, RandomInt<T, true>{s, low, range});
    }
  });
}

// --- bernoulli_ -------------------------------------------------------------------------------

template <typename T>
struct BernoulliScalar {
  Stream s;
  double p;
  __device__ void operator()(uint64_t b, T* v, int64_t, int count) const {
    const philox::Words w = s.block(b);
    for (int k = 0; k < count; ++k) v[k] = from_int<T>(scalar::bernoulli(w.w[k], p) ? 1 : 0);
  }
};

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

void bernoulli_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Stream s = stream_of(c);
  if (c.inputs.size() == 1) {
    const double p = c.attr<double>(0);
    visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
      fill_blocks<T, 4>(out, BernoulliScalar<T>{s, p});
    });
    return;
  }
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
    KILN_FAIL("[bernoulli_] expected all probabilities in [0, 1], got ", q, " at element ", at);
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

void multinomial_cuda(OpCall& c) {
  const Tensor& probs = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t num_samples = c.attr<int64_t>(0);
  const bool replacement = c.attr<bool>(1);
  const Stream s = stream_of(c);
  const bool batched = probs.dim() == 2;
  const int64_t rows = batched ? probs.size(0) : 1;
  const int64_t cats = probs.size(-1);
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
      KILN_CHECK(code % 4 != kBadProbability,
                 "[multinomial] probability tensor contains either inf, nan or element < 0");
      KILN_CHECK(code % 4 != kZeroSum,
                 "[multinomial] invalid multinomial distribution (sum of probabilities <= 0) in "
                 "row ",
                 code / 4);
      KILN_FAIL(
          "[multinomial] invalid multinomial distribution (with replacement=False, not enough "
          "non-negative category to sample): ",
          code / 4, " categories with nonzero probability, ", num_samples, " samples");
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

void randperm_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const int64_t n = out.numel();
  if (n == 0) return;
  const Stream s = stream_of(c);
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

KILN_REGISTER_KERNEL(uniform_, kCUDA, uniform_cuda);
KILN_REGISTER_KERNEL(normal_, kCUDA, normal_cuda);
KILN_REGISTER_KERNEL(random_, kCUDA, random_cuda);
KILN_REGISTER_KERNEL(bernoulli_, kCUDA, bernoulli_cuda);
KILN_REGISTER_KERNEL(multinomial, kCUDA, multinomial_cuda);
KILN_REGISTER_KERNEL(randperm, kCUDA, randperm_cuda);

}  // namespace kiln::cuda
