// The CUDA kernels of layer_norm and layer_norm_backward (tensor/ops/norm.cpp; reference:
// kernels/cpu/norm.cpp): which of the kernels of kernels/cuda/layer_norm.cuh runs a call, from
// the row length, the alignment of the rows and the dtype alone.
//
// f16, bf16 and f32 rows take the register kernels (a group of threads per row holding the row in
// registers): forward a warp per row under 2048 elements, else 128 threads per row, or 512 for
// rows too long for 128 x 16 packs; backward a warp under 2048 elements, else 256 threads per row
// taking two rows per iteration where a thread holds at most 2 packs, or 512 threads (one row)
// for rows too long for 256 x 4 packs. Rows whose length or pointers do not allow 16-byte packs
// take the same kernels with packs of one element. Rows too long for the register kernels, and
// f64, take the loop kernels. The variants these won against live in the kernel lab
// (benchmarks/lab/layer_norm_lab.cu); measurements: benchmarks/RESULTS.md.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/layer_norm.cuh"
#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::launch_column_sums;
using internal::launch_layer_norm_bwd;
using internal::launch_layer_norm_fwd;
using internal::packable;
using internal::visit_x_weight;

// Threads per row of the register kernels: a warp for rows under 2048 elements whose packs fit
// `max_p` per lane (several rows per block), then `long_rows` threads (forward 128, backward 256:
// the RMSNorm and LayerNorm measurements in benchmarks/RESULTS.md), then 512; 0: too long for the
// register kernels.
int threads_per_row(int64_t d, int64_t nvec, int max_p, int long_rows) {
  if (d < 2048 && nvec <= 32 * max_p) return 32;
  if (nvec <= static_cast<int64_t>(long_rows) * max_p) return long_rows;
  if (nvec <= 512 * max_p) return 512;
  return 0;
}

void layer_norm_cuda(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).defined() ? c.input(1).contiguous() : Tensor();
  const Tensor b = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor& y = c.outputs[0];
  const Tensor& mean = c.outputs[1];
  const Tensor& rstd = c.outputs[2];
  const int64_t rows = mean.numel();
  if (rows == 0) return;
  const int64_t d = x.numel() / rows;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  const ScalarType pt = w.defined() ? w.dtype() : b.defined() ? b.dtype() : x.dtype();
  visit_x_weight("layer_norm", x.dtype(), pt, [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const Acc eps = static_cast<Acc>(c.attr<double>(1));
    T* py = static_cast<T*>(y.data_ptr());
    Acc* pm = static_cast<Acc*>(mean.data_ptr());
    Acc* pr = static_cast<Acc*>(rstd.data_ptr());
    const T* px = static_cast<const T*>(x.data_ptr());
    const W* pw = w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr;
    const W* pb = b.defined() ? static_cast<const W*>(b.data_ptr()) : nullptr;
    if constexpr (!std::is_same_v<T, double>) {
      constexpr int kPack = 16 / sizeof(T);
      // A warp in 256-thread blocks, 128 and 512 threads alone in their blocks.
      auto run = [&]<int N>(std::integral_constant<int, N>) {
        switch (d == 0 ? 0 : threads_per_row(d, d / N, 16, 128)) {
          case 32:
            return launch_layer_norm_fwd<T, W, N, 32, 256>(py, pm, pr, px, pw, pb, rows, d, eps,
                                                           stream);
          case 128:
            return launch_layer_norm_fwd<T, W, N, 128, 128>(py, pm, pr, px, pw, pb, rows, d, eps,
                                                            stream);
          case 512:
            return launch_layer_norm_fwd<T, W, N, 512, 512>(py, pm, pr, px, pw, pb, rows, d, eps,
                                                            stream);
          default:
            return false;
        }
      };
      if (packable<T, W>(d, {px, py}, {pw, pb}) ? run(std::integral_constant<int, kPack>{})
                                                : run(std::integral_constant<int, 1>{})) {
        return;
      }
    }
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(rows, int64_t{1} << 20));
    internal::layer_norm_fwd_loop_kernel<T, W>
        <<<grid, 256, 0, stream>>>(py, pm, pr, px, pw, pb, rows, d, eps);
    KILN_CUDA_LAUNCH_CHECK("layer_norm_fwd_loop_kernel");
  });
}

void layer_norm_backward_cuda(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const Tensor w = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor mean = c.input(3).contiguous();
  const Tensor rstd = c.input(4).contiguous();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const Tensor& db = c.outputs[2];
  const int64_t d = dw.numel(), rows = rstd.numel();
  if (d == 0) return;
  DeviceGuard guard(x.device().index());
  const cudaStream_t stream = current_stream();
  if (rows == 0) {
    KILN_CUDA_CHECK(cudaMemsetAsync(dw.data_ptr(), 0, dw.nbytes(), stream));
    KILN_CUDA_CHECK(cudaMemsetAsync(db.data_ptr(), 0, db.nbytes(), stream));
    return;
  }
  visit_x_weight(
      "layer_norm", x.dtype(), dw.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
        using Acc = opmath_t<T>;
        T* pdx = static_cast<T*>(dx.data_ptr());
        W* pdw = static_cast<W*>(dw.data_ptr());
        W* pdb = static_cast<W*>(db.data_ptr());
        const T* pdy = static_cast<const T*>(dy.data_ptr());
        const T* px = static_cast<const T*>(x.data_ptr());
        const W* pw = w.defined() ? static_cast<const W*>(w.data_ptr()) : nullptr;
        const Acc* pm = static_cast<const Acc*>(mean.data_ptr());
        const Acc* pr = static_cast<const Acc*>(rstd.data_ptr());
        const Device dev = x.device();
        if constexpr (!std::is_same_v<T, double>) {
          constexpr int kPack = 16 / sizeof(T);
          // A warp in 256-thread blocks, one row per iteration; 256 threads, two rows (where a
          // thread holds at most 2 packs); 512 threads, one row.
          auto run = [&]<int N>(std::integral_constant<int, N>) {
            switch (threads_per_row(d, d / N, 4, 256)) {
              case 32:
                return launch_layer_norm_bwd<T, W, N, 32, 256, 1>(pdx, pdw, pdb, pdy, px, pw, pm,
                                                                  pr, rows, d, dev, stream);
              case 256:
                return launch_layer_norm_bwd<T, W, N, 256, 256, 2>(pdx, pdw, pdb, pdy, px, pw, pm,
                                                                   pr, rows, d, dev, stream);
              case 512:
                return launch_layer_norm_bwd<T, W, N, 512, 512, 1>(pdx, pdw, pdb, pdy, px, pw, pm,
                                                                   pr, rows, d, dev, stream);
              default:
                return false;
            }
          };
          if (packable<T, W>(d, {px, pdy, pdx}, {pw}) ? run(std::integral_constant<int, kPack>{})
                                                      : run(std::integral_constant<int, 1>{})) {
            return;
          }
        }
        const int64_t nb =
            std::min<int64_t>(rows, static_cast<int64_t>(loops::multiprocessor_count()) * 8);
        const Tensor part = empty({2, nb, d}, TensorOptions(dtype_of<Acc>()).device(dev));
        Acc* pp = static_cast<Acc*>(part.data_ptr());
        internal::layer_norm_bwd_loop_kernel<T, W><<<static_cast<unsigned>(nb), 256, 0, stream>>>(
            pdx, pp, pp + nb * d, pdy, px, pw, pm, pr, rows, d);
        KILN_CUDA_LAUNCH_CHECK("layer_norm_bwd_loop_kernel");
        launch_column_sums<Acc, W>(pdw, pp, pdb, pp + nb * d, nb, d, stream);
      });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(layer_norm, kCUDA, "fused", layer_norm_cuda, layer_norm_supported);
KILN_REGISTER_KERNEL(layer_norm_backward, kCUDA, layer_norm_backward_cuda);

}  // namespace kiln::cuda
