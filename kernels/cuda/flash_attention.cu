// CUDA kernels of flash_attention and flash_attention_backward (tensor/ops/attention.cpp;
// reference: kernels/cpu/flash_attention.cpp). bf16/f16 operands on the tensor cores, f32
// accumulation and softmax; D in {64, 128} (and 256 on Hopper); the T x S scores never leave
// registers and shared memory.
//
// Tensor-core instruction: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16} (sm_80+). With
// lane = 4 * g + t (g = lane / 4 in 0..7, t = lane % 4), each register holding two 16-bit
// elements, the lower-indexed one in the low half, the fragments are (PTX ISA, "Matrix
// fragments for mma.m16n8k16"):
//   A 16x16 (row-major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 =
//   A[g+8][2t+8..] B 16x8  ("col"):     b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g] C 16x8  (f32):
//   c0, c1 = C[g][2t], C[g][2t+1];  c2, c3 = C[g+8][2t], C[g+8][2t+1]
// Consequences used below:
//   - B = K^T for S = Q K^T is K stored [key][d] with b0 = K[n0 + g][k0 + 2t..]: one 32-bit
//     shared load per register; A = Q likewise.
//   - The C fragments of two adjacent n8 tiles (columns 16 kk .. 16 kk + 15) are, packed to
//     16 bits, exactly the A fragment of those 16 columns: a0 = (c0, c1) of tile 2kk, a1 = (c2, c3)
//     of tile 2kk, a2 = (c0, c1) of tile 2kk+1, a3 = (c2, c3) of tile 2kk+1. So P (or dS) goes from
//     the score accumulators to the next MMA's A operand without shared memory.
//   - B operands whose k index runs along the rows of a row-major tile (V for P V, dO and Q in
//     the backward) come from ldmatrix.x4.trans: lane l addresses row (l & 15), column block
//     (l >> 4) * 8 of a 16x16 sub-tile; matrix i (rows 8 (i & 1) .., columns 8 (i >> 1) ..)
//     arrives transposed, so thread (g, t) gets rows 2t, 2t+1 of column g: registers 0, 1 are
//     b0, b1 of the first n8 tile, registers 2, 3 of the second.
// Shared-memory rows are padded by 8 elements (16 bytes): with a row stride of D + 8 elements
// the 8 rows x 4 words of a fragment load, and the 8 rows of an ldmatrix, hit distinct banks.
//
// Forward: one CTA of 4 warps per (batch * head, 64-row query block), each warp 16 query rows;
// key blocks of 64, K and V double-buffered through cp.async (the next block loads while this
// one computes); online softmax in the exp2 domain in registers; key blocks entirely outside
// the causal/window band are skipped, and masking is applied only to blocks that straddle it.
// Query blocks are issued heaviest (latest, for causal) first.
// Backward (FA2): Delta = rowsum(dO * O) - dlse in a small kernel; then one CTA per (batch,
// kv head, 64-key block), looping over the query heads of the group and their 64-row query
// blocks: each warp owns 16 keys and recomputes S^T = K Q^T and P^T = exp(S^T - lse), dP^T =
// V dO^T, dS^T = P^T (dP^T - Delta); dV += P^T dO and dK += dS^T Q stay in registers (summed
// over the group: no atomics for dk/dv); dS goes through shared memory for dQ = dS K, which
// each warp (16 query rows) adds into an f32 buffer with atomics, converted to the dtype at
// the end.
//
// FLOPs (causal halves both): forward 4 B H T S D (two GEMMs), backward 10 B H T S D (five:
// S recomputed, dP, dV, dK, dQ). On the H100 (GPU.md) torch's flash reaches 175-207 TFLOP/s
// forward and 242-284 backward at the Llama shapes. These kernels use mma.sync (not Hopper's
// wgmma) with 64 x 64 tiles and 4 warps: expected about 50-70% of those figures (forward
// ~100-140, backward ~100-150 TFLOP/s), still far ahead of the composite, which writes and
// reads the f32 T x S scores several times.
//
// v2 kernels (the default; the v1 kernels above them stay compiled and selectable):
//   KILN_FLASH_KERNEL=v1      both passes on v1;  =fwd_v1 / =bwd_v1: only that pass on v1.
//   KILN_FLASH_FWD_WARPS=4    the D 64 forward v2 with 4 warps / 64 rows instead of 8 / 128.
// What changed and why it should be faster (measured on v1 at B16 H12 T1024 and B4 H32/8 T2048,
// causal bf16 D 64: fwd 127 TFLOP/s and bwd 93, against torch's flash 195 and ~180):
//   - Both passes: the block index of the sequence (query blocks forward, key blocks backward)
//     is grid.y and the (batch, head) index grid.x. CTAs are issued x-fastest, so for causal
//     attention every head's heaviest blocks start before any lighter one (v1 issued heavy..light
//     per head, leaving a tail of long blocks). Grids with more than 65535 blocks along the
//     sequence fall back to v1.
//   - Both passes: B fragments whose rows are the n index (K in Q K^T; Q and dO in the
//     backward's K Q^T and V dO^T) and all A fragments come from one ldmatrix.x4 per two n8 tiles
//     (per 16x16 A tile) instead of four 32-bit shared loads: 4x fewer shared-load instructions
//     competing with the MMAs for issue slots in the GEMM loops.
//   - Forward, D 64: 8 warps and 128 query rows per CTA, so each K / V tile loaded into shared
//     memory serves twice the rows (half the K / V traffic and barriers per FLOP); capped at 128
//     registers for 2 CTAs (16 warps) per SM. A warp skips the MMAs of a causal key block that lies
//     entirely after its own 16 rows (the first warps on the diagonal), and masks only blocks
//     that straddle its own rows. D 128 keeps 4 warps (its registers allow no more).
//   - Backward, D 64 (D 128 stays on v1: double buffers would take it past half the SM's shared
//     memory): the (query head of the group, query block) steps of a CTA are one flattened loop
//     whose next Q / dO tiles (cp.async into a second buffer) and lse / Delta (registers) are
//     fetched while the current step computes; v1 waited for every step's loads with the whole
//     CTA idle. Two barriers per step instead of three. dQ still goes through f32 atomics (as
//     FA2's; a separate dQ kernel would recompute S and dP: 7 GEMMs instead of 5), but as
//     float2 vector atomics (sm_90): half the atomic instructions.
// Expected (an estimate, not measured when written: no GPU here): backward ~1.3-1.6x, forward
// ~1.2-1.4x at the shapes above. Registers (ptxas, sm_90a): fwd v2 D 64 8 warps 128 with a
// 40-68 byte spill (KILN_FLASH_FWD_WARPS=4: 159, no spill, 3 CTAs per SM), fwd v2 D 128 219,
// bwd v2 D 64 234 (2 CTAs per SM, as v1), no spills.
//
// Forward v3 (the default at D 64 with scale > 0 off Hopper; KILN_FLASH_KERNEL=fwd_v3 selects it
// on Hopper, fwd_v2 selects v2): v2 gave
// every warp 16 query rows, so each K / V fragment read from shared memory fed one MMA and the
// shared-memory reads, not the tensor cores, set the pace (an m16n8k16 MMA consumes 512 bytes
// of B fragments per 4096 FLOPs). v3 gives each of 4 warps 32 rows (two m16 tiles): every
// fragment feeds two MMAs. Its softmax keeps the raw scores and folds the scale into the
// exponent (one FFMA and one ex2.approx per probability). 255 registers, no spill, 2 CTAs per
// SM. Measured on the H200 (benchmarks/RESULTS.md): 1.30x v2 at the 160m shape, 1.32x at 1b.
// The v2 backward computes its probabilities the same way (without softcap).
//
// Hopper (sm_90a code and a compute-capability-9 device; kWgmmaBuilt): the forward v4 and the
// backward v3 run both passes' GEMMs as warpgroup MMAs (wgmma, primitives in wgmma.cuh) on
// 128-byte-swizzled shared-memory tiles filled by cp.async, so that no fragment is loaded from
// shared memory by the threads (the limit of the mma.sync kernels above), at head sizes 64 and
// 128. 64 query rows (forward) or 64 keys (backward) per warpgroup, and several CTAs per SM:
// while one warpgroup computes its softmax or dS, another's MMAs run. Measured against PyTorch's
// flash kernels in the same run (benchmarks/RESULTS.md, session 7), H200 / H100: forward
// 1.16x / 1.13x at the 160m shape and 1.12x / 1.11x at 1b (v3 was 0.94 / 0.92), backward
// 1.07x / 1.00x and 1.04x / 1.03x (v2 0.93 / 0.94); at Mistral-7B's head size 128, forward
// 0.88 / 0.87 and backward 0.94 / 0.91 (v2 / v1 0.62 / 0.55). KILN_FLASH_KERNEL=fwd_v3 / bwd_v2
// select the mma.sync kernels on Hopper. Head size 256 (Gemma) runs only on these: the forward v4
// at D 256 and flash_bwd_kernel_wgmma_split (session 9: forward 1.13 / 1.13, backward 1.16 /
// 1.17 of PyTorch at gemma-2b's shape, H100 / H200).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/wgmma.cuh"
#include "tensor/env_switch.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 16 * kWarps;  // query rows per CTA (forward) / per step (backward)
constexpr int kBlockN = 64;           // keys per step (forward) / per CTA (backward)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// --- Device helpers ---------------------------------------------------------------------------

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

template <typename E>
__device__ __forceinline__ uint32_t ld32(const E* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a)
               : "memory");
}

// A 16x16 A fragment from a row-major shared tile (rows r0.., columns c0..; stride ld).
template <typename E>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const E* s, int ld, int r0, int c0) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  a[0] = ld32(s + (r0 + g) * ld + c0 + 2 * t);
  a[1] = ld32(s + (r0 + g + 8) * ld + c0 + 2 * t);
  a[2] = ld32(s + (r0 + g) * ld + c0 + 8 + 2 * t);
  a[3] = ld32(s + (r0 + g + 8) * ld + c0 + 8 + 2 * t);
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
// (dst as a shared-window address)
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

// Rows [row0, row0 + ROWS) of a [*, D] matrix with row stride ld (elements) into a shared tile
// of stride D + 8; rows at or past `rows` are zero-filled.
template <typename E, int D, int ROWS>
__device__ __forceinline__ void load_tile(E* s, const E* g, int64_t ld, int row0, int rows) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool ok = row0 + r < rows;
    cp_async16(s + r * (D + 8) + col, ok ? g + static_cast<int64_t>(row0 + r) * ld + col : g, ok);
  }
}

struct Strides {
  int64_t b, h, t;  // elements; the last dim is contiguous
};

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* dout;    // backward
  void* out;           // forward: out [B, H, T, D] contiguous
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
  Strides sq, sk, sv, sdo;
  int h, hkv, t, s;
  float scale, softcap;
  bool causal;
  int window;
};

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

// The forwards' epilogue for one m16 row tile: rows i0 (r = 0) and i0 + 8 (r = 1), with their
// running maxima mrow (log2 domain) and this thread's shares lrow of the row sums (added across
// the quad here). Writes out = O / l at this thread's columns 8 dt + 2 t, + 1 (o(dt, c) is O's
// accumulator for n8 tile dt, element c of the m16n8 C fragment) and, from t == 0, lse (-inf for
// a row that saw no key).
template <typename E, int D, typename Acc>
__device__ __forceinline__ void store_out_lse(const Params& p, int64_t bh, int i0, int t,
                                              const float (&mrow)[2], const float (&lrow)[2],
                                              Acc o) {
  E* out = static_cast<E*>(p.out) + bh * p.t * D;
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
        *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(i) * D + dt * 8 + 2 * t) =
            pack2<E>(o(dt, 2 * r) * inv, o(dt, 2 * r + 1) * inv);
      }
      if (t == 0) p.lse[bh * p.t + i] = l > 0.0f ? mrow[r] * kLn2 + logf(l) : -INFINITY;
    }
  }
}

// --- Forward ----------------------------------------------------------------------------------

template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(kThreads) flash_fwd_kernel(const Params p) {
  constexpr int SD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sq = reinterpret_cast<E*>(smem);
  E* sk = sq + kBlockM * SD;      // 2 buffers
  E* sv = sk + 2 * kBlockN * SD;  // 2 buffers
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int bh = blockIdx.y, b = bh / p.h, h = bh % p.h, kvh = h / (p.h / p.hkv);
  const int m0 = mb * kBlockM;
  const E* q = static_cast<const E*>(p.q) + b * p.sq.b + h * p.sq.h;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;

  int nb0, nb1;
  key_blocks<kBlockM, kBlockN>(p, m0, nb0, nb1);

  load_tile<E, D, kBlockM>(sq, q, p.sq.t, m0, p.t);
  if (nb0 < nb1) {
    load_tile<E, D, kBlockN>(sk, k, p.sk.t, nb0 * kBlockN, p.s);
    load_tile<E, D, kBlockN>(sv, v, p.sv.t, nb0 * kBlockN, p.s);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a(qf[kk], sq, SD, w * 16, kk * 16);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  const int row[2] = {m0 + w * 16 + g, m0 + w * 16 + g + 8};

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile<E, D, kBlockN>(sk + (buf ^ 1) * kBlockN * SD, k, p.sk.t, (nb + 1) * kBlockN, p.s);
      load_tile<E, D, kBlockN>(sv + (buf ^ 1) * kBlockN * SD, v, p.sv.t, (nb + 1) * kBlockN, p.s);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* kb = sk + buf * kBlockN * SD;
    const E* vb = sv + buf * kBlockN * SD;

    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const E* kr = kb + (nt * 8 + g) * SD + kk * 16 + 2 * t;
        mma<E>(s[nt], qf[kk], ld32(kr), ld32(kr + 8));
      }
    }
    const int n0 = nb * kBlockN;
    const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > m0) ||
                      (p.window > 0 && n0 <= m0 + kBlockM - 1 - p.window);
    float dcap = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = score<kCap>(p, s[nt][e], row[e >> 1], n0 + nt * 8 + 2 * t + (e & 1), mask, dcap);
      }
    }
    // Online softmax: rows g (r = 0) and g + 8 (r = 1), each spread over the 4 lanes of a quad.
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
      lrow[r] = lrow[r] * alpha + sum;  // this lane's share; the quad is summed at the end
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * r] *= alpha;
        o[dt][2 * r + 1] *= alpha;
      }
    }
    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      const uint32_t a[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, vb + (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8);
        mma<E>(o[2 * dt], a, bf[0], bf[1]);
        mma<E>(o[2 * dt + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  store_out_lse<E, D>(p, bh, row[0], t, mrow, lrow, [&](int dt, int c) { return o[dt][c]; });
}

// --- Backward ---------------------------------------------------------------------------------

// delta[row] = sum_d dout[row, d] * out[row, d] - dlse[row], and the row's D f32 of the dQ
// accumulator zeroed (the memset the backward kernels need, fused into this pass). D / 8 threads
// per row, each one 16-byte pack of dout and out (rows of both are 16-byte aligned:
// kernel_operand, a contiguous out) and two float4 of zeros.
template <typename E, int D>
__global__ void __launch_bounds__(256)
    flash_bwd_delta_kernel(float* __restrict__ delta, float* __restrict__ dq_acc,
                           const E* __restrict__ dout, Strides sdo, const E* __restrict__ out,
                           const float* __restrict__ dlse, int h, int t, int64_t rows) {
  constexpr int TPR = D / 8;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / TPR;
  const int c = static_cast<int>(threadIdx.x % TPR);
  if (r >= rows) return;  // whole row groups leave together (TPR divides the block)
  const int64_t b = r / (static_cast<int64_t>(h) * t), hh = (r / t) % h, i = r % t;
  const uint4 dv =
      *reinterpret_cast<const uint4*>(dout + b * sdo.b + hh * sdo.h + i * sdo.t + c * 8);
  const uint4 ov = *reinterpret_cast<const uint4*>(out + r * D + c * 8);
  const E* de = reinterpret_cast<const E*>(&dv);
  const E* oe = reinterpret_cast<const E*>(&ov);
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc += to_f32(de[e]) * to_f32(oe[e]);
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (c == 0) delta[r] = acc - dlse[r];
  float4* z = reinterpret_cast<float4*>(dq_acc + r * D) + 2 * c;
  z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dst = src rounded to E, four elements per step (n a multiple of 4, both 16-byte aligned).
template <typename E>
__global__ void flash_bwd_convert_kernel(E* __restrict__ dst, const float* __restrict__ src,
                                         int64_t n4) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 f = reinterpret_cast<const float4*>(src)[i];
    reinterpret_cast<uint2*>(dst)[i] = make_uint2(pack2<E>(f.x, f.y), pack2<E>(f.z, f.w));
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

      // S^T (this warp's 16 keys x 64 queries) and dP^T = V dO^T.
      float st[8][4], dpt[8][4];
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t ka[4], va[4];
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
      // dV += P^T dO, dK += dS^T Q (k index: queries, 16 per step).
#pragma unroll
      for (int kk = 0; kk < kBlockM / 16; ++kk) {
        const uint32_t pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]),
                                pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                                pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
        const uint32_t da[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]),
                                pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                                pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
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
      // dS [query][key] to shared memory for dQ.
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sds[(nt * 8 + 2 * t + (e & 1)) * SDS + w * 16 + g + 8 * (e >> 1)] =
              from_f32<E>(dpt[nt][e]);
        }
      }
      __syncthreads();
      // dQ (this warp's 16 query rows x D) = dS K, added into the f32 buffer.
      float dq[D / 8][4];
#pragma unroll
      for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[4];
        load_a(a, sds, SDS, w * 16, kk * 16);
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, sk + (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8);
          mma<E>(dq[2 * dt], a, bf[0], bf[1]);
          mma<E>(dq[2 * dt + 1], a, bf[2], bf[3]);
        }
      }
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
            pack2<E>(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dvp + off) = pack2<E>(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
  }
}

// --- v2 kernels (the default; KILN_FLASH_KERNEL=v1 selects the kernels above) ----------------

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

// load_tile for a CTA of NT threads.
template <typename E, int D, int ROWS, int NT>
__device__ __forceinline__ void load_tile_nt(E* s, const E* g, int64_t ld, int row0, int rows) {
  constexpr int kChunks = D / 8;
  for (int c = threadIdx.x; c < ROWS * kChunks; c += NT) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool ok = row0 + r < rows;
    cp_async16(s + r * (D + 8) + col, ok ? g + static_cast<int64_t>(row0 + r) * ld + col : g, ok);
  }
}

// CTAs per SM the forward v2 is compiled for (a register cap of 64K / (32 KW x this)): 8 warps
// at D 64 fit 2 CTAs in 128 registers; 4 warps at D 64 fit 3 (v1 used 133 registers); D 128
// needs ~176 and keeps 2.
template <int D, int KW>
constexpr int kFwdMinBlocks = KW == 8 ? (D == 64 ? 2 : 1) : (D == 64 ? 3 : 2);

// Forward v2: KW warps (16 query rows each) per CTA; grid (B * H, query blocks) with the query
// block index in y, reversed, so that the heaviest (latest, for causal) blocks of every head are
// issued before any lighter one; K fragments by ldmatrix (4x fewer shared loads than ld32).
template <typename E, int D, bool kCap, int KW>
__global__ void __launch_bounds__(KW * 32, kFwdMinBlocks<D, KW>)
    flash_fwd_kernel_v2(const Params p) {
  constexpr int SD = D + 8, BM = 16 * KW, NT = KW * 32;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sq = reinterpret_cast<E*>(smem);
  E* sk = sq + BM * SD;           // 2 buffers
  E* sv = sk + 2 * kBlockN * SD;  // 2 buffers
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int bh = blockIdx.x, b = bh / p.h, h = bh % p.h, kvh = h / (p.h / p.hkv);
  const int m0 = mb * BM;
  const E* q = static_cast<const E*>(p.q) + b * p.sq.b + h * p.sq.h;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;

  int nb0, nb1;
  key_blocks<BM, kBlockN>(p, m0, nb0, nb1);

  load_tile_nt<E, D, BM, NT>(sq, q, p.sq.t, m0, p.t);
  if (nb0 < nb1) {
    load_tile_nt<E, D, kBlockN, NT>(sk, k, p.sk.t, nb0 * kBlockN, p.s);
    load_tile_nt<E, D, kBlockN, NT>(sv, v, p.sv.t, nb0 * kBlockN, p.s);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldsm_a(qf[kk], sq, SD, w * 16, kk * 16);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  const int row[2] = {m0 + w * 16 + g, m0 + w * 16 + g + 8};
  // The last row of this warp: key blocks entirely past it (causal) are skipped by the warp.
  const int wlast = m0 + w * 16 + 15;

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile_nt<E, D, kBlockN, NT>(sk + (buf ^ 1) * kBlockN * SD, k, p.sk.t, (nb + 1) * kBlockN,
                                      p.s);
      load_tile_nt<E, D, kBlockN, NT>(sv + (buf ^ 1) * kBlockN * SD, v, p.sv.t, (nb + 1) * kBlockN,
                                      p.s);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* kb = sk + buf * kBlockN * SD;
    const E* vb = sv + buf * kBlockN * SD;
    const int n0 = nb * kBlockN;
    // Warp-uniform: with 8 warps the first warps of the diagonal block see none of its keys.
    // (Windows: the block-level range already excludes blocks no row of the CTA sees; a warp
    // that sees none of a block's keys just computes zeros, as in v1.)
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
      float dcap = 0.0f;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] =
              score<kCap>(p, s[nt][e], row[e >> 1], n0 + nt * 8 + 2 * t + (e & 1), mask, dcap);
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
        const float muse = mnew == -INFINITY ? 0.0f : mnew;
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
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t a[4] = {pack2<E>(s[2 * kk][0], s[2 * kk][1]),
                               pack2<E>(s[2 * kk][2], s[2 * kk][3]),
                               pack2<E>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               pack2<E>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int dt = 0; dt < D / 16; ++dt) {
          uint32_t bf[4];
          ldsm_x4_trans(bf, vb + (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8);
          mma<E>(o[2 * dt], a, bf[0], bf[1]);
          mma<E>(o[2 * dt + 1], a, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }

  store_out_lse<E, D>(p, bh, row[0], t, mrow, lrow, [&](int dt, int c) { return o[dt][c]; });
}

// exp2 on the special-function unit, subnormal results flushed to zero (exp2f adds a range
// fix-up around the same instruction; the probabilities here are in [0, 1] and a subnormal one
// is below bf16's resolution of the sum anyway).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Forward v3 (the default for D 64): 4 warps, each owning MI = 2 m16 tiles (32 consecutive query
// rows) of a 128-row query block. Every K / V fragment loaded from shared memory (ldmatrix)
// feeds MI MMAs instead of one, halving the shared-memory traffic per FLOP, the limit of v2
// (16 rows per warp). The softmax runs on raw scores: the row maximum of the raw scores times
// scale log2(e) is the maximum of the scaled ones (scale > 0), so each probability is one FFMA
// and one ex2 (v2: two multiplies, a subtraction and exp2f's fix-up). Soft-capped scores are
// mapped to the log2 domain first (factor 1). Key blocks entirely after a warp's last row are
// skipped by that warp; only blocks straddling the causal edge, the window edge or the end of
// the keys are masked. Requires scale > 0 (otherwise v2 runs).
template <typename E, int D, bool kCap>
__global__ void __launch_bounds__(128, 2) flash_fwd_kernel_v3(const Params p) {
  constexpr int MI = 2, KW = 4, NT = KW * 32, BM = 16 * MI * KW, SD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  E* sq = reinterpret_cast<E*>(smem);
  E* sk = sq + BM * SD;           // 2 buffers
  E* sv = sk + 2 * kBlockN * SD;  // 2 buffers
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.y) - 1 - static_cast<int>(blockIdx.y);
  const int bh = blockIdx.x, b = bh / p.h, h = bh % p.h, kvh = h / (p.h / p.hkv);
  const int m0 = mb * BM;
  const int wfirst = m0 + w * 16 * MI, wlast = wfirst + 16 * MI - 1;
  const E* q = static_cast<const E*>(p.q) + b * p.sq.b + h * p.sq.h;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;

  int nb0, nb1;
  key_blocks<BM, kBlockN>(p, m0, nb0, nb1);

  load_tile_nt<E, D, BM, NT>(sq, q, p.sq.t, m0, p.t);
  if (nb0 < nb1) {
    load_tile_nt<E, D, kBlockN, NT>(sk, k, p.sk.t, nb0 * kBlockN, p.s);
    load_tile_nt<E, D, kBlockN, NT>(sv, v, p.sv.t, nb0 * kBlockN, p.s);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  uint32_t qf[MI][D / 16][4];
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) ldsm_a(qf[mi][kk], sq, SD, w * 16 * MI + mi * 16, kk * 16);
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
    const int buf = (nb - nb0) & 1;
    if (nb + 1 < nb1) {
      load_tile_nt<E, D, kBlockN, NT>(sk + (buf ^ 1) * kBlockN * SD, k, p.sk.t, (nb + 1) * kBlockN,
                                      p.s);
      load_tile_nt<E, D, kBlockN, NT>(sv + (buf ^ 1) * kBlockN * SD, v, p.sv.t, (nb + 1) * kBlockN,
                                      p.s);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const E* kb = sk + buf * kBlockN * SD;
    const E* vb = sv + buf * kBlockN * SD;
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
        for (int mi = 0; mi < MI; ++mi) {
          a[mi][0] = pack2<E>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
          a[mi][1] = pack2<E>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
          a[mi][2] = pack2<E>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
          a[mi][3] = pack2<E>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
        }
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

// Forward v4 (Hopper, sm_90a; the default with scale > 0 on a compute-capability-9 GPU):
// the two GEMMs of every key block run as warpgroup MMAs (wgmma) instead of per-warp mma.sync.
// A CTA is NWG warpgroups of 128 threads, each owning 64 query rows of a 64 NWG-row query block;
// K and V blocks of BN keys are double-buffered in shared memory through cp.async (every thread
// copies), in the 128-byte-swizzled layout wgmma reads directly (wgmma.cuh), so no shared-memory
// fragment loads are issued: S = Q K^T is D / 16 m64nBNk16 steps with K from shared memory and Q
// from shared memory or (QR, the "r" configurations) from registers, loaded once from global
// memory in wgmma's A fragment layout; O += P V takes P from the S accumulators in registers
// (their layout is wgmma's A fragment layout) and V from shared memory read N-major (transposed).
// The softmax is v3's: raw scores, the scale folded into one FFMA per probability before ex2; at
// D 128 and 256 the running maximum moves lazily (kStaleMax). Each warpgroup skips the key blocks
// entirely after its own last row, and masks only the blocks straddling the causal edge, the
// window edge or the end of the keys.
// Configurations (KILN_FLASH_WGMMA=NWGxBN[r], measured in benchmarks/RESULTS.md): at D 64, 2x64
// (the default: 2 CTAs, so 4 warpgroups, per SM, up to 128 registers), 1x64 (4 CTAs per SM),
// 1x32, 4x64, 2x128 and 3x128 (1 CTA per SM), 1x64r and 2x64r; at D 128, 3x64r (the default: 1
// CTA of 3 warpgroups per SM in 168 registers, shared memory holding only K and V), 1x64r (3
// CTAs per SM), 2x64r, 1x32 (4 CTAs per SM) and 1x64 (2, by shared memory); at D 256 (O alone
// takes 128 registers), 2x32r (the default: 1 CTA per SM, 253 registers; the softcapped kernel
// keeps Q in shared memory, as 2x32), 2x32, 1x32 and 1x32r (2 CTAs per SM) and 1x64 (1). What
// matters is warpgroups per SM: while one computes its softmax, the tensor cores run another's
// MMAs (2x128, at 2 warpgroups per SM, was 1.4x slower than 2x64 on the H200; 2x64 was
// 1.05-1.10x faster than 1x64); then the K / V bytes loaded per query row, and the barriers:
// with several warpgroups per CTA at D 128 and 256, 3 K / V stages leave one CTA barrier per
// key block (wgmma_fwd_stages), and 3x64r is 1.13x faster than 1x64r at the same 3 warpgroups
// per SM (with 2 stages, 1.02x), 2x32r 1.15x faster than 1x32r. At D 128, Q in registers also
// halves the shared-memory reads per key block, which bound 1x32 (1x64r is 1.13x faster than
// 1x32).
// How far (log2 domain) a block's maximum score may exceed the forward v4's running maximum before
// the running maximum moves: probabilities stay at most 2^8.
constexpr float kStaleMax = 8.0f;

// CTAs per SM the forward v4 is compiled for (its register cap: 64K / (128 NWG x this)).
template <int D, int NWG, int BN, bool QR>
constexpr int wgmma_fwd_min_blocks() {
  if (D == 256) return NWG == 1 && BN == 32 ? 2 : 1;  // by shared memory (1x32: 96 KiB)
  if (D == 128 && NWG > 1) return 1;
  if (D == 128) return BN == 32 ? 4 : QR ? 3 : 2;  // 1x64 with Q: held to 2 by shared memory
  if (BN == 128) return 1;
  return NWG == 1 ? 4 : NWG == 2 ? 2 : 1;  // 16 warps per SM in 128 registers
}

// K / V stages in shared memory of the forward v4: 3 where several warpgroups share a CTA at
// D 128 and 256, so that one CTA barrier per key block suffices (the buffer refilled at block n
// was last read at block n - 1, before that block's barrier), and the warpgroups may drift up to
// a block apart; 2 otherwise (a second barrier per block guards the refill).
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
  const int bh = blockIdx.x, b = bh / p.h, h = bh % p.h, kvh = h / (p.h / p.hkv);
  const int m0 = mb * BM, wfirst = m0 + 64 * wg, wlast = wfirst + 63;
  const E* q = static_cast<const E*>(p.q) + b * p.sq.b + h * p.sq.h;
  const E* k = static_cast<const E*>(p.k) + b * p.sk.b + kvh * p.sk.h;
  const E* v = static_cast<const E*>(p.v) + b * p.sv.b + kvh * p.sv.h;

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
      // the vote cost more than the multiplies it saved (2-3%): the maximum moves every block.
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
  __trap();  // launched only where the sm_90a code exists (kWgmmaBuilt, compute capability 9)
#endif
}

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

// The wgmma backwards' dQ_part (an m64nN accumulator, N = NC) times the scale into the f32 dQ
// accumulator with float2 atomics: this thread's rows i0, i0 + 8 (skipped past T) of (batch,
// head) bh, columns c0 + 8 dt, + 1.
template <int D, int NC>
__device__ __forceinline__ void add_dq_part(const Params& p, int64_t bh, int i0, int c0,
                                            const float (&dq)[NC / 2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + 8 * r;
    if (i < p.t) {
      float* dst = p.dq_acc + (bh * p.t + i) * D + c0;
#pragma unroll
      for (int dt = 0; dt < NC / 8; ++dt) {
        atomicAdd(reinterpret_cast<float2*>(dst + dt * 8),
                  make_float2(dq[4 * dt + 2 * r] * p.scale, dq[4 * dt + 2 * r + 1] * p.scale));
      }
    }
  }
}

// Backward v3 (Hopper, sm_90a; the default on a compute-capability-9 GPU): v2's
// algorithm on warpgroup MMAs. A CTA is NWG warpgroups for 64 NWG keys of one (batch, kv head),
// each warpgroup owning 64 keys; it loops over (query head of the group, 64-row query block)
// steps whose Q / dO tiles (128-byte-swizzled, cp.async) and lse / Delta are double-buffered,
// with one CTA barrier per step. Per step and warpgroup (m64nNk16 steps, N = 64 or D):
//   - S^T = K Q^T (K and Q K-major from shared memory); P^T = exp2(S^T scale log2(e) - lse),
//     rounded to the dtype in registers (pa);
//   - dP^T = V dO^T and dV += P^T dO (P^T from registers, dO read N-major) issued together;
//     once dP^T has landed (dV may still run), dS^T = P^T (dP^T - Delta) with P^T widened from
//     pa, so that S^T's f32 registers are free for dP^T's;
//   - dK += dS^T Q issued, dS^T stored to the warpgroup's own swizzled [key][query] tile, and
//     dQ_part = dS K issued (dS read M-major, K N-major): with one warpgroup over its 64 keys and
//     every column, with two (after a CTA barrier) over the CTA's 128 keys and column half wg;
//     dQ_part goes to the f32 dQ accumulator with float2 atomics, one per dQ element and 64 NWG
//     keys.
// dK and dV stay in registers across the steps. Configurations (KILN_FLASH_WGMMA_BWD): 1x64 (the
// default at D 64: 3 CTAs, so 3 warpgroups, per SM in 168 registers; 2 CTAs per SM at D 128,
// where dK and dV alone take 128 registers a thread) and 2x64 (1 CTA per SM; the default at
// D 128, where it issues dP^T with S^T and halves the dQ atomics: 1.12-1.18x faster than 1x64
// there). At D 64 warpgroups per SM decide, as in the forward: 2x64 is 1.19-1.28x slower.
template <typename E, int D, bool kCap, int NWG>
__global__ void __launch_bounds__(128 * NWG, NWG == 2 ? 1 : (D == 128 ? 2 : 3))
    flash_bwd_kernel_wgmma(const Params p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace kiln::cuda::internal;
  constexpr int NT = 128 * NWG, BK = 64 * NWG, BQ = 64;
  // dP^T issued with S^T, so that it runs while P^T is computed: with 2 warpgroups (1 CTA per SM,
  // room for S^T and dP^T in registers together; the softcapped kernel would spill).
  constexpr bool kEarlyDp = NWG == 2 && !kCap;
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
  // Grid (B * H_kv, key blocks) with the key block in y, as v2: for causal attention every head's
  // heaviest (first) key blocks are issued before any lighter one. (Walking chunks of heads key
  // block by key block instead, so that the CTAs in flight share the Q, dO and dQ rows of fewer
  // heads in L2, was 1.04x faster at the 160m shape but 1.23-1.27x slower at 1b, whose 4-head
  // GQA CTAs are long: a chunk's heaviest CTAs started late and trailed.)
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
    // A warpgroup whose keys are all hidden computes its (zero) P^T and dS^T all the same: a
    // branch on the warpgroup index, which ptxas cannot prove uniform across the warpgroup, made
    // it serialise every wgmma of the kernel.
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
      // P^T, rounded to the dtype: dV's A operand, and (widened again) dS^T's factor, so that
      // S^T's f32 registers are free for dP^T.
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
    // dQ_part = dS K over the CTA's keys: with one warpgroup, its 64 keys and every column; with
    // two, both warpgroups' dS^T tiles (after a CTA barrier) and column half wg, so that each dQ
    // element gets one atomic per 128 keys. A hidden warpgroup's tile holds zeros (see above); a
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
      // Every warpgroup's tile, with a fixed accumulate flag: skipping a hidden warpgroup's tile
      // (a branch ptxas cannot prove uniform) made ptxas serialise the wgmma of the kernel.
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
      add_dq_part<D, kCols>(p, bh, m0 + 16 * w + g, wg * kCols + 2 * t, dq);
    }
    steps.end(it, nl, nd);
  }

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
            pack2<E>(dk[4 * dt + 2 * r] * p.scale, dk[4 * dt + 2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dvp + off) =
            pack2<E>(dv[4 * dt + 2 * r], dv[4 * dt + 2 * r + 1]);
      }
    }
  }
#else
  __trap();  // launched only where the sm_90a code exists (kWgmmaBuilt, compute capability 9)
#endif
}

// Backward v3 at head size 256 (Hopper, sm_90a; the only backward there). One warpgroup's dK and
// dV over 64 keys and 256 columns would take 256 registers a thread, so a CTA of 2 warpgroups
// shares its 64 keys and splits the work: per (query head, 64-row query block) step, warpgroup wg
//   - computes S^T and dP^T for the 64 keys and its 32 queries 32 wg .. 32 wg + 31 (m64n32k16
//     steps, K / V and Q / dO K-major from shared memory, both issued before P^T is computed),
//     then P^T and dS^T (as v3), and stores both, rounded to the dtype, into two shared
//     [key][query] tiles;
//   - after a CTA barrier, accumulates columns DW wg .. DW wg + DW - 1 (DW = D / 2) of dV += P^T dO
//     and dK += dS^T Q (P^T and dS^T K-major from shared memory, dO and Q N-major), and computes
//     the same columns of dQ_part = dS K (dS M-major, K N-major), added into the f32 dQ
//     accumulator with float2 atomics.
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
      // P^T and dS^T (rounded to the dtype; dS^T from the rounded P^T, as v3) into the shared
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
      add_dq_part<D, DW>(p, bh, m0 + 16 * w + g, wg * DW + 2 * t, dq);
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
  __trap();  // launched only where the sm_90a code exists (kWgmmaBuilt, compute capability 9)
#endif
}

// Backward v2 (D 64): as v1, plus
//   - grid (B * H_kv, key blocks) with the key block in y: for causal the heaviest (first) key
//     blocks of every head are issued before any lighter one, so the long blocks do not trail;
//   - the (query head, query block) steps of a CTA are flattened into one loop whose next Q / dO
//     tiles (cp.async) and lse / Delta (registers) are fetched while this step computes (double
//     buffers), instead of waiting for every load;
//   - Q and dO B fragments and all A fragments by ldmatrix (4x fewer shared loads than ld32).
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
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) st[nt][e] = dpt[nt][e] = 0.0f;
    }
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      ldsm_a(ka, sk, SD, w * 16, kk * 16);
      ldsm_a(va, sv, SD, w * 16, kk * 16);
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t qf[4], df[4];
        ldsm_b2(qf, qb, SD, np * 16, kk * 16);
        ldsm_b2(df, dob, SD, np * 16, kk * 16);
        mma<E>(st[2 * np], ka, qf[0], qf[1]);
        mma<E>(st[2 * np + 1], ka, qf[2], qf[3]);
        mma<E>(dpt[2 * np], va, df[0], df[1]);
        mma<E>(dpt[2 * np + 1], va, df[2], df[3]);
      }
    }
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
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      const uint32_t pa[4] = {pack2<E>(st[2 * kk][0], st[2 * kk][1]),
                              pack2<E>(st[2 * kk][2], st[2 * kk][3]),
                              pack2<E>(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                              pack2<E>(st[2 * kk + 1][2], st[2 * kk + 1][3])};
      const uint32_t da[4] = {pack2<E>(dpt[2 * kk][0], dpt[2 * kk][1]),
                              pack2<E>(dpt[2 * kk][2], dpt[2 * kk][3]),
                              pack2<E>(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                              pack2<E>(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        const int off = (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8;
        uint32_t bf[4];
        ldsm_x4_trans(bf, dob + off);
        mma<E>(dv[2 * dt], pa, bf[0], bf[1]);
        mma<E>(dv[2 * dt + 1], pa, bf[2], bf[3]);
        ldsm_x4_trans(bf, qb + off);
        mma<E>(dk[2 * dt], da, bf[0], bf[1]);
        mma<E>(dk[2 * dt + 1], da, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sds[(nt * 8 + 2 * t + (e & 1)) * SDS + w * 16 + g + 8 * (e >> 1)] = from_f32<E>(dpt[nt][e]);
      }
    }
    __syncthreads();
    float dq[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a[4];
      ldsm_a(a, sds, SDS, w * 16, kk * 16);
#pragma unroll
      for (int dt = 0; dt < D / 16; ++dt) {
        uint32_t bf[4];
        ldsm_x4_trans(bf, sk + (kk * 16 + (lane & 15)) * SD + dt * 16 + (lane >> 4) * 8);
        mma<E>(dq[2 * dt], a, bf[0], bf[1]);
        mma<E>(dq[2 * dt + 1], a, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = m0 + w * 16 + g + 8 * r;
      if (i < p.t) {
        float* dst = p.dq_acc + (bh * p.t + i) * D + 2 * t;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          // One 8-byte vector atomic (sm_90) per pair: half the atomics of v1; dst is even.
          atomicAdd(reinterpret_cast<float2*>(dst + dt * 8),
                    make_float2(dq[dt][2 * r] * p.scale, dq[dt][2 * r + 1] * p.scale));
        }
      }
    }
    if (it + 1 < nit && threadIdx.x < kBlockM) {
      slse[(buf ^ 1) * kBlockM + threadIdx.x] = nl;
      sdelta[(buf ^ 1) * kBlockM + threadIdx.x] = nd;
    }
    cp_async_wait<0>();
    __syncthreads();  // the next step's tiles are visible; sds and this step's buffers are free
  }

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
            pack2<E>(dk[dt][2 * r] * p.scale, dk[dt][2 * r + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(dvp + off) = pack2<E>(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
  }
}

// --- Host side --------------------------------------------------------------------------------

// Whether this build holds the sm_90a code of the wgmma kernels (CMake defines KILN_CUDA_SM90A
// when 90a is among CMAKE_CUDA_ARCHITECTURES).
#if defined(KILN_CUDA_SM90A)
constexpr bool kWgmmaBuilt = true;
#else
constexpr bool kWgmmaBuilt = false;
#endif

// Whether the wgmma kernels can run: sm_90a code in the build and a compute-capability-9 device.
bool wgmma_device() {
  return kWgmmaBuilt && loops::device_attribute<cudaDevAttrComputeCapabilityMajor>() == 9;
}

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// t itself when its last dim is contiguous and every other stride and the base allow 16-byte
// rows (the views of a qkv projection split + transpose qualify); a fresh contiguous copy
// otherwise (clone, not contiguous(): a contiguous view at a misaligned offset stays one).
Tensor kernel_operand(const Tensor& t) {
  bool ok = t.stride(3) == 1 || t.size(3) <= 1;
  for (int d = 0; d < 3 && ok; ++d) ok = t.stride(d) % 8 == 0 || t.size(d) <= 1;
  return ok && aligned16(t) ? t : t.clone();
}

// t itself when contiguous with a 16-byte aligned base, else a fresh contiguous copy.
Tensor aligned_contiguous(const Tensor& t) {
  return t.is_contiguous() && aligned16(t) ? t : t.clone();
}

Strides strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

void check_supported(const char* op, const Tensor& q, double scale) {
  KILN_CHECK(q.dtype() == kBFloat16 || q.dtype() == kHalf, "[", op,
             "] the CUDA kernel takes bfloat16 or float16, got ", dtype_name(q.dtype()),
             " (F::scaled_dot_product_attention falls back to the composite for other dtypes)");
  const int64_t d = q.size(3);
  KILN_CHECK(d == 64 || d == 128 || d == 256, "[", op,
             "] the CUDA kernel takes head sizes 64, 128 and (on Hopper) 256, got q ",
             shape_str(q.sizes()));
  KILN_CHECK(q.size(0) * q.size(1) <= 65535 && q.size(2) < (int64_t{1} << 30), "[", op,
             "] too many heads or rows for the CUDA kernel: q ", shape_str(q.sizes()));
  if (d == 256) {
    KILN_CHECK(wgmma_device(), "[", op,
               "] head size 256 runs only on the Hopper (sm_90a) kernels, and this ",
               kWgmmaBuilt ? "GPU is not compute capability 9.x" : "build holds no sm_90a code",
               ": q ", shape_str(q.sizes()),
               " (F::scaled_dot_product_attention falls back to the composite)");
    KILN_CHECK(scale > 0, "[", op, "] head size 256 takes a positive scale, got ", scale, ": q ",
               shape_str(q.sizes()));
    KILN_CHECK(q.size(2) <= int64_t{65535} * 64, "[", op,
               "] too many rows for the head-size-256 kernel: q ", shape_str(q.sizes()));
  }
}

template <typename Kernel>
void launch(Kernel kernel, dim3 grid, size_t smem, const Params& p, const char* name,
            int threads = kThreads) {
  // Shared memory beyond 48 KB must be opted into, once per kernel.
  KILN_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
  kernel<<<grid, threads, smem, current_stream()>>>(p);
  KILN_CUDA_LAUNCH_CHECK(name);
}

template <typename F>
void visit_e(ScalarType dt, F&& f) {
  if (dt == kBFloat16) {
    f(TypeTag<__nv_bfloat16>{});
  } else {
    f(TypeTag<__half>{});
  }
}

template <typename F>
void visit_d_cap(int64_t d, bool cap, F&& f) {
  if (d == 64) {
    cap ? f(std::integral_constant<int, 64>{}, std::true_type{})
        : f(std::integral_constant<int, 64>{}, std::false_type{});
  } else {
    cap ? f(std::integral_constant<int, 128>{}, std::true_type{})
        : f(std::integral_constant<int, 128>{}, std::false_type{});
  }
}

// KILN_FLASH_KERNEL's values, in the order EnvChoice numbers them (kDefault: unset or empty).
enum class FlashKernel { kDefault = -1, kV1, kFwdV1, kBwdV1, kFwdV2, kFwdV3, kBwdV2 };

FlashKernel flash_kernel_switch() {
  static const kiln::internal::EnvChoice kernel(
      "KILN_FLASH_KERNEL", {"v1", "fwd_v1", "bwd_v1", "fwd_v2", "fwd_v3", "bwd_v2"});
  return static_cast<FlashKernel>(kernel.get());
}

// The wgmma kernel of a pass (forward v4, backward v3) runs unless KILN_FLASH_KERNEL selects
// another kernel for that pass, or the build or the device cannot run it (wgmma_device). Head
// size 256 has no other kernel: it ignores KILN_FLASH_KERNEL.
bool use_wgmma(bool forward) {
  using enum FlashKernel;
  const FlashKernel k = flash_kernel_switch();
  const bool other = k == kV1 || (forward ? k == kFwdV1 || k == kFwdV2 || k == kFwdV3
                                          : k == kBwdV1 || k == kBwdV2);
  return !other && wgmma_device();
}

// KILN_FLASH_WGMMA_BWD: the backward v3's warpgroups per CTA x 64 keys (-1 when unset): 1x64 (the
// default at head size 64: 3 CTAs per SM, 2 at head size 128) or 2x64 (1 CTA per SM; the default
// at head size 128).
int bwd_wgmma_config() {
  static const kiln::internal::EnvChoice config("KILN_FLASH_WGMMA_BWD", {"1x64", "2x64"});
  return config.get();
}

// KILN_FLASH_WGMMA: the forward v4's warpgroups x key-block size, "r" for Q in registers (-1 when
// unset). Head size 64 takes 1x64, 2x64 (the default), 4x64, 2x128, 3x128, 1x32, 1x64r and
// 2x64r; head size 128 takes 1x64, 1x32, 1x64r, 2x64r and 3x64r (the default); head size 256
// takes 1x64, 1x32, 1x32r, 2x32 and 2x32r (the default); any other value selects the head
// size's default.
int fwd_wgmma_config() {
  static const kiln::internal::EnvChoice config(
      "KILN_FLASH_WGMMA", {"1x64", "2x64", "4x64", "2x128", "3x128", "1x32", "1x64r", "2x64r",
                           "1x32r", "2x32", "2x32r", "3x64r"});
  return config.get();
}

// Parts over which the head-size-256 backward splits a kv head's rep query heads (Params::hsplit).
// With few kv heads (gemma-2b has 1) its `ctas` (batch, kv head, key block) CTAs are too few and
// too unequal (causal) to fill the GPU; split, they add dK and dV into f32 accumulators. The
// smallest divisor of rep that gives 3 CTAs per SM, else rep; 1 under KILN_FLASH_BWD_HSPLIT=1.
int bwd_head_split(int64_t rep, int64_t ctas) {
  static const kiln::internal::EnvChoice no_split("KILN_FLASH_BWD_HSPLIT", {"1"});
  if (no_split.get() == 0) return 1;
  for (int64_t n = 1; n < rep; ++n) {
    if (rep % n == 0 && ctas * n >= 3 * loops::multiprocessor_count()) return static_cast<int>(n);
  }
  return static_cast<int>(rep);
}

// KILN_FLASH_KERNEL=v1 selects the v1 kernels for both passes, fwd_v1 / bwd_v1 for one pass
// only (cached; tests call kiln::internal::reload_env_switches() after setenv).
bool use_v1_kernels(bool forward) {
  const FlashKernel k = flash_kernel_switch();
  return k == FlashKernel::kV1 || k == (forward ? FlashKernel::kFwdV1 : FlashKernel::kBwdV1);
}

// KILN_FLASH_KERNEL=fwd_v2 runs the forward v2 where v3 would be the default.
bool use_fwd_v2() { return flash_kernel_switch() == FlashKernel::kFwdV2; }

// Warps per CTA of the forward v2 at D 64: 8 (128 query rows) unless KILN_FLASH_FWD_WARPS=4.
int fwd_warps_d64() {
  static const kiln::internal::EnvChoice warps("KILN_FLASH_FWD_WARPS", {"4", "8"});
  return warps.get() == 0 ? 4 : 8;
}

Params make_params(const OpCall& c, const Tensor& q, const Tensor& k, const Tensor& v) {
  Params p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.sq = strides_of(q);
  p.sk = strides_of(k);
  p.sv = strides_of(v);
  p.h = static_cast<int>(q.size(1));
  p.hkv = static_cast<int>(k.size(1));
  p.t = static_cast<int>(q.size(2));
  p.s = static_cast<int>(k.size(2));
  p.scale = static_cast<float>(c.attr<double>(0));
  const int64_t window = c.attr<int64_t>(2);
  p.causal = c.attr<bool>(1) || window > 0;  // a window is causal (as the composite)
  p.window = static_cast<int>(std::min<int64_t>(window, int64_t{1} << 30));
  p.softcap = static_cast<float>(c.attr<double>(3));
  p.hsplit = 1;
  return p;
}

void flash_attention_cuda(OpCall& c) {
  const Tensor q = kernel_operand(c.input(0));
  const Tensor k = kernel_operand(c.input(1));
  const Tensor v = kernel_operand(c.input(2));
  check_supported("flash_attention", q, c.attr<double>(0));
  KILN_CHECK(k.size(2) < (int64_t{1} << 30), "[flash_attention] too many keys: k ",
             shape_str(k.sizes()));
  const Tensor& out = c.outputs[0];
  const Tensor& lse = c.outputs[1];
  if (q.numel() == 0) return;
  DeviceGuard guard(q.device().index());
  Params p = make_params(c, q, k, v);
  p.out = out.data_ptr();
  p.lse = static_cast<float*>(lse.data_ptr());
  // v4 (the default with a positive scale on Hopper), v3 (elsewhere at D 64) and v2 put the
  // query blocks in grid.y (at most 65535 of them).
  // Head size 256 runs only here (check_supported: a positive scale, a Hopper device).
  if (q.size(3) == 256 || (p.scale > 0 && use_wgmma(true))) {
    auto go = [&]<int D, int NWG, int BN, bool QR = false>() {
      const int64_t nqb = (q.size(2) + 64 * NWG - 1) / (64 * NWG);
      if (nqb > 65535) return false;
      const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)), static_cast<unsigned>(nqb));
      visit_e(q.dtype(), [&]<typename E>(TypeTag<E>) {
        auto run = [&]<bool kCap, bool kQR>() {
          // Alignment slack, Q (unless in registers), 2 or 3 x (K, V).
          const size_t smem =
              1024 + 2 * D * ((kQR ? 0 : 64 * NWG) + 2 * wgmma_fwd_stages<D, NWG>() * BN);
          launch(flash_fwd_kernel_wgmma<E, D, kCap, NWG, BN, kQR>, grid, smem, p,
                 "flash_fwd_kernel_wgmma", 128 * NWG);
        };
        if (p.softcap > 0) {
          // With Q in registers the softcapped kernel at D 128 and 256 runs short of registers
          // (ptxas serializes its wgmma or spills): it keeps Q in shared memory.
          run.template operator()<true, QR && D == 64>();
        } else {
          run.template operator()<false, QR>();
        }
      });
      return true;
    };
    const int config = fwd_wgmma_config();
    bool done;
    if (q.size(3) == 64) {
      done = config == 0   ? go.template operator()<64, 1, 64>()
             : config == 2 ? go.template operator()<64, 4, 64>()
             : config == 3 ? go.template operator()<64, 2, 128>()
             : config == 4 ? go.template operator()<64, 3, 128>()
             : config == 5 ? go.template operator()<64, 1, 32>()
             : config == 6 ? go.template operator()<64, 1, 64, true>()
             : config == 7 ? go.template operator()<64, 2, 64, true>()
                           : go.template operator()<64, 2, 64>();
    } else if (q.size(3) == 128) {
      done = config == 0   ? go.template operator()<128, 1, 64>()
             : config == 5 ? go.template operator()<128, 1, 32>()
             : config == 6 ? go.template operator()<128, 1, 64, true>()
             : config == 7 ? go.template operator()<128, 2, 64, true>()
                           : go.template operator()<128, 3, 64, true>();
    } else {
      done = config == 0   ? go.template operator()<256, 1, 64>()
             : config == 5 ? go.template operator()<256, 1, 32>()
             : config == 8 ? go.template operator()<256, 1, 32, true>()
             : config == 9 ? go.template operator()<256, 2, 32>()
                           : go.template operator()<256, 2, 32, true>();
    }
    if (done) return;
    KILN_CHECK(q.size(3) != 256, "[flash_attention] internal: no head-size-256 kernel ran");
  }
  const int64_t nqb3 = (q.size(2) + 127) / 128;
  if (!use_v1_kernels(true) && !use_fwd_v2() && q.size(3) == 64 && p.scale > 0 && nqb3 <= 65535) {
    const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)), static_cast<unsigned>(nqb3));
    visit_e(q.dtype(), [&]<typename E>(TypeTag<E>) {
      constexpr int D = 64;
      const size_t smem = sizeof(E) * (D + 8) * (128 + 4 * kBlockN);
      if (p.softcap > 0) {
        launch(flash_fwd_kernel_v3<E, D, true>, grid, smem, p, "flash_fwd_kernel_v3", 128);
      } else {
        launch(flash_fwd_kernel_v3<E, D, false>, grid, smem, p, "flash_fwd_kernel_v3", 128);
      }
    });
    return;
  }
  const int kw = q.size(3) == 64 ? fwd_warps_d64() : kWarps;
  const int64_t nqb = (q.size(2) + 16 * kw - 1) / (16 * kw);
  if (!use_v1_kernels(true) && nqb <= 65535) {
    const dim3 grid(static_cast<unsigned>(q.size(0) * q.size(1)), static_cast<unsigned>(nqb));
    visit_e(q.dtype(), [&]<typename E>(TypeTag<E>) {
      visit_d_cap(q.size(3), p.softcap > 0,
                  [&]<int D, bool kCap>(std::integral_constant<int, D>, std::bool_constant<kCap>) {
                    auto go = [&]<int KW>(std::integral_constant<int, KW>) {
                      const size_t smem = sizeof(E) * (D + 8) * (16 * KW + 4 * kBlockN);
                      launch(flash_fwd_kernel_v2<E, D, kCap, KW>, grid, smem, p,
                             "flash_fwd_kernel_v2", 32 * KW);
                    };
                    if constexpr (D == 64) {
                      if (kw == 8) {
                        go(std::integral_constant<int, 8>{});
                      } else {
                        go(std::integral_constant<int, 4>{});
                      }
                    } else {
                      go(std::integral_constant<int, kWarps>{});
                    }
                  });
    });
    return;
  }
  const dim3 grid(static_cast<unsigned>((q.size(2) + kBlockM - 1) / kBlockM),
                  static_cast<unsigned>(q.size(0) * q.size(1)));
  visit_e(q.dtype(), [&]<typename E>(TypeTag<E>) {
    visit_d_cap(q.size(3), p.softcap > 0,
                [&]<int D, bool kCap>(std::integral_constant<int, D>, std::bool_constant<kCap>) {
                  const size_t smem = sizeof(E) * (D + 8) * (kBlockM + 4 * kBlockN);
                  launch(flash_fwd_kernel<E, D, kCap>, grid, smem, p, "flash_fwd_kernel");
                });
  });
}

void flash_attention_backward_cuda(OpCall& c) {
  const Tensor dout = kernel_operand(c.input(0));
  const Tensor q = kernel_operand(c.input(1));
  const Tensor k = kernel_operand(c.input(2));
  const Tensor v = kernel_operand(c.input(3));
  const Tensor out = aligned_contiguous(c.input(4));  // read in 16-byte packs by the delta pass
  const Tensor lse = c.input(5).contiguous();
  const Tensor dlse = c.input(6).contiguous();
  check_supported("flash_attention_backward", q, c.attr<double>(0));
  const Tensor& dq = c.outputs[0];
  const Tensor& dk = c.outputs[1];
  const Tensor& dv = c.outputs[2];
  DeviceGuard guard(q.device().index());
  const cudaStream_t stream = current_stream();
  if (k.numel() == 0) {  // no keys (or no kv heads): nothing reaches q
    if (dq.numel() > 0) KILN_CUDA_CHECK(cudaMemsetAsync(dq.data_ptr(), 0, dq.nbytes(), stream));
    return;
  }
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  const TensorOptions f32 = TensorOptions(kFloat).device(q.device());
  const Tensor delta = empty({std::max<int64_t>(rows, 1)}, f32);
  const Tensor dq_acc = empty({std::max<int64_t>(q.numel(), 1)}, f32);  // zeroed by the delta pass
  Params p = make_params(c, q, k, v);
  p.dout = dout.data_ptr();
  p.sdo = strides_of(dout);
  p.lse = static_cast<float*>(lse.data_ptr());
  p.delta = static_cast<const float*>(delta.data_ptr());
  p.dq_acc = static_cast<float*>(dq_acc.data_ptr());
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  visit_e(q.dtype(), [&]<typename E>(TypeTag<E>) {
    if (rows > 0) {
      auto delta_pass = [&]<int D>(std::integral_constant<int, D>) {
        constexpr int kRowsPerBlock = 256 / (D / 8);
        flash_bwd_delta_kernel<E, D>
            <<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0, stream>>>(
                static_cast<float*>(delta.data_ptr()), static_cast<float*>(dq_acc.data_ptr()),
                static_cast<const E*>(dout.data_ptr()), p.sdo,
                static_cast<const E*>(out.data_ptr()), static_cast<const float*>(dlse.data_ptr()),
                p.h, p.t, rows);
        KILN_CUDA_LAUNCH_CHECK("flash_bwd_delta_kernel");
      };
      if (q.size(3) == 64) {
        delta_pass(std::integral_constant<int, 64>{});
      } else if (q.size(3) == 128) {
        delta_pass(std::integral_constant<int, 128>{});
      } else {
        delta_pass(std::integral_constant<int, 256>{});
      }
    }
    const int64_t nkb = (k.size(2) + kBlockN - 1) / kBlockN;
    KILN_CHECK(nkb <= 65535 || q.size(3) != 256,
               "[flash_attention_backward] too many keys for the head-size-256 kernel: k ",
               shape_str(k.sizes()));
    // The convert pass: src (f32, n elements, a multiple of 4) rounded into dst.
    const auto convert = [&](void* dst, const float* src, int64_t n) {
      const int64_t n4 = n / 4;
      flash_bwd_convert_kernel<E>
          <<<static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 65536)), 256, 0, stream>>>(
              static_cast<E*>(dst), src, n4);
      KILN_CUDA_LAUNCH_CHECK("flash_bwd_convert_kernel");
    };
    Tensor dkv_acc;
    if (q.size(3) == 256) {
      // Head size 256: 2 warpgroups share 64 keys (grid.y), splitting the columns of dK and dV;
      // a kv head's query heads split over p.hsplit CTAs (bwd_head_split).
      constexpr int D = 256;
      p.hsplit = bwd_head_split(q.size(1) / k.size(1), k.size(0) * k.size(1) * nkb);
      if (p.hsplit > 1) {
        dkv_acc = empty({2 * k.numel()}, f32);
        KILN_CUDA_CHECK(cudaMemsetAsync(dkv_acc.data_ptr(), 0, dkv_acc.nbytes(), stream));
        p.dk_acc = static_cast<float*>(dkv_acc.data_ptr());
        p.dv_acc = p.dk_acc + k.numel();
      }
      const dim3 grid(static_cast<unsigned>(k.size(0) * k.size(1) * p.hsplit),
                      static_cast<unsigned>(nkb));
      // Alignment slack, K and V, 2 x (Q, dO), the P^T and dS^T tiles, 2 x (lse, Delta).
      const size_t smem = 1024 + 2 * D * 64 * 6 + 2 * 128 * 64 + sizeof(float) * 4 * 64;
      if (p.softcap > 0) {
        launch(flash_bwd_kernel_wgmma_split<E, D, true>, grid, smem, p,
               "flash_bwd_kernel_wgmma_split", 256);
      } else {
        launch(flash_bwd_kernel_wgmma_split<E, D, false>, grid, smem, p,
               "flash_bwd_kernel_wgmma_split", 256);
      }
    } else if (nkb <= 65535 && use_wgmma(false)) {
      // v3 (the default on Hopper): key blocks of 64 per warpgroup in grid.y.
      auto go = [&]<int D, int NWG>() {
        const dim3 grid3(static_cast<unsigned>(k.size(0) * k.size(1)),
                         static_cast<unsigned>((k.size(2) + 64 * NWG - 1) / (64 * NWG)));
        // Alignment slack, K and V (64 NWG rows), 2 x (Q, dO) (64 rows), NWG x dS^T (64 x 64),
        // 2 x (lse, Delta).
        const size_t smem =
            1024 + 2 * D * 64 * (2 * NWG + 4) + 128 * 64 * NWG + sizeof(float) * 4 * 64;
        if (p.softcap > 0) {
          launch(flash_bwd_kernel_wgmma<E, D, true, NWG>, grid3, smem, p, "flash_bwd_kernel_wgmma",
                 128 * NWG);
        } else {
          launch(flash_bwd_kernel_wgmma<E, D, false, NWG>, grid3, smem, p, "flash_bwd_kernel_wgmma",
                 128 * NWG);
        }
      };
      const int config = bwd_wgmma_config();
      if (q.size(3) == 128) {
        if (config == 0) {
          go.template operator()<128, 1>();
        } else {
          go.template operator()<128, 2>();
        }
      } else if (config == 1) {
        go.template operator()<64, 2>();
      } else {
        go.template operator()<64, 1>();
      }
    } else if (!use_v1_kernels(false) && q.size(3) == 64 && nkb <= 65535) {
      // v2 (the default for D 64): key blocks in grid.y, Q / dO double-buffered.
      const dim3 grid2(static_cast<unsigned>(k.size(0) * k.size(1)), static_cast<unsigned>(nkb));
      constexpr int D = 64;
      const size_t smem =
          sizeof(E) * ((D + 8) * (2 * kBlockN + 4 * kBlockM) + kBlockM * (kBlockN + 8)) +
          sizeof(float) * 4 * kBlockM;
      if (p.softcap > 0) {
        launch(flash_bwd_kernel_v2<E, D, true>, grid2, smem, p, "flash_bwd_kernel_v2");
      } else {
        launch(flash_bwd_kernel_v2<E, D, false>, grid2, smem, p, "flash_bwd_kernel_v2");
      }
    } else {
      const dim3 grid(static_cast<unsigned>((k.size(2) + kBlockN - 1) / kBlockN),
                      static_cast<unsigned>(k.size(0) * k.size(1)));
      visit_d_cap(q.size(3), p.softcap > 0,
                  [&]<int D, bool kCap>(std::integral_constant<int, D>, std::bool_constant<kCap>) {
                    const size_t smem = sizeof(E) * ((D + 8) * (2 * kBlockN + 2 * kBlockM) +
                                                     kBlockM * (kBlockN + 8)) +
                                        sizeof(float) * 2 * kBlockM;
                    launch(flash_bwd_kernel<E, D, kCap>, grid, smem, p, "flash_bwd_kernel");
                  });
    }
    if (q.numel() > 0) convert(dq.data_ptr(), p.dq_acc, q.numel());  // D: a multiple of 4
    if (p.dk_acc != nullptr) {
      convert(dk.data_ptr(), p.dk_acc, k.numel());
      convert(dv.data_ptr(), p.dv_acc, k.numel());
    }
  });
}

}  // namespace

bool flash_attention_supports_head_size(int64_t head_size, int device) {
  if (head_size == 64 || head_size == 128) return true;
  if (head_size != 256) return false;
  DeviceGuard guard(device < 0 ? current_device() : device);
  return wgmma_device();
}

KILN_REGISTER_KERNEL(flash_attention, kCUDA, flash_attention_cuda);
KILN_REGISTER_KERNEL(flash_attention_backward, kCUDA, flash_attention_backward_cuda);

}  // namespace kiln::cuda
