// The CUDA kernels of softmax and log_softmax (CPU: kernels/cpu/softmax.cpp): which kernel of
// kernels/cuda/softmax.cuh runs a call, from the shape alone. The input is brought to a
// contiguous [A, R, K] block with the softmax dim in the middle:
//   - K == 1 and R <= 1024: one warp per row;
//   - K == 1, rows that fit in shared memory (32768 bf16 = 64 KiB; about 100000 16-bit elements
//     on Hopper): one block per row, the row read once into shared memory (one bulk copy on
//     sm_90), about 8 16-byte vectors per thread (128 to 512 threads);
//   - K == 1, longer rows: one block per row, two passes (online maximum and sum, then y);
//   - K > 1: one thread per column.
// The thread counts and the load path these won against live in the kernel lab
// (benchmarks/lab/softmax_lab.cu); measurements: benchmarks/RESULTS.md.
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/softmax.cuh"
#include "kernels/cuda/softmax.h"
#include "kernels/reduce_fn.h"
#include "tensor/registry.h"

namespace kiln::cuda {

namespace internal {
namespace {

template <bool kLog>
void softmax_launch(const Tensor& x_in, int64_t dim_in, const Tensor& out, SoftmaxRowLoad load,
                    const char* op) {
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const Tensor x = loops::as_dtype(x_in, out.dtype()).contiguous();
  const scalar::DimBlock b = scalar::dim_block(x, wrap_dim(dim_in, x.dim(), op));
  const int64_t A = b.A, R = b.R, K = b.K;
  const cudaStream_t stream = current_stream();
  visit_floating(out.dtype(), op, [&]<typename T>(TypeTag<T>) {
    const T* in = static_cast<const T*>(x.data_ptr());
    T* o = static_cast<T*>(out.data_ptr());
    if (K == 1 && R <= kSoftmaxWarpRowMax) {
      softmax_warp_kernel<T, kLog>
          <<<loops::grid_for(A, loops::kThreads / kSoftmaxWarp), loops::kThreads, 0, stream>>>(
              in, o, A, R);
      KILN_CUDA_LAUNCH_CHECK("softmax_warp_kernel");
    } else if (K == 1) {
      KILN_CHECK(A < (int64_t{1} << 31), "[", op, "] too many rows for the CUDA kernel: ", A);
      const auto blocks = static_cast<unsigned>(A);
      // Room for the row and the shift that aligns its vectorised body.
      const int64_t smem = ((R + kVec<T>)*static_cast<int64_t>(sizeof(T)) + 15) / 16 * 16;
      if (smem <= max_row_smem()) {
        prepare_smem_kernel<T, kLog>();
        softmax_smem_kernel<T, kLog><<<blocks, smem_row_threads(R / kVec<T>), smem, stream>>>(
            in, o, static_cast<int>(R), load == SoftmaxRowLoad::kBulk);
        KILN_CUDA_LAUNCH_CHECK("softmax_smem_kernel");
      } else {
        softmax_online_kernel<T, kLog><<<blocks, kMaxRowThreads, 0, stream>>>(in, o, R);
        KILN_CUDA_LAUNCH_CHECK("softmax_online_kernel");
      }
    } else {
      softmax_columns_kernel<T, kLog>
          <<<loops::grid_for(A * K), loops::kThreads, 0, stream>>>(in, o, A, R, K);
      KILN_CUDA_LAUNCH_CHECK("softmax_columns_kernel");
    }
  });
}

}  // namespace

void softmax_forward(const Tensor& x, int64_t dim, bool log, const Tensor& out,
                     SoftmaxRowLoad load) {
  if (log) {
    softmax_launch<true>(x, dim, out, load, "log_softmax");
  } else {
    softmax_launch<false>(x, dim, out, load, "softmax");
  }
}

}  // namespace internal

namespace {

template <bool kLog>
void softmax_cuda(OpCall& c) {
  internal::softmax_launch<kLog>(c.input(0), c.attr<int64_t>(0), c.outputs[0],
                                 internal::SoftmaxRowLoad::kBulk, c.name().c_str());
}

}  // namespace

KILN_REGISTER_KERNEL(softmax, kCUDA, softmax_cuda<false>);
KILN_REGISTER_KERNEL(log_softmax, kCUDA, softmax_cuda<true>);

}  // namespace kiln::cuda
