// cuDNN's fused attention (kernels/cuda/cudnn_attention.cpp) against the CPU kernel's f64 loops
// (kernels/cpu/flash_attention.cpp) on the same bf16/f16 inputs widened (attention_reference):
// forward out and lse, backward dq/dk/dv without dlse (lse received no gradient, as in training:
// cuDNN's own backward graph, which must take every case) and with one (zeros or random: the graph
// that takes kiln's row sum, optional where cuDNN builds no plan for it), causal and not, odd T and
// S (T != S), GQA and MQA, head sizes 64, 128 and 256, q/k/v as strided views of one qkv
// projection; the support rule's refusals; the "fastest" kernel's measured choice per shape and the
// eager path (F::scaled_dot_product_attention through autograd) that goes through it.
//
// Tolerances as tests/kernels/gpu_flash_test.cpp (cuDNN, too, rounds P and dS to the input dtype
// before the second GEMMs): 1e-2 / 2e-3 for out, 2e-2 / 4e-3 for the gradients, 1e-4 for lse.
//
// Every failure prints cudnn::probe() for the case: which engine cuDNN chose for the forward and
// both backward graphs, or cuDNN's reason for building no plan. Suites named Gpu* carry the ctest
// label `gpu`; they skip without a GPU or without cuDNN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_split.h"
#include "autograd/engine.h"
#include "kernels/cuda/runtime.h"
#include "kernels/gpu_test_util.h"
#include "nn/functional.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "test_util.h"

#if defined(KILN_WITH_CUDNN)
#include "kernels/cuda/cudnn_attention.h"
#endif

namespace kiln {
namespace {

using test::attention_reference;
using test::kGpu;
using test::rel_error;
using Attrs = absl::InlinedVector<Attr, 4>;

namespace F = nn::functional;

class GpuCudnnAttention : public test::GpuTest {
 protected:
  void SetUp() override {
    test::GpuTest::SetUp();
    if (IsSkipped()) return;
#if defined(KILN_WITH_CUDNN)
    if (!cuda::cudnn::available()) {
      GTEST_SKIP() << "cuDNN 9 not usable (loaded version " << cuda::cudnn::version() << ")";
    }
    static bool printed = false;
    if (!printed) {
      printed = true;
      std::printf("[cudnn] version %lld\n", static_cast<long long>(cuda::cudnn::version()));
    }
#else
    GTEST_SKIP() << "kiln was built without cuDNN";
#endif
  }
};

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

bool accepts(const OpDef& op, const std::string& kernel, const TensorVec& inputs,
             const Attrs& attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = inputs;
  call.attrs = attrs;
  const KernelDef* k = op.find_kernel(kCUDA, kernel);
  return k != nullptr && k->accepts(call);
}

#if defined(KILN_WITH_CUDNN)
// The candidate engines a selection timed: printed, and where cuDNN offered several (and this
// process had not timed them before), exactly one chosen, the fastest.
void expect_one_engine_chosen(const cuda::cudnn::Selection& s) {
  std::printf("[cudnn] engines: %s\n",
              s.cudnn_engines.empty() ? "one, or timed before" : s.cudnn_engines.c_str());
  if (s.cudnn_engines.empty()) return;
  double chosen = -1, fastest = std::numeric_limits<double>::infinity();
  int starred = 0;
  for (const std::string& part : std::vector<std::string>(absl::StrSplit(s.cudnn_engines, "; "))) {
    const size_t colon = part.rfind(": ");
    ASSERT_NE(colon, std::string::npos) << part;
    const double ms = std::stod(part.substr(colon + 2));
    fastest = std::min(fastest, ms);
    if (part.rfind("*", 0) == 0) {
      ++starred;
      chosen = ms;
    }
  }
  EXPECT_EQ(starred, 1) << s.cudnn_engines;
  EXPECT_EQ(chosen, fastest) << s.cudnn_engines;
}
#endif

std::string probe(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
#if defined(KILN_WITH_CUDNN)
  return cuda::cudnn::probe(q, k, v, causal, scale);
#else
  return "";
#endif
}

struct Case {
  int64_t b, h, hkv, t, s, d;
  bool causal = false;
  ScalarType dtype = kBFloat16;
  bool strided = false;  // q, k, v as views of one [B, T, H + 2 H_kv, D] projection (T == S)
  bool dlse = false;     // a gradient on lse too
  int64_t window = 0;    // a sliding window (cuDNN takes one of at least T: no window)
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.b) + " H" + std::to_string(c.h) + "/" + std::to_string(c.hkv) +
         " T" + std::to_string(c.t) + " S" + std::to_string(c.s) + " D" + std::to_string(c.d) +
         (c.causal ? " causal " : " ") + std::string(dtype_name(c.dtype)) +
         (c.strided ? " strided" : "") + (c.dlse ? " dlse" : "") +
         (c.window ? " window " + std::to_string(c.window) : "");
}

void make_inputs(const Case& c, Tensor& q, Tensor& k, Tensor& v) {
  if (c.strided) {
    const Tensor qkv = randn({c.b, c.t, c.h + 2 * c.hkv, c.d}).to(c.dtype).to(kGpu);
    q = qkv.narrow(2, 0, c.h).transpose(1, 2);
    k = qkv.narrow(2, c.h, c.hkv).transpose(1, 2);
    v = qkv.narrow(2, c.h + c.hkv, c.hkv).transpose(1, 2);
  } else {
    q = randn({c.b, c.h, c.t, c.d}).to(c.dtype).to(kGpu);
    k = randn({c.b, c.hkv, c.s, c.d}).to(c.dtype).to(kGpu);
    v = randn({c.b, c.hkv, c.s, c.d}).to(c.dtype).to(kGpu);
  }
}

// The "cudnn" backward on bwd_in (dlse: its last input, defined or not) against the CPU
// kernel's gradients dr.
void check_backward(const Case& c, const TensorVec& bwd_in, const Attrs& attrs, const TensorVec& dr,
                    const Tensor& q, const Tensor& k, const Tensor& v, double scale) {
  SCOPED_TRACE(bwd_in[6].defined() ? "dlse defined (dsum=input)" : "dlse undefined (dsum=cudnn)");
  const TensorVec dg = call_op_with_kernel(bwd_op(), "cudnn", bwd_in, attrs);
  const double e[3] = {rel_error(dg[0], dr[0]), rel_error(dg[1], dr[1]), rel_error(dg[2], dr[2])};
  EXPECT_LE(e[0], grad_tol(c.dtype)) << "dq";
  EXPECT_LE(e[1], grad_tol(c.dtype)) << "dk";
  EXPECT_LE(e[2], grad_tol(c.dtype)) << "dv";
  if (std::max({e[0], e[1], e[2]}) > grad_tol(c.dtype)) {
    std::printf("%s", probe(q, k, v, c.causal, scale).c_str());
  }
}

// The case's forward and backward on the "cudnn" kernel against the CPU kernel. The kernel must
// accept the forward and the backward without dlse; the backward with a dlse (zeros, or random
// for c.dlse) runs where cuDNN builds a plan for it. The backward takes the CPU reference's out
// and lse, so that its error is its own.
void check_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  Tensor q, k, v;
  make_inputs(c, q, k, v);
  const double scale = 1.5 / std::sqrt(static_cast<double>(c.d));
  const Attrs attrs = {scale, c.causal, c.window, 0.0};
  const Tensor qc = q.to(kCPU), kc = k.to(kCPU), vc = v.to(kCPU);
  const TensorVec r = attention_reference(fwd_op(), {qc, kc, vc}, attrs);
  const Tensor dout = randn(q.sizes()).to(c.dtype);
  const Tensor dlse = c.dlse ? randn(r[1].sizes()) : zeros(r[1].sizes());
  const TensorVec dr0 =
      attention_reference(bwd_op(), {dout, qc, kc, vc, r[0], r[1], Tensor()}, attrs);
  const TensorVec dr = attention_reference(bwd_op(), {dout, qc, kc, vc, r[0], r[1], dlse}, attrs);
  const TensorVec fwd_in = {q, k, v};
  const TensorVec bwd_in0 = {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), Tensor()};
  const TensorVec bwd_in = {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), dlse.to(kGpu)};
  const bool takes_fwd = accepts(fwd_op(), "cudnn", fwd_in, attrs);
  const bool takes_bwd0 = accepts(bwd_op(), "cudnn", bwd_in0, attrs);
  const bool takes_bwd = accepts(bwd_op(), "cudnn", bwd_in, attrs);
  if (!takes_fwd) {
    ADD_FAILURE() << "cuDNN refused the forward call; probe:\n" << probe(q, k, v, c.causal, scale);
  }
  if (!takes_bwd0) {
    ADD_FAILURE() << "cuDNN refused the backward without dlse; probe:\n"
                  << probe(q, k, v, c.causal, scale);
  }
  // The backward graph that takes kiln's row sum (with dlse) as an input builds no plan on some
  // cuDNN versions (9.14 on an H100: none); the rule then refuses and the hand kernels run it.
  if (!takes_bwd) {
    std::printf("[cudnn] backward with dlse refused (no plan): %s\n", describe(c).c_str());
  }
  if (takes_fwd) {
    const TensorVec g = call_op_with_kernel(fwd_op(), "cudnn", fwd_in, attrs);
    EXPECT_EQ(g[0].dtype(), c.dtype);
    const double eo = rel_error(g[0], r[0]), el = rel_error(g[1], r[1]);
    EXPECT_LE(eo, out_tol(c.dtype)) << "out";
    EXPECT_LE(el, 1e-4) << "lse (cuDNN's Stats)";
    if (eo > out_tol(c.dtype) || el > 1e-4)
      std::printf("%s", probe(q, k, v, c.causal, scale).c_str());
  }
  if (takes_bwd0) check_backward(c, bwd_in0, attrs, dr0, q, k, v, scale);
  if (takes_bwd) check_backward(c, bwd_in, attrs, dr, q, k, v, scale);
}

TEST_F(GpuCudnnAttention, ProbeGraphs) {
  // Not a check: what this cuDNN builds for a typical shape, printed for the log.
  const Tensor q = randn({2, 4, 128, 64}).to(kBFloat16).to(kGpu);
  const Tensor k = randn({2, 2, 128, 64}).to(kBFloat16).to(kGpu);
  std::printf("%s", probe(q, k, k, true, 0.125).c_str());
  std::printf("%s", probe(q, k, k, false, 0.125).c_str());
}

TEST_F(GpuCudnnAttention, OddLengthsCausalAndNot) {
  manual_seed(51);
  for (int64_t t : {1, 17, 100, 257}) {
    for (bool causal : {false, true}) {
      check_case({2, 3, 3, t, t, 64, causal});
      check_case({1, 2, 2, t, t, 128, causal});
    }
  }
  check_case({1, 2, 2, 100, 257, 64, true});  // S > T (top-left causal)
  check_case({1, 2, 2, 257, 100, 64, true});  // T > S
  check_case({1, 2, 2, 70, 190, 128, false});
}

TEST_F(GpuCudnnAttention, GqaMqaAndF16) {
  manual_seed(52);
  check_case({2, 8, 2, 100, 100, 64, true});  // GQA 4:1
  check_case({1, 4, 1, 257, 257, 64, true});  // MQA
  check_case({1, 8, 2, 77, 77, 128, false});
  check_case({2, 4, 1, 130, 130, 64, true, kHalf});
  check_case({1, 2, 2, 65, 65, 128, false, kHalf});
}

TEST_F(GpuCudnnAttention, StridedQkvAndLseGradient) {
  manual_seed(53);
  check_case({2, 4, 4, 100, 100, 64, true, kBFloat16, true});
  check_case({1, 8, 2, 129, 129, 128, true, kBFloat16, true});  // GQA views
  check_case({1, 4, 2, 77, 77, 64, false, kHalf, true});
  check_case({1, 2, 2, 33, 130, 64, false, kHalf, false, true});  // dlse != 0
  check_case({2, 4, 2, 100, 100, 128, true, kBFloat16, false, true});
  check_case({1, 4, 2, 64, 64, 64, true, kBFloat16, true, true});
}

// A sliding window at least as long as the queries hides nothing the causal mask shows: cuDNN
// runs it as causal attention (Mistral's window of 4096 at T <= 4096), also where the call says
// causal=false (a window implies causal); a shorter window is refused (SupportRuleRefuses).
TEST_F(GpuCudnnAttention, WindowCoveringTheQueriesIsNoWindow) {
  manual_seed(57);
  Case c{1, 4, 2, 100, 100, 128, true};
  c.window = 100;
  check_case(c);
  c.window = 4096;
  c.causal = false;
  check_case(c);
  Case g{2, 4, 4, 77, 77, 64, true, kHalf, true};
  g.window = 77;
  check_case(g);
}

TEST_F(GpuCudnnAttention, HeadSize256) {
  manual_seed(54);
  check_case({1, 2, 2, 100, 100, 256, true});
  check_case({1, 4, 2, 150, 150, 256, false, kHalf});
  check_case({1, 4, 2, 150, 150, 256, true, kBFloat16, true});
}

TEST_F(GpuCudnnAttention, LongerSequences) {
  manual_seed(55);
  check_case({1, 4, 4, 1024, 1024, 64, true});
  check_case({1, 4, 2, 1000, 1000, 128, true, kBFloat16, true});
}

// What cuDNN does not take here: the rule refuses, and the other kernels or the decomposition
// run the call.
// cuDNN's backward accumulates dQ in an f32 buffer that each call must start at zero: repeated
// calls, and calls captured in a CUDA graph and replayed, give the first call's results.
TEST_F(GpuCudnnAttention, RepeatedAndCapturedBackwardsMatchTheFirst) {
  manual_seed(56);
  const Attrs attrs = {0.125, true, int64_t{0}, 0.0};
  auto inputs = [&] {
    const Tensor q = randn({2, 4, 128, 64}).to(kBFloat16).to(kGpu);
    const Tensor k = randn({2, 2, 128, 64}).to(kBFloat16).to(kGpu);
    const Tensor v = randn({2, 2, 128, 64}).to(kBFloat16).to(kGpu);
    const TensorVec f = call_op(fwd_op(), {q, k, v}, attrs);
    const Tensor dout = randn({2, 4, 128, 64}).to(kBFloat16).to(kGpu);
    return TensorVec{dout, q, k, v, f[0], f[1], Tensor()};
  };
  const TensorVec a = inputs(), b = inputs();
  if (!accepts(bwd_op(), "cudnn", a, attrs)) GTEST_SKIP() << "cuDNN refused the backward";
  const TensorVec want_a = call_op_with_kernel(bwd_op(), "cudnn", a, attrs);
  const TensorVec want_b = call_op_with_kernel(bwd_op(), "cudnn", b, attrs);
  const TensorVec* const want[3] = {&want_a, &want_b, &want_a};
  // A dQ accumulator left unzeroed would add one call's dQ to the next: an error near 1.
  for (int i = 0; i < 3; ++i) {
    const TensorVec got = call_op_with_kernel(bwd_op(), "cudnn", i == 1 ? b : a, attrs);
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_LE(rel_error(got[j], (*want[i])[j]), 1e-2) << "eager call " << i << ", grad " << j;
    }
  }
  std::vector<Tensor> outs;
  for (int i = 0; i < 3; ++i) {
    for (size_t j = 0; j < 3; ++j) outs.push_back(empty_like((*want[i])[j]));
  }
  const std::shared_ptr<cuda::internal::CapturedGraph> graph =
      cuda::internal::capture_graph(0, [&] {
        for (int i = 0; i < 3; ++i) {
          const TensorVec r = call_op_with_kernel(bwd_op(), "cudnn", i == 1 ? b : a, attrs);
          for (size_t j = 0; j < 3; ++j) outs[3 * static_cast<size_t>(i) + j].copy_(r[j]);
        }
        return std::vector<Storage>{};
      });
  for (int replay = 0; replay < 3; ++replay) {
    for (Tensor& o : outs) o.zero_();
    graph->launch();
    cuda::synchronize();
    for (int i = 0; i < 3; ++i) {
      for (size_t j = 0; j < 3; ++j) {
        EXPECT_LE(rel_error(outs[3 * static_cast<size_t>(i) + j], (*want[i])[j]), 1e-2)
            << "replay " << replay << ", call " << i << ", grad " << j;
      }
    }
    // Eager calls between replays.
    const TensorVec got = call_op_with_kernel(bwd_op(), "cudnn", b, attrs);
    EXPECT_LE(rel_error(got[0], want_b[0]), 1e-2) << "eager call after replay " << replay;
  }
}

// flash_attention_backward_qkv (the compiler's merged attention backward): cuDNN writing dq, dk
// and dv into their places in the qkv gradient, dq and dk rotated back there ("cudnn"), and the
// two ops one after the other ("in_parts"), against the CPU's two kernels (f32), with GQA,
// MHA and head sizes 64 and 128, rope_cache's f32 tables and random bf16/f16 ones; repeated
// calls and calls inside a CUDA graph capture (built plans only) give the first call's results.
TEST_F(GpuCudnnAttention, BackwardMergedIntoQkv) {
  manual_seed(58);
  static const OpDef& fused = KILN_OP(flash_attention_backward_qkv);
  struct QkvCase {
    int64_t b, h, g, t, d;
    ScalarType dtype;
    bool rope_tables;
  };
  for (const QkvCase& c :
       {QkvCase{2, 4, 2, 100, 64, kBFloat16, true}, QkvCase{1, 4, 4, 77, 128, kHalf, false},
        QkvCase{2, 8, 2, 129, 64, kBFloat16, false}}) {
    const int64_t n = c.h + 2 * c.g;
    SCOPED_TRACE("B" + std::to_string(c.b) + " H" + std::to_string(c.h) + "/" +
                 std::to_string(c.g) + " T" + std::to_string(c.t) + " D" + std::to_string(c.d) +
                 " " + std::string(dtype_name(c.dtype)));
    const Tensor qkv = randn({c.b, c.t, n * c.d}).to(c.dtype);
    Tensor cos, sin;
    if (c.rope_tables) {
      std::tie(cos, sin) = F::rope_cache(c.t, c.d);
    } else {
      cos = randn({c.t, c.d}).to(c.dtype);
      sin = randn({c.t, c.d}).to(c.dtype);
    }
    auto [q, k, v] = split_qkv_rotary(qkv, cos, sin, c.h, c.g);
    const Attrs attrs = {0.125, true, int64_t{0}, 0.0};
    const TensorVec f = call_op(fwd_op(), {q, k, v}, attrs);
    const Tensor dout = randn(q.sizes()).to(c.dtype);
    Attrs all = attrs;
    all.push_back(true);
    const Tensor want = call_op1(fused, {dout, q, k, v, f[0], f[1], Tensor(), cos, sin}, all);
    const TensorVec in = {dout.to(kGpu), q.to(kGpu), k.to(kGpu),   v.to(kGpu),  f[0].to(kGpu),
                          f[1].to(kGpu), Tensor(),   cos.to(kGpu), sin.to(kGpu)};
    ASSERT_TRUE(accepts(fused, "in_parts", in, all));
    const Tensor parts = call_op_with_kernel(fused, "in_parts", in, all)[0];
    EXPECT_LE(rel_error(parts, want), grad_tol(c.dtype)) << "in parts";
    if (!accepts(fused, "cudnn", in, all)) {
      ADD_FAILURE() << "cuDNN refused the case: " << probe(in[1], in[2], in[3], true, 0.125);
      continue;
    }
    for (int call = 0; call < 2; ++call) {
      const Tensor got = call_op_with_kernel(fused, "cudnn", in, all)[0];
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_LE(rel_error(got, want), grad_tol(c.dtype)) << "cuDNN in place, call " << call;
    }
    Tensor captured = empty_like(parts);
    const std::shared_ptr<cuda::internal::CapturedGraph> graph =
        cuda::internal::capture_graph(0, [&] {
          captured.copy_(call_op_with_kernel(fused, "cudnn", in, all)[0]);
          return std::vector<Storage>{};
        });
    for (int replay = 0; replay < 2; ++replay) {
      captured.zero_();
      graph->launch();
      cuda::synchronize();
      EXPECT_LE(rel_error(captured, want), grad_tol(c.dtype)) << "replay " << replay;
    }
    // The dispatcher's choice (measured: cuDNN in place or the two ops) agrees too.
    EXPECT_LE(rel_error(call_op(fused, in, all)[0], want), grad_tol(c.dtype)) << "dispatched";
  }
}

TEST_F(GpuCudnnAttention, SupportRuleRefuses) {
  const Tensor q = randn({1, 2, 64, 64}).to(kBFloat16).to(kGpu);
  const Attrs plain = {0.125, true, int64_t{0}, 0.0};
  EXPECT_TRUE(accepts(fwd_op(), "cudnn", {q, q, q}, plain)) << probe(q, q, q, true, 0.125);
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {q, q, q}, {0.125, true, int64_t{16}, 0.0}))
      << "sliding window";
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {q, q, q}, {0.125, true, int64_t{0}, 5.0})) << "softcap";
  const Tensor mask = ones({64, 64}, TensorOptions(kBool).device(kGpu));
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {q, q, q, mask}, {0.125, false, int64_t{0}, 0.0, 0.0}))
      << "attn_mask";
  EXPECT_FALSE(
      accepts(fwd_op(), "cudnn", {q, q, q, Tensor()}, {0.125, false, int64_t{0}, 0.0, 0.1}))
      << "dropout";
  const Tensor f = q.to(kFloat);
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {f, f, f}, plain)) << "f32";
  const Tensor q96 = randn({1, 2, 64, 96}).to(kBFloat16).to(kGpu);
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {q96, q96, q96}, plain)) << "head size 96";
  // A view whose rows are not 16-byte aligned (the flash kernels copy it; cuDNN refuses).
  const Tensor big = randn({1, 2, 64, 72}).to(kBFloat16).to(kGpu);
  const Tensor odd = big.narrow(3, 1, 64);
  EXPECT_FALSE(accepts(fwd_op(), "cudnn", {odd, odd, odd}, plain)) << "misaligned rows";
}

// The "fastest" kernel: the first call of a shape measures cuDNN against the hand kernel and
// remembers the winner; its outputs are right either way, and later calls follow the choice (the
// rule refuses when the hand kernel won, so that the dispatcher runs it).
// The flash backwards (hand and cuDNN) add dQ over key blocks with float atomics: two calls on
// the same inputs differ in dQ's last bits (measured at these shapes in session 17). With
// deterministic algorithms (tensor/deterministic.h) they refuse and the op's decomposition runs:
// the same bits on every call, and within bf16's gradient tolerance of the fused kernels: the
// model shapes of llama-160m, llama-3.2-1b (GQA), mistral-7b (head size 128) and
// gemma-2b (head size 256, one kv head), causal, no dlse.
TEST_F(GpuCudnnAttention, DeterministicBackwardIsTheDecomposition) {
  manual_seed(57);
  const Case cases[] = {{4, 12, 12, 1024, 1024, 64, true, kBFloat16, true},
                        {2, 32, 8, 2048, 2048, 64, true},
                        {1, 32, 8, 2048, 2048, 128, true},
                        {2, 8, 1, 1024, 1024, 256, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c));
    Tensor q, k, v;
    make_inputs(c, q, k, v);
    const Attrs attrs = {1.0 / std::sqrt(static_cast<double>(c.d)), true, int64_t{0}, 0.0};
    const TensorVec r = call_op(fwd_op(), {q, k, v}, attrs);
    const Tensor dout = randn(q.sizes()).to(c.dtype).to(kGpu);
    const TensorVec in = {dout, q, k, v, r[0], r[1], Tensor()};
    const TensorVec fused = call_op(bwd_op(), in, attrs);  // the dispatcher's kernel
    const DeterministicGuard deterministic(true);
    for (const char* kernel : {"fastest", "cudnn", "flash_hopper", "flash_sm80"}) {
      EXPECT_FALSE(accepts(bwd_op(), kernel, in, attrs)) << kernel << " in deterministic mode";
    }
    const TensorVec first = call_op(bwd_op(), in, attrs);
    for (int run = 0; run < 2; ++run) {
      const TensorVec again = call_op(bwd_op(), in, attrs);
      for (int i = 0; i < 3; ++i) {
        EXPECT_TRUE(equal(again[i].cpu(), first[i].cpu())) << "d" << "qkv"[i] << ", run " << run;
      }
    }
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(first[i].dtype(), c.dtype);
      EXPECT_LE(rel_error(first[i], fused[i]), grad_tol(c.dtype)) << "d" << "qkv"[i];
    }
  }
}

TEST_F(GpuCudnnAttention, SelectionByMeasurement) {
#if defined(KILN_WITH_CUDNN)
  manual_seed(56);
  cuda::cudnn::clear_selections();
  const Case c{4, 8, 2, 512, 512, 64, true, kBFloat16, true};
  Tensor q, k, v;
  make_inputs(c, q, k, v);
  const double scale = 0.125;
  const Attrs attrs = {scale, true, int64_t{0}, 0.0};
  const TensorVec r = attention_reference(fwd_op(), {q, k, v}, attrs);
  const TensorVec fwd_in = {q, k, v};
  ASSERT_TRUE(accepts(fwd_op(), "fastest", fwd_in, attrs)) << probe(q, k, v, true, scale);
  for (int call = 0; call < 2; ++call) {
    const TensorVec g = call_op(fwd_op(), fwd_in, attrs);  // the dispatcher's choice
    EXPECT_LE(rel_error(g[0], r[0]), out_tol(c.dtype)) << "call " << call;
    EXPECT_LE(rel_error(g[1], r[1]), 1e-4) << "call " << call;
  }
  const cuda::cudnn::Selection s = cuda::cudnn::last_selection("flash_attention");
  std::printf("[cudnn] forward %s: cudnn %.3f ms, hand %.3f ms -> %s\n", s.key.c_str(), s.cudnn_ms,
              s.hand_ms, s.winner.c_str());
  ASSERT_FALSE(s.winner.empty()) << "the first call did not measure; plans:\n"
                                 << cuda::cudnn::describe_plans();
  expect_one_engine_chosen(s);
  EXPECT_EQ(accepts(fwd_op(), "fastest", fwd_in, attrs), s.winner == "cudnn");

  const Tensor dout = randn(q.sizes()).to(c.dtype);
  const Tensor qc = q.to(kCPU), kc = k.to(kCPU), vc = v.to(kCPU);
  // The backward without dlse (training's: lse receives no gradient), which cuDNN's own graph
  // (dsum=cudnn) runs: measured with that graph, the one later calls run.
  const TensorVec dr0 =
      attention_reference(bwd_op(), {dout, qc, kc, vc, r[0], r[1], Tensor()}, attrs);
  const TensorVec bwd_in0 = {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), Tensor()};
  ASSERT_TRUE(accepts(bwd_op(), "cudnn", bwd_in0, attrs)) << probe(q, k, v, true, scale);
  ASSERT_TRUE(accepts(bwd_op(), "fastest", bwd_in0, attrs)) << probe(q, k, v, true, scale);
  for (int call = 0; call < 2; ++call) {
    const TensorVec dg = call_op(bwd_op(), bwd_in0, attrs);
    EXPECT_LE(rel_error(dg[0], dr0[0]), grad_tol(c.dtype)) << "dq, call " << call;
    EXPECT_LE(rel_error(dg[1], dr0[1]), grad_tol(c.dtype)) << "dk, call " << call;
    EXPECT_LE(rel_error(dg[2], dr0[2]), grad_tol(c.dtype)) << "dv, call " << call;
  }
  const cuda::cudnn::Selection sb0 = cuda::cudnn::last_selection("flash_attention_backward");
  std::printf("[cudnn] backward %s: cudnn %.3f ms, hand %.3f ms -> %s\n", sb0.key.c_str(),
              sb0.cudnn_ms, sb0.hand_ms, sb0.winner.c_str());
  ASSERT_FALSE(sb0.winner.empty()) << "the first backward call did not measure; plans:\n"
                                   << cuda::cudnn::describe_plans();
  expect_one_engine_chosen(sb0);
  EXPECT_NE(sb0.key.find("dsum=cudnn"), std::string::npos) << sb0.key;
  EXPECT_EQ(accepts(bwd_op(), "fastest", bwd_in0, attrs), sb0.winner == "cudnn");

  // With a dlse (zeros): the graph that takes kiln's row sum, measured on its own (another key)
  // and only where cuDNN built a plan for it (see check_case); else the hand kernel runs.
  const Tensor dlse = zeros(r[1].sizes());
  const TensorVec dr = attention_reference(bwd_op(), {dout, qc, kc, vc, r[0], r[1], dlse}, attrs);
  const TensorVec bwd_in = {dout.to(kGpu), q, k, v, r[0].to(kGpu), r[1].to(kGpu), dlse.to(kGpu)};
  for (int call = 0; call < 2; ++call) {
    const TensorVec dg = call_op(bwd_op(), bwd_in, attrs);
    EXPECT_LE(rel_error(dg[0], dr[0]), grad_tol(c.dtype)) << "dq, call " << call;
    EXPECT_LE(rel_error(dg[1], dr[1]), grad_tol(c.dtype)) << "dk, call " << call;
    EXPECT_LE(rel_error(dg[2], dr[2]), grad_tol(c.dtype)) << "dv, call " << call;
  }
  const cuda::cudnn::Selection sb = cuda::cudnn::last_selection("flash_attention_backward");
  if (accepts(bwd_op(), "cudnn", bwd_in, attrs)) {
    std::printf("[cudnn] backward %s: cudnn %.3f ms, hand %.3f ms -> %s\n", sb.key.c_str(),
                sb.cudnn_ms, sb.hand_ms, sb.winner.c_str());
    EXPECT_NE(sb.key.find("dsum=input"), std::string::npos) << "not measured: " << sb.key;
    EXPECT_EQ(accepts(bwd_op(), "fastest", bwd_in, attrs), sb.winner == "cudnn");
  } else {
    EXPECT_FALSE(accepts(bwd_op(), "fastest", bwd_in, attrs));
    EXPECT_EQ(sb.key, sb0.key) << "nothing measured for the call with dlse";
  }
  std::printf("%s", cuda::cudnn::describe_plans().c_str());
#endif
}

// The engine timed fastest for a shape goes to the disk cache; a new process (the plans
// forgotten) finalizes only that engine for the shape instead of every candidate, and times none.
TEST_F(GpuCudnnAttention, EngineChoiceIsKeptInTheDiskCache) {
#if defined(KILN_WITH_CUDNN)
  const test::DiskCacheScope cache(test::DiskCacheScope::fresh("cudnn"));
  manual_seed(58);
  cuda::cudnn::clear_plans();
  const Case c{2, 4, 4, 384, 384, 64, true, kBFloat16};  // a shape no other test uses
  Tensor q, k, v;
  make_inputs(c, q, k, v);
  const double scale = 0.125;
  const Attrs attrs = {scale, true, int64_t{0}, 0.0};
  const TensorVec r = attention_reference(fwd_op(), {q, k, v}, attrs);
  const TensorVec in = {q, k, v};
  ASSERT_TRUE(accepts(fwd_op(), "fastest", in, attrs)) << probe(q, k, v, true, scale);
  const cuda::KernelSetupStats s0 = cuda::kernel_setup_stats();
  const TensorVec g = call_op(fwd_op(), in, attrs);
  EXPECT_LE(rel_error(g[0], r[0]), out_tol(c.dtype));
  const cuda::cudnn::Selection s = cuda::cudnn::last_selection("flash_attention");
  ASSERT_FALSE(s.winner.empty()) << cuda::cudnn::describe_plans();
  expect_one_engine_chosen(s);
  if (s.cudnn_engines.empty()) GTEST_SKIP() << "cuDNN offered one engine: no choice to keep";
  const cuda::KernelSetupStats s1 = cuda::kernel_setup_stats();
  EXPECT_GE(s1.choices_written, s0.choices_written + 1);
  EXPECT_GE(s1.attention_shapes_timed, s0.attention_shapes_timed + 1);
  // The chosen engine, as a one-engine plan describes itself.
  std::string chosen;
  for (const std::string& part : std::vector<std::string>(absl::StrSplit(s.cudnn_engines, "; "))) {
    if (part.rfind("*", 0) == 0) chosen = part.substr(1, part.rfind(": ") - 1);
  }
  ASSERT_FALSE(chosen.empty()) << s.cudnn_engines;

  cuda::cudnn::clear_plans();  // as a new process
  const TensorVec g2 = call_op(fwd_op(), in, attrs);
  EXPECT_LE(rel_error(g2[0], r[0]), out_tol(c.dtype));
  EXPECT_LE(rel_error(g2[1], r[1]), 1e-4);
  const cuda::KernelSetupStats s2 = cuda::kernel_setup_stats();
  EXPECT_GE(s2.choices_read, s1.choices_read + 1);
  const cuda::cudnn::Selection again = cuda::cudnn::last_selection("flash_attention");
  EXPECT_EQ(again.key, s.key);
  EXPECT_EQ(again.cudnn_engines, "") << "the engines were timed again";
  const std::string plans = cuda::cudnn::describe_plans();
  EXPECT_NE(plans.find(s.key + ": " + chosen + "\n"), std::string::npos)
      << "want the one engine " << chosen << " for " << s.key << "; plans:\n"
      << plans;
#endif
}

// F::scaled_dot_product_attention on the GPU through autograd (the dispatcher's choice, cuDNN
// where it measured faster) against the same call on f64 CPU copies, with gradients. lse gets no
// gradient, so the backward is called without dlse and measures cuDNN's own graph (dsum=cudnn).
TEST_F(GpuCudnnAttention, EagerSdpaMatchesCpuWithGradients) {
  manual_seed(57);
#if defined(KILN_WITH_CUDNN)
  cuda::cudnn::clear_selections();
#endif
  struct R {
    int64_t h, hkv, t, d;
    bool causal;
  };
  for (const R& r : {R{4, 2, 256, 64, true}, R{4, 4, 130, 128, false}, R{4, 1, 200, 256, true}}) {
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
                                                       /*enable_gqa=*/true);
      autograd::variable_list g = autograd::grad({o}, {ql, kl, vl}, {dout.to(dtype).to(device)});
      g.insert(g.begin(), o);
      return g;
    };
    const autograd::variable_list ref = run(Device(kCPU), kDouble);
    for (int rep = 0; rep < 2; ++rep) {  // the first call measures, the second follows the choice
      const autograd::variable_list got = run(kGpu, kBFloat16);
      EXPECT_LE(rel_error(got[0], ref[0]), out_tol(kBFloat16)) << "out, rep " << rep;
      EXPECT_LE(rel_error(got[1], ref[1]), grad_tol(kBFloat16)) << "dq, rep " << rep;
      EXPECT_LE(rel_error(got[2], ref[2]), grad_tol(kBFloat16)) << "dk, rep " << rep;
      EXPECT_LE(rel_error(got[3], ref[3]), grad_tol(kBFloat16)) << "dv, rep " << rep;
    }
#if defined(KILN_WITH_CUDNN)
    const cuda::cudnn::Selection sb = cuda::cudnn::last_selection("flash_attention_backward");
    std::printf("[cudnn] eager backward %s: cudnn %.3f ms, hand %.3f ms -> %s\n", sb.key.c_str(),
                sb.cudnn_ms, sb.hand_ms, sb.winner.c_str());
    EXPECT_NE(sb.key.find("dsum=cudnn"), std::string::npos)
        << "the backward did not measure cuDNN's graph without dlse: " << sb.key << "\nplans:\n"
        << cuda::cudnn::describe_plans();
    cuda::cudnn::clear_selections();  // the next shape's measurement is its own
#endif
  }
}

}  // namespace
}  // namespace kiln
