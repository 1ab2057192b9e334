// The library's portable flash-attention forward (kernels in flash_fwd_sm80.cuh): v3 at head size
// 64 with a positive scale (its softmax folds the scale into the exponent), v2 otherwise (8 warps
// at head size 64, 4 at 128). Measured in benchmarks/RESULTS.md (sessions 2-3); the other
// configurations are timed in the kernel lab.
#include "kernels/cuda/flash_fwd_sm80.cuh"

namespace kiln::cuda::flash {

void launch_fwd_sm80(const Params& p, const LaunchInfo& info) {
  visit_e(info.dtype, [&]<typename E>(TypeTag<E>) {
    visit_cap(p, [&]<bool kCap>(std::bool_constant<kCap>) {
      if (info.head_size == 64 && p.scale > 0) {
        launch_fwd_v3<E, kCap>(p, info.batch);
      } else if (info.head_size == 64) {
        launch_fwd_v2<E, 64, kCap, 8>(p, info.batch);
      } else {
        launch_fwd_v2<E, 128, kCap, kWarps>(p, info.batch);
      }
    });
  });
}

}  // namespace kiln::cuda::flash
