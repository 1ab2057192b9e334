// The library's Hopper flash-attention backward (kernels in flash_bwd_hopper.cuh), the fastest
// measured configuration per head size (benchmarks/RESULTS.md, sessions 7-9; the others are timed
// in the kernel lab):
//   - D 64: 1 warpgroup per 64 keys (3 CTAs per SM in 168 registers: warpgroups per SM decide);
//   - D 128: 2 warpgroups per 128 keys (1 CTA per SM), which splits dQ by columns (half the
//     atomics) and issues dP^T with S^T;
//   - D 256: the split kernel, its query heads split over CTAs where the grid is small
//     (bwd_head_split).
#include "kernels/cuda/flash_bwd_hopper.cuh"
#include "kernels/cuda/loops.cuh"
#include "tensor/ops.h"

namespace kiln::cuda::flash {
namespace {

// Parts over which the head-size-256 backward splits a kv head's rep query heads (Params::hsplit).
// With few kv heads (gemma-2b has 1) its `ctas` (batch, kv head, key block) CTAs are too few and
// too unequal (causal) to fill the GPU; split, they add dK and dV into f32 accumulators. The
// smallest divisor of rep that gives 3 CTAs per SM, else rep.
int bwd_head_split(int64_t rep, int64_t ctas) {
  for (int64_t n = 1; n < rep; ++n) {
    if (rep % n == 0 && ctas * n >= 3 * loops::multiprocessor_count()) return static_cast<int>(n);
  }
  return static_cast<int>(rep);
}

// The head-size-256 backward with its query heads split over `hsplit` CTAs per kv head (0:
// bwd_head_split's choice): dK and dV through f32 accumulators when split.
template <typename E>
void launch_split(const Params& base, const LaunchInfo& info, int hsplit) {
  Params p = base;
  const int64_t rep = p.h / p.hkv, nkv = info.batch * p.hkv * p.s * int64_t{256};
  p.hsplit = hsplit > 0 ? hsplit : bwd_head_split(rep, info.batch * p.hkv * ((p.s + 63) / 64));
  KILN_CHECK(rep % p.hsplit == 0, "[flash_attention_backward] internal: a head split of ", p.hsplit,
             " does not divide ", rep, " query heads per kv head");
  Tensor dkv_acc;
  if (p.hsplit > 1) {
    dkv_acc = empty({2 * nkv}, TensorOptions(kFloat).device(info.device));
    KILN_CUDA_CHECK(cudaMemsetAsync(dkv_acc.data_ptr(), 0, dkv_acc.nbytes(), current_stream()));
    p.dk_acc = static_cast<float*>(dkv_acc.data_ptr());
    p.dv_acc = p.dk_acc + nkv;
  }
  visit_cap(p, [&]<bool kCap>(std::bool_constant<kCap>) {
    launch_bwd_wgmma_split<E, kCap>(p, info.batch);
  });
  if (p.hsplit > 1) {
    store_rounded(p.dk, p.dk_acc, nkv, info.dtype);
    store_rounded(p.dv, p.dv_acc, nkv, info.dtype);
  }
}

}  // namespace

void launch_bwd_hopper(const Params& p, const LaunchInfo& info, int hsplit) {
  visit_e(info.dtype, [&]<typename E>(TypeTag<E>) {
    if (info.head_size == 256) {
      launch_split<E>(p, info, hsplit);
      return;
    }
    visit_cap(p, [&]<bool kCap>(std::bool_constant<kCap>) {
      if (info.head_size == 64) {
        launch_bwd_wgmma<E, 64, kCap, 1>(p, info.batch);
      } else {
        launch_bwd_wgmma<E, 128, kCap, 2>(p, info.batch);
      }
    });
  });
}

}  // namespace kiln::cuda::flash
