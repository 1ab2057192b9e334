// The library's Hopper flash-attention forward (kernel in flash_fwd_hopper.cuh), one configuration
// per head size (warpgroups x key-block size, "r": Q in registers), the fastest measured
// (benchmarks/RESULTS.md, sessions 7-9; the others are timed in the kernel lab):
//   - D 64: 2x64 (2 CTAs, so 4 warpgroups, per SM in 128 registers; Q in registers gains nothing
//     there);
//   - D 128: 3x64r (1 CTA of 3 warpgroups per SM in 168 registers, shared memory holding only K
//     and V in 3 stages);
//   - D 256: 2x32r (1 CTA per SM; O alone takes 128 registers a thread).
// The softcapped kernel at D 128 and 256 keeps Q in shared memory: with Q in registers it runs
// short of registers (ptxas serialises its wgmma or spills).
#include "kernels/cuda/flash_fwd_hopper.cuh"

namespace kiln::cuda::flash {
namespace {

template <typename E, int D, int NWG, int BN, bool QR>
void launch_config(const Params& p, int64_t batch) {
  if (p.softcap > 0) {
    launch_fwd_wgmma<E, D, true, NWG, BN, QR && D == 64>(p, batch);
  } else {
    launch_fwd_wgmma<E, D, false, NWG, BN, QR>(p, batch);
  }
}

}  // namespace

void launch_fwd_hopper(const Params& p, const LaunchInfo& info) {
  visit_e(info.dtype, [&]<typename E>(TypeTag<E>) {
    if (info.head_size == 64) {
      launch_config<E, 64, 2, 64, false>(p, info.batch);
    } else if (info.head_size == 128) {
      launch_config<E, 128, 3, 64, true>(p, info.batch);
    } else {
      launch_config<E, 256, 2, 32, true>(p, info.batch);
    }
  });
}

}  // namespace kiln::cuda::flash
