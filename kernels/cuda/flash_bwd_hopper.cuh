// The Hopper flash-attention backwards (warpgroup MMAs, sm_90a; internal to kernels/cuda/): the
// kernel templates and their launch configurations. flash_bwd_hopper.cu holds the library's
// choice; the kernel lab (benchmarks/lab/flash_attention_lab.cu) times the other configurations.
//
// Idea: the FlashAttention-2 backward of flash_bwd_sm80.cuh on warpgroup MMAs (wgmma.cuh). A CTA
// owns a block of keys of one (batch, kv head) and loops over (query head of the group, 64-row
// query block) steps, whose Q / dO tiles (128-byte-swizzled, cp.async) and lse / Delta are
// double-buffered (WgmmaBwdSteps), with one CTA barrier per step; it recomputes S^T = K Q^T and
// P^T = exp2(S^T scale log2(e) - lse), dP^T = V dO^T and dS^T = P^T (dP^T - Delta) (from P^T
// rounded to the dtype, the operand dV uses); dV += P^T dO and dK += dS^T Q stay in registers
// across the steps; dQ_part = dS K goes to the f32 dQ accumulator with float2 atomics (add_dq).
// Fused: scale, softcap's derivative, the masks, dK's scale.
// Invariants: flash_attention.cu has run the Delta pass (Delta = rowsum(dO * O) - dlse, dQ's
// accumulator zeroed) and rounds dQ afterwards; grid (B * H_kv [x head split], key blocks) with
// the key block in y, so that for causal every head's heaviest (first) key blocks are issued
// before any lighter one; query blocks wholly outside a key block's band are skipped. Launched only
// where the sm_90a code exists (the support rule); elsewhere the kernel bodies are traps.
//   - flash_bwd_kernel_wgmma (D 64 and 128): NWG warpgroups of 64 keys each. With one warpgroup,
//     dQ_part covers its 64 keys and every column; with two (after a CTA barrier on both dS^T
//     tiles), the CTA's 128 keys and column half wg: one atomic per dQ element and 128 keys.
//   - flash_bwd_kernel_wgmma_split (D 256): one warpgroup's dK and dV over 64 keys and 256 columns
//     would take 256 registers a thread, so a CTA of 2 warpgroups shares its 64 keys and splits the
//     work: S^T and dP^T by queries, then dK, dV and dQ by columns, through shared P^T and dS^T
//     tiles. With few kv heads the query heads of a kv head split over p.hsplit CTAs, which add dK
//     and dV into f32 accumulators (p.dk_acc, p.dv_acc) that the launcher rounds afterwards.
// A branch on the warpgroup index around a wgmma, which ptxas cannot prove uniform across the
// warpgroup, makes ptxas serialise every wgmma of the kernel (warning C7520): warpgroups whose keys
// are all hidden compute zero tiles instead of skipping them.
#pragma once

#include "kernels/cuda/flash_common.cuh"

namespace kiln::cuda::flash {

// The step pipeline of the wgmma backwards: step it (< nit = heads x nmb) is query head
// h0 + it / nmb and query block mb0 + it % nmb; its Q and dO tiles (128-byte-swizzled, cp.async)
// and the lse (log2 domain) and Delta of its BQ rows (in shared memory, filled by threads < BQ)
// are double-buffered, so that step it + 1's loads run while step it computes.
template <typename E, int D, int BQ, int NT>
struct WgmmaBwdSteps {
  static constexpr uint32_t kTile = BQ * D * 2;  // bytes of a Q or dO tile
  const Params& p;
  int b, h0, mb0, nmb, nit;
  uint32_t sq, sdo;      // 2 tiles each
  float *slse, *sdelta;  // 2 x BQ each

  __device__ int head(int it) const { return h0 + it / nmb; }
  __device__ int row0(int it) const { return (mb0 + it % nmb) * BQ; }
  __device__ void issue(int it, int buf) const {
    const int hh = head(it), m0 = row0(it);
    const E* q = static_cast<const E*>(p.q) + b * p.sq.b + hh * p.sq.h;
    const E* dout = static_cast<const E*>(p.dout) + b * p.sdo.b + hh * p.sdo.h;
    load_swizzled<E, D, BQ, NT>(sq + buf * kTile, q, p.sq.t, m0, p.t);
    load_swizzled<E, D, BQ, NT>(sdo + buf * kTile, dout, p.sdo.t, m0, p.t);
  }
  __device__ void fetch(int it, float& l2, float& dl) const {
    lse_delta_row(p, static_cast<int64_t>(b) * p.h + head(it),
                  row0(it) + static_cast<int>(threadIdx.x), l2, dl);
  }
  // Before the loop: step 0's loads.
  __device__ void start() const {
    if (nit > 0) {
      issue(0, 0);
      if (threadIdx.x < BQ) fetch(0, slse[threadIdx.x], sdelta[threadIdx.x]);
    }
    cp_async_commit();
  }
  // At the top of step it: its tiles visible to every thread (and every thread done with step
  // it - 1), step it + 1's loads issued and its lse / Delta fetched into nl, nd.
  __device__ void begin(int it, float& nl, float& nd) const {
    cp_async_wait<0>();
    internal::fence_proxy_async();
    __syncthreads();
    nl = nd = 0.0f;
    if (it + 1 < nit) {
      issue(it + 1, (it & 1) ^ 1);
      if (threadIdx.x < BQ) fetch(it + 1, nl, nd);
    }
    cp_async_commit();
  }
  // At the end of step it: step it + 1's lse / Delta into the other buffer.
  __device__ void end(int it, float nl, float nd) const {
    if (it + 1 < nit && threadIdx.x < BQ) {
      slse[((it & 1) ^ 1) * BQ + threadIdx.x] = nl;
      sdelta[((it & 1) ^ 1) * BQ + threadIdx.x] = nd;
    }
  }
};

// Per step and warpgroup (m64nNk16 steps, N = 64 or D):
//   - S^T = K Q^T (K and Q K-major from shared memory); P^T rounded to the dtype in registers (pa);
//   - dP^T = V dO^T and dV += P^T dO (P^T from registers, dO read N-major) issued together; once
//     dP^T has landed (dV may still run), dS^T with P^T widened from pa, so that S^T's f32
//     registers are free for dP^T's (with 2 warpgroups and no softcap, kEarlyDp issues dP^T with
//     S^T instead, so that it runs while P^T is computed);
//   - dK += dS^T Q issued, dS^T stored to the warpgroup's own swizzled [key][query] tile, and
//     dQ_part = dS K issued (dS read M-major, K N-major).
template <typename E, int D, bool kCap, int NWG>
__global__ void __launch_bounds__(128 * NWG, NWG == 2 ? 1 : (D == 128 ? 2 : 3))
    flash_bwd_kernel_wgmma(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kiln::cuda::internal;
  constexpr int NT = 128 * NWG, BK = 64 * NWG, BQ = 64;
  constexpr bool kEarlyDp = NWG == 2 && !kCap;  // room for S^T and dP^T in registers together
  // K, V, Q and dO tiles are D / 64 sub-tiles of 64 columns (load_swizzled), 128 bytes per row
  // and sub-tile; dS^T is one 64 x 64 tile per warpgroup.
  constexpr uint32_t kRow = 128, kTileK = BK * D * 2, kTileQ = BQ * D * 2, kTileDs = 64 * kRow;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sraw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sk = (sraw + 1023) & ~1023u, sv = sk + kTileK;
  const uint32_t sq = sv + kTileK, sdo = sq + 2 * kTileQ;  // 2 buffers each
  const uint32_t sds = sdo + 2 * kTileQ;                   // one per warpgroup
  float* slse = reinterpret_cast<float*>(smem_raw + (sds + NWG * kTileDs - sraw));  // 2 x BQ
  float* sdelta = slse + 2 * BQ;                                                    // 2 x BQ
  const int tid = threadIdx.x, wg = NWG == 1 ? 0 : tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int bk = blockIdx.x, n0 = blockIdx.y * BK, k0 = n0 + 64 * wg;  // first keys: CTA, warpgroup
  const float sl = p.scale * kLog2e;  // accumulator -> log2 domain (without softcap)
  const int b = bk / p.hkv, kvh = bk % p.hkv, rep = p.h / p.hkv;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  load_swizzled<E, D, BK, NT>(sk, k, p.sk.t, n0, p.s);
  load_swizzled<E, D, BK, NT>(sv, v, p.sv.t, n0, p.s);

  int mb0, mb1;
  query_blocks<BK, BQ>(p, n0, mb0, mb1);
  const int nmb = mb1 - mb0, nit = rep * nmb;
  const WgmmaBwdSteps<E, D, BQ, NT> steps{p, b, kvh * rep, mb0, nmb, nit, sq, sdo, slse, sdelta};
  steps.start();

  float dk[D / 2], dv[D / 2], st[BQ / 2], dpt[BQ / 2], dq[D / 2 / NWG];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < D / 2 / NWG; ++i) dq[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < BQ / 2; ++i) st[i] = dpt[i] = 0.0f;
  // This thread's keys (rows of S^T): k0 + 16 w + g and + 8.
  const int key[2] = {k0 + 16 * w + g, k0 + 16 * w + g + 8};
  const uint32_t kw = sk + wg * 64 * kRow, vw = sv + wg * 64 * kRow, dsw = sds + wg * kTileDs;

  for (int it = 0; it < nit; ++it) {
    const int buf = it & 1;
    float nl, nd;  // step it + 1's lse and Delta (threads < BQ)
    steps.begin(it, nl, nd);
    const int m0 = steps.row0(it);
    const int64_t bh = static_cast<int64_t>(b) * p.h + steps.head(it);
    const uint32_t qb = sq + buf * kTileQ, dob = sdo + buf * kTileQ;
    const float* lb = slse + buf * BQ;
    const float* db = sdelta + buf * BQ;
    // Whether no key of the 64 from kb0 is visible from any of these queries (uniform across the
    // warpgroup that owns them).
    const auto skipped = [&](int kb0) {
      return kb0 >= p.s || (p.causal && kb0 > m0 + BQ - 1) ||
             (p.window > 0 && kb0 + 63 < m0 - p.window + 1);
    };
    bool live[NWG];
#pragma unroll
    for (int j = 0; j < NWG; ++j) live[j] = !skipped(n0 + 64 * j);
    if (live[0] || live[NWG - 1]) {
      acc_fence(st);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {  // k step kk: sub-tile kk / 4, 32 bytes per step
        wgmma_ss<E, BQ, 0, 0>(st, smem_desc(kw + (kk >> 2) * BK * kRow + (kk & 3) * 32, 16, 1024),
                              smem_desc(qb + (kk >> 2) * BQ * kRow + (kk & 3) * 32, 16, 1024),
                              kk > 0);
      }
      wgmma_commit();
      // dP^T = V dO^T, issued before P^T is computed (kEarlyDp) or after it.
      const auto issue_dpt = [&] {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          wgmma_ss<E, BQ, 0, 0>(
              dpt, smem_desc(vw + (kk >> 2) * BK * kRow + (kk & 3) * 32, 16, 1024),
              smem_desc(dob + (kk >> 2) * BQ * kRow + (kk & 3) * 32, 16, 1024), kk > 0);
        }
        wgmma_commit();
      };
      if constexpr (kEarlyDp) {
        acc_fence(dpt);
        issue_dpt();
        wgmma_wait<1>();  // S^T
      } else {
        wgmma_wait<0>();
      }
      acc_fence(st);
      const bool mask = k0 + 64 > p.s || (p.causal && k0 + 63 > m0) ||
                        (p.window > 0 && k0 <= m0 + BQ - 1 - p.window);
      float dcap[kCap ? BQ / 2 : 1];
#pragma unroll
      for (int e = 0; e < BQ / 2; ++e) {
        const int il = 8 * (e >> 2) + 2 * t + (e & 1), j = key[(e >> 1) & 1];
        float pr;
        if constexpr (kCap) {
          pr = exp2f(score<kCap>(p, st[e], m0 + il, j, mask, dcap[e]) - lb[il]);
        } else {  // one FFMA and one ex2 (as the forward)
          pr = fast_exp2(fmaf(st[e], sl, -lb[il]));
          if (mask && !visible(p, m0 + il, j)) pr = 0.0f;
        }
        st[e] = pr;
      }
      // P^T, rounded to the dtype: dV's A operand, and (widened again) dS^T's factor.
      uint32_t pa[BQ / 16][4];
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
          pa[kk][i] = pack2<E>(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);
      }
      wgmma_fence();  // pa
      if constexpr (!kEarlyDp) {
        acc_fence(dpt);
        issue_dpt();
      }
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
        wgmma_rs<E, D, 1>(dv, pa[kk], smem_desc(dob + kk * 16 * kRow, BQ * kRow, 1024), true);
      }
      wgmma_commit();
      wgmma_wait<1>();  // dP^T (dV may still run: it only reads pa, as dS^T does)
      acc_fence(dpt);
      uint32_t da[BQ / 16][4];
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = 8 * kk + 2 * i, il = 8 * (e >> 2) + 2 * t;
          const float2 pr = unpack2<E>(pa[kk][i]);
          float ds0 = pr.x * (dpt[e] - db[il]), ds1 = pr.y * (dpt[e + 1] - db[il + 1]);
          if constexpr (kCap) {
            ds0 *= dcap[e];
            ds1 *= dcap[e + 1];
          }
          da[kk][i] = pack2<E>(ds0, ds1);
        }
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
        wgmma_rs<E, D, 1>(dk, da[kk], smem_desc(qb + kk * 16 * kRow, BQ * kRow, 1024), true);
      }
      wgmma_commit();
      // dS^T into this warpgroup's [key][query] tile: register da[kk][i] holds keys
      // 16 w + g + 8 (i & 1), queries 16 kk + 8 (i >> 1) + 2 t, + 1.
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = 16 * w + g + 8 * (i & 1), c = 16 * kk + 8 * (i >> 1) + 2 * t;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(dsw + swizzle_offset(r, c)), "r"(da[kk][i])
                       : "memory");
        }
      }
      fence_proxy_async();
    }
    // dQ_part = dS K over the CTA's keys. A hidden warpgroup's tile holds zeros (see above); a
    // step in which every key is hidden adds nothing (uniform across the CTA).
    if (live[0] || live[NWG - 1]) {
      if constexpr (NWG == 1) {
        asm volatile("bar.sync 1, 128;\n" ::: "memory");  // this warpgroup's dS^T
      } else {
        __syncthreads();  // both warpgroups' dS^T
      }
      constexpr int kCols = D / NWG;  // columns wg kCols .. + kCols - 1 of dQ
      const uint32_t kcol = sk + (wg * kCols / 64) * BK * kRow + (wg * kCols % 64) * 2;
      acc_fence(dq);
      wgmma_fence();
      // Every warpgroup's tile, with a fixed accumulate flag (no branch on the warpgroup index).
#pragma unroll
      for (int j = 0; j < NWG; ++j) {
#pragma unroll
        for (int kk = 0; kk < 64 / 16; ++kk) {
          wgmma_ss<E, kCols, 1, 1>(dq, smem_desc(sds + j * kTileDs + kk * 16 * kRow, kTileDs, 1024),
                                   smem_desc(kcol + (4 * j + kk) * 16 * kRow, BK * kRow, 1024),
                                   4 * j + kk > 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(dq);
      acc_fence(dk);
      acc_fence(dv);
      add_dq<D, kCols>(p, bh, m0 + 16 * w + g, wg * kCols + 2 * t,
                       [&](int dt, int c) { return dq[4 * dt + c]; });
    }
    steps.end(it, nl, nd);
  }

  store_dk_dv<E, D>(
      p, bk, key, t, [&](int dt, int c) { return dk[4 * dt + c]; },
      [&](int dt, int c) { return dv[4 * dt + c]; });
#else
  __trap();  // launched only where the sm_90a code exists (the support rule)
#endif
}

// Per (query head, 64-row query block) step, warpgroup wg
//   - computes S^T and dP^T for the 64 keys and its 32 queries 32 wg .. 32 wg + 31 (m64n32k16
//     steps, K / V and Q / dO K-major from shared memory, both issued before P^T is computed),
//     then P^T and dS^T, and stores both, rounded to the dtype, into two shared [key][query] tiles;
//   - after a CTA barrier, accumulates columns DW wg .. DW wg + DW - 1 (DW = D / 2) of dV += P^T dO
//     and dK += dS^T Q (P^T and dS^T K-major from shared memory, dO and Q N-major), and computes
//     the same columns of dQ_part = dS K (dS M-major, K N-major).
// Registers: dK and dV 64 each, dQ_part 64, S^T and dP^T 16 each. Shared memory: K, V (32 KiB
// each), 2 x (Q, dO) (128 KiB), the P^T and dS^T tiles (16 KiB): 1 CTA of 8 warps per SM.
template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(256, 1) flash_bwd_kernel_wgmma_split(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kiln::cuda::internal;
  constexpr int NT = 256, BK = 64, BQ = 64, QW = BQ / 2, DW = D / 2;
  constexpr uint32_t kRow = 128, kTileK = BK * D * 2, kTileQ = BQ * D * 2, kTileP = 64 * kRow;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sraw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t sk = (sraw + 1023) & ~1023u, sv = sk + kTileK;
  const uint32_t sq = sv + kTileK, sdo = sq + 2 * kTileQ;  // 2 buffers each
  const uint32_t sp = sdo + 2 * kTileQ, sds = sp + kTileP;
  float* slse = reinterpret_cast<float*>(smem_raw + (sds + kTileP - sraw));  // 2 x BQ
  float* sdelta = slse + 2 * BQ;                                             // 2 x BQ
  const int tid = threadIdx.x, wg = tid >> 7, w = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  // grid.x: (batch, kv head, part): part takes query heads part * rep .. + rep - 1 of the group.
  const int bk = blockIdx.x / p.hsplit, part = blockIdx.x % p.hsplit, n0 = blockIdx.y * BK;
  const float sl = p.scale * kLog2e;
  const int b = bk / p.hkv, kvh = bk % p.hkv, rep = p.h / p.hkv / p.hsplit;
  const int h0 = kvh * rep * p.hsplit + part * rep;  // first query head
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  load_swizzled<E, D, BK, NT>(sk, k, p.sk.t, n0, p.s);
  load_swizzled<E, D, BK, NT>(sv, v, p.sv.t, n0, p.s);

  int mb0, mb1;
  query_blocks<BK, BQ>(p, n0, mb0, mb1);
  const int nmb = mb1 - mb0, nit = rep * nmb;
  const WgmmaBwdSteps<E, D, BQ, NT> steps{p, b, h0, mb0, nmb, nit, sq, sdo, slse, sdelta};
  steps.start();

  float dk[DW / 2], dv[DW / 2];
#pragma unroll
  for (int i = 0; i < DW / 2; ++i) dk[i] = dv[i] = 0.0f;
  // This thread's keys (rows of S^T, local to the CTA): 16 w + g and + 8.
  const int kl[2] = {16 * w + g, 16 * w + g + 8};
  // Column offsets of this warpgroup's 32 queries in the Q / dO tiles, and of its DW columns
  // (DW / 64 sub-tiles) in the K, Q and dO tiles.
  const uint32_t qrow = wg * QW * kRow, kcol = wg * (DW / 64) * BK * kRow,
                 qcol = wg * (DW / 64) * BQ * kRow;

  for (int it = 0; it < nit; ++it) {
    const int buf = it & 1;
    float nl, nd;  // step it + 1's lse and Delta (threads < BQ)
    steps.begin(it, nl, nd);
    const int m0 = steps.row0(it);
    const int64_t bh = static_cast<int64_t>(b) * p.h + steps.head(it);
    const uint32_t qb = sq + buf * kTileQ, dob = sdo + buf * kTileQ;
    const float* lb = slse + buf * BQ;
    const float* db = sdelta + buf * BQ;
    // CTA-uniform: whether some key of the block is visible from some query of the step.
    const bool live = !(n0 >= p.s || (p.causal && n0 > m0 + BQ - 1) ||
                        (p.window > 0 && n0 + BK - 1 < m0 - p.window + 1));
    if (live) {
      // Declared per step (and zeroed), so that their registers are not held across steps.
      float st[QW / 2], dpt[QW / 2], dq[DW / 2];
#pragma unroll
      for (int i = 0; i < QW / 2; ++i) st[i] = dpt[i] = 0.0f;
      acc_fence(st);
      acc_fence(dpt);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {  // k step kk: sub-tile kk / 4, 32 bytes per step
        wgmma_ss<E, QW, 0, 0>(
            st, smem_desc(sk + (kk >> 2) * BK * kRow + (kk & 3) * 32, 16, 1024),
            smem_desc(qb + (kk >> 2) * BQ * kRow + qrow + (kk & 3) * 32, 16, 1024), kk > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        wgmma_ss<E, QW, 0, 0>(
            dpt, smem_desc(sv + (kk >> 2) * BK * kRow + (kk & 3) * 32, 16, 1024),
            smem_desc(dob + (kk >> 2) * BQ * kRow + qrow + (kk & 3) * 32, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // S^T
      acc_fence(st);
      const bool mask = n0 + BK > p.s || (p.causal && n0 + BK - 1 > m0) ||
                        (p.window > 0 && n0 <= m0 + BQ - 1 - p.window);
      float dcap[kCap ? QW / 2 : 1];
#pragma unroll
      for (int e = 0; e < QW / 2; ++e) {
        const int il = wg * QW + 8 * (e >> 2) + 2 * t + (e & 1), j = n0 + kl[(e >> 1) & 1];
        float pr;
        if constexpr (kCap) {
          pr = exp2f(score<kCap>(p, st[e], m0 + il, j, mask, dcap[e]) - lb[il]);
        } else {
          pr = fast_exp2(fmaf(st[e], sl, -lb[il]));
          if (mask && !visible(p, m0 + il, j)) pr = 0.0f;
        }
        st[e] = pr;
      }
      wgmma_wait<0>();  // dP^T
      acc_fence(dpt);
      // P^T and dS^T (rounded to the dtype; dS^T from the rounded P^T) into the shared
      // [key][query] tiles: elements e, e + 1 are key kl[(e >> 1) & 1], queries il, il + 1.
#pragma unroll
      for (int e = 0; e < QW / 2; e += 2) {
        const int il = wg * QW + 8 * (e >> 2) + 2 * t;
        const uint32_t pa = pack2<E>(st[e], st[e + 1]);
        const float2 pr = unpack2<E>(pa);
        float ds0 = pr.x * (dpt[e] - db[il]), ds1 = pr.y * (dpt[e + 1] - db[il + 1]);
        if constexpr (kCap) {
          ds0 *= dcap[e];
          ds1 *= dcap[e + 1];
        }
        const uint32_t off = swizzle_offset(kl[(e >> 1) & 1], il);
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sp + off), "r"(pa) : "memory");
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sds + off), "r"(pack2<E>(ds0, ds1))
                     : "memory");
      }
      fence_proxy_async();
      __syncthreads();  // both warpgroups' halves of P^T and dS^T
#pragma unroll
      for (int i = 0; i < DW / 2; ++i) dq[i] = 0.0f;
      acc_fence(dv);
      acc_fence(dk);
      acc_fence(dq);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {  // k16 steps over the queries
        wgmma_ss<E, DW, 0, 1>(dv, smem_desc(sp + kk * 32, 16, 1024),
                              smem_desc(dob + qcol + kk * 16 * kRow, BQ * kRow, 1024), true);
      }
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
        wgmma_ss<E, DW, 0, 1>(dk, smem_desc(sds + kk * 32, 16, 1024),
                              smem_desc(qb + qcol + kk * 16 * kRow, BQ * kRow, 1024), true);
      }
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {  // k16 steps over the keys
        wgmma_ss<E, DW, 1, 1>(dq, smem_desc(sds + kk * 16 * kRow, kTileP, 1024),
                              smem_desc(sk + kcol + kk * 16 * kRow, BK * kRow, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      acc_fence(dq);
      acc_fence(dk);
      acc_fence(dv);
      add_dq<D, DW>(p, bh, m0 + 16 * w + g, wg * DW + 2 * t,
                    [&](int dt, int c) { return dq[4 * dt + c]; });
    }
    steps.end(it, nl, nd);
  }

  const int64_t base = static_cast<int64_t>(bk) * p.s * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = n0 + kl[r];
    if (j < p.s) {
#pragma unroll
      for (int dt = 0; dt < DW / 8; ++dt) {
        const int64_t off = static_cast<int64_t>(j) * D + wg * DW + dt * 8 + 2 * t;
        const float2 kv =
            make_float2(dk[4 * dt + 2 * r] * p.scale, dk[4 * dt + 2 * r + 1] * p.scale);
        const float2 vv = make_float2(dv[4 * dt + 2 * r], dv[4 * dt + 2 * r + 1]);
        if (p.dk_acc != nullptr) {
          atomicAdd(reinterpret_cast<float2*>(p.dk_acc + base + off), kv);
          atomicAdd(reinterpret_cast<float2*>(p.dv_acc + base + off), vv);
        } else {
          *reinterpret_cast<uint32_t*>(static_cast<E*>(p.dk) + base + off) = pack2<E>(kv.x, kv.y);
          *reinterpret_cast<uint32_t*>(static_cast<E*>(p.dv) + base + off) = pack2<E>(vv.x, vv.y);
        }
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a code exists (the support rule)
#endif
}

// --- Launch configurations ---------------------------------------------------------------------

template <typename E, int D, bool kCap, int NWG>
void launch_bwd_wgmma(const Params& p, int64_t batch) {
  const dim3 grid(static_cast<unsigned>(batch * p.hkv),
                  static_cast<unsigned>((p.s + 64 * NWG - 1) / (64 * NWG)));
  // Alignment slack, K and V (64 NWG rows), 2 x (Q, dO) (64 rows), NWG x dS^T (64 x 64),
  // 2 x (lse, Delta).
  const size_t smem = 1024 + 2 * D * 64 * (2 * NWG + 4) + 128 * 64 * NWG + sizeof(float) * 4 * 64;
  launch(flash_bwd_kernel_wgmma<E, D, kCap, NWG>, grid, smem, p, "flash_bwd_kernel_wgmma",
         128 * NWG);
}

// The head-size-256 kernel with p.hsplit parts per kv head (p.dk_acc, p.dv_acc set when > 1).
template <typename E, bool kCap>
void launch_bwd_wgmma_split(const Params& p, int64_t batch) {
  constexpr int D = 256;
  const dim3 grid(static_cast<unsigned>(batch * p.hkv * p.hsplit),
                  static_cast<unsigned>((p.s + 63) / 64));
  // Alignment slack, K and V, 2 x (Q, dO), the P^T and dS^T tiles, 2 x (lse, Delta).
  const size_t smem = 1024 + 2 * D * 64 * 6 + 2 * 128 * 64 + sizeof(float) * 4 * 64;
  launch(flash_bwd_kernel_wgmma_split<E, D, kCap>, grid, smem, p, "flash_bwd_kernel_wgmma_split",
         256);
}

}  // namespace kiln::cuda::flash
