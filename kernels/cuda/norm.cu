// The CUDA kernels of rms_norm and rms_norm_backward (tensor/ops/norm.cpp; reference:
// kernels/cpu/norm.cpp): which of the kernels of kernels/cuda/norm.cuh runs a call, from the row
// length and the alignment of the rows alone.
//
// Forward: rows under 2048 elements take one warp each, rows from 2048 a group of 128 threads
// each, both holding the row in registers (up to 16 packs per thread); longer or unpackable rows
// take the loop kernel. Backward: rows over 2048 elements take 256 threads each, shorter ones 128
// threads two rows at a time (up to 4 packs per thread); longer or unpackable rows take the loop
// kernel. The variants these won against live in the kernel lab (benchmarks/lab/norm_lab.cu);
// measurements: benchmarks/RESULTS.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/norm.cuh"
#include "kernels/cuda/norm.h"
#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {

namespace internal {
namespace {

using loops::multiprocessor_count;

// Threads per row of the loop kernels: one pack per thread up to 256 threads, more threads (up to
// 1024) before a thread holds more than `cache` packs.
int threads_for(int64_t nvec, int cache) {
  auto round32 = [](int64_t v) {
    return static_cast<int>(std::max<int64_t>(32, (v + 31) / 32 * 32));
  };
  const int one_each = std::min(round32(nvec), 256);
  const int cached = std::min(round32((nvec + cache - 1) / cache), 1024);
  return std::max(one_each, cached);
}

const char* kernel_name(RmsNormForward k) {
  switch (k) {
    case RmsNormForward::kWarp:
      return "warp";
    case RmsNormForward::kGroup:
      return "group";
    case RmsNormForward::kLoop:
      return "loop";
    default:
      return "auto";
  }
}

}  // namespace

void rms_norm_forward(const Tensor& x_in, const Tensor& w_in, double eps, const Tensor& y,
                      const Tensor& rstd, RmsNormForward kernel) {
  const Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t d = w.numel(), rows = rstd.numel();
  if (rows == 0) return;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  visit_x_weight(
      "rms_norm", x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        constexpr int kPack = 16 / sizeof(T);
        T* py = static_cast<T*>(y.data_ptr());
        Acc* pr = static_cast<Acc*>(rstd.data_ptr());
        const T* px = static_cast<const T*>(x.data_ptr());
        const W* pw = static_cast<const W*>(w.data_ptr());
        const Acc e = static_cast<Acc>(eps);
        const bool packed = d > 0 && packable<T, W>(d, {px, py}, {pw});
        const int64_t nvec = d / kPack;
        RmsNormForward k = kernel;
        if (k == RmsNormForward::kAuto) {
          k = !packed                                      ? RmsNormForward::kLoop
              : d >= 2048 && nvec <= 16 * kRmsGroupThreads ? RmsNormForward::kGroup
              : nvec <= 16 * 32                            ? RmsNormForward::kWarp
                                                           : RmsNormForward::kLoop;
        }
        constexpr auto kPacks = std::integer_sequence<int, 1, 2, 4, 8, 16>{};
        bool ran = true;
        if (k == RmsNormForward::kWarp) {
          constexpr int kRowsPerBlock = 8;
          const auto blocks = static_cast<unsigned>(
              std::min<int64_t>((rows + kRowsPerBlock - 1) / kRowsPerBlock, 1 << 20));
          ran = packed && with_packs<32>(nvec, kPacks, [&]<int P>(std::integral_constant<int, P>) {
                  rms_norm_fwd_warp_kernel<T, W, kPack, P>
                      <<<blocks, 32 * kRowsPerBlock, 0, stream>>>(py, pr, px, pw, rows, d, e);
                  KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_warp_kernel");
                });
        } else if (k == RmsNormForward::kGroup) {
          const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 30));
          ran = packed &&
                with_packs<kRmsGroupThreads>(
                    nvec, kPacks, [&]<int P>(std::integral_constant<int, P>) {
                      rms_norm_fwd_group_kernel<T, W, kPack, P, kRmsGroupThreads>
                          <<<blocks, kRmsGroupThreads, 0, stream>>>(py, pr, px, pw, rows, d, e);
                      KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_group_kernel");
                    });
        } else {
          const auto blocks = static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20));
          auto launch = [&]<int N>(std::integral_constant<int, N>) {
            rms_norm_fwd_loop_kernel<T, W, N>
                <<<blocks, threads_for(d / N, kRmsCache), 0, stream>>>(py, pr, px, pw, rows, d, e);
            KILN_CUDA_LAUNCH_CHECK("rms_norm_fwd_loop_kernel");
          };
          if (packed) {
            launch(std::integral_constant<int, kPack>{});
          } else {
            launch(std::integral_constant<int, 1>{});
          }
        }
        KILN_CHECK(ran, "[rms_norm] the ", kernel_name(k), " kernel cannot run rows of ", d,
                   packed ? " elements" : " unpackable elements");
      });
}

void rms_norm_backward(const Tensor& dy_in, const Tensor& x_in, const Tensor& w_in,
                       const Tensor& rstd_in, const Tensor& dx, const Tensor& dw,
                       RmsNormBackward kernel, const Tensor& residual) {
  const Tensor dy = dy_in.contiguous(), x = x_in.contiguous(), w = w_in.contiguous();
  const Tensor rstd = rstd_in.contiguous();
  const Tensor res = residual.defined() ? residual.contiguous() : Tensor();
  const int64_t d = w.numel(), rows = rstd.numel();
  if (d == 0) return;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  if (rows == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, dw.nbytes(), stream));
    return;
  }
  visit_x_weight(
      "rms_norm", x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        constexpr int kPack = 16 / sizeof(T);
        T* pdx = static_cast<T*>(dx.data_ptr());
        W* pdw = static_cast<W*>(dw.data_ptr());
        const T* pdy = static_cast<const T*>(dy.data_ptr());
        const T* px = static_cast<const T*>(x.data_ptr());
        const W* pw = static_cast<const W*>(w.data_ptr());
        const Acc* pr = static_cast<const Acc*>(rstd.data_ptr());
        const T* pres = res.defined() ? static_cast<const T*>(res.data_ptr()) : nullptr;
        const bool packed = packable<T, W>(d, {px, pdy, pdx, pres}, {pw});
        if (kernel != RmsNormBackward::kLoop) {
          // Rows over 2048 elements: 256 threads, one row at a time; shorter: 128 threads, two;
          // rows of at most 96 packs (768 bf16 elements: llama-160m) 96 threads, two, so that
          // no warp idles.
          const bool ran =
              packed &&
              (d > 2048 ? launch_rms_norm_bwd_rows<T, W, 256, 1>(pdx, pdw, pdy, px, pw, pr, pres,
                                                                 rows, d, x.device(), stream)
               : d / kPack <= 96
                   ? launch_rms_norm_bwd_rows<T, W, 96, 2>(pdx, pdw, pdy, px, pw, pr, pres, rows, d,
                                                           x.device(), stream)
                   : launch_rms_norm_bwd_rows<T, W, 128, 2>(pdx, pdw, pdy, px, pw, pr, pres, rows,
                                                            d, x.device(), stream));
          if (ran) return;
          KILN_CHECK(kernel == RmsNormBackward::kAuto,
                     "[rms_norm_backward] the row-group kernel cannot run rows of ", d,
                     packed ? " elements" : " unpackable elements");
        }
        const int n = packed ? kPack : 1;
        const int threads = threads_for(d / n, kRmsCacheBwd);
        const int64_t grid =
            std::min<int64_t>(rows, multiprocessor_count() * std::max(1, 2048 / threads));
        const Tensor partial = empty({grid, d}, TensorOptions(dtype_of<Acc>()).device(x.device()));
        Acc* pp = static_cast<Acc*>(partial.data_ptr());
        auto launch = [&]<int N>(std::integral_constant<int, N>) {
          rms_norm_bwd_loop_kernel<T, W, N><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
              pdx, pp, pdy, px, pw, pr, pres, rows, d);
          KILN_CUDA_LAUNCH_CHECK("rms_norm_bwd_loop_kernel");
        };
        if (packed) {
          launch(std::integral_constant<int, kPack>{});
        } else {
          launch(std::integral_constant<int, 1>{});
        }
        launch_column_sums<Acc, W>(pdw, pp, nullptr, nullptr, grid, d, stream);
      });
}

}  // namespace internal

namespace {

void rms_norm_cuda(OpCall& c) {
  internal::rms_norm_forward(c.input(0), c.input(1), c.attr<double>(0), c.outputs[0], c.outputs[1]);
}

void rms_norm_backward_cuda(OpCall& c) {
  const Tensor& x = c.input(1);
  const Tensor& rstd = c.input(3);
  internal::rms_norm_backward(
      c.input(0), x, c.input(2), rstd.is_cuda() ? rstd : rstd.to(x.device()), c.outputs[0],
      c.outputs[1], internal::RmsNormBackward::kAuto, c.inputs.size() > 4 ? c.input(4) : Tensor());
}

}  // namespace

KILN_REGISTER_KERNEL_IF(rms_norm, kCUDA, "fused", rms_norm_cuda, rms_norm_supported);
KILN_REGISTER_KERNEL(rms_norm_backward, kCUDA, rms_norm_backward_cuda);

}  // namespace kiln::cuda
