// What the flash-attention CUDA kernels share (internal to kernels/cuda/): their parameters, the
// masks and block ranges, the epilogues, the tile loaders and the mma.sync fragment helpers, and
// the host interface between the op and the kernel families.
//
// Files: flash_attention.cu (the op's kernels: operands, Params, the backward's Delta pass and dQ
// conversion, the support rules, registration); the portable mma.sync kernels (sm_80+)
// flash_fwd_sm80.cuh / .cu and flash_bwd_sm80.cuh / .cu; the Hopper wgmma kernels (sm_90a)
// flash_fwd_hopper.cuh / .cu and flash_bwd_hopper.cuh / .cu. The .cuh files hold the kernel
// templates and their launch configurations, the .cu files the library's choice among them; the
// kernel lab (benchmarks/lab/flash_attention_lab.cu) launches the other configurations through the
// same headers and run_forward / run_backward.
//
// Every kernel computes, per (batch, query head h) and query row i, with kv head h / (H / H_kv):
// s_ij = scale q_i . k_j, capped to softcap tanh(s_ij / softcap) when softcap > 0, masked where key
// j is not visible (j >= S, causal j > i, window j <= i - window); out_i = softmax_j(s_ij) v_j and
// lse_i = log sum_j exp s_ij (tensor/ops/attention.cpp; the reference is
// kernels/cpu/flash_attention.cpp). The T x S scores never leave registers and shared memory.
// Invariants every kernel relies on (flash_attention.cu establishes them): q, k, v (and dout) are
// bf16 or f16 with a contiguous last dim and 16-byte rows; out, lse and dq, dk, dv are contiguous;
// the support rule has accepted the call (head size, lengths, grid limits). Accumulation and the
// softmax are f32, in the exp2 domain (scores times log2 e); a row that sees no key gets out 0 and
// lse -inf.
//
// The mma.sync kernels use mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}. With
// lane = 4 g + t (g = lane / 4 in 0..7, t = lane % 4), each register holding two 16-bit elements,
// the lower-indexed one in the low half, the fragments are (PTX ISA, "Matrix fragments for
// mma.m16n8k16"):
//   A 16x16 (row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..],
//                        a3 = A[g+8][2t+8..]
//   B 16x8  ("col"):     b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C 16x8  (f32):       c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
// Consequences used by the kernels:
//   - B = K^T for S = Q K^T is K stored [key][d] with b0 = K[n0 + g][k0 + 2t..]: one 32-bit shared
//     load per register; A = Q likewise.
//   - The C fragments of two adjacent n8 tiles (columns 16 kk .. 16 kk + 15), packed to 16 bits,
//     are exactly the A fragment of those 16 columns (c_to_a): P (or dS) goes from the score
//     accumulators to the next MMA's A operand without shared memory. wgmma's accumulators have
//     the same layout per warp (wgmma.cuh), so the epilogues below serve both families.
//   - B operands whose k index runs along the rows of a row-major tile (V for P V, dO and Q in the
//     backward) come from ldmatrix.x4.trans: lane l addresses row (l & 15), column block
//     (l >> 4) * 8 of a 16x16 sub-tile; matrix i (rows 8 (i & 1) .., columns 8 (i >> 1) ..)
//     arrives transposed, so thread (g, t) gets rows 2t, 2t+1 of column g: registers 0, 1 are b0,
//     b1 of the first n8 tile, registers 2, 3 of the second.
// Shared-memory rows of the mma.sync kernels are padded by 8 elements (16 bytes): with a row
// stride of D + 8 elements the 8 rows x 4 words of a fragment load, and the 8 rows of an ldmatrix,
// hit distinct banks. The wgmma kernels use 128-byte-swizzled tiles instead (load_swizzled).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/wgmma.cuh"
#include "tensor/registry.h"

namespace kiln::cuda::flash {

constexpr int kWarps = 4;  // warps of the mma.sync kernels with 16 rows a warp
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 16 * kWarps;  // query rows per CTA (forward v1) / per step (backward)
constexpr int kBlockN = 64;           // keys per step (forward) / per CTA (backward)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Strides {
  int64_t b, h, t;  // elements; the last dim is contiguous
};

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;    // backward
  void* out;           // forward: out [B, H, T, D], strides `so` (the last dim contiguous)
  float* lse;          // [B, H, T]
  const float* delta;  // backward: rowsum(dO * O) - dlse
  float* dq_acc;       // backward: f32 [B, H, T, D]
  void* dk;            // backward: [B, H_kv, S, D] contiguous
  void* dv;
  // Backward at head size 256: the query heads of a kv head are split over `hsplit` CTAs, which
  // then add their dK and dV into these f32 [B, H_kv, S, D] accumulators (null when hsplit is 1).
  float* dk_acc;
  float* dv_acc;
  int hsplit;
  Strides sq, sk, sv, sdo, so;
  int h, hkv, t, s;
  float scale, softcap;
  bool causal;  // a window implies causal
  int window;
};

// --- Element conversions ---------------------------------------------------------------------

template <typename E>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}

// The two 16-bit elements of a pack2 word, widened (low half first). bf16 by a shift and a mask
// of the word (__bfloat1622float2 emits a cvt per element instead).
template <typename E>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
}

template <typename E>
__device__ __forceinline__ float to_f32(E x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <typename E>
__device__ __forceinline__ E from_f32(float x) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

// exp2 on the special-function unit, subnormal results flushed to zero (exp2f adds a range
// fix-up around the same instruction; the probabilities here are in [0, 1] and a subnormal one is
// below bf16's resolution of the sum anyway).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// --- mma.sync fragments (the sm80 kernels) -----------------------------------------------------

// c += a b for one m16n8k16 tile (fragment layouts in the header comment).
template <typename E>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if constexpr (std::is_same_v<E, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// The A fragment of k16 step kk from the C fragments of n8 tiles 2 kk and 2 kk + 1, rounded to E.
template <typename E>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[8][4], int kk) {
  a[0] = pack2<E>(c[2 * kk][0], c[2 * kk][1]);
  a[1] = pack2<E>(c[2 * kk][2], c[2 * kk][3]);
  a[2] = pack2<E>(c[2 * kk + 1][0], c[2 * kk + 1][1]);
  a[3] = pack2<E>(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

template <typename E>
__device__ __forceinline__ uint32_t ld32(const E* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

// A 16x16 A fragment from a row-major shared tile (rows r0.., columns c0..; stride ld), by 32-bit
// loads.
template <typename E>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const E* s, int ld, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  a[0] = ld32(s + (r0 + g) * ld + c0 + 2 * t);
  a[1] = ld32(s + (r0 + g + 8) * ld + c0 + 2 * t);
  a[2] = ld32(s + (r0 + g) * ld + c0 + 8 + 2 * t);
  a[3] = ld32(s + (r0 + g + 8) * ld + c0 + 8 + 2 * t);
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// ldmatrix.x4 without transpose: lane l addresses row (l & 15), column block (l >> 4) * 8 of a
// 16x16 sub-tile at (r0, c0): matrix i (rows 8 (i & 1) .., columns 8 (i >> 1) ..) arrives with
// thread (g, t) holding row g, columns 2t, 2t+1 — exactly a0..a3 of the A fragment.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// The A fragment of the 16x16 sub-tile at (r0, c0) of a row-major shared tile, in one ldmatrix.
template <typename E>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const E* s, int ld, int r0, int c0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, s + (r0 + (lane & 15)) * ld + c0 + (lane >> 4) * 8);
}

// B fragments of two adjacent n8 tiles (rows n0 .. n0 + 15 of a row-major [n][k] tile, k columns
// c0 .. c0 + 15), the "B = X^T" case (K for Q K^T, Q and dO in the backward): lane l addresses
// row n0 + 8 (l >> 4) + (l & 7), column c0 + 8 ((l >> 3) & 1), so matrix i holds rows
// 8 (i >> 1) .., columns 8 (i & 1) ..: b[0], b[1] are b0, b1 of tile n0, b[2], b[3] of n0 + 8.
template <typename E>
__device__ __forceinline__ void ldsm_b2(uint32_t (&b)[4], const E* s, int ld, int n0, int c0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(b, s + (n0 + ((lane >> 4) << 3) + (lane & 7)) * ld + c0 + ((lane >> 3) & 1) * 8);
}

// c (an m16 x D accumulator) += a (the m16 x k16 A fragment of k step kk) times rows
// 16 kk .. 16 kk + 15 of a padded row-major [k][D] shared tile s, its B fragments by
// ldmatrix.trans (V for P V, K for dS K).
template <typename E, int D>
__device__ __forceinline__ void mma_rows(float (&c)[D / 8][4], const uint32_t (&a)[4], const E* s,
                                         int kk, int lane) {
#pragma unroll
  for (int dt = 0; dt < D / 16; ++dt) {
    uint32_t bf[4];
    ldsm_x4_trans(bf, s + (kk * 16 + (lane & 15)) * (D + 8) + dt * 16 + (lane >> 4) * 8);
    mma<E>(c[2 * dt], a, bf[0], bf[1]);
    mma<E>(c[2 * dt + 1], a, bf[2], bf[3]);
  }
}

// --- Tile loads --------------------------------------------------------------------------------

// 16 bytes global -> shared (dst as a shared-window address), zero-filled when !valid (src is
// then not read).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
               : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  cp_async16(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [row0, row0 + ROWS) of a [*, D] matrix with row stride ld (elements) into a shared tile of
// stride D + 8, by the NT threads of the CTA; rows at or past `rows` are zero-filled.
template <typename E, int D, int ROWS, int NT = kThreads>
__device__ __forceinline__ void load_tile(E* s, const E* g, int64_t ld, int row0, int rows) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += NT) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool ok = row0 + r < rows;
    cp_async16(s + r * (D + 8) + col, ok ? g + static_cast<int64_t>(row0 + r) * ld + col : g, ok);
  }
}

// Rows [row0, row0 + ROWS) of a [*, D] matrix (row stride ld elements) into 128-byte-swizzled
// shared memory at dst (wgmma.cuh): D / 64 tiles of ROWS x 64 elements, one after the other
// (columns 64 s .. 64 s + 63 in tile s, at dst + s ROWS 128), by the NT threads of the CTA through
// cp.async; rows at or past `rows` are zero-filled.
template <typename E, int D, int ROWS, int NT>
__device__ __forceinline__ void load_swizzled(uint32_t dst, const E* src, int64_t ld, int row0,
                                              int rows) {
  constexpr unsigned kChunks = D / 8;
  // Unsigned: the divisions by kChunks are shifts, and ch >> 3 is 0 at D 64 (as signed ints they
  // cost 2-4 registers and 2.5-8% of the flash kernels' time).
#pragma unroll
  for (unsigned c = threadIdx.x; c < ROWS * kChunks; c += NT) {
    const int r = static_cast<int>(c / kChunks), ch = static_cast<int>(c % kChunks);
    const bool ok = row0 + r < rows;
    const E* from = ok ? src + static_cast<int64_t>(row0 + r) * ld + ch * 8 : src;
    cp_async16(dst + (ch >> 3) * ROWS * 128 + internal::swizzle_offset(r, (ch & 7) * 8), from, ok);
  }
}

// The rows of (batch, head) bh in q, and of its kv head in k and v.
template <typename E>
struct HeadRows {
  const E* q;
  const E* k;
  const E* v;
};
template <typename E>
__device__ __forceinline__ HeadRows<E> head_rows(const Params& p, int bh) {
  const int b = bh / p.h, h = bh % p.h, kvh = h / (p.h / p.hkv);
  return {static_cast<const E*>(p.q) + b * p.sq.b + h * p.sq.h,
          static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h,
          static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h};
}

// --- Masks and block ranges --------------------------------------------------------------------

// Whether query i sees key j (key range, causal and window masks).
__device__ __forceinline__ bool visible(const Params& p, int i, int j) {
  return j < p.s && (!p.causal || j <= i) && (p.window == 0 || j > i - p.window);
}

// The score of query i, key j (f32 accumulator x), scaled, capped and in the log2 domain; -inf
// where masked. `dcap` gets d(capped)/d(scaled), for the backward.
template <bool kCap>
__device__ __forceinline__ float score(const Params& p, float x, int i, int j, bool mask,
                                       float& dcap) {
  x *= p.scale;
  if constexpr (kCap) {
    const float th = tanhf(x / p.softcap);
    x = p.softcap * th;
    dcap = 1.0f - th * th;
  }
  x *= kLog2e;
  if (mask && !visible(p, i, j)) x = -INFINITY;
  return x;
}

// Key blocks [nb0, nb1) of BN keys that the ROWS query rows from m0 can see (causal: keys up to
// the last row; window: keys after the first row's window start).
template <int ROWS, int BN>
__device__ __forceinline__ void key_blocks(const Params& p, int m0, int& nb0, int& nb1) {
  int kend = p.s, kbeg = 0;
  if (p.causal) kend = min(kend, m0 + ROWS);
  if (p.window > 0) kbeg = max(0, m0 - p.window + 1);
  nb0 = kbeg / BN;
  nb1 = kend > kbeg ? (kend + BN - 1) / BN : nb0;
}

// Query blocks [mb0, mb1) of BQ rows that see some of the KEYS keys from n0 (causal: rows from
// n0; window: rows before the last key plus the window).
template <int KEYS, int BQ>
__device__ __forceinline__ void query_blocks(const Params& p, int n0, int& mb0, int& mb1) {
  const int qbeg = p.causal ? n0 : 0;
  const int qend = p.window > 0 ? min(p.t, n0 + KEYS - 1 + p.window) : p.t;
  mb0 = qbeg / BQ;
  mb1 = qend > qbeg ? (qend + BQ - 1) / BQ : mb0;
}

// lse of row i of (batch, head) bh in the log2 domain, +inf for rows past T and rows that see no
// key (so that every probability exp2(x - inf) is 0), and its Delta (0 past T).
__device__ __forceinline__ void lse_delta_row(const Params& p, int64_t bh, int i, float& l2,
                                              float& dl) {
  const float l = i < p.t ? p.lse[bh * p.t + i] : -INFINITY;
  l2 = l == -INFINITY ? INFINITY : l * kLog2e;
  dl = i < p.t ? p.delta[bh * p.t + i] : 0.0f;
}

// --- Epilogues ---------------------------------------------------------------------------------
// Accumulator accessors acc(dt, c): element c of the m16n8 C fragment of n8 tile dt.

// The forwards' epilogue for one m16 row tile: rows i0 (r = 0) and i0 + 8 (r = 1), with their
// running maxima mrow (log2 domain) and this thread's shares lrow of the row sums (added across
// the quad here). Writes out = O / l at this thread's columns 8 dt + 2 t, + 1 and, from t == 0,
// lse (-inf for a row that saw no key).
template <typename E, int D, typename Acc>
__device__ __forceinline__ void store_out_lse(const Params& p, int64_t bh, int i0, int t,
                                              const float (&mrow)[2], const float (&lrow)[2],
                                              Acc o) {
  E* out = static_cast<E*>(p.out) + (bh / p.h) * p.so.b + (bh % p.h) * p.so.h;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = lrow[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const int i = i0 + 8 * r;
    if (i < p.t) {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(i) * p.so.t + dt * 8 + 2 * t) =
            pack2<E>(o(dt, 2 * r) * inv, o(dt, 2 * r + 1) * inv);
      }
      if (t == 0) p.lse[bh * p.t + i] = l > 0.0f ? mrow[r] * kLn2 + logf(l) : -INFINITY;
    }
  }
}

// The backwards' epilogue for keys key[0], key[1] (skipped past S) of (batch, kv head) bk, all D
// columns: dK times the scale and dV, rounded to E.
template <typename E, int D, typename AccK, typename AccV>
__device__ __forceinline__ void store_dk_dv(const Params& p, int bk, const int (&key)[2], int t,
                                            AccK dk, AccV dv) {
  E* dkp = static_cast<E*>(p.dk) + static_cast<int64_t>(bk) * p.s * D;
  E* dvp = static_cast<E*>(p.dv) + static_cast<int64_t>(bk) * p.s * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key[r];
    if (j < p.s) {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const int64_t off = static_cast<int64_t>(j) * D + dt * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(dkp + off) =
            pack2<E>(dk(dt, 2 * r) * p.scale, dk(dt, 2 * r + 1) * p.scale);
        *reinterpret_cast<uint32_t*>(dvp + off) = pack2<E>(dv(dt, 2 * r), dv(dt, 2 * r + 1));
      }
    }
  }
}

// A dQ part (NC columns from c0 + 8 dt, + 1 for this thread) times the scale into the f32 dQ
// accumulator with float2 atomics (sm_90): this thread's rows i0, i0 + 8 (skipped past T) of
// (batch, head) bh.
template <int D, int NC, typename Acc>
__device__ __forceinline__ void add_dq(const Params& p, int64_t bh, int i0, int c0, Acc dq) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    if (i < p.t) {
      float* dst = p.dq_acc + (bh * p.t + i) * D + c0;
#pragma unroll
      for (int dt = 0; dt < NC / 8; ++dt) {
        atomicAdd(reinterpret_cast<float2*>(dst + dt * 8),
                  make_float2(dq(dt, 2 * r) * p.scale, dq(dt, 2 * r + 1) * p.scale));
      }
    }
  }
}

// --- Host interface ----------------------------------------------------------------------------

// What a launcher needs besides Params.
struct LaunchInfo {
  ScalarType dtype;  // kBFloat16 or kHalf
  int64_t batch;
  int head_size;
  Device device;  // of the operands (current while the launcher runs)
};
// Launches a family's main kernel for a prepared call (flash_attention.cu's run_forward /
// run_backward): the forward writes p.out and p.lse; the backward adds into p.dq_acc (zeroed) and
// writes p.dk and p.dv.
using Launcher = void (*)(const Params& p, const LaunchInfo& info);

// The op's kernels around a launcher (flash_attention.cu): operands, Params and outputs of a
// flash_attention call (c.outputs allocated: out, lse) or a flash_attention_backward call
// (c.outputs: dq, dk, dv; the Delta pass before the launcher, dQ rounded after it).
void run_forward(OpCall& c, Launcher launch_kernel);
void run_backward(OpCall& c, Launcher launch_kernel);
// dst = n f32 values of src (n a multiple of 4, 16-byte aligned) rounded to dtype, on the current
// stream.
void store_rounded(void* dst, const float* src, int64_t n, ScalarType dtype);

// The library's kernels (the winning configurations, by head size): flash_fwd_sm80.cu,
// flash_bwd_sm80.cu, flash_fwd_hopper.cu, flash_bwd_hopper.cu. launch_bwd_hopper's hsplit is the
// head-size-256 kernel's query-head split (0: bwd_head_split's choice).
void launch_fwd_sm80(const Params& p, const LaunchInfo& info);
void launch_bwd_sm80(const Params& p, const LaunchInfo& info);
void launch_fwd_hopper(const Params& p, const LaunchInfo& info);
void launch_bwd_hopper(const Params& p, const LaunchInfo& info, int hsplit = 0);

// Launches kernel<<<grid, threads, smem>>>(p) on the current stream, opting into more than 48 KB
// of shared memory.
template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, const Params& p, const char* name,
            int threads = kThreads) {
  KILN_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  kernel<<<grid, threads, smem, current_stream()>>>(p);
  KILN_CUDA_LAUNCH_CHECK(name);
}

// f(TypeTag<E>{}) with E the device element type of dtype (bf16 or f16).
template <typename F>
void visit_e(ScalarType dtype, F&& f) {
  if (dtype == kBFloat16) {
    f(TypeTag<__nv_bfloat16>{});
  } else {
    f(TypeTag<__half>{});
  }
}

// f(std::bool_constant<kCap>{}) with kCap = (softcap > 0).
template <typename F>
void visit_cap(const Params& p, F&& f) {
  if (p.softcap > 0) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

}  // namespace kiln::cuda::flash
