// The flash-attention kernel lab (lab.h): the variants of the flash kernels that the library does
// not ship, each validated against the CPU reference (kernels/cpu/flash_attention.cpp on f64
// copies) and timed beside the library's kernels at the GPU benchmark's shapes (causal bf16: 160m
// B16 H12 T1024 D64, 1b B4 H32/8 T2048 D64, 7b B4 H32/8 T2048 D128, g2b B4 H8/1 T2048 D256).
//
//   kiln_kernel_lab --only flash_attention
//
// The variants reuse the library's kernel templates and launch configurations
// (kernels/cuda/flash_{fwd,bwd}_{sm80,hopper}.cuh) in the configurations the library does not
// choose, and the library's pre- and post-processing (flash::run_forward / run_backward); the first
// forward (v1), which no configuration of a library kernel reproduces, lives here. Rows:
// "[library]" is the dispatcher's choice (flash_hopper on Hopper), "[... (flash_sm80)]" the
// portable family forced by name. The measurements and why each variant lost:
// benchmarks/RESULTS.md.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/flash_bwd_hopper.cuh"
#include "kernels/cuda/flash_bwd_sm80.cuh"
#include "kernels/cuda/flash_fwd_hopper.cuh"
#include "kernels/cuda/flash_fwd_sm80.cuh"
#include "lab/lab.h"
#include "tensor/ops.h"

namespace {

using kiln::Tensor;
using kiln::TensorVec;
namespace flash = kiln::cuda::flash;
using Attrs = absl::InlinedVector<kiln::Attr, 4>;
using E = __nv_bfloat16;

// --- Forward v1 --------------------------------------------------------------------------------
// The first flash forward: 4 warps of 16 query rows per 64-row query block, grid (query blocks,
// B * H) (issued head by head, heaviest block first within a head, so that the long causal blocks
// of the last heads trail), K fragments by 32-bit shared loads. v2 (flash_fwd_sm80.cuh) swapped
// the grid's axes, loads K by ldmatrix and gives a CTA 128 rows at head size 64.
template <int D, bool kCap>
__global__ void __launch_bounds__(flash::kThreads) flash_fwd_kernel_v1(const flash::Params p) {
  using namespace kiln::cuda::flash;
  constexpr int SD = D + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  const PaddedTiles<E, D, kBlockM, kThreads> tiles(smem);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int mb = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int bh = blockIdx.y;
  const HeadRows<E> x = head_rows<E>(p, bh);
  const int m0 = mb * kBlockM;
  int nb0, nb1;
  key_blocks<kBlockM, kBlockN>(p, m0, nb0, nb1);
  tiles.start(p, x, m0, nb0, nb1);

  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a(qf[kk], tiles.sq, SD, w * 16, kk * 16);
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
  const int row[2] = {m0 + w * 16 + g, m0 + w * 16 + g + 8};

  for (int nb = nb0; nb < nb1; ++nb) {
    const int buf = tiles.next(p, x, nb, nb0, nb1);
    const E* kb = tiles.k_block(buf);
    const int n0 = nb * kBlockN;
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
    const bool mask = n0 + kBlockN > p.s || (p.causal && n0 + kBlockN - 1 > m0) ||
                      (p.window > 0 && n0 <= m0 + kBlockM - 1 - p.window);
    softmax_block<D, kCap>(p, s, row, n0, t, mask, mrow, lrow, o);
    add_pv<E, D>(o, s, tiles.v_block(buf), lane);
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  store_out_lse<E, D>(p, bh, row[0], t, mrow, lrow, [&](int dt, int c) { return o[dt][c]; });
}

template <int D>
void fwd_v1(const flash::Params& p, const flash::LaunchInfo& info) {
  const dim3 grid(static_cast<unsigned>((p.t + flash::kBlockM - 1) / flash::kBlockM),
                  static_cast<unsigned>(info.batch * p.h));
  const size_t smem = sizeof(E) * (D + 8) * (flash::kBlockM + 4 * flash::kBlockN);
  flash::launch(flash_fwd_kernel_v1<D, false>, grid, smem, p, "flash_fwd_kernel_v1");
}

// --- The library's kernel templates in other configurations (bf16, no softcap) ------------------

template <int D, int KW>
void fwd_v2(const flash::Params& p, const flash::LaunchInfo& info) {
  flash::launch_fwd_v2<E, D, false, KW>(p, info.batch);
}
template <int D, int NWG, int BN, bool QR>
void fwd_wgmma(const flash::Params& p, const flash::LaunchInfo& info) {
  flash::launch_fwd_wgmma<E, D, false, NWG, BN, QR>(p, info.batch);
}
template <int D>
void bwd_v1(const flash::Params& p, const flash::LaunchInfo& info) {
  flash::launch_bwd_v1<E, D, false>(p, info.batch);
}
template <int D, int NWG>
void bwd_wgmma(const flash::Params& p, const flash::LaunchInfo& info) {
  flash::launch_bwd_wgmma<E, D, false, NWG>(p, info.batch);
}
void bwd_no_head_split(const flash::Params& p, const flash::LaunchInfo& info) {
  flash::launch_bwd_hopper(p, info, /*hsplit=*/1);
}

// --- Variants ----------------------------------------------------------------------------------

const kiln::OpDef& fwd_op() {
  static const kiln::OpDef& op = KILN_OP(flash_attention);
  return op;
}
const kiln::OpDef& bwd_op() {
  static const kiln::OpDef& op = KILN_OP(flash_attention_backward);
  return op;
}

struct Variant {
  std::string name;  // the row tag
  int d;             // the head size it runs at
  bool forward;
  const char* family;        // the library family whose device and shape rule it shares
  flash::Launcher launcher;  // nullptr: the library's family `family` itself, forced by name
};

// Runs a variant's pass on GPU tensors: (q, k, v) -> (out, lse) or (dout, q, k, v, out, lse, dlse)
// -> (dq, dk, dv).
TensorVec run(const Variant& variant, const TensorVec& inputs, const Attrs& attrs) {
  const kiln::OpDef& op = variant.forward ? fwd_op() : bwd_op();
  if (variant.launcher == nullptr) {
    return kiln::call_op_with_kernel(op, variant.family, inputs, attrs);
  }
  kiln::OpCall call;
  call.op = &op;
  call.inputs = inputs;
  call.attrs = attrs;
  for (const kiln::TensorSpec& s : op.meta(call)) {
    call.outputs.push_back(kiln::empty(s.sizes, kiln::TensorOptions(s.dtype).device(s.device)));
  }
  if (variant.forward) {
    flash::run_forward(call, variant.launcher);
  } else {
    flash::run_backward(call, variant.launcher);
  }
  return call.outputs;
}

// Whether the variant's family rule accepts a call with these inputs (its device can run it).
bool runs_here(const Variant& variant, const TensorVec& inputs, const Attrs& attrs) {
  kiln::OpCall call;
  call.op = variant.forward ? &fwd_op() : &bwd_op();
  call.inputs = inputs;
  call.attrs = attrs;
  return call.op->find_kernel(kiln::kCUDA, variant.family)->accepts(call);
}

const std::vector<Variant>& variants() {
  static const std::vector<Variant> v = {
      {"v3 (flash_sm80)", 64, true, "flash_sm80", nullptr},
      {"v2", 64, true, "flash_sm80", fwd_v2<64, 8>},
      {"v2 4 warps", 64, true, "flash_sm80", fwd_v2<64, 4>},
      {"v1", 64, true, "flash_sm80", fwd_v1<64>},
      {"wgmma 1x64", 64, true, "flash_hopper", fwd_wgmma<64, 1, 64, false>},
      {"wgmma 1x32", 64, true, "flash_hopper", fwd_wgmma<64, 1, 32, false>},
      {"wgmma 4x64", 64, true, "flash_hopper", fwd_wgmma<64, 4, 64, false>},
      {"wgmma 2x128", 64, true, "flash_hopper", fwd_wgmma<64, 2, 128, false>},
      {"wgmma 3x128", 64, true, "flash_hopper", fwd_wgmma<64, 3, 128, false>},
      {"wgmma 1x64r", 64, true, "flash_hopper", fwd_wgmma<64, 1, 64, true>},
      {"wgmma 2x64r", 64, true, "flash_hopper", fwd_wgmma<64, 2, 64, true>},
      {"v2 (flash_sm80)", 64, false, "flash_sm80", nullptr},
      {"v1", 64, false, "flash_sm80", bwd_v1<64>},
      {"wgmma 2x64", 64, false, "flash_hopper", bwd_wgmma<64, 2>},
      {"v2 (flash_sm80)", 128, true, "flash_sm80", nullptr},
      {"v1", 128, true, "flash_sm80", fwd_v1<128>},
      {"wgmma 1x64", 128, true, "flash_hopper", fwd_wgmma<128, 1, 64, false>},
      {"wgmma 1x32", 128, true, "flash_hopper", fwd_wgmma<128, 1, 32, false>},
      {"wgmma 1x64r", 128, true, "flash_hopper", fwd_wgmma<128, 1, 64, true>},
      {"wgmma 2x64r", 128, true, "flash_hopper", fwd_wgmma<128, 2, 64, true>},
      {"v1 (flash_sm80)", 128, false, "flash_sm80", nullptr},
      {"wgmma 1x64", 128, false, "flash_hopper", bwd_wgmma<128, 1>},
      {"wgmma 1x64", 256, true, "flash_hopper", fwd_wgmma<256, 1, 64, false>},
      {"wgmma 1x32", 256, true, "flash_hopper", fwd_wgmma<256, 1, 32, false>},
      {"wgmma 1x32r", 256, true, "flash_hopper", fwd_wgmma<256, 1, 32, true>},
      {"wgmma 2x32", 256, true, "flash_hopper", fwd_wgmma<256, 2, 32, false>},
      {"no head split", 256, false, "flash_hopper", bwd_no_head_split},
  };
  return v;
}

// --- Validation against the CPU reference ------------------------------------------------------

struct Case {
  int64_t b, h, hkv, t, s;
  bool causal;
  int64_t window;
};

// Elementwise against the f64 reference, with an absolute tolerance relative to its largest value
// (bf16 operands: P and dS are rounded to bf16 before their second GEMM).
void check_close(const std::string& what, const Tensor& got, const Tensor& ref, double tol) {
  const double scale = ref.numel() > 0 ? ref.abs().max().item<double>() : 0.0;
  kiln::lab::check(what, got, ref, tol * std::max(scale, 1.0), tol);
}

void validate(int d) {
  for (const Case& c : {Case{2, 4, 2, 257, 257, true, 0}, Case{1, 2, 1, 100, 130, false, 0},
                        Case{1, 4, 4, 200, 200, true, 37}}) {
    const Tensor q = kiln::bench::random({c.b, c.h, c.t, d}, kiln::kBFloat16, 1.0f);
    const Tensor k = kiln::bench::random({c.b, c.hkv, c.s, d}, kiln::kBFloat16, 1.0f);
    const Tensor v = kiln::bench::random({c.b, c.hkv, c.s, d}, kiln::kBFloat16, 1.0f);
    const Tensor dout = kiln::bench::random({c.b, c.h, c.t, d}, kiln::kBFloat16, 1.0f);
    const Attrs attrs = {1.5 / std::sqrt(static_cast<double>(d)), c.causal, c.window, 0.0};
    const auto f64 = [](const Tensor& t) { return t.to(kiln::kCPU).to(kiln::kDouble); };
    const TensorVec ref = kiln::call_op(fwd_op(), {f64(q), f64(k), f64(v)}, attrs);
    const Tensor dlse = kiln::zeros(ref[1].sizes(), kiln::TensorOptions(kiln::kDouble));
    const TensorVec dref =
        kiln::call_op(bwd_op(), {f64(dout), f64(q), f64(k), f64(v), ref[0], ref[1], dlse}, attrs);
    const TensorVec fwd_in = {q, k, v};
    const TensorVec bwd_in = {dout,
                              q,
                              k,
                              v,
                              ref[0].to(kiln::kBFloat16).to(q.device()),
                              ref[1].to(kiln::kFloat).to(q.device()),
                              dlse.to(kiln::kFloat).to(q.device())};
    const std::string tag = "D" + std::to_string(d) + " T" + std::to_string(c.t) + " S" +
                            std::to_string(c.s) + (c.causal ? " causal" : "") +
                            (c.window > 0 ? " window" : "");
    for (const Variant& variant : variants()) {
      if (variant.d != d) continue;
      const TensorVec& in = variant.forward ? fwd_in : bwd_in;
      if (!runs_here(variant, in, attrs)) continue;
      const std::string name =
          std::string(variant.forward ? "fwd [" : "bwd [") + variant.name + "] " + tag;
      const TensorVec got = run(variant, in, attrs);
      if (variant.forward) {
        check_close(name + " out", got[0], ref[0], 2e-2);
        check_close(name + " lse", got[1], ref[1], 1e-3);
      } else {
        check_close(name + " dq", got[0], dref[0], 4e-2);
        check_close(name + " dk", got[1], dref[1], 4e-2);
        check_close(name + " dv", got[2], dref[2], 4e-2);
      }
    }
  }
}

// --- Timing at the benchmark shapes ------------------------------------------------------------

struct Shape {
  const char* name;
  int64_t b, h, hkv, t, d;
};

void time_shape(const Shape& s) {
  const Tensor q = kiln::bench::random({s.b, s.h, s.t, s.d}, kiln::kBFloat16);
  const Tensor k = kiln::bench::random({s.b, s.hkv, s.t, s.d}, kiln::kBFloat16);
  const Tensor v = kiln::bench::random({s.b, s.hkv, s.t, s.d}, kiln::kBFloat16);
  const Tensor dout = kiln::bench::random({s.b, s.h, s.t, s.d}, kiln::kBFloat16);
  const Attrs attrs = {1.0 / std::sqrt(static_cast<double>(s.d)), true, int64_t{0}, 0.0};
  const TensorVec fwd_in = {q, k, v};
  kiln::OpCall call;
  call.op = &fwd_op();
  call.inputs = fwd_in;
  call.attrs = attrs;
  if (fwd_op().select_kernel(kiln::kCUDA, call) == nullptr) return;  // no flash kernel here
  const TensorVec out = kiln::call_op(fwd_op(), fwd_in, attrs);
  const Tensor dlse =
      kiln::zeros(out[1].sizes(), kiln::TensorOptions(kiln::kFloat).device(q.device()));
  const TensorVec bwd_in = {dout, q, k, v, out[0], out[1], dlse};
  const double flops = 4.0 * s.b * s.h * s.t * s.t * s.d / 2;
  const std::string base = std::string("sdpa causal ") + s.name;
  kiln::bench::report(
      base + " fwd [library]",
      kiln::bench::time_ms([&](int) { (void)kiln::call_op(fwd_op(), fwd_in, attrs); }), flops, 0);
  kiln::bench::report(base + " bwd [library]", kiln::bench::time_ms([&](int) {
                        (void)kiln::call_op(bwd_op(), bwd_in, attrs);
                      }),
                      2.5 * flops, 0);
  for (const Variant& variant : variants()) {
    if (variant.d != s.d) continue;
    const TensorVec& in = variant.forward ? fwd_in : bwd_in;
    if (!runs_here(variant, in, attrs)) continue;
    kiln::bench::report(base + (variant.forward ? " fwd [" : " bwd [") + variant.name + "]",
                        kiln::bench::time_ms([&](int) { (void)run(variant, in, attrs); }),
                        variant.forward ? flops : 2.5 * flops, 0);
  }
}

KILN_LAB_CASE(flash_attention, [] {
  for (const int d : {64, 128, 256}) validate(d);
  for (const Shape& s : {Shape{"160m", 16, 12, 12, 1024, 64}, Shape{"1b", 4, 32, 8, 2048, 64},
                         Shape{"7b", 4, 32, 8, 2048, 128}, Shape{"g2b", 4, 8, 1, 2048, 256}}) {
    time_shape(s);
  }
});

}  // namespace
