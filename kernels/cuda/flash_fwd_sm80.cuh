// The portable flash-attention forwards (mma.sync, sm_80+; internal to kernels/cuda/): the kernel
// templates and their launch configurations. flash_fwd_sm80.cu holds the library's choice; the
// kernel lab (benchmarks/lab/flash_attention_lab.cu) runs the other configurations.
//
// Idea: one CTA per (batch * head, query block), each warp owning 16 (v2) or 32 (v3) query rows
// whose Q fragments stay in registers; key blocks of 64, K and V double-buffered in padded shared
// memory through cp.async (the next block loads while this one computes); S = Q K^T, the online
// softmax and O += P V in registers, P going from the score accumulators straight into the next
// MMA's A operand (c_to_a). Fused: scale, softcap, the causal / window / key-range masks, the
// final O / l and lse. Never materialised: the T x S scores and probabilities.
// Invariants: grid (B * H, query blocks) with the query block index in y, reversed, so that the
// heaviest (latest, for causal) blocks of every head are issued before any lighter one; key blocks
// entirely outside the rows' causal / window band are skipped (per CTA, and per warp past its last
// row), and only blocks straddling a mask edge (the causal diagonal, the window's start, the end of
// the keys) evaluate visible(). Head sizes 64 and 128; query blocks at most 65535 (the support
// rule).
//   - v2: KW warps of 16 rows; K fragments by ldmatrix (4x fewer shared loads than 32-bit loads).
//     8 warps (128 rows) at D 64, so that each K / V tile serves twice the rows, capped at 128
//     registers for 2 CTAs per SM; 4 warps at D 128 (its registers allow no more). Any scale.
//   - v3 (D 64, scale > 0): 4 warps of 32 rows (two m16 tiles), so that every K / V fragment read
//     from shared memory feeds two MMAs (v2 is bound by those reads). Its softmax runs on raw
//     scores: the row maximum of the raw scores times scale log2(e) is the maximum of the scaled
//     ones when scale > 0, so each probability is one FFMA and one ex2. 255 registers, 2 CTAs per
//     SM.
#pragma once

#include "kernels/cuda/flash_common.cuh"

namespace kiln::cuda::flash {

// Scores of one m16 row tile (rows row[0], row[1]) against the 64 keys from n0, into the log2
// domain (masked where `mask`), then the online softmax: rows g (r = 0) and g + 8 (r = 1), each
// spread over the 4 lanes of a quad. Moves the running maxima mrow, rescales O and this lane's
// share of the row sums lrow (the quad's shares are added at the end), and leaves the
// probabilities in s.
template <int D, bool kCap>
__device__ __forceinline__ void softmax_block(const Params& p, float (&s)[8][4],
                                              const int (&row)[2], int n0, int t, bool mask,
                                              float (&mrow)[2], float (&lrow)[2],
                                              float (&o)[D / 8][4]) {
  float dcap = 0.0f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = score<kCap>(p, s[nt][e], row[e >> 1], n0 + nt * 8 + 2 * t + (e & 1), mask, dcap);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(mrow[r], mx);
    const float muse = mnew == -INFINITY ? 0.0f : mnew;  // a row with nothing visible yet
    const float alpha = exp2f(mrow[r] - muse);
    mrow[r] = mnew;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][2 * r] = exp2f(s[nt][2 * r] - muse);
      s[nt][2 * r + 1] = exp2f(s[nt][2 * r + 1] - muse);
      sum += s[nt][2 * r] + s[nt][2 * r + 1];
    }
    lrow[r] = lrow[r] * alpha + sum;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      o[dt][2 * r] *= alpha;
      o[dt][2 * r + 1] *= alpha;
    }
  }
}

// O += P V for one m16 row tile: P from the probabilities' accumulators s, V the 64-key block at
// vb (padded rows of D + 8), read by ldmatrix.trans.
template <typename E, int D>
__device__ __forceinline__ void add_pv(float (&o)[D / 8][4], const float (&s)[8][4], const E* vb,
                                       int lane) {
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    uint32_t a[4];
    c_to_a<E>(a, s, kk);
    mma_rows<E, D>(o, a, vb, kk, lane);
  }
}

// The shared-memory pipeline of the mma.sync forwards: a BM-row Q tile and two buffers each of
// 64-key K and V blocks (rows padded to D + 8), filled by the NT threads through cp.async.
template <typename E, int D, int BM, int NT>
struct PaddedTiles {
  static constexpr int SD = D + 8;
  E* sq;
  E* sk;  // 2 buffers
  E* sv;  // 2 buffers

  __device__ explicit PaddedTiles(unsigned char* smem)
      : sq(reinterpret_cast<E*>(smem)), sk(sq + BM * SD), sv(sk + 2 * kBlockN * SD) {}
  // Q's rows from m0 and key block nb0 (when there is one), landed and visible to the CTA.
  __device__ void start(const Params& p, const HeadRows<E>& x, int m0, int nb0, int nb1) const {
    load_tile<E, D, BM, NT>(sq, x.q, p.sq.t, m0, p.t);
    if (nb0 < nb1) {
      load_tile<E, D, kBlockN, NT>(sk, x.k, p.sk.t, nb0 * kBlockN, p.s);
      load_tile<E, D, kBlockN, NT>(sv, x.v, p.sv.t, nb0 * kBlockN, p.s);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  // At the top of key block nb: block nb + 1 issued into the other buffer, block nb landed and
  // visible to the CTA. Returns block nb's buffer.
  __device__ int next(const Params& p, const HeadRows<E>& x, int nb, int nb0, int nb1) const {
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile<E, D, kBlockN, NT>(sk + (buf ^ 1) * kBlockN * SD, x.k, p.sk.t, (nb + 1) * kBlockN,
                                   p.s);
      load_tile<E, D, kBlockN, NT>(sv + (buf ^ 1) * kBlockN * SD, x.v, p.sv.t, (nb + 1) * kBlockN,
                                   p.s);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    return buf;
  }
  __device__ const E* k_block(int buf) const { return sk + buf * kBlockN * SD; }
  __device__ const E* v_block(int buf) const { return sv + buf * kBlockN * SD; }
};

// CTAs per SM the forward v2 is compiled for (a register cap of 64K / (32 KW x this)): 8 warps at
// D 64 fit 2 CTAs in 128 registers; 4 warps at D 64 fit 3; D 128 needs ~176 and keeps 2.
template <int D, int KW>
constexpr int kFwdMinBlocks = KW == 8 ? (D == 64 ? 2 : 1) : (D == 64 ? 3 : 2);

template <typename E, int D, bool kCap, int KW>
__global__ void __launch_bounds__(KW * 32, kFwdMinBlocks<D, KW>)
    flash_fwd_kernel_v2(const Params p) {
  constexpr int SD = D + 8, BM = 16 * KW, NT = KW * 32;
  extern __shared__ __align__(16) unsigned char smem[];
  const PaddedTiles<E, D, BM, NT> tiles(smem);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int bh = blockIdx.x;
  const HeadRows<E> x = head_rows<E>(p, bh);
  const int m0 = mb * BM;
  int nb0, nb1;
  key_blocks<BM, kBlockN>(p, m0, nb0, nb1);
  tiles.start(p, x, m0, nb0, nb1);

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldsm_a(qf[kk], tiles.sq, SD, w * 16, kk * 16);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  const int row[2] = {m0 + w * 16 + g, m0 + w * 16 + g + 8};
  // The last row of this warp: key blocks entirely past it (causal) are skipped by the warp.
  const int wlast = m0 + w * 16 + 15;

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = tiles.next(p, x, nb, nb0, nb1);
    const E* kb = tiles.k_block(buf);
    const E* vb = tiles.v_block(buf);
    const int n0 = nb * kBlockN;
    // Warp-uniform: with 8 warps the first warps of the diagonal block see none of its keys.
    // (Windows: the block-level range already excludes blocks no row of the CTA sees; a warp
    // that sees none of a block's keys just computes zeros.)
    if (!(p.causal && n0 > wlast)) {
      float s[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bf[4];
          ldsm_b2(bf, kb, SD, np * 16, kk * 16);
          mma<E>(s[2 * np], qf[kk], bf[0], bf[1]);
          mma<E>(s[2 * np + 1], qf[kk], bf[2], bf[3]);
        }
      }
      const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > m0 + w * 16) ||
                        (p.window > 0 && n0 <= wlast - p.window);
      softmax_block<D, kCap>(p, s, row, n0, t, mask, mrow, lrow, o);
      add_pv<E, D>(o, s, vb, lane);
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  store_out_lse<E, D>(p, bh, row[0], t, mrow, lrow, [&](int dt, int c) { return o[dt][c]; });
}

template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(128, 2) flash_fwd_kernel_v3(const Params p) {
  constexpr int MI = 2, KW = 4, NT = KW * 32, BM = 16 * MI * KW, SD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const PaddedTiles<E, D, BM, NT> tiles(smem);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int bh = blockIdx.x;
  const HeadRows<E> x = head_rows<E>(p, bh);
  const int m0 = mb * BM, wfirst = m0 + w * 16 * MI, wlast = wfirst + 16 * MI - 1;
  int nb0, nb1;
  key_blocks<BM, kBlockN>(p, m0, nb0, nb1);
  tiles.start(p, x, m0, nb0, nb1);

  uint32_t qf[MI][D / 16][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      ldsm_a(qf[mi][kk], tiles.sq, SD, w * 16 * MI + mi * 16, kk * 16);
    }
  }

  float o[MI][D / 8][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mi][i][0] = o[mi][i][1] = o[mi][i][2] = o[mi][i][3] = 0.0f;
  }
  // Per row (2 per m16 tile): the running maximum in the exp2 domain and this thread's share of
  // the running sum (the quad's shares are added at the end).
  float mrow[MI][2], lrow[MI][2];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    mrow[mi][0] = mrow[mi][1] = -INFINITY;
    lrow[mi][0] = lrow[mi][1] = 0.0f;
  }
  // Factor from the accumulator to the exp2 domain (soft-capped scores are converted in place).
  const float sl = kCap ? 1.0f : p.scale * kLog2e;

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = tiles.next(p, x, nb, nb0, nb1);
    const E* kb = tiles.k_block(buf);
    const E* vb = tiles.v_block(buf);
    const int n0 = nb * kBlockN;
    if (!(p.causal && n0 > wlast)) {  // warp-uniform
      float s[MI][8][4];
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          s[mi][nt][0] = s[mi][nt][1] = s[mi][nt][2] = s[mi][nt][3] = 0;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int np = 0; np < 4; ++np) {
          uint32_t bf[4];
          ldsm_b2(bf, kb, SD, np * 16, kk * 16);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma<E>(s[mi][2 * np], qf[mi][kk], bf[0], bf[1]);
            mma<E>(s[mi][2 * np + 1], qf[mi][kk], bf[2], bf[3]);
          }
        }
      }
      const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > wfirst) ||
                        (p.window > 0 && n0 <= wlast - p.window);
      if (kCap || mask) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int i = wfirst + mi * 16 + g + 8 * (e >> 1), j = n0 + nt * 8 + 2 * t + (e & 1);
              float x = s[mi][nt][e];
              if constexpr (kCap) x = p.softcap * tanhf(x * p.scale / p.softcap) * kLog2e;
              if (mask && !visible(p, i, j)) x = -INFINITY;
              s[mi][nt][e] = x;
            }
          }
        }
      }
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            mx = fmaxf(mx, fmaxf(s[mi][nt][2 * r], s[mi][nt][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mnew = fmaxf(mrow[mi][r], mx * sl);
          const float muse = mnew == -INFINITY ? 0.0f : mnew;
          const float alpha = fast_exp2(mrow[mi][r] - muse);
          mrow[mi][r] = mnew;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            s[mi][nt][2 * r] = fast_exp2(fmaf(s[mi][nt][2 * r], sl, -muse));
            s[mi][nt][2 * r + 1] = fast_exp2(fmaf(s[mi][nt][2 * r + 1], sl, -muse));
            sum += s[mi][nt][2 * r] + s[mi][nt][2 * r + 1];
          }
          lrow[mi][r] = lrow[mi][r] * alpha + sum;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            o[mi][dt][2 * r] *= alpha;
            o[mi][dt][2 * r + 1] *= alpha;
          }
        }
      }
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[MI][4];
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) c_to_a<E>(a[mi], s[mi], kk);
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, vb + (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8);
#pragma unroll
          for (int mi = 0; mi < MI; ++mi) {
            mma<E>(o[mi][2 * dt], a[mi], bf[0], bf[1]);
            mma<E>(o[mi][2 * dt + 1], a[mi], bf[2], bf[3]);
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
    store_out_lse<E, D>(p, bh, wfirst + mi * 16 + g, t, mrow[mi], lrow[mi],
                        [&](int dt, int c) { return o[mi][dt][c]; });
  }
}

// --- Launch configurations ---------------------------------------------------------------------

template <typename E, int D, bool kCap, int KW>
void launch_fwd_v2(const Params& p, int64_t batch) {
  const dim3 grid(static_cast<unsigned>(batch * p.h),
                  static_cast<unsigned>((p.t + 16 * KW - 1) / (16 * KW)));
  const size_t smem = sizeof(E) * (D + 8) * (16 * KW + 4 * kBlockN);  // Q, 2 x (K, V)
  launch(flash_fwd_kernel_v2<E, D, kCap, KW>, grid, smem, p, "flash_fwd_kernel_v2", 32 * KW);
}

template <typename E, bool kCap>
void launch_fwd_v3(const Params& p, int64_t batch) {
  constexpr int D = 64;
  const dim3 grid(static_cast<unsigned>(batch * p.h), static_cast<unsigned>((p.t + 127) / 128));
  const size_t smem = sizeof(E) * (D + 8) * (128 + 4 * kBlockN);  // Q, 2 x (K, V)
  launch(flash_fwd_kernel_v3<E, D, kCap>, grid, smem, p, "flash_fwd_kernel_v3", 128);
}

}  // namespace kiln::cuda::flash
