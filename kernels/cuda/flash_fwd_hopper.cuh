// The Hopper flash-attention forward (warpgroup MMAs, sm_90a; internal to kernels/cuda/): the
// kernel template and its launch configuration. flash_fwd_hopper.cu holds the library's
// configuration per head size; the kernel lab (benchmarks/lab/flash_attention_lab.cu) times the
// others.
//
// Idea: the two GEMMs of every key block run as warpgroup MMAs (wgmma.cuh), so that no MMA
// fragment is loaded from shared memory by the threads (the limit of the mma.sync kernels). A CTA
// is NWG warpgroups of 128 threads, each owning 64 query rows of a 64 NWG-row query block; K and V
// blocks of BN keys are double- or triple-buffered in shared memory through cp.async (every thread
// copies), in the 128-byte-swizzled layout wgmma reads directly: S = Q K^T is D / 16 m64nBNk16
// steps with K from shared memory and Q from shared memory or (QR, the "r" configurations) from
// registers, loaded once from global memory in wgmma's A fragment layout; O += P V takes P from the
// S accumulators in registers (their layout is wgmma's A fragment layout) and V from shared memory
// read N-major (transposed). The softmax runs on raw scores, the scale folded into one FFMA per
// probability before ex2 (which needs scale > 0); at D 128 and 256 the running maximum moves
// lazily (kStaleMax). Fused: scale, softcap, the masks, O / l and lse.
// Invariants: grid (B * H, query blocks) with the query block in y, reversed (heaviest causal
// blocks first); each warpgroup skips the key blocks entirely after its own last row and masks
// only blocks straddling a mask edge; head sizes 64, 128 and 256, scale > 0, query blocks at most
// 65535 (the support rule). Launched only where the sm_90a code exists (the support rule checks
// the build and a compute-capability-9 device); elsewhere the kernel body is a trap.
// What matters for speed is warpgroups per SM (while one computes its softmax, the tensor cores
// run another's MMAs), then the K / V bytes loaded per query row, then the barriers: with several
// warpgroups per CTA at D 128 and 256, 3 K / V stages leave one CTA barrier per key block
// (wgmma_fwd_stages). Measurements of every configuration: benchmarks/RESULTS.md, sessions 7-9.
#pragma once

#include "kernels/cuda/flash_common.cuh"

namespace kiln::cuda::flash {

// How far (log2 domain) a block's maximum score may exceed the running maximum before the
// running maximum moves: probabilities stay at most 2^8.
constexpr float kStaleMax = 8.0f;

// CTAs per SM the forward is compiled for (its register cap: 64K / (128 NWG x this)).
template <int D, int NWG, int BN, bool QR>
constexpr int wgmma_fwd_min_blocks() {
  if (D == 256) return NWG == 1 && BN == 32 ? 2 : 1;  // by shared memory (1x32: 96 KiB)
  if (D == 128 && NWG > 1) return 1;
  if (D == 128) return BN == 32 ? 4 : QR ? 3 : 2;  // 1x64 with Q: held to 2 by shared memory
  if (BN == 128) return 1;
  return NWG == 1 ? 4 : NWG == 2 ? 2 : 1;  // 16 warps per SM in 128 registers
}

// K / V stages in shared memory: 3 where several warpgroups share a CTA at D 128 and 256, so that
// one CTA barrier per key block suffices (the buffer refilled at block n was last read at block
// n - 1, before that block's barrier), and the warpgroups may drift up to a block apart; 2
// otherwise (a second barrier per block guards the refill).
template <int D, int NWG>
constexpr int wgmma_fwd_stages() {
  return NWG > 1 && D >= 128 ? 3 : 2;
}

template <typename E, int D, bool kCap, int NWG, int BN, bool QR>
__global__ void __launch_bounds__(128 * NWG, wgmma_fwd_min_blocks<D, NWG, BN, QR>())
    flash_fwd_kernel_wgmma(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kiln::cuda::internal;
  constexpr int NT = 128 * NWG, BM = 64 * NWG;
  // Tiles of 64-column sub-tiles (load_swizzled): 128 bytes per row and sub-tile.
  constexpr uint32_t kRowBytes = 128, kTileQ = QR ? 0 : BM * D * 2, kTileKV = BN * D * 2;
  extern __shared__ unsigned char smem_raw[];
  // wgmma's swizzle repeats every 1024 bytes: tiles start on a 1024-byte boundary.
  const uint32_t sraw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  constexpr int kStages = wgmma_fwd_stages<D, NWG>();
  const uint32_t sq = (sraw + 1023) & ~1023u, sk = sq + kTileQ, sv = sk + kStages * kTileKV;
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int bh = blockIdx.x;
  const HeadRows<E> x = head_rows<E>(p, bh);
  const E *q = x.q, *k = x.k, *v = x.v;
  const int m0 = mb * BM, wfirst = m0 + 64 * wg, wlast = wfirst + 63;

  int nb0, nb1;
  key_blocks<BM, BN>(p, m0, nb0, nb1);

  if constexpr (!QR) load_swizzled<E, D, BM, NT>(sq, q, p.sq.t, m0, p.t);
  if (nb0 < nb1) {
    load_swizzled<E, D, BN, NT>(sk, k, p.sk.t, nb0 * BN, p.s);
    load_swizzled<E, D, BN, NT>(sv, v, p.sv.t, nb0 * BN, p.s);
  }
  cp_async_commit();
  if constexpr (kStages == 3) {  // block nb0 + 1 into stage 1 (a group of its own, maybe empty)
    if (nb0 + 1 < nb1) {
      load_swizzled<E, D, BN, NT>(sk + kTileKV, k, p.sk.t, (nb0 + 1) * BN, p.s);
      load_swizzled<E, D, BN, NT>(sv + kTileKV, v, p.sv.t, (nb0 + 1) * BN, p.s);
    }
    cp_async_commit();
  }
  int stage = 0;  // of block nb (3 stages)

  float o[D / 2], s[BN / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) s[i] = 0.0f;
  // Rows g and g + 8 of this warp's 16: the running maximum (exp2 domain) and this thread's
  // share of the running sum (the quad's shares are added at the end).
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  const float sl = kCap ? 1.0f : p.scale * kLog2e;
  constexpr bool kLazy = D >= 128;
  const uint32_t sq_wg = sq + wg * 64 * kRowBytes;
  // QR: this thread's Q fragments (the A operand of S = Q K^T, k16 step kk) straight from global
  // memory into registers: rows 16 w + g (+ 8), columns 16 kk + 2 t (+ 8), + 1; zero past the end.
  uint32_t qa[QR ? D / 16 : 1][4];
  if constexpr (QR) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = wfirst + 16 * w + g + 8 * r;
      const E* qrow = q + static_cast<int64_t>(i) * p.sq.t + 2 * t;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          qa[kk][r + 2 * c] =
              i < p.t ? __ldg(reinterpret_cast<const unsigned int*>(qrow + 16 * kk + 8 * c)) : 0u;
        }
      }
    }
  }

  for (int nb = nb0; nb < nb1; ++nb) {
    int buf;
    if constexpr (kStages == 3) {
      // One group per block: the most recent is block nb + 1's, so waiting for all but one
      // leaves block nb's landed.
      buf = stage;
      cp_async_wait<1>();
      fence_proxy_async();
      __syncthreads();  // block nb visible; every warpgroup is done with block nb - 1's stage
      const int refill = stage == 0 ? 2 : stage - 1;
      if (nb + 2 < nb1) {
        load_swizzled<E, D, BN, NT>(sk + refill * kTileKV, k, p.sk.t, (nb + 2) * BN, p.s);
        load_swizzled<E, D, BN, NT>(sv + refill * kTileKV, v, p.sv.t, (nb + 2) * BN, p.s);
      }
      cp_async_commit();
      stage = stage == 2 ? 0 : stage + 1;
    } else {
      buf = (nb - nb0) & 1;
      if (nb + 1 < nb1) {
        load_swizzled<E, D, BN, NT>(sk + (buf ^ 1) * kTileKV, k, p.sk.t, (nb + 1) * BN, p.s);
        load_swizzled<E, D, BN, NT>(sv + (buf ^ 1) * kTileKV, v, p.sv.t, (nb + 1) * BN, p.s);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      fence_proxy_async();  // this thread's cp.async writes, before wgmma (async proxy) reads them
      __syncthreads();
    }
    const uint32_t kb = sk + buf * kTileKV, vb = sv + buf * kTileKV;
    const int n0 = nb * BN;
    if (!(p.causal && n0 > wlast)) {  // warpgroup-uniform
      acc_fence(s);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {  // k step kk: sub-tile kk / 4, 32 bytes per step
        const uint64_t kd = smem_desc(kb + (kk >> 2) * BN * kRowBytes + (kk & 3) * 32, 16, 1024);
        if constexpr (QR) {
          wgmma_rs<E, BN, 0>(s, qa[kk], kd, kk > 0);
        } else {
          wgmma_ss<E, BN, 0, 0>(
              s, smem_desc(sq_wg + (kk >> 2) * BM * kRowBytes + (kk & 3) * 32, 16, 1024), kd,
              kk > 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(s);
      const bool mask = n0 + BN > p.s || (p.causal && n0 + BN - 1 > wfirst) ||
                        (p.window > 0 && n0 <= wlast - p.window);
      if (kCap || mask) {
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) {
          const int i = wfirst + 16 * w + g + 8 * ((e >> 1) & 1);
          const int j = n0 + 8 * (e >> 2) + 2 * t + (e & 1);
          float x = s[e];
          if constexpr (kCap) x = p.softcap * tanhf(x * p.scale / p.softcap) * kLog2e;
          if (mask && !visible(p, i, j)) x = -INFINITY;
          s[e] = x;
        }
      }
      // At D 128 and 256 (kLazy) the running maximum only moves when a block's maximum exceeds it
      // by more than kStaleMax (log2 domain): the probabilities stay below 2^kStaleMax, exact in
      // f32 and as precise in the dtype, and O's D / 2 rescaling multiplies are skipped for the
      // warp unless one of its rows moved (a row's first visible block always moves it). At D 64
      // the vote cost more than the multiplies it saved: the maximum moves every block.
      float alpha[2];
      bool moved = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
          mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        alpha[r] = 1.0f;
        // (False while both are -inf: nothing visible yet.)
        if (!kLazy || mx * sl > mrow[r] + kStaleMax) {
          const float mnew = fmaxf(mrow[r], mx * sl);
          alpha[r] = fast_exp2(mrow[r] - (mnew == -INFINITY ? 0.0f : mnew));  // 0 from -inf
          mrow[r] = mnew;
          moved = true;
        }
        const float muse = mrow[r] == -INFINITY ? 0.0f : mrow[r];
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
          s[4 * nt + 2 * r] = fast_exp2(fmaf(s[4 * nt + 2 * r], sl, -muse));
          s[4 * nt + 2 * r + 1] = fast_exp2(fmaf(s[4 * nt + 2 * r + 1], sl, -muse));
          sum += s[4 * nt + 2 * r] + s[4 * nt + 2 * r + 1];
        }
        lrow[r] = lrow[r] * alpha[r] + sum;
      }
      if (!kLazy || __any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            o[4 * dt + 2 * r] *= alpha[r];
            o[4 * dt + 2 * r + 1] *= alpha[r];
          }
        }
      }
      uint32_t a[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        a[kk][0] = pack2<E>(s[8 * kk + 0], s[8 * kk + 1]);
        a[kk][1] = pack2<E>(s[8 * kk + 2], s[8 * kk + 3]);
        a[kk][2] = pack2<E>(s[8 * kk + 4], s[8 * kk + 5]);
        a[kk][3] = pack2<E>(s[8 * kk + 6], s[8 * kk + 7]);
      }
      acc_fence(o);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        // V read N-major: 16 key rows per step; LBO steps to the next 64 columns (sub-tile).
        wgmma_rs<E, D, 1>(o, a[kk], smem_desc(vb + kk * 16 * kRowBytes, BN * kRowBytes, 1024),
                          true);
      }
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(o);
    }
    // Every warpgroup is done with this buffer before it is refilled (3 stages: the next
    // block's barrier orders that).
    if constexpr (kStages == 2) __syncthreads();
  }

  store_out_lse<E, D>(p, bh, wfirst + 16 * w + g, t, mrow, lrow,
                      [&](int dt, int c) { return o[4 * dt + c]; });
#else
  __trap();  // launched only where the sm_90a code exists (the support rule)
#endif
}

// The forward in configuration NWG x BN (QR: Q in registers).
template <typename E, int D, bool kCap, int NWG, int BN, bool QR>
void launch_fwd_wgmma(const Params& p, int64_t batch) {
  const dim3 grid(static_cast<unsigned>(batch * p.h),
                  static_cast<unsigned>((p.t + 64 * NWG - 1) / (64 * NWG)));
  // Alignment slack, Q (unless in registers), 2 or 3 x (K, V).
  const size_t smem = 1024 + 2 * D * ((QR ? 0 : 64 * NWG) + 2 * wgmma_fwd_stages<D, NWG>() * BN);
  launch(flash_fwd_kernel_wgmma<E, D, kCap, NWG, BN, QR>, grid, smem, p, "flash_fwd_kernel_wgmma",
         128 * NWG);
}

}  // namespace kiln::cuda::flash
