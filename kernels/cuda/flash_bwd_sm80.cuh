// The portable flash-attention backwards (mma.sync, sm_80+; internal to kernels/cuda/): the kernel
// templates and their launch configurations. flash_bwd_sm80.cu holds the library's choice; the
// kernel lab (benchmarks/lab/flash_attention_lab.cu) runs the other ones.
//
// Idea (FlashAttention-2): one CTA of 4 warps per (batch, kv head, 64-key block), looping over the
// query heads of the group and their 64-row query blocks. Each warp owns 16 keys and recomputes
// S^T = K Q^T and P^T = exp2(S^T - lse), dP^T = V dO^T and dS^T = P^T (dP^T - Delta); dV += P^T dO
// and dK += dS^T Q stay in registers across the steps (summed over the group: no atomics for dK,
// dV); dS goes through shared memory for dQ = dS K, which each warp (16 query rows) adds into the
// f32 dQ accumulator with atomics. Fused: scale, softcap's derivative, the masks, dK's scale.
// Invariants: flash_attention.cu has run the Delta pass (Delta = rowsum(dO * O) - dlse, dQ's
// accumulator zeroed) and rounds dQ afterwards; lse is the forward's (natural log, -inf for rows
// that see no key); query blocks entirely outside a key block's causal / window band are skipped.
// Head sizes 64 and 128.
//   - v1 (the library's kernel at head size 128, where v2's double buffers would take it past half
//     the SM's shared memory): grid (key blocks, B * H_kv), so B H_kv <= 65535; every step waits
//     for its own Q / dO loads; fragments by 32-bit shared loads.
//   - v2 (head size 64): grid (B * H_kv, key blocks) with the key block in y, so that for causal
//     the heaviest (first) key blocks of every head are issued before any lighter one; the
//     (query head, query block) steps are one flattened loop whose next Q / dO tiles (cp.async into
//     a second buffer) and lse / Delta (registers) are fetched while the current step computes;
//     fragments by ldmatrix; probabilities as one FFMA and one ex2 without softcap; dQ by float2
//     atomics (sm_90), half the atomic instructions.
#pragma once

#include "kernels/cuda/flash_common.cuh"

namespace kiln::cuda::flash {

// S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys and the step's 64 queries (k index: the
// head dimension), from the padded K, V, Q and dO tiles; fragments by ldmatrix with kLdsm, else
// by 32-bit shared loads.
template <typename E, int D, bool kLdsm>
__device__ __forceinline__ void st_dpt(float (&st)[8][4], float (&dpt)[8][4], const E* sk,
                                       const E* sv, const E* sq, const E* sdo, int lane) {
  constexpr int SD = D + 8;
  const int w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
  }
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t ka[4], va[4];
    if constexpr (kLdsm) {
      ldsm_a(ka, sk, SD, w * 16, kk * 16);
      ldsm_a(va, sv, SD, w * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t qf[4], df[4];
        ldsm_b2(qf, sq, SD, np * 16, kk * 16);
        ldsm_b2(df, sdo, SD, np * 16, kk * 16);
        mma<E>(st[2 * np], ka, qf[0], qf[1]);
        mma<E>(st[2 * np + 1], ka, qf[2], qf[3]);
        mma<E>(dpt[2 * np], va, df[0], df[1]);
        mma<E>(dpt[2 * np + 1], va, df[2], df[3]);
      }
    } else {
      load_a(ka, sk, SD, w * 16, kk * 16);
      load_a(va, sv, SD, w * 16, kk * 16);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const E* qr = sq + (nt * 8 + g) * SD + kk * 16 + 2 * t;
        const E* dr = sdo + (nt * 8 + g) * SD + kk * 16 + 2 * t;
        mma<E>(st[nt], ka, ld32(qr), ld32(qr + 8));
        mma<E>(dpt[nt], va, ld32(dr), ld32(dr + 8));
      }
    }
  }
}

// dV += P^T dO and dK += dS^T Q for this warp's 16 keys (k index: the step's 64 queries): P^T in
// st, dS^T in dpt (accumulator layout), dO and Q the step's padded [query][d] tiles.
template <typename E, int D>
__device__ __forceinline__ void add_dv_dk(float (&dv)[D / 8][4], float (&dk)[D / 8][4],
                                          const float (&st)[8][4], const float (&dpt)[8][4],
                                          const E* sdo, const E* sq, int lane) {
  constexpr int SD = D + 8;
#pragma unroll
  for (int kk = 0; kk < kBlockM / 16; ++kk) {
    uint32_t pa[4], da[4];
    c_to_a<E>(pa, st, kk);
    c_to_a<E>(da, dpt, kk);
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      const int off = (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8;
      uint32_t bf[4];
      ldsm_x4_trans(bf, sdo + off);
      mma<E>(dv[2 * dt], pa, bf[0], bf[1]);
      mma<E>(dv[2 * dt + 1], pa, bf[2], bf[3]);
      ldsm_x4_trans(bf, sq + off);
      mma<E>(dk[2 * dt], da, bf[0], bf[1]);
      mma<E>(dk[2 * dt + 1], da, bf[2], bf[3]);
    }
  }
}

// dQ (this warp's 16 query rows x D) = dS K: dS^T (dpt, this warp's 16 keys) is stored to the
// shared [query][key] tile sds (stride kBlockN + 8), then, after a CTA barrier, read back as A
// fragments (by ldmatrix with kLdsm, else 32-bit loads) against K's padded tile.
template <typename E, int D, bool kLdsm>
__device__ __forceinline__ void ds_times_k(float (&dq)[D / 8][4], const float (&dpt)[8][4], E* sds,
                                           const E* sk, int lane) {
  constexpr int SDS = kBlockN + 8;
  const int w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sds[(nt * 8 + 2 * t + (e & 1)) * SDS + w * 16 + g + 8 * (e >> 1)] = from_f32<E>(dpt[nt][e]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    uint32_t a[4];
    if constexpr (kLdsm) {
      ldsm_a(a, sds, SDS, w * 16, kk * 16);
    } else {
      load_a(a, sds, SDS, w * 16, kk * 16);
    }
    mma_rows<E, D>(dq, a, sk, kk, lane);
  }
}

template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(kThreads) flash_bwd_kernel(const Params p) {
  constexpr int SD = D + 8, SDS = kBlockN + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sk = reinterpret_cast<E*>(smem);
  E* sv = sk + kBlockN * SD;
  E* sq = sv + kBlockN * SD;
  E* sdo = sq + kBlockM * SD;
  E* sds = sdo + kBlockM * SD;  // dS [query][key]
  float* slse = reinterpret_cast<float*>(sds + kBlockM * SDS);
  float* sdelta = slse + kBlockM;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * kBlockN;
  const int bk = blockIdx.y, b = bk / p.hkv, kvh = bk % p.hkv, rep = p.h / p.hkv;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  load_tile<E, D, kBlockN>(sk, k, p.sk.t, n0, p.s);
  load_tile<E, D, kBlockN>(sv, v, p.sv.t, n0, p.s);
  cp_async_commit();

  int mb0, mb1;
  query_blocks<kBlockN, kBlockM>(p, n0, mb0, mb1);

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
  }
  const int key[2] = {n0 + w * 16 + g, n0 + w * 16 + g + 8};

  for (int hh = kvh * rep; hh < (kvh + 1) * rep; ++hh) {
    const int64_t bh = static_cast<int64_t>(b) * p.h + hh;
    const E* q = static_cast<const E*>(p.q) + b * p.sq.b + hh * p.sq.h;
    const E* dout = static_cast<const E*>(p.dout) + b * p.sdo.b + hh * p.sdo.h;
    for (int mb = mb0; mb < mb1; ++mb) {
      const int m0 = mb * kBlockM;
      load_tile<E, D, kBlockM>(sq, q, p.sq.t, m0, p.t);
      load_tile<E, D, kBlockM>(sdo, dout, p.sdo.t, m0, p.t);
      cp_async_commit();
      if (threadIdx.x < kBlockM) {
        lse_delta_row(p, bh, m0 + threadIdx.x, slse[threadIdx.x], sdelta[threadIdx.x]);
      }
      cp_async_wait<0>();
      __syncthreads();

      float st[8][4], dpt[8][4];
      st_dpt<E, D, false>(st, dpt, sk, sv, sq, sdo, lane);
      const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > m0) ||
                        (p.window > 0 && n0 <= m0 + kBlockM - 1 - p.window);
      // P^T into st, dS^T into dpt.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int il = nt * 8 + 2 * t + (e & 1);
          float dcap = 1.0f;
          const float x = score<kCap>(p, st[nt][e], m0 + il, key[e >> 1], mask, dcap);
          const float pr = exp2f(x - slse[il]);
          st[nt][e] = pr;
          float ds = pr * (dpt[nt][e] - sdelta[il]);
          if constexpr (kCap) ds *= dcap;
          dpt[nt][e] = ds;
        }
      }
      add_dv_dk<E, D>(dv, dk, st, dpt, sdo, sq, lane);
      float dq[D / 8][4];
      ds_times_k<E, D, false>(dq, dpt, sds, sk, lane);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + w * 16 + g + 8 * r;
        if (i < p.t) {
          float* dst = p.dq_acc + (bh * p.t + i) * D + 2 * t;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            atomicAdd(dst + dt * 8, dq[dt][2 * r] * p.scale);
            atomicAdd(dst + dt * 8 + 1, dq[dt][2 * r + 1] * p.scale);
          }
        }
      }
      __syncthreads();  // sq, sdo, sds are refilled by the next step
    }
  }
  cp_async_wait<0>();  // no query block at all: K and V were still in flight

  store_dk_dv<E, D>(
      p, bk, key, t, [&](int dt, int c) { return dk[dt][c]; },
      [&](int dt, int c) { return dv[dt][c]; });
}

template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(kThreads, 2) flash_bwd_kernel_v2(const Params p) {
  constexpr int SD = D + 8, SDS = kBlockN + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sk = reinterpret_cast<E*>(smem);
  E* sv = sk + kBlockN * SD;
  E* sq = sv + kBlockN * SD;                                    // 2 buffers
  E* sdo = sq + 2 * kBlockM * SD;                               // 2 buffers
  E* sds = sdo + 2 * kBlockM * SD;                              // dS [query][key]
  float* slse = reinterpret_cast<float*>(sds + kBlockM * SDS);  // 2 buffers
  float* sdelta = slse + 2 * kBlockM;                           // 2 buffers
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.y * kBlockN;
  const float sl = p.scale * kLog2e;  // accumulator -> log2 domain (without softcap)
  const int bk = blockIdx.x, b = bk / p.hkv, kvh = bk % p.hkv, rep = p.h / p.hkv;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;
  load_tile<E, D, kBlockN>(sk, k, p.sk.t, n0, p.s);
  load_tile<E, D, kBlockN>(sv, v, p.sv.t, n0, p.s);

  int mb0, mb1;
  query_blocks<kBlockN, kBlockM>(p, n0, mb0, mb1);
  const int nmb = mb1 - mb0, nit = rep * nmb;

  // Step it: query head kvh * rep + it / nmb, query block mb0 + it % nmb.
  auto issue = [&](int it, int buf) {
    const int hh = kvh * rep + it / nmb, m0 = (mb0 + it % nmb) * kBlockM;
    const E* q = static_cast<const E*>(p.q) + b * p.sq.b + hh * p.sq.h;
    const E* dout = static_cast<const E*>(p.dout) + b * p.sdo.b + hh * p.sdo.h;
    load_tile<E, D, kBlockM>(sq + buf * kBlockM * SD, q, p.sq.t, m0, p.t);
    load_tile<E, D, kBlockM>(sdo + buf * kBlockM * SD, dout, p.sdo.t, m0, p.t);
  };
  // lse (log2 domain) and Delta of row threadIdx.x (< kBlockM) of step it.
  auto fetch = [&](int it, float& l2, float& dl) {
    const int hh = kvh * rep + it / nmb;
    lse_delta_row(p, static_cast<int64_t>(b) * p.h + hh, (mb0 + it % nmb) * kBlockM + threadIdx.x,
                  l2, dl);
  };
  if (nit > 0) {
    issue(0, 0);
    if (threadIdx.x < kBlockM) fetch(0, slse[threadIdx.x], sdelta[threadIdx.x]);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.0f;
  }
  const int key[2] = {n0 + w * 16 + g, n0 + w * 16 + g + 8};

  for (int it = 0; it < nit; ++it) {
    const int buf = it & 1;
    const int hh = kvh * rep + it / nmb, m0 = (mb0 + it % nmb) * kBlockM;
    const int64_t bh = static_cast<int64_t>(b) * p.h + hh;
    // Prefetch step it + 1 into the other buffers (last read in step it - 1, before its final
    // barrier).
    float nl = 0.0f, nd = 0.0f;
    if (it + 1 < nit) {
      issue(it + 1, buf ^ 1);
      cp_async_commit();
      if (threadIdx.x < kBlockM) fetch(it + 1, nl, nd);
    }
    const E* qb = sq + buf * kBlockM * SD;
    const E* dob = sdo + buf * kBlockM * SD;
    const float* lb = slse + buf * kBlockM;
    const float* db = sdelta + buf * kBlockM;

    float st[8][4], dpt[8][4];
    st_dpt<E, D, true>(st, dpt, sk, sv, qb, dob, lane);
    const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > m0) ||
                      (p.window > 0 && n0 <= m0 + kBlockM - 1 - p.window);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int il = nt * 8 + 2 * t + (e & 1);
        float dcap = 1.0f, pr;
        if constexpr (kCap) {
          pr = exp2f(score<kCap>(p, st[nt][e], m0 + il, key[e >> 1], mask, dcap) - lb[il]);
        } else {  // one FFMA and one ex2 (as the forward v3)
          pr = fast_exp2(fmaf(st[nt][e], sl, -lb[il]));
          if (mask && !visible(p, m0 + il, key[e >> 1])) pr = 0.0f;
        }
        st[nt][e] = pr;
        float ds = pr * (dpt[nt][e] - db[il]);
        if constexpr (kCap) ds *= dcap;
        dpt[nt][e] = ds;
      }
    }
    add_dv_dk<E, D>(dv, dk, st, dpt, dob, qb, lane);
    float dq[D / 8][4];
    ds_times_k<E, D, true>(dq, dpt, sds, sk, lane);
    add_dq<D, D>(p, bh, m0 + w * 16 + g, 2 * t, [&](int dt, int c) { return dq[dt][c]; });
    if (it + 1 < nit && threadIdx.x < kBlockM) {
      slse[(buf ^ 1) * kBlockM + threadIdx.x] = nl;
      sdelta[(buf ^ 1) * kBlockM + threadIdx.x] = nd;
    }
    cp_async_wait<0>();
    __syncthreads();  // the next step's tiles are visible; sds and this step's buffers are free
  }

  store_dk_dv<E, D>(
      p, bk, key, t, [&](int dt, int c) { return dk[dt][c]; },
      [&](int dt, int c) { return dv[dt][c]; });
}

// --- Launch configurations ---------------------------------------------------------------------

template <typename E, int D, bool kCap>
void launch_bwd_v1(const Params& p, int64_t batch) {
  const dim3 grid(static_cast<unsigned>((p.s + kBlockN - 1) / kBlockN),
                  static_cast<unsigned>(batch * p.hkv));
  // K, V, Q, dO, dS, lse and Delta.
  const size_t smem =
      sizeof(E) * ((D + 8) * (2 * kBlockN + 2 * kBlockM) + kBlockM * (kBlockN + 8)) +
      sizeof(float) * 2 * kBlockM;
  launch(flash_bwd_kernel<E, D, kCap>, grid, smem, p, "flash_bwd_kernel");
}

template <typename E, bool kCap>
void launch_bwd_v2(const Params& p, int64_t batch) {
  constexpr int D = 64;
  const dim3 grid(static_cast<unsigned>(batch * p.hkv),
                  static_cast<unsigned>((p.s + kBlockN - 1) / kBlockN));
  // K, V, 2 x (Q, dO), dS, 2 x (lse, Delta).
  const size_t smem =
      sizeof(E) * ((D + 8) * (2 * kBlockN + 4 * kBlockM) + kBlockM * (kBlockN + 8)) +
      sizeof(float) * 4 * kBlockM;
  launch(flash_bwd_kernel_v2<E, D, kCap>, grid, smem, p, "flash_bwd_kernel_v2");
}

}  // namespace kiln::cuda::flash
