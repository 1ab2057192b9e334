// The rms_norm kernels that lost (kernels/cuda/norm.cu ships the winners), validated against an
// f64 reference composed of kiln ops on the CPU and timed beside the library's kernels, bf16 x
// and weight, at Llama's shapes (8192 x 2048: llama-3.2-1b, 16384 x 768: llama-160m) and a large
// one (32768 x 4096).
//
// Forward (the library: a warp per row under 2048 elements, a group of 128 threads from 2048):
//   v0  one warp per row at every length (the library's warp kernel)
//   v1  one warp per 2 rows, both rows' loads issued before either reduction
//   v2  128 threads per row, as first written (the general kernel below)
//   v3  256 threads per row;  v4  64 threads per row (4 rows per 256-thread block)
//   v5  as v2, the weight loaded with x, before the reduction;  v6  as v0, likewise
// Backward (the library: 256 threads per row over 2048 elements, else 128 threads, 2 rows at a
// time; weight and dweight in registers):
//   v0  the loop kernel (a block per row, dweight partials in global memory)
//   v1  256 threads, 1 row;  v2  256 threads, 2 rows;  v3  128 threads, 2 rows;  v4  128, 4 rows
// measurements: benchmarks/RESULTS.md ("RMSNorm variants").
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/norm.h"
#include "lab/lab.h"
#include "tensor/ops.h"

namespace kiln::lab {
namespace {

using cuda::internal::load_pack;
using cuda::internal::Pack;
using cuda::internal::raw_elem;
using cuda::internal::RawPack;
using cuda::internal::rsqrt_of;
using cuda::internal::store_pack;
using cuda::internal::warp_sum;

// Groups of TPR threads (a multiple of 32) each normalise R rows at a time, every thread holding
// P 16-byte packs of each row in registers. All R rows' loads are issued before any reduction;
// with kWFirst the weight packs are loaded with x, before the reduction, instead of after it.
// Groups wider than a warp combine their warps' sums through shared memory. The loop is uniform
// over the block (rows past the end are masked) so that the barriers are safe. Rows of at most
// TPR * P packs.
template <typename T, typename W, int N, int P, int TPR, int R, bool kWFirst>
__global__ void __launch_bounds__(256)
    rms_norm_fwd_variant_kernel(T* __restrict__ y, opmath_t<T>* __restrict__ rstd,
                                const T* __restrict__ x, const W* __restrict__ w, int64_t rows,
                                int64_t d, opmath_t<T> eps) {
  using Acc = opmath_t<T>;
  constexpr int kWarpsPerGroup = TPR / 32;
  const int groups = static_cast<int>(blockDim.x) / TPR;
  const int g = static_cast<int>(threadIdx.x) / TPR, t = static_cast<int>(threadIdx.x) % TPR;
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  const int64_t nvec = d / N;
  const int64_t per_block = static_cast<int64_t>(groups) * R;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * per_block; base < rows;
       base += static_cast<int64_t>(gridDim.x) * per_block) {
    const int64_t row0 = base + static_cast<int64_t>(g) * R;
    RawPack<T, N> raw[R][P];
    Pack<W, N> wraw[kWFirst ? P : 1];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < rows) {
        const T* xr = x + (row0 + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) raw[r][p] = *reinterpret_cast<const RawPack<T, N>*>(xr + v * N);
        }
      }
    }
    if constexpr (kWFirst) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const int64_t v = t + p * TPR;
        if (v < nvec) wraw[p] = *reinterpret_cast<const Pack<W, N>*>(w + v * N);
      }
    }
    Acc ss[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      ss[r] = 0;
      if (row0 + r < rows) {
#pragma unroll
        for (int p = 0; p < P; ++p) {
          if (t + p * TPR < nvec) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
              const Acc f = raw_elem<T, N, Acc>(raw[r][p], i);
              ss[r] += f * f;
            }
          }
        }
      }
      ss[r] = warp_sum(ss[r]);
    }
    if constexpr (kWarpsPerGroup > 1) {
      __shared__ Acc smem[8][R];  // [warp][row]; blocks of at most 256 threads
      if (lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r) smem[warp][r] = ss[r];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < R; ++r) {
        Acc s = 0;
#pragma unroll
        for (int k = 0; k < kWarpsPerGroup; ++k) s += smem[g * kWarpsPerGroup + k][r];
        ss[r] = s;
      }
      __syncthreads();  // smem is written again by the next iteration
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (row0 + r < rows) {
        const Acc rs = rsqrt_of(ss[r] / static_cast<Acc>(d) + eps);
        if (t == 0) rstd[row0 + r] = rs;
        T* yr = y + (row0 + r) * d;
#pragma unroll
        for (int p = 0; p < P; ++p) {
          const int64_t v = t + p * TPR;
          if (v < nvec) {
            Acc wv[N], o[N];
            if constexpr (kWFirst) {
#pragma unroll
              for (int i = 0; i < N; ++i) wv[i] = static_cast<Acc>(wraw[p].v[i]);
            } else {
              load_pack<N>(w + v * N, wv);
            }
#pragma unroll
            for (int i = 0; i < N; ++i) o[i] = raw_elem<T, N, Acc>(raw[r][p], i) * rs * wv[i];
            store_pack<N>(yr + v * N, o);
          }
        }
      }
    }
  }
}

// Launches rms_norm_fwd_variant_kernel in blocks of `block` threads with the smallest P of 1 to
// 16 that covers a row; false (nothing launched) where none does.
template <typename T, int TPR, int R, bool kWFirst>
bool launch_fwd_variant(int block, const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                        const Tensor& rstd) {
  constexpr int N = 16 / sizeof(T);
  const int64_t d = w.numel(), rows = rstd.numel();
  const int64_t per_block = static_cast<int64_t>(block / TPR) * R;
  const auto grid =
      static_cast<unsigned>(std::min<int64_t>((rows + per_block - 1) / per_block, 1 << 30));
  return cuda::internal::with_packs<TPR>(
      d / N, std::integer_sequence<int, 1, 2, 4, 8, 16>{},
      [&]<int P>(std::integral_constant<int, P>) {
        rms_norm_fwd_variant_kernel<T, T, N, P, TPR, R, kWFirst><<<grid, block>>>(
            static_cast<T*>(y.data_ptr()), static_cast<float*>(rstd.data_ptr()),
            static_cast<const T*>(x.data_ptr()), static_cast<const T*>(w.data_ptr()), rows, d,
            static_cast<float>(eps));
        KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_variant_kernel");
      });
}

// One variant: runs the call (outputs given) and says whether it applied to the shape.
using Run =
    std::function<bool(const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& rstd)>;
using RunBwd = std::function<bool(const Tensor& dy, const Tensor& x, const Tensor& w,
                                  const Tensor& rstd, const Tensor& dx, const Tensor& dw)>;

constexpr double kEps = 1e-6;

std::vector<std::pair<std::string, Run>> forward_variants() {
  using cuda::internal::RmsNormForward;
  using BF = BFloat16;
  return {
      {"v0 warp",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         if (w.numel() > 32 * 16 * 8) return false;
         cuda::internal::rms_norm_forward(x, w, kEps, y, r, RmsNormForward::kWarp);
         return true;
       }},
      {"v1 warp, 2 rows",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 32, 2, false>(128, x, w, kEps, y, r);
       }},
      {"v2 128 threads",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 128, 1, false>(128, x, w, kEps, y, r);
       }},
      {"v3 256 threads",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 256, 1, false>(256, x, w, kEps, y, r);
       }},
      {"v4 64 threads",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 64, 1, false>(256, x, w, kEps, y, r);
       }},
      {"v5 128 threads, w first",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 128, 1, true>(128, x, w, kEps, y, r);
       }},
      {"v6 warp, w first",
       [](const Tensor& x, const Tensor& w, const Tensor& y, const Tensor& r) {
         return launch_fwd_variant<BF, 32, 1, true>(256, x, w, kEps, y, r);
       }},
  };
}

// A backward row-group configuration of the library's kernel (kernels/cuda/norm.cuh).
template <int TPR, int R>
bool run_bwd_rows(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                  const Tensor& dx, const Tensor& dw) {
  using BF = BFloat16;
  return cuda::internal::launch_rms_norm_bwd_rows<BF, BF, TPR, R>(
      static_cast<BF*>(dx.data_ptr()), static_cast<BF*>(dw.data_ptr()),
      static_cast<const BF*>(dy.data_ptr()), static_cast<const BF*>(x.data_ptr()),
      static_cast<const BF*>(w.data_ptr()), static_cast<const float*>(rstd.data_ptr()),
      /*res=*/nullptr, rstd.numel(), w.numel(), x.device(), cuda::current_stream());
}

std::vector<std::pair<std::string, RunBwd>> backward_variants() {
  return {
      {"v0 loop",
       [](const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& r, const Tensor& dx,
          const Tensor& dw) {
         cuda::internal::rms_norm_backward(dy, x, w, r, dx, dw,
                                           cuda::internal::RmsNormBackward::kLoop);
         return true;
       }},
      {"v1 256 threads", run_bwd_rows<256, 1>},
      {"v2 256 threads, 2 rows", run_bwd_rows<256, 2>},
      {"v3 128 threads, 2 rows", run_bwd_rows<128, 2>},
      {"v4 128 threads, 4 rows", run_bwd_rows<128, 4>},
  };
}

// The f64 reference on the CPU: y and rstd, then dx and dw, composed of kiln ops.
struct Reference {
  Tensor y, rstd, dx, dw;
};
Reference reference(const Tensor& x_gpu, const Tensor& w_gpu, const Tensor& dy_gpu) {
  const Tensor x = x_gpu.to(kCPU).to(kDouble), w = w_gpu.to(kCPU).to(kDouble);
  const Tensor dy = dy_gpu.to(kCPU).to(kDouble);
  const Tensor r = rsqrt(mean(square(x), {-1}, true) + kEps);
  const Tensor g = dy * w;
  const Tensor dx = r * g - x * r * r * r * mean(g * x, {-1}, true);
  return {x * r * w, r.view({-1}), dx, sum(dy * x * r, {0})};
}

// Every variant against the reference on rows of d elements (rows chosen to leave partial
// blocks and steps): y and rstd, dx and dw.
void check_variants(int64_t rows, int64_t d) {
  const Tensor x = bench::random({rows, d}, kBFloat16), w = bench::random({d}, kBFloat16);
  const Tensor dy = bench::random({rows, d}, kBFloat16);
  const Reference ref = reference(x, w, dy);
  const std::string shape = std::to_string(rows) + "x" + std::to_string(d);
  const TensorOptions f32 = TensorOptions(kFloat).device(x.device());
  for (const auto& [name, run] : forward_variants()) {
    const Tensor y = empty_like(x), r = empty({rows}, f32);
    if (!run(x, w, y, r)) continue;
    check("rmsnorm " + shape + " fwd y [" + name + "]", y, ref.y, 1e-2, 1e-2);
    check("rmsnorm " + shape + " fwd rstd [" + name + "]", r, ref.rstd, 1e-6, 1e-5);
  }
  const Tensor rstd = ref.rstd.to(kFloat).to(x.device());
  for (const auto& [name, run] : backward_variants()) {
    const Tensor dx = empty_like(x), dw = empty_like(w);
    if (!run(dy, x, w, rstd, dx, dw)) continue;
    check("rmsnorm " + shape + " bwd dx [" + name + "]", dx, ref.dx, 2e-2, 1e-2);
    // dw: bf16 of a sum over the rows (about sqrt(rows) in size).
    check("rmsnorm " + shape + " bwd dw [" + name + "]", dw, ref.dw, 0.1, 1e-2);
  }
}

// The library's op and each variant that applies, timed on 4 input sets in rotation. Bytes:
// forward x read and y written, backward x and dy read and dx written.
void time_variants(int64_t rows, int64_t d) {
  std::vector<Tensor> xs, dys, rstds;
  const Tensor w = bench::random({d}, kBFloat16);
  static const OpDef& bwd = KILN_OP(rms_norm_backward);
  for (int i = 0; i < 4; ++i) {
    xs.push_back(bench::random({rows, d}, kBFloat16));
    dys.push_back(bench::random({rows, d}, kBFloat16));
    rstds.push_back(call_op(KILN_OP(rms_norm), {xs.back(), w}, {kEps})[1]);
  }
  const double bytes = static_cast<double>(rows * d * 2);
  const std::string base = "rmsnorm " + std::to_string(rows) + "x" + std::to_string(d) + " bf16 ";
  bench::report(base + "fwd [library]",
                bench::time_ms([&](int i) { (void)rms_norm(xs[i % 4], w, kEps); }), 0, 2 * bytes);
  const Tensor y = empty_like(xs[0]), r = empty_like(rstds[0]);
  for (const auto& [name, run] : forward_variants()) {
    if (!run(xs[0], w, y, r)) continue;
    bench::report(base + "fwd [" + name + "]",
                  bench::time_ms([&, &run = run](int i) { (void)run(xs[i % 4], w, y, r); }), 0,
                  2 * bytes);
  }
  bench::report(base + "bwd [library]", bench::time_ms([&](int i) {
                  (void)call_op(bwd, {dys[i % 4], xs[i % 4], w, rstds[i % 4]});
                }),
                0, 3 * bytes);
  const Tensor dx = empty_like(xs[0]), dw = empty_like(w);
  for (const auto& [name, run] : backward_variants()) {
    if (!run(dys[0], xs[0], w, rstds[0], dx, dw)) continue;
    bench::report(base + "bwd [" + name + "]", bench::time_ms([&, &run = run](int i) {
                    (void)run(dys[i % 4], xs[i % 4], w, rstds[i % 4], dx, dw);
                  }),
                  0, 3 * bytes);
  }
}

KILN_LAB_CASE(norm, [] {
  for (const auto& [rows, d] : std::vector<std::pair<int64_t, int64_t>>{
           {1031, 2048}, {2049, 768}, {257, 4096}, {67, 8192}, {5, 264}}) {
    check_variants(rows, d);
  }
  for (const auto& [rows, d] :
       std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {16384, 768}, {32768, 4096}}) {
    time_variants(rows, d);
  }
});

}  // namespace
}  // namespace kiln::lab
