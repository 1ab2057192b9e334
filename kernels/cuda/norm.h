// The rms_norm CUDA kernels (kernels/cuda/norm.cu) behind launchers that take the kernel as an
// explicit choice. The op passes kAuto: the kernel for the row length and alignment. The tests
// pass each kernel on rows that kAuto sends elsewhere (the loop kernels on short packed rows, the
// warp kernel on rows of 2048 and more); the kernel lab times them side by side.
//
//   const Tensor y = empty_like(x), rstd = empty({rows}, TensorOptions(kFloat).device(x.device()));
//   kiln::cuda::internal::rms_norm_forward(x, w, 1e-6, y, rstd, RmsNormForward::kLoop);
//
// Includes no CUDA header. Internal to kiln.
#pragma once

#include "tensor/tensor.h"

namespace kiln::cuda::internal {

// The forward kernels (kernels/cuda/norm.cuh): one warp per row (16-byte-packable rows of at most
// 32 x 16 packs), a group of 128 threads per row (packable rows of at most 128 x 16 packs), the
// loop kernel (any row). kAuto: a warp under 2048 elements, a group from 2048, the loop kernel
// for longer or unpackable rows.
enum class RmsNormForward { kAuto, kWarp, kGroup, kLoop };

// The backward kernels: row groups holding the weight and the dweight sums in registers
// (packable rows of at most 4 packs per thread: 256 threads per row over 2048 elements, else 128
// threads two rows at a time), the loop kernel (any row). kAuto: the row groups where they fit.
enum class RmsNormBackward { kAuto, kRows, kLoop };

// rms_norm of x [rows, d] (any leading shape; d = w.numel()) with weight w into y (x's shape and
// dtype) and rstd (rows elements of x's opmath dtype), all on one GPU; y and rstd contiguous.
// A kernel that cannot run the call is an error.
void rms_norm_forward(const Tensor& x, const Tensor& w, double eps, const Tensor& y,
                      const Tensor& rstd, RmsNormForward kernel = RmsNormForward::kAuto);

// The gradients dx (x's shape and dtype) and dw (w's) of rms_norm from dy, x, w and the forward's
// rstd, on one GPU; dx and dw contiguous. A defined `residual` (x's shape and dtype) is added to
// dx before its rounding.
void rms_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd,
                       const Tensor& dx, const Tensor& dw,
                       RmsNormBackward kernel = RmsNormBackward::kAuto,
                       const Tensor& residual = Tensor());

}  // namespace kiln::cuda::internal
