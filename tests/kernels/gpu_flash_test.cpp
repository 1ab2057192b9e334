// The flash-attention CUDA kernels (kernels/cuda/flash_attention.cu) against the CPU kernel
// (kernels/cpu/flash_attention.cpp, f64 loops) on the same bf16/f16 inputs, and the routed
// F::scaled_dot_product_attention against the composite (KILN_SDPA=math): odd lengths, T != S,
// causal, windows, softcap, GQA 4:1 and MQA, D 64, 128 and 256 (Hopper), strided q/k/v from a qkv
// split, rows that see no key, forward out/lse and backward dq/dk/dv (with and without a gradient
// on lse).
//
// Tolerances (relative L2 error against the f64 reference on identical inputs): the kernels
// round P (and dS in the backward) to the input dtype before the second GEMM and round the
// outputs once; each rounding is a relative error of at most 2^-9 (bf16) / 2^-12 (f16) per
// element, about a third of that in RMS, so the outputs land near 2e-3 (bf16) / 3e-4 (f16);
// gradients chain two such roundings and a cancellation (dP - Delta). Hence 1e-2 / 2e-3 for
// out, 2e-2 / 4e-3 for the gradients; lse is f32 throughout (1e-4 covers exp2f/logf).
//
// Every case runs on each kernel path (kernel_paths()) against one CPU reference.
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::kGpu;
using test::rel_error;

namespace F = nn::functional;

class GpuFlashAttention : public test::GpuTest {};

double out_tol(ScalarType t) { return t == kBFloat16 ? 1e-2 : 2e-3; }
double grad_tol(ScalarType t) { return t == kBFloat16 ? 2e-2 : 4e-3; }

struct Case {
  int64_t b, h, hkv, t, s, d;
  bool causal = false;
  int64_t window = 0;
  double softcap = 0;
  ScalarType dtype = kBFloat16;
  bool strided = false;  // q, k, v as views of one [B, T, H + 2 H_kv, D] projection
  bool dlse = false;     // a gradient on lse too
  bool growing = false;  // key j scaled by 1 + j / 16: scores grow along the keys
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.b) + " H" + std::to_string(c.h) + "/" + std::to_string(c.hkv) +
         " T" + std::to_string(c.t) + " S" + std::to_string(c.s) + " D" + std::to_string(c.d) +
         (c.causal ? " causal" : "") + " window " + std::to_string(c.window) + " softcap " +
         std::to_string(c.softcap) + " " + std::string(dtype_name(c.dtype)) +
         (c.strided ? " strided" : "") + (c.dlse ? " dlse" : "") + (c.growing ? " growing" : "");
}

// q, k, v on the GPU (in c.dtype; views of one projection when c.strided).
void make_inputs(const Case& c, Tensor& q, Tensor& k, Tensor& v) {
  if (c.strided) {
    const Tensor qkv = randn({c.b, c.t, c.h + 2 * c.hkv, c.d}).to(c.dtype).to(kGpu);
    q = qkv.narrow(2, 0, c.h).transpose(1, 2);
    k = qkv.narrow(2, c.h, c.hkv).transpose(1, 2);
    v = qkv.narrow(2, c.h + c.hkv, c.hkv).transpose(1, 2);
  } else {
    q = randn({c.b, c.h, c.t, c.d}).to(c.dtype).to(kGpu);
    Tensor kf = randn({c.b, c.hkv, c.s, c.d});
    if (c.growing) kf = kf * (arange(c.s, TensorOptions(kFloat)) / 16.0 + 1.0).reshape({c.s, 1});
    k = kf.to(c.dtype).to(kGpu);
    v = randn({c.b, c.hkv, c.s, c.d}).to(c.dtype).to(kGpu);
  }
}

// The kernel paths of kernels/cuda/flash_attention.cu, chosen by environment variables read at
// every call: v1 (KILN_FLASH_KERNEL=v1); the default (on Hopper the wgmma kernels: the v4
// forward with 2 warpgroups and 64-key blocks at D 64, 3 warpgroups, 64-key blocks and Q in
// registers at D 128, and the v3 backward with 1 warpgroup per CTA at D 64, 2 at D 128;
// elsewhere the v3 forward and v2 backward at D 64, the v2 forward and v1 backward at D 128);
// v4's other configurations (KILN_FLASH_WGMMA=1x64, also 64-key blocks at D 128; 1x32, 1x64r
// and 2x64r at both; 4x64, 2x128 and 3x128 at D 64; 3x64r, the D-128 default); the v3 forward
// (KILN_FLASH_KERNEL=fwd_v3: v2 at D 128; the backward stays at its default); the v3 backward
// with 2 warpgroups per CTA (KILN_FLASH_WGMMA_BWD=2x64); the v2 backward (bwd_v2: v1 at
// D 128); the v2 forward with 8 warps (fwd_v2) and with 4 warps (and KILN_FLASH_FWD_WARPS=4).
const std::vector<std::string>& kernel_paths() {
  static const std::vector<std::string> paths = {
      "v1",         "default",       "wgmma-1x64",  "wgmma-4x64", "wgmma-2x128",    "wgmma-3x128",
      "wgmma-1x32", "wgmma-1x64r",   "wgmma-2x64r", "fwd_v3",     "wgmma_bwd-2x64", "bwd_v2",
      "fwd_v2",     "fwd_v2-4warps", "wgmma-3x64r"};
  return paths;
}

// Selects a path for its lifetime, then restores the default.
class KernelPath {
 public:
  explicit KernelPath(const std::string& path)
      : kernel_("KILN_FLASH_KERNEL", path == "v1"                 ? "v1"
                                     : path == "fwd_v3"           ? "fwd_v3"
                                     : path == "bwd_v2"           ? "bwd_v2"
                                     : path.starts_with("fwd_v2") ? "fwd_v2"
                                                                  : ""),
        warps_("KILN_FLASH_FWD_WARPS", path == "fwd_v2-4warps" ? "4" : ""),
        wgmma_("KILN_FLASH_WGMMA", path.starts_with("wgmma-") ? path.substr(6) : ""),
        wgmma_bwd_("KILN_FLASH_WGMMA_BWD", path.starts_with("wgmma_bwd-") ? path.substr(10) : ""),
        hsplit_("KILN_FLASH_BWD_HSPLIT", path == "no-hsplit" ? "1" : "") {}

 private:
  test::ScopedEnv kernel_, warps_, wgmma_, wgmma_bwd_, hsplit_;
};

// Head size 256 has one forward kernel (v4: 2x32r by default, 1x64, 1x32, 1x32r and 2x32 under
// KILN_FLASH_WGMMA) and one backward (2 warpgroups sharing 64 keys; its query heads split over
// CTAs where the grid is small, which every GQA / MQA case here is, unless
// KILN_FLASH_BWD_HSPLIT=1): the other paths would run the same kernels again.
const std::vector<std::string>& kernel_paths_d256() {
  static const std::vector<std::string> paths = {"default",     "wgmma-1x64", "wgmma-1x32",
                                                 "wgmma-1x32r", "wgmma-2x32", "no-hsplit"};
  return paths;
}

bool takes_d256() { return cuda::flash_attention_supports_head_size(256); }

void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Tensor q, k, v;
  make_inputs(c, q, k, v);
  const double scale = 1.5 / std::sqrt(static_cast<double>(c.d));
  static const OpDef& fwd = KILN_OP(flash_attention);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const absl::InlinedVector<Attr, 4> attrs = {scale, c.causal, c.window, c.softcap};
  const TensorVec r = call_op(fwd, {q.to(kCPU), k.to(kCPU), v.to(kCPU)}, attrs);
  const Tensor dout = randn(q.sizes()).to(c.dtype);
  const Tensor dlse = c.dlse ? randn(r[1].sizes()) : zeros(r[1].sizes());
  const TensorVec dr =
      call_op(bwd, {dout, q.to(kCPU), k.to(kCPU), v.to(kCPU), r[0], r[1], dlse}, attrs);
  for (const std::string& path : c.d == 256 ? kernel_paths_d256() : kernel_paths()) {
    SCOPED_TRACE("kernel path " + path);
    const KernelPath scope(path);
    const TensorVec g = call_op(fwd, {q, k, v}, attrs);
    ASSERT_TRUE(g[0].is_cuda());
    EXPECT_EQ(g[0].dtype(), c.dtype);
    EXPECT_EQ(g[1].dtype(), kFloat);
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(c.dtype)) << "out";
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4) << "lse";
    // The backward takes the CPU reference's out and lse (as the forward's own are checked
    // above), so that its error is its own.
    const TensorVec dg =
        call_op(bwd, {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), dlse.to(kGpu)}, attrs);
    EXPECT_LE(rel_error(dg[0], dr[0]), grad_tol(c.dtype)) << "dq";
    EXPECT_LE(rel_error(dg[1], dr[1]), grad_tol(c.dtype)) << "dk";
    EXPECT_LE(rel_error(dg[2], dr[2]), grad_tol(c.dtype)) << "dv";
  }
}

TEST_F(GpuFlashAttention, OddLengthsCausalAndNot) {
  manual_seed(41);
  for (int64_t t : {1, 17, 100, 257}) {
    for (bool causal : {false, true}) {
      check_case({2, 3, 3, t, t, 64, causal});
      check_case({1, 2, 2, t, t, 128, causal});
    }
  }
}

TEST_F(GpuFlashAttention, GqaMqaAndF16) {
  manual_seed(42);
  check_case({2, 8, 2, 100, 100, 64, true});  // GQA 4:1
  check_case({1, 4, 1, 257, 257, 64, true});  // MQA
  check_case({1, 8, 2, 77, 77, 128, false});
  check_case({2, 4, 1, 130, 130, 64, true, 0, 0, kHalf});  // f16
  check_case({1, 2, 2, 65, 65, 128, false, 0, 0, kHalf});
}

TEST_F(GpuFlashAttention, WindowsSoftcapAndTNotS) {
  manual_seed(43);
  check_case({1, 4, 2, 257, 257, 64, true, 37});        // window crossing block edges
  check_case({1, 2, 2, 200, 200, 64, false, 64});       // a window alone (implies causal)
  check_case({1, 4, 4, 150, 150, 64, true, 0, 5.0});    // softcap
  check_case({1, 4, 2, 100, 100, 128, true, 20, 3.0});  // window + softcap, D 128
  check_case({1, 2, 2, 100, 257, 64, true});            // S > T (top-left causal)
  check_case({1, 2, 2, 257, 100, 64, true});            // T > S
  check_case({1, 2, 1, 200, 50, 64, true, 30});         // rows >= 79 see no key
  check_case({1, 2, 2, 33, 130, 64, false, 0, 0, kHalf, false, true});  // lse gradient
  check_case({1, 2, 2, 100, 100, 64, true, 0, 2.0, kBFloat16, false, true});
}

// A negative scale (v3 assumes a positive one and hands such calls to v2).
TEST_F(GpuFlashAttention, NegativeScale) {
  manual_seed(46);
  const Tensor q = randn({1, 2, 70, 64}).to(kBFloat16), k = randn({1, 2, 70, 64}).to(kBFloat16);
  const Tensor v = randn({1, 2, 70, 64}).to(kBFloat16);
  for (bool causal : {false, true}) {
    auto [oc, lc] = flash_attention(q, k, v, -0.2, causal);
    auto [o, l] = flash_attention(q.to(kGpu), k.to(kGpu), v.to(kGpu), -0.2, causal);
    EXPECT_LE(rel_error(o, oc), out_tol(kBFloat16));
    EXPECT_LE(rel_error(l, lc), 1e-4);
  }
}

TEST_F(GpuFlashAttention, StridedQkvSplitAndUnalignedViews) {
  manual_seed(44);
  check_case({2, 4, 2, 100, 100, 64, true, 0, 0, kBFloat16, true});
  check_case({1, 8, 8, 257, 257, 128, false, 0, 0, kBFloat16, true});
  check_case({1, 6, 2, 64, 64, 64, true, 0, 0, kHalf, true});
  // Views whose base is not 16-byte aligned take a contiguous copy first.
  const Tensor big = randn({1, 2, 40, 65}).to(kBFloat16).to(kGpu);
  const Tensor q = big.narrow(3, 1, 64), k = big.narrow(3, 0, 64);
  auto [oc, lc] = flash_attention(q.to(kCPU), k.to(kCPU), k.to(kCPU), 0.125, true);
  for (const std::string& path : kernel_paths()) {
    SCOPED_TRACE("kernel path " + path);
    const KernelPath scope(path);
    auto [o, l] = flash_attention(q, k, k, 0.125, true);
    EXPECT_LE(rel_error(o, oc), out_tol(kBFloat16));
    EXPECT_LE(rel_error(l, lc), 1e-4);
  }
}

// Contiguous views at an offset of one element (2 bytes off 16-byte alignment) for every
// operand of the forward and the backward, out included (the backward's delta pass reads dout
// and out in 16-byte packs): the kernels take aligned copies.
TEST_F(GpuFlashAttention, ContiguousMisalignedViews) {
  manual_seed(47);
  const Shape shape = {1, 2, 70, 64};
  const int64_t n = 2 * 70 * 64;
  auto misaligned = [&](const Tensor& cpu) {
    Tensor flat = empty({n + 1}, TensorOptions(kBFloat16).device(kGpu));
    Tensor view = flat.slice(0, 1, n + 1).view(shape);
    view.copy_(cpu.to(kGpu));
    EXPECT_TRUE(view.is_contiguous());
    return view;
  };
  const Tensor q = randn(shape).to(kBFloat16), k = randn(shape).to(kBFloat16),
               v = randn(shape).to(kBFloat16), dout = randn(shape).to(kBFloat16);
  static const OpDef& fwd = KILN_OP(flash_attention);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const absl::InlinedVector<Attr, 4> attrs = {0.125, true, int64_t{0}, 0.0};
  const TensorVec r = call_op(fwd, {q, k, v}, attrs);
  const Tensor dlse = zeros(r[1].sizes());
  const TensorVec dr = call_op(bwd, {dout, q, k, v, r[0], r[1], dlse}, attrs);
  for (const std::string& path : kernel_paths()) {
    SCOPED_TRACE("kernel path " + path);
    const KernelPath scope(path);
    const TensorVec g = call_op(fwd, {misaligned(q), misaligned(k), misaligned(v)}, attrs);
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(kBFloat16)) << "out";
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4) << "lse";
    const TensorVec dg = call_op(bwd,
                                 {misaligned(dout), misaligned(q), misaligned(k), misaligned(v),
                                  misaligned(r[0]), r[1].to(kGpu), dlse.to(kGpu)},
                                 attrs);
    EXPECT_LE(rel_error(dg[0], dr[0]), grad_tol(kBFloat16)) << "dq";
    EXPECT_LE(rel_error(dg[1], dr[1]), grad_tol(kBFloat16)) << "dk";
    EXPECT_LE(rel_error(dg[2], dr[2]), grad_tol(kBFloat16)) << "dv";
  }
}

TEST_F(GpuFlashAttention, LongerSequencesManyBlocks) {
  manual_seed(45);
  check_case({1, 4, 2, 1024, 1024, 64, true});
  check_case({1, 2, 2, 600, 600, 128, true, 256});
  // Several batches and kv heads (the v2 grids put heads in x, blocks in y), lengths that are
  // not multiples of the 128-row forward block, GQA 4:1, a window spanning several blocks.
  check_case({3, 8, 2, 333, 333, 64, true});
  check_case({2, 4, 4, 200, 200, 64, false});
  check_case({2, 4, 1, 450, 450, 64, true, 150, 0, kHalf});
  check_case({2, 4, 2, 320, 320, 64, true, 0, 0, kBFloat16, false, true});
}

// Scores that grow along the keys (key j scaled by 1 + j / 16), so that a row's running maximum
// keeps rising from block to block, by more than 2^8 in the log2 domain at some blocks and less
// at others: both branches of the forward v4's lazily moved maximum at D 128 (and the rescaling
// of every other path).
TEST_F(GpuFlashAttention, RunningMaximumRisesAcrossBlocks) {
  manual_seed(46);
  for (const int64_t d : {64, 128}) {
    check_case({1, 4, 2, 300, 300, d, true, 0, 0, kBFloat16, false, false, true});
    check_case({1, 2, 2, 200, 200, d, false, 0, 0, kHalf, false, false, true});
  }
}

// Head size 256 (Gemma): the Hopper kernels only (elsewhere the router takes the composite, and
// the op says why: UnsupportedHeadSizeAndDtypeErrors).
TEST_F(GpuFlashAttention, HeadSize256) {
  if (!takes_d256()) GTEST_SKIP() << "head size 256 runs on Hopper (sm_90a) GPUs only";
  manual_seed(48);
  for (int64_t t : {1, 70, 257}) {
    for (bool causal : {false, true}) check_case({1, 2, 2, t, t, 256, causal});
  }
  check_case({2, 8, 1, 130, 130, 256, true});                         // MQA (gemma-2b)
  check_case({1, 4, 2, 300, 300, 256, true, 100, 5.0});               // window + softcap (gemma-2)
  check_case({1, 2, 2, 100, 230, 256, true, 0, 0, kHalf});            // S > T, f16
  check_case({1, 2, 2, 230, 100, 256, true, 0, 3.0, kHalf});          // T > S, softcap, f16
  check_case({1, 4, 2, 150, 150, 256, true, 0, 0, kBFloat16, true});  // strided qkv
  check_case({1, 2, 2, 90, 90, 256, false, 0, 0, kBFloat16, false, true});          // lse gradient
  check_case({1, 2, 2, 300, 300, 256, true, 0, 0, kBFloat16, false, false, true});  // growing
}

TEST_F(GpuFlashAttention, RoutedSdpaEqualsCompositeWithGradients) {
  manual_seed(46);
  struct R {
    int64_t h, hkv, t, d;
    bool causal;
    int64_t window;
    double softcap;
  };
  for (const R& r : {R{4, 2, 77, 64, true, 0, 0.0}, R{4, 4, 130, 128, false, 0, 0.0},
                     R{8, 2, 100, 64, true, 33, 4.0}, R{4, 1, 90, 256, true, 40, 5.0}}) {
    if (r.d == 256 && !takes_d256()) continue;  // the composite on both sides
    SCOPED_TRACE(::testing::Message() << "H" << r.h << "/" << r.hkv << " T" << r.t << " D" << r.d);
    const Tensor q = randn({2, r.h, r.t, r.d}).to(kBFloat16).to(kGpu);
    const Tensor k = randn({2, r.hkv, r.t, r.d}).to(kBFloat16).to(kGpu);
    const Tensor v = randn({2, r.hkv, r.t, r.d}).to(kBFloat16).to(kGpu);
    const Tensor dout = randn({2, r.h, r.t, r.d}).to(kBFloat16).to(kGpu);
    auto run = [&](bool math) {
      const test::ScopedEnv sdpa("KILN_SDPA", math ? "math" : "");
      const Tensor ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
                   vl = v.detach().requires_grad_(true);
      const Tensor o = F::scaled_dot_product_attention(ql, kl, vl, {}, 0.0, r.causal, 0.1,
                                                       /*enable_gqa=*/true, r.window, r.softcap);
      autograd::variable_list g = autograd::grad({o}, {ql, kl, vl}, {dout});
      g.insert(g.begin(), o);
      return g;
    };
    const autograd::variable_list math = run(true);
    for (const std::string& path : r.d == 256 ? kernel_paths_d256() : kernel_paths()) {
      SCOPED_TRACE("kernel path " + path);
      const KernelPath scope(path);
      const autograd::variable_list fused = run(false);
      // Both round to bf16 at different points (the composite rounds the probabilities to bf16
      // before P V as well): the same tolerances as against the f64 loops, doubled.
      EXPECT_LE(rel_error(fused[0], math[0]), 2 * out_tol(kBFloat16)) << "out";
      EXPECT_LE(rel_error(fused[1], math[1]), 2 * grad_tol(kBFloat16)) << "dq";
      EXPECT_LE(rel_error(fused[2], math[2]), 2 * grad_tol(kBFloat16)) << "dk";
      EXPECT_LE(rel_error(fused[3], math[3]), 2 * grad_tol(kBFloat16)) << "dv";
    }
  }
}

TEST_F(GpuFlashAttention, UnsupportedHeadSizeAndDtypeErrors) {
  const Tensor q = randn({1, 2, 8, 32}).to(kBFloat16).to(kGpu);
  EXPECT_KILN_ERROR(flash_attention(q, q, q, 0.1), "head sizes 64, 128 and (on Hopper) 256");
  // Head size 256: a Hopper GPU and a positive scale.
  const Tensor q256 = randn({1, 2, 8, 256}).to(kBFloat16).to(kGpu);
  if (takes_d256()) {
    EXPECT_KILN_ERROR(flash_attention(q256, q256, q256, -0.1), "positive scale");
  } else {
    EXPECT_KILN_ERROR(flash_attention(q256, q256, q256, 0.1), "Hopper");
  }
  const Tensor o256 = F::scaled_dot_product_attention(q256, q256, q256, {}, 0.0, true, -0.1);
  EXPECT_EQ(to_shape(o256.sizes()), to_shape(q256.sizes()));
  const Tensor q32 = randn({1, 2, 8, 64}).to(kGpu);
  EXPECT_KILN_ERROR(flash_attention(q32, q32, q32, 0.1), "bfloat16 or float16");
  // The router sends these to the composite instead.
  const Tensor o = F::scaled_dot_product_attention(q, q, q, {}, 0.0, true);
  EXPECT_EQ(to_shape(o.sizes()), to_shape(q.sizes()));
}

}  // namespace
}  // namespace kiln
