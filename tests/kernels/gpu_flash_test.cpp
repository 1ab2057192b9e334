// The flash-attention CUDA kernels (kernels/cuda/flash_attention.cu and the family files beside
// it) against the CPU kernel's f64 loops (kernels/cpu/flash_attention.cpp) on the same bf16/f16
// inputs widened (attention_reference), and the support rules: odd lengths, T != S, causal,
// windows, softcap, GQA 4:1 and MQA, D 64, 128 and 256 (Hopper), negative scales, strided q/k/v
// from a qkv split, misaligned views, rows that see no key, forward out/lse and backward dq/dk/dv
// (with and without a gradient on lse).
//
// Every case runs on each kernel family whose support rule accepts it, forced by name
// (call_op_with_kernel): "flash_hopper" (the wgmma kernels, on compute capability 9.x) and
// "flash_sm80" (the mma.sync kernels, which a Hopper GPU runs too). Within a family the kernel
// follows the call: flash_sm80 takes the forward v3 at D 64 with a positive scale and v2 otherwise,
// the backward v2 at D 64 and v1 at D 128; flash_hopper's backward at D 256 splits the query heads
// over CTAs where the grid is small (the GQA / MQA cases here) and not where it is large (rep 1).
//
// Tolerances (relative L2 error against the f64 reference on identical inputs): the kernels
// round P (and dS in the backward) to the input dtype before the second GEMM and round the
// outputs once; each rounding is a relative error of at most 2^-9 (bf16) / 2^-12 (f16) per
// element, about a third of that in RMS, so the outputs land near 2e-3 (bf16) / 3e-4 (f16);
// gradients chain two such roundings and a cancellation (dP - Delta). Hence 1e-2 / 2e-3 for
// out, 2e-2 / 4e-3 for the gradients; lse is f32 throughout (1e-4 covers exp2f/logf).
//
// Suites named Gpu* carry the ctest label `gpu` and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::attention_reference;
using test::kGpu;
using test::rel_error;
using Attrs = absl::InlinedVector<Attr, 4>;

namespace F = nn::functional;

class GpuFlashAttention : public test::GpuTest {};

double out_tol(ScalarType t) { return t == kBFloat16 ? 1e-2 : 2e-3; }
double grad_tol(ScalarType t) { return t == kBFloat16 ? 2e-2 : 4e-3; }

const OpDef& fwd_op() {
  static const OpDef& op = KILN_OP(flash_attention);
  return op;
}
const OpDef& bwd_op() {
  static const OpDef& op = KILN_OP(flash_attention_backward);
  return op;
}

const std::vector<std::string>& families() {
  static const std::vector<std::string> f = {"flash_hopper", "flash_sm80"};
  return f;
}

// Whether the CUDA kernel `kernel` of `op` accepts the call (meta-valid inputs).
bool accepts(const OpDef& op, const std::string& kernel, const TensorVec& inputs,
             const Attrs& attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = inputs;
  call.attrs = attrs;
  const KernelDef* k = op.find_kernel(kCUDA, kernel);
  return k != nullptr && k->accepts(call);
}

struct Case {
  int64_t b, h, hkv, t, s, d;
  bool causal = false;
  int64_t window = 0;
  double softcap = 0;
  ScalarType dtype = kBFloat16;
  bool strided = false;  // q, k, v as views of one [B, T, H + 2 H_kv, D] projection
  bool dlse = false;     // a gradient on lse too (else zeros, and undefined: both are checked)
  bool growing = false;  // key j scaled by 1 + j / 16: scores grow along the keys
  double scale = 0;      // 0: 1.5 / sqrt(D)
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.b) + " H" + std::to_string(c.h) + "/" + std::to_string(c.hkv) +
         " T" + std::to_string(c.t) + " S" + std::to_string(c.s) + " D" + std::to_string(c.d) +
         (c.causal ? " causal" : "") + " window " + std::to_string(c.window) + " softcap " +
         std::to_string(c.softcap) + " " + std::string(dtype_name(c.dtype)) +
         (c.strided ? " strided" : "") + (c.dlse ? " dlse" : "") + (c.growing ? " growing" : "") +
         " scale " + std::to_string(c.scale);
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

// Runs the case's forward and backward on every family that accepts it (at least one must; which
// ones, SupportRules checks) against the CPU kernel.
// The backward takes the CPU reference's out and lse (the forward's own are checked first), so
// that its error is its own.
void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Tensor q, k, v;
  make_inputs(c, q, k, v);
  const double scale = c.scale != 0 ? c.scale : 1.5 / std::sqrt(static_cast<double>(c.d));
  const Attrs attrs = {scale, c.causal, c.window, c.softcap};
  const TensorVec r = attention_reference(fwd_op(), {q, k, v}, attrs);
  const Tensor dout = randn(q.sizes()).to(c.dtype);
  const Tensor dlse = c.dlse ? randn(r[1].sizes()) : zeros(r[1].sizes());
  const TensorVec dr = attention_reference(bwd_op(), {dout, q, k, v, r[0], r[1], dlse}, attrs);
  const TensorVec fwd_in = {q, k, v};
  const TensorVec bwd_in = {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), dlse.to(kGpu)};
  int ran = 0;
  for (const std::string& family : families()) {
    const bool takes = accepts(fwd_op(), family, fwd_in, attrs);
    EXPECT_EQ(takes, accepts(bwd_op(), family, bwd_in, attrs)) << family;
    if (!takes) continue;
    SCOPED_TRACE("kernel " + family);
    ++ran;
    const TensorVec g = call_op_with_kernel(fwd_op(), family, fwd_in, attrs);
    ASSERT_TRUE(g[0].is_cuda());
    EXPECT_EQ(g[0].dtype(), c.dtype);
    EXPECT_EQ(g[1].dtype(), kFloat);
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(c.dtype)) << "out";
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4) << "lse";
    const TensorVec dg = call_op_with_kernel(bwd_op(), family, bwd_in, attrs);
    EXPECT_LE(rel_error(dg[0], dr[0]), grad_tol(c.dtype)) << "dq";
    EXPECT_LE(rel_error(dg[1], dr[1]), grad_tol(c.dtype)) << "dk";
    EXPECT_LE(rel_error(dg[2], dr[2]), grad_tol(c.dtype)) << "dv";
    if (!c.dlse) {  // an undefined dlse (zeros: what training passes) gives the same gradients
      TensorVec no_dlse = bwd_in;
      no_dlse[6] = Tensor();
      const TensorVec du = call_op_with_kernel(bwd_op(), family, no_dlse, attrs);
      EXPECT_LE(rel_error(du[0], dr[0]), grad_tol(c.dtype)) << "dq, dlse undefined";
      EXPECT_LE(rel_error(du[1], dr[1]), grad_tol(c.dtype)) << "dk, dlse undefined";
      EXPECT_LE(rel_error(du[2], dr[2]), grad_tol(c.dtype)) << "dv, dlse undefined";
    }
  }
  EXPECT_GE(ran, 1) << "no flash kernel took the case";
}

// Whether this GPU runs the Hopper family (wgmma kernels built and compute capability 9.x).
bool hopper_here() {
  const Tensor q = randn({1, 1, 8, 64}).to(kBFloat16).to(kGpu);
  return accepts(fwd_op(), "flash_hopper", {q, q, q}, {0.125, true, int64_t{0}, 0.0});
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

// A negative scale: flash_sm80 only (the forward v2; flash_hopper's softmax and v3's need a
// positive scale).
TEST_F(GpuFlashAttention, NegativeScale) {
  manual_seed(46);
  for (bool causal : {false, true}) {
    check_case({1, 2, 2, 70, 70, 64, causal, 0, 0, kBFloat16, false, false, false, -0.2});
    check_case({1, 2, 1, 90, 90, 128, causal, 0, 0, kBFloat16, false, false, false, -0.1});
  }
  check_case({1, 2, 2, 70, 70, 64, true, 0, 3.0, kBFloat16, false, false, false, -0.2});
}

TEST_F(GpuFlashAttention, StridedQkvSplitAndUnalignedViews) {
  manual_seed(44);
  check_case({2, 4, 2, 100, 100, 64, true, 0, 0, kBFloat16, true});
  check_case({1, 8, 8, 257, 257, 128, false, 0, 0, kBFloat16, true});
  check_case({1, 6, 2, 64, 64, 64, true, 0, 0, kHalf, true});
  // Views whose base is not 16-byte aligned take a contiguous copy first.
  const Tensor big = randn({1, 2, 40, 65}).to(kBFloat16).to(kGpu);
  const Tensor q = big.narrow(3, 1, 64), k = big.narrow(3, 0, 64);
  const Attrs attrs = {0.125, true, int64_t{0}, 0.0};
  const TensorVec r = attention_reference(fwd_op(), {q, k, k}, attrs);
  for (const std::string& family : families()) {
    if (!accepts(fwd_op(), family, {q, k, k}, attrs)) continue;
    SCOPED_TRACE("kernel " + family);
    const TensorVec g = call_op_with_kernel(fwd_op(), family, {q, k, k}, attrs);
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(kBFloat16));
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4);
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
  const Attrs attrs = {0.125, true, int64_t{0}, 0.0};
  const TensorVec r = call_op(fwd_op(), {q, k, v}, attrs);
  const Tensor dlse = zeros(r[1].sizes());
  const TensorVec dr = call_op(bwd_op(), {dout, q, k, v, r[0], r[1], dlse}, attrs);
  for (const std::string& family : families()) {
    const TensorVec fwd_in = {misaligned(q), misaligned(k), misaligned(v)};
    if (!accepts(fwd_op(), family, fwd_in, attrs)) continue;
    SCOPED_TRACE("kernel " + family);
    const TensorVec g = call_op_with_kernel(fwd_op(), family, fwd_in, attrs);
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(kBFloat16)) << "out";
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4) << "lse";
    const TensorVec dg =
        call_op_with_kernel(bwd_op(), family,
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
  // Several batches and kv heads (the grids put heads in x, blocks in y), lengths that are not
  // multiples of the 128-row forward block, GQA 4:1, a window spanning several blocks.
  check_case({3, 8, 2, 333, 333, 64, true});
  check_case({2, 4, 4, 200, 200, 64, false});
  check_case({2, 4, 1, 450, 450, 64, true, 150, 0, kHalf});
  check_case({2, 4, 2, 320, 320, 64, true, 0, 0, kBFloat16, false, true});
}

// Scores that grow along the keys (key j scaled by 1 + j / 16), so that a row's running maximum
// keeps rising from block to block, by more than 2^8 in the log2 domain at some blocks and less
// at others: both branches of the Hopper forward's lazily moved maximum at D 128 and 256 (and the
// rescaling of every other kernel).
TEST_F(GpuFlashAttention, RunningMaximumRisesAcrossBlocks) {
  manual_seed(46);
  for (const int64_t d : {64, 128}) {
    check_case({1, 4, 2, 300, 300, d, true, 0, 0, kBFloat16, false, false, true});
    check_case({1, 2, 2, 200, 200, d, false, 0, 0, kHalf, false, false, true});
  }
}

// Head size 256 (Gemma): flash_hopper only (elsewhere no flash kernel takes it).
TEST_F(GpuFlashAttention, HeadSize256) {
  if (!hopper_here()) GTEST_SKIP() << "head size 256 runs on Hopper (sm_90a) GPUs only";
  manual_seed(48);
  for (int64_t t : {1, 70, 257}) {
    for (bool causal : {false, true}) check_case({1, 2, 2, t, t, 256, causal});
  }
  check_case({2, 8, 1, 130, 130, 256, true});                         // MQA (gemma-2b): split
  check_case({1, 4, 2, 300, 300, 256, true, 100, 5.0});               // window + softcap (gemma-2)
  check_case({1, 2, 2, 100, 230, 256, true, 0, 0, kHalf});            // S > T, f16
  check_case({1, 2, 2, 230, 100, 256, true, 0, 3.0, kHalf});          // T > S, softcap, f16
  check_case({1, 4, 2, 150, 150, 256, true, 0, 0, kBFloat16, true});  // strided qkv
  check_case({1, 2, 2, 90, 90, 256, false, 0, 0, kBFloat16, false, true});          // lse gradient
  check_case({1, 2, 2, 300, 300, 256, true, 0, 0, kBFloat16, false, false, true});  // growing
}

// More than 65535 (batch, kv head) pairs: the Hopper grids put them in x (no such limit), the
// sm80 backward v1 in y, so flash_sm80 declines the call, for both passes.
TEST_F(GpuFlashAttention, ManyHeads) {
  manual_seed(49);
  for (const int64_t d : {64, 128}) {
    const Case c{1, 70000, 70000, 3, 3, d, true};
    Tensor q, k, v;
    make_inputs(c, q, k, v);
    EXPECT_FALSE(accepts(fwd_op(), "flash_sm80", {q, k, v}, {0.125, true, int64_t{0}, 0.0}));
    if (hopper_here()) check_case(c);
  }
}

// The support rules: which calls each family takes (the same for both passes), and calls no family
// takes (the dispatcher then runs the op's decomposition).
TEST_F(GpuFlashAttention, SupportRules) {
  const Attrs attrs = {0.125, true, int64_t{0}, 0.0};
  const Attrs negative = {-0.125, true, int64_t{0}, 0.0};
  const auto rules = [&](int64_t d, ScalarType dtype, const Attrs& a) {
    const Tensor q = randn({1, 2, 8, d}).to(dtype).to(kGpu);
    const Tensor lse = zeros({1, 2, 8}, TensorOptions(kFloat).device(kGpu));
    std::vector<bool> takes;
    for (const std::string& family : families()) {
      const bool f = accepts(fwd_op(), family, {q, q, q}, a);
      EXPECT_EQ(f, accepts(bwd_op(), family, {q, q, q, q, q, lse, lse}, a)) << family << " D" << d;
      takes.push_back(f);
    }
    return takes;
  };
  const bool hopper = hopper_here();
  EXPECT_EQ(rules(64, kBFloat16, attrs), (std::vector<bool>{hopper, true}));
  EXPECT_EQ(rules(128, kHalf, attrs), (std::vector<bool>{hopper, true}));
  EXPECT_EQ(rules(256, kBFloat16, attrs), (std::vector<bool>{hopper, false}));
  EXPECT_EQ(rules(64, kBFloat16, negative), (std::vector<bool>{false, true}));
  EXPECT_EQ(rules(256, kBFloat16, negative), (std::vector<bool>{false, false}));
  EXPECT_EQ(rules(32, kBFloat16, attrs), (std::vector<bool>{false, false}));
  EXPECT_EQ(rules(64, kFloat, attrs), (std::vector<bool>{false, false}));
  const Tensor q32 = randn({1, 2, 8, 32}).to(kBFloat16).to(kGpu);
  EXPECT_KILN_ERROR(call_op_with_kernel(fwd_op(), "flash_sm80", {q32, q32, q32}, attrs),
                    "does not support this call");
  // The forward's optional attn_mask and dropout, and a value head size other than q's: no flash
  // kernel (the decomposition runs them); an undefined mask and dropout 0 change nothing.
  const Tensor q = randn({1, 2, 8, 64}).to(kBFloat16).to(kGpu);
  const Tensor mask = ones({1, 1, 8, 8}, TensorOptions(kBool).device(kGpu));
  const Attrs no_dropout = {0.125, false, int64_t{0}, 0.0, 0.0};
  const Attrs dropout = {0.125, false, int64_t{0}, 0.0, 0.1};
  for (const std::string& family : families()) {
    SCOPED_TRACE(family);
    EXPECT_FALSE(accepts(fwd_op(), family, {q, q, q, mask}, no_dropout));
    EXPECT_FALSE(accepts(fwd_op(), family, {q, q, q, Tensor()}, dropout));
    EXPECT_FALSE(accepts(fwd_op(), family, {q, q, q32}, attrs));
    EXPECT_EQ(accepts(fwd_op(), family, {q, q, q, Tensor()}, no_dropout),
              accepts(fwd_op(), family, {q, q, q}, {0.125, false, int64_t{0}, 0.0}));
  }
}

// F::scaled_dot_product_attention on the GPU (the flash kernels the dispatcher chooses, through
// autograd and the op's backward rule) against the same call on f64 CPU copies, with gradients.
TEST_F(GpuFlashAttention, RoutedSdpaMatchesCpuWithGradients) {
  manual_seed(46);
  struct R {
    int64_t h, hkv, t, d;
    bool causal;
    int64_t window;
    double softcap;
  };
  for (const R& r : {R{4, 2, 77, 64, true, 0, 0.0}, R{4, 4, 130, 128, false, 0, 0.0},
                     R{8, 2, 100, 64, true, 33, 4.0}, R{4, 1, 90, 256, true, 40, 5.0}}) {
    SCOPED_TRACE(::testing::Message() << "H" << r.h << "/" << r.hkv << " T" << r.t << " D" << r.d);
    const Tensor q = randn({2, r.h, r.t, r.d}).to(kBFloat16);
    const Tensor k = randn({2, r.hkv, r.t, r.d}).to(kBFloat16);
    const Tensor v = randn({2, r.hkv, r.t, r.d}).to(kBFloat16);
    const Tensor dout = randn({2, r.h, r.t, r.d}).to(kBFloat16);
    auto run = [&](Device device, ScalarType dtype) {
      const auto leaf = [&](const Tensor& t) {
        return t.to(dtype).to(device).detach().requires_grad_(true);
      };
      const Tensor ql = leaf(q), kl = leaf(k), vl = leaf(v);
      const Tensor o = F::scaled_dot_product_attention(ql, kl, vl, {}, 0.0, r.causal, 0.1,
                                                       /*enable_gqa=*/true, r.window, r.softcap);
      autograd::variable_list g = autograd::grad({o}, {ql, kl, vl}, {dout.to(dtype).to(device)});
      g.insert(g.begin(), o);
      return g;
    };
    const autograd::variable_list ref = run(Device(kCPU), kDouble);
    const autograd::variable_list got = run(kGpu, kBFloat16);
    EXPECT_LE(rel_error(got[0], ref[0]), out_tol(kBFloat16)) << "out";
    EXPECT_LE(rel_error(got[1], ref[1]), grad_tol(kBFloat16)) << "dq";
    EXPECT_LE(rel_error(got[2], ref[2]), grad_tol(kBFloat16)) << "dk";
    EXPECT_LE(rel_error(got[3], ref[3]), grad_tol(kBFloat16)) << "dv";
  }
}

}  // namespace
}  // namespace kiln
