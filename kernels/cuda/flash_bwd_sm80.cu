// The library's portable flash-attention backward (kernels in flash_bwd_sm80.cuh): v2 at head
// size 64, v1 at 128 (v2's double buffers would take it past half the SM's shared memory).
// Measured in benchmarks/RESULTS.md (session 2 on); the kernel lab times v1 at head size 64.
#include "kernels/cuda/flash_bwd_sm80.cuh"

namespace kiln::cuda::flash {

void launch_bwd_sm80(const Params& p, const LaunchInfo& info) {
  visit_e(info.dtype, [&]<typename E>(TypeTag<E>) {
    visit_cap(p, [&]<bool kCap>(std::bool_constant<kCap>) {
      if (info.head_size == 64) {
        launch_bwd_v2<E, kCap>(p, info.batch);
      } else {
        launch_bwd_v1<E, 128, kCap>(p, info.batch);
      }
    });
  });
}

}  // namespace kiln::cuda::flash
