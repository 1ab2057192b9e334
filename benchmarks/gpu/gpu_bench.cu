// kiln's GPU benchmark harness: cuBLASLt GEMMs at the Llama training shapes, the fused RMSNorm,
// LayerNorm, cross-entropy, RoPE, SwiGLU/GeGLU and flash-attention kernels, the multi-tensor
// AdamW step, gradient clipping (per-tensor ops vs the foreach ops), elementwise ops, reductions
// and softmax, compiled elementwise chains (fused_cuda's generated kernels, beside eager), and a
// device-to-device copy as the bandwidth ceiling (memory-bound rows also print
// their fraction of it).
//
//   kiln_gpu_bench [results.json] [--no-gemm] [--only SECTIONS]
//   # then: python3 benchmarks/gpu/torch_reference.py --kiln results.json   (same run, same GPU)
//
// --only takes a comma-separated list of sections (gemm, rmsnorm, layernorm, cross-entropy, flash,
// rope, qkv, lm-loss, glu, generic, fused, clip, adamw; fused-rows: fused's row kernels alone) and
// runs only those, after the copy that sets the bandwidth ceiling; for profiling one family (ncu)
// or a quick rerun. Unknown names are an error. --no-gemm is --only with every section but gemm.
//
// Method: gpu/bench_util.h (fresh random inputs, warm-up, CUDA events, medians of 20). Kernel
// variants that lost to the library's kernels are timed beside them in the kernel lab (lab/).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "compiler/compile.h"
#include "gpu/bench_util.h"
#include "gpu/fused_bench.h"
#if defined(KILN_WITH_CUDNN)
#include "kernels/cuda/cudnn_attention.h"
#endif
#include "kernels/cuda/check.h"
#include "kernels/cuda/cublaslt.h"
#include "nn/optim/adamw.h"
#include "nn/utils/clip_grad.h"
#include "tensor/foreach.h"
#include "tensor/linear_cross_entropy.h"
#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"

namespace {

using kiln::bench::random;
using kiln::bench::random_targets;
using kiln::bench::report;
using kiln::bench::time_ms;

using kiln::Tensor;

struct Gemm {
  const char* name;
  int64_t m, n, k;
};

// out[M, N] = x[M, K] @ w[N, K]^T (forward), dx = dy @ w (dgrad), dw = dy^T @ x (wgrad): the
// three GEMMs of a Linear layer in a training step, each read in place (no transposed copies).
// `suffix` ends every row name (the autotuned re-run's " [autotune]").
void bench_gemm(const Gemm& g, bool with_backward, const std::string& suffix = "") {
  const Tensor x = random({g.m, g.k}, kiln::kBFloat16);
  const Tensor w = random({g.n, g.k}, kiln::kBFloat16);
  const double flops = 2.0 * g.m * g.n * g.k;
  const std::string base = std::string("gemm ") + g.name + " " + std::to_string(g.m) + "x" +
                           std::to_string(g.n) + "x" + std::to_string(g.k);
  report(base + " fwd" + suffix, time_ms([&](int) { (void)kiln::mm(x, w.t()); }), flops, 0);
  if (!with_backward) return;
  const Tensor dy = random({g.m, g.n}, kiln::kBFloat16);
  report(base + " dgrad" + suffix, time_ms([&](int) { (void)kiln::mm(dy, w); }), flops, 0);
  report(base + " wgrad" + suffix, time_ms([&](int) { (void)kiln::mm(dy.t(), x); }), flops, 0);
}

// A Linear layer's weight and bias gradients (a layer with a bias: GPT-2's, BERT's, an MLP's):
// dW = dy^T @ x and db = dy summed over the rows, as the mm and the sum that addmm's backward ran
// before (dy read twice), and as one mm_with_bias_grad call (cuBLASLt's bias gradient epilogue,
// dy read once), which addmm's backward runs on a GPU now.
void bench_bias_grad(const Gemm& g) {
  static const kiln::OpDef& op = KILN_OP(mm_with_bias_grad);
  const Tensor x = random({g.m, g.k}, kiln::kBFloat16);
  const Tensor dy = random({g.m, g.n}, kiln::kBFloat16);
  const double flops = 2.0 * g.m * g.n * g.k;
  const std::string base = std::string("wgrad + bias grad ") + g.name + " " + std::to_string(g.m) +
                           "x" + std::to_string(g.n) + "x" + std::to_string(g.k);
  report(base + " [mm + sum]", time_ms([&](int) {
           (void)kiln::mm(dy.t(), x);
           (void)kiln::sum(dy, {0});
         }),
         flops, 0);
  report(base + " [mm_with_bias_grad]", time_ms([&](int) {
           (void)kiln::call_op(op, {dy.t(), x}, {int64_t{0}});
         }),
         flops, 0);
}

// A Linear layer with a bias, then relu or tanh-gelu (an MLP's up projection): addmm (bias
// epilogue) then the activation (the pre-activation written and read back), against one
// addmm_activation (cuBLASLt's RELU_BIAS / GELU_BIAS epilogue), which the compiler's
// matmul_epilogue writes for the pair.
void bench_activation_epilogue(const Gemm& g) {
  static const kiln::OpDef& op = KILN_OP(addmm_activation);
  const Tensor x = random({g.m, g.k}, kiln::kBFloat16);
  const Tensor w = random({g.n, g.k}, kiln::kBFloat16);
  const Tensor bias = random({g.n}, kiln::kBFloat16);
  const double flops = 2.0 * g.m * g.n * g.k;
  const std::string base = std::string("linear + act ") + g.name + " " + std::to_string(g.m) + "x" +
                           std::to_string(g.n) + "x" + std::to_string(g.k);
  for (bool use_gelu : {false, true}) {
    const std::string act = use_gelu ? " gelu-tanh" : " relu";
    report(base + act + " [addmm, then act]", time_ms([&](int) {
             const Tensor y = kiln::addmm(bias, x, w.t());
             (void)(use_gelu ? kiln::gelu(y, "tanh") : kiln::relu(y));
           }),
           flops, 0);
    report(base + act + " [addmm_activation]", time_ms([&](int) {
             (void)kiln::call_op(op, {bias, x, w.t()},
                                 {kiln::Scalar(1.0), kiln::Scalar(1.0), use_gelu});
           }),
           flops, 0);
  }
}

// A tanh-gelu layer in training (a GPT-2 MLP's up projection, [m, k] x [k, n]): the forward as
// addmm then gelu (the pre-activation kept) against addmm_gelu_aux (GELU_AUX_BIAS), and the
// backward's product of the down projection's input gradient ([m, k'] x [k', n], k' = k) then
// gelu_backward against mm_dgelu (DGELU), which the compiler's matmul_epilogue writes for them.
void bench_gelu_layer(const Gemm& g) {
  static const kiln::OpDef& aux = KILN_OP(addmm_gelu_aux);
  static const kiln::OpDef& dgelu = KILN_OP(mm_dgelu);
  static const kiln::OpDef& gelu_grad = KILN_OP(gelu_backward);
  const Tensor x = random({g.m, g.k}, kiln::kBFloat16);
  const Tensor w = random({g.n, g.k}, kiln::kBFloat16);
  const Tensor bias = random({g.n}, kiln::kBFloat16);
  const Tensor dz = random({g.m, g.k}, kiln::kBFloat16);
  const Tensor w2 = random({g.k, g.n}, kiln::kBFloat16);
  const Tensor pre = kiln::addmm(bias, x, w.t());
  const double flops = 2.0 * g.m * g.n * g.k;
  const std::string base = std::string("gelu layer ") + g.name + " " + std::to_string(g.m) + "x" +
                           std::to_string(g.n) + "x" + std::to_string(g.k);
  report(base + " fwd [addmm, then gelu]", time_ms([&](int) {
           const Tensor p = kiln::addmm(bias, x, w.t());
           (void)kiln::gelu(p, "tanh");
         }),
         flops, 0);
  report(base + " fwd [addmm_gelu_aux]", time_ms([&](int) {
           (void)kiln::call_op(aux, {bias, x, w.t()}, {kiln::Scalar(1.0), kiln::Scalar(1.0)});
         }),
         flops, 0);
  report(base + " bwd [mm, then gelu_backward]", time_ms([&](int) {
           (void)kiln::call_op1(gelu_grad, {kiln::mm(dz, w2), pre}, {std::string("tanh")});
         }),
         flops, 0);
  report(base + " bwd [mm_dgelu]", time_ms([&](int) {
           (void)kiln::call_op1(dgelu, {dz, w2, pre});
         }),
         flops, 0);

  // The whole MLP (Linear k -> n with bias, tanh-gelu, Linear n -> k with bias) compiled, one
  // training step's forward and backward, with and without the matmul_epilogue executor.
  auto mlp = [](const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                const Tensor& b2) {
    return kiln::linear(kiln::gelu(kiln::linear(x, w1, b1), "tanh"), w2, b2);
  };
  std::vector<Tensor> params;
  for (const Tensor& t : {x, w, bias, w2, random({g.k}, kiln::kBFloat16)}) {
    params.push_back(t.detach().requires_grad_(true));
  }
  const Tensor gy = random({g.m, g.k}, kiln::kBFloat16);
  for (const bool epilogue : {false, true}) {
    kiln::CompileOptions options;
    if (!epilogue) options.executors({"fused_cuda", "eager"});
    auto f = kiln::compile(mlp, options);
    report(
        base + " mlp train step" + (epilogue ? " [compiled]" : " [compiled, no matmul_epilogue]"),
        time_ms([&](int) {
          const Tensor y = f(params[0], params[1], params[2], params[3], params[4]);
          (void)kiln::autograd::grad({y}, params, {gy});
        }),
        6.0 * flops, 0);
  }
}

// The training GEMMs again with per-shape autotuning (kernels/cuda/cublaslt.h): time_ms's
// warm-up call of each shape times the heuristic's candidates, the samples then run the
// fastest. kiln-only rows (named as the plain ones plus " [autotune]"); the 8192^3 reference is
// left out so that the comparison's reference rate stays the plain one.
void bench_gemm_autotune(const std::vector<Gemm>& gemms) {
  const bool previous = kiln::cuda::matmul_autotune();
  kiln::cuda::set_matmul_autotune(true);
  const kiln::cuda::MatmulAutotuneStats before = kiln::cuda::matmul_autotune_stats();
  for (const Gemm& g : gemms) bench_gemm(g, true, " [autotune]");
  const kiln::cuda::MatmulAutotuneStats after = kiln::cuda::matmul_autotune_stats();
  std::printf("  (autotune: %lld shapes tuned, %lld candidates timed)\n",
              static_cast<long long>(after.tuned_shapes - before.tuned_shapes),
              static_cast<long long>(after.candidates_timed - before.candidates_timed));
  kiln::cuda::set_matmul_autotune(previous);
}

// --- flash attention (kernels/cuda/flash_attention.cu, kernels/cuda/cudnn_attention.cpp) -------
// Causal SDPA forward and backward at the Llama training shapes, on the kernel the dispatcher
// chooses ("fastest" measures cuDNN against the hand kernel on the first call of a shape; shapes
// no kernel takes here are skipped), then on each of "flash_hopper" and "cudnn" by name where it
// takes the call. FLOPs counted as FlashAttention does: forward 4 B H T^2 D, backward 10 B H T^2 D
// (the five GEMMs), halved for causal. The variants that lost are timed beside these in the
// kernel lab (lab/flash_attention_lab.cu). The shapes named "... qkv" lay the operands out as a
// training step does: q, k and v are head views of one [B, T, (H + 2 G) D] projection and dO a
// [B, T, H D] product viewed [B, H, T, D] (strided, [B, T, H, D] in memory), where the others are
// contiguous [B, H, T, D]. torch_reference.py times torch's SDPA on the same layouts.
void bench_flash_attention() {
  struct Shape {
    const char* name;
    int64_t b, h, hkv, t, d;
    bool qkv_views = false;
  };
  static const kiln::OpDef& fwd = KILN_OP(flash_attention);
  static const kiln::OpDef& bwd = KILN_OP(flash_attention_backward);
  auto accepts = [](const kiln::OpDef& op, const char* kernel, const kiln::TensorVec& inputs,
                    const absl::InlinedVector<kiln::Attr, 4>& attrs) {
    kiln::OpCall call;
    call.op = &op;
    call.inputs = inputs;
    call.attrs = attrs;
    const kiln::KernelDef* k = op.find_kernel(kiln::kCUDA, kernel);
    return k != nullptr && k->accepts(call);
  };
  // "7b": Mistral-7B's attention (32 query and 8 kv heads of 128) at 1b's tokens per step; "4k":
  // the same heads at B 1, T 4096; "g2b": gemma-2b's (8 query heads and 1 kv head of 256) at 1b's
  // tokens.
  for (const Shape& s :
       {Shape{"160m", 16, 12, 12, 1024, 64}, Shape{"160m qkv", 16, 12, 12, 1024, 64, true},
        Shape{"1b", 4, 32, 8, 2048, 64}, Shape{"1b qkv", 4, 32, 8, 2048, 64, true},
        Shape{"7b", 4, 32, 8, 2048, 128}, Shape{"4k", 1, 32, 8, 4096, 128},
        Shape{"g2b", 4, 8, 1, 2048, 256}}) {
    Tensor q, k, v, dout;
    if (s.qkv_views) {
      const int64_t n = s.h + 2 * s.hkv;
      const Tensor qkv = random({s.b, s.t, n * s.d}, kiln::kBFloat16);
      q = kiln::internal::qkv_heads(qkv, 0, s.h, n);
      k = kiln::internal::qkv_heads(qkv, s.h, s.hkv, n);
      v = kiln::internal::qkv_heads(qkv, s.h + s.hkv, s.hkv, n);
      dout = kiln::internal::qkv_heads(random({s.b, s.t, s.h * s.d}, kiln::kBFloat16), 0, s.h, s.h);
    } else {
      q = random({s.b, s.h, s.t, s.d}, kiln::kBFloat16);
      k = random({s.b, s.hkv, s.t, s.d}, kiln::kBFloat16);
      v = random({s.b, s.hkv, s.t, s.d}, kiln::kBFloat16);
      dout = random({s.b, s.h, s.t, s.d}, kiln::kBFloat16);
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
    const absl::InlinedVector<kiln::Attr, 4> attrs = {scale, true, int64_t{0}, 0.0};
    kiln::OpCall call;
    call.op = &fwd;
    call.inputs = {q, k, v};
    call.attrs = attrs;
    if (fwd.select_kernel(kiln::kCUDA, call) == nullptr) continue;
    const kiln::TensorVec out = kiln::call_op(fwd, {q, k, v}, attrs);
    // No lse gradient (undefined dlse), as in training: cuDNN's standard backward graph.
    const kiln::TensorVec bwd_in = {dout, q, k, v, out[0], out[1], Tensor()};
    const double flops = 4.0 * s.b * s.h * s.t * s.t * s.d / 2;
    const std::string base = std::string("sdpa causal ") + s.name;
    report(base + " fwd", time_ms([&](int) {
             (void)kiln::call_op(fwd, {q, k, v}, attrs);
           }),
           flops, 0);
    report(base + " bwd", time_ms([&](int) { (void)kiln::call_op(bwd, bwd_in, attrs); }),
           2.5 * flops, 0);
#if defined(KILN_WITH_CUDNN)
    for (const char* op : {"flash_attention", "flash_attention_backward"}) {
      const kiln::cuda::cudnn::Selection sel = kiln::cuda::cudnn::last_selection(op);
      if (!sel.winner.empty()) {
        std::printf("  (%s: first-call measurement cudnn %.3f ms, hand %.3f ms -> %s)\n", op,
                    sel.cudnn_ms, sel.hand_ms, sel.winner.c_str());
      }
    }
#endif
    for (const char* kernel : {"flash_hopper", "cudnn"}) {
      const std::string label = std::string(" [") + kernel + "]";
      if (accepts(fwd, kernel, {q, k, v}, attrs)) {
        report(base + " fwd" + label, time_ms([&](int) {
                 (void)kiln::call_op_with_kernel(fwd, kernel, {q, k, v}, attrs);
               }),
               flops, 0);
      }
      if (accepts(bwd, kernel, bwd_in, attrs)) {
        report(base + " bwd" + label,
               time_ms([&](int) { (void)kiln::call_op_with_kernel(bwd, kernel, bwd_in, attrs); }),
               2.5 * flops, 0);
      }
    }
  }
}

// RoPE at llama-3.2-1b's shape: B 4 ("1b"; 16 for "1b x4", the large size), T 2048, 32 q heads
// and 8 kv heads of 64, bf16. q and k are the [B, H, T, D] views of one
// [B, T, (32 + 2 * 8) * 64] qkv projection, read in place; cos/sin are bf16 [T, D] tables (as
// Hugging Face's Llama keeps them). 3 projections in rotation (each 50 MiB at B 4). Bytes: q and
// k read and written. The backward rotates contiguous dq, dk (the transposed rotation).
void bench_rope(int64_t b, const std::string& name) {
  const int64_t t = 2048, hq = 32, hkv = 8, d = 64;
  std::vector<Tensor> qs, ks, dqs, dks;
  for (int i = 0; i < 3; ++i) {
    const Tensor qkv = random({b, t, (hq + 2 * hkv) * d}, kiln::kBFloat16);
    qs.push_back(qkv.narrow(-1, 0, hq * d).view({b, t, hq, d}).transpose(1, 2));
    ks.push_back(qkv.narrow(-1, hq * d, hkv * d).view({b, t, hkv, d}).transpose(1, 2));
    dqs.push_back(random({b, hq, t, d}, kiln::kBFloat16));
    dks.push_back(random({b, hkv, t, d}, kiln::kBFloat16));
  }
  const Tensor cos = random({t, d}, kiln::kBFloat16), sin = random({t, d}, kiln::kBFloat16);
  const double bytes = 2.0 * static_cast<double>((hq + hkv) * b * t * d * 2);
  static const kiln::OpDef& qk = KILN_OP(rotary_emb_qk);
  report("rope " + name + " q+k bf16 fwd",
         time_ms([&](int i) { (void)kiln::rotary_emb_qk(qs[i % 3], ks[i % 3], cos, sin); }), 0,
         bytes);
  if (b == 4) {
    report("rope " + name + " q+k bf16 fwd (2 launches)", time_ms([&](int i) {
             (void)kiln::rotary_emb(qs[i % 3], cos, sin);
             (void)kiln::rotary_emb(ks[i % 3], cos, sin);
           }),
           0, bytes);
  }
  report("rope " + name + " q+k bf16 bwd", time_ms([&](int i) {
           (void)kiln::call_op(qk, {dqs[i % 3], dks[i % 3], cos, sin}, {true});
         }),
         0, bytes);
}

// The LM head and its loss, forward and backward through autograd, bf16: linear then
// cross_entropy_fused (the [N, V] logits and their gradient whole) against linear_cross_entropy
// (chunks of about 256 MiB of logits). FLOPs: the three matmuls.
void bench_linear_cross_entropy(int64_t n, int64_t c, int64_t v, const std::string& name) {
  const Tensor x = random({n, c}, kiln::kBFloat16).requires_grad_(true);
  const Tensor w = random({v, c}, kiln::kBFloat16, 0.05f).requires_grad_(true);
  const Tensor t = random_targets(n, v);
  const double flops = 6.0 * static_cast<double>(n * c * v);
  report("lm head + loss " + name + " linear, cross_entropy_fused", time_ms([&](int) {
           const Tensor loss = kiln::cross_entropy_fused(kiln::mm(x, w.t()), t);
           (void)kiln::autograd::grad({loss}, {x, w});
         }),
         flops, 0);
  report("lm head + loss " + name + " linear_cross_entropy", time_ms([&](int) {
           const Tensor loss = kiln::linear_cross_entropy(x, w, t);
           (void)kiln::autograd::grad({loss}, {x, w});
         }),
         flops, 0);
}

// The heads of a qkv projection with RoPE on q and k, forward and backward through autograd, at
// llama-160m's training shape (B 16, T 1024, 12 + 2 * 12 heads of 64, bf16): split_qkv_rotary
// (one kernel each way) against narrow views through rotary_emb_qk, whose backward adds three
// zero-filled qkv-sized gradients. Bytes: qkv read and the heads written, then the heads'
// gradients read and qkv's written.
void bench_qkv_heads() {
  const int64_t b = 16, t = 1024, h = 12, g = 12, d = 64;
  const Tensor qkv = random({b, t, (h + 2 * g) * d}, kiln::kBFloat16).requires_grad_(true);
  const Tensor dq = random({b, h, t, d}, kiln::kBFloat16);
  const Tensor dk = random({b, g, t, d}, kiln::kBFloat16);
  const Tensor dv = random({b, g, t, d}, kiln::kBFloat16);
  const Tensor cos = random({t, d}, kiln::kBFloat16), sin = random({t, d}, kiln::kBFloat16);
  const double bytes = 4.0 * static_cast<double>(qkv.numel() * 2);
  report("qkv heads 160m bf16 fwd+bwd split_qkv_rotary", time_ms([&](int) {
           auto [q, k, v] = kiln::split_qkv_rotary(qkv, cos, sin, h, g);
           (void)kiln::autograd::grad({q, k, v}, {qkv}, {dq, dk, dv});
         }),
         0, bytes);
  report("qkv heads 160m bf16 fwd+bwd views + rotary_emb_qk", time_ms([&](int) {
           const Tensor heads = qkv.view({b, t, h + 2 * g, d});
           auto [q, k] = kiln::rotary_emb_qk(heads.narrow(2, 0, h).transpose(1, 2),
                                             heads.narrow(2, h, g).transpose(1, 2), cos, sin);
           const Tensor v = heads.narrow(2, h + g, g).transpose(1, 2);
           (void)kiln::autograd::grad({q, k, v}, {qkv}, {dq, dk, dv});
         }),
         0, bytes);
}

// SwiGLU and tanh-GeGLU over 8192 x 8192 bf16 gate and up (128 MiB each: no rotation needed).
// Bytes: forward gate, up read and y written; backward dy, gate, up read, dgate and dup written.
void bench_glu() {
  const int64_t n = 8192, f = 8192;
  const Tensor gate = random({n, f}, kiln::kBFloat16, 4.0f), up = random({n, f}, kiln::kBFloat16);
  const Tensor dy = random({n, f}, kiln::kBFloat16);
  const double tb = static_cast<double>(n * f * 2);
  static const kiln::OpDef& swb = KILN_OP(swiglu_backward);
  static const kiln::OpDef& geb = KILN_OP(geglu_tanh_backward);
  report("swiglu 8192x8192 bf16 fwd", time_ms([&](int) { (void)kiln::swiglu(gate, up); }), 0,
         3 * tb);
  report("swiglu 8192x8192 bf16 bwd", time_ms([&](int) {
           (void)kiln::call_op(swb, {dy, gate, up});
         }),
         0, 5 * tb);
  report("geglu_tanh 8192x8192 bf16 fwd", time_ms([&](int) { (void)kiln::geglu_tanh(gate, up); }),
         0, 3 * tb);
  report("geglu_tanh 8192x8192 bf16 bwd", time_ms([&](int) {
           (void)kiln::call_op(geb, {dy, gate, up});
         }),
         0, 5 * tb);
}

// The generic kernels: elementwise add/mul over 64M elements (bf16 and f32, 2 reads + 1 write),
// the row sum of an 8192 x 8192 matrix (sum over the last dim), the sum of all of it (64M
// elements read), its column sums and those of 8192 x 2048 (sum over the first dim: a broadcast
// bias's gradient), and softmax over the last dim of 8192 x 32768 bf16 (read + write).
void bench_generic() {
  const int64_t n = int64_t{64} << 20;
  for (kiln::ScalarType dt : {kiln::kBFloat16, kiln::kFloat}) {
    const std::string tn = dt == kiln::kFloat ? "f32" : "bf16";
    const double eb = static_cast<double>(kiln::element_size(dt));
    const Tensor a = random({n}, dt), b = random({n}, dt);
    report("add 64M " + tn, time_ms([&](int) { (void)kiln::add(a, b); }), 0, 3 * n * eb);
    report("mul 64M " + tn, time_ms([&](int) { (void)kiln::mul(a, b); }), 0, 3 * n * eb);
    const Tensor m = a.view({8192, 8192});
    report("sum rows 8192x8192 " + tn, time_ms([&](int) { (void)kiln::sum(m, {1}); }), 0, n * eb);
    report("sum all 64M " + tn, time_ms([&](int) { (void)kiln::sum(a); }), 0, n * eb);
    report("sum columns 8192x8192 " + tn, time_ms([&](int) { (void)kiln::sum(m, {0}); }), 0,
           n * eb);
    const Tensor g = a.narrow(0, 0, 8192 * 2048).view({8192, 2048});
    report("sum columns 8192x2048 " + tn, time_ms([&](int) { (void)kiln::sum(g, {0}); }), 0,
           8192.0 * 2048 * eb);
  }
  const Tensor x = random({8192, 32768}, kiln::kBFloat16, 8.0f);
  report("softmax 8192x32768 bf16", time_ms([&](int) { (void)kiln::softmax(x, -1); }), 0,
         2.0 * static_cast<double>(x.nbytes()));
  // copy_ and fill_: conversions (mixed-precision FSDP converts its f32 shards to bf16 and bf16
  // gradients to f32), FSDP's rows out of a gather (same dtype: cudaMemcpy2DAsync), a transpose,
  // and a fill that is no byte pattern.
  const Tensor f = random({n}, kiln::kFloat), h = random({n}, kiln::kBFloat16);
  Tensor to_h = kiln::empty({n}, h.options()), to_f = kiln::empty({n}, f.options());
  report("convert f32->bf16 64M", time_ms([&](int) { to_h.copy_(f); }), 0, 6.0 * n);
  report("convert bf16->f32 64M", time_ms([&](int) { to_f.copy_(h); }), 0, 6.0 * n);
  const Tensor rows = h.view({4, n / 4}).narrow(1, 1024, n / 8);
  Tensor packed = kiln::empty({4, n / 8}, h.options());
  report("copy rows 4x8M of 4x16M bf16", time_ms([&](int) { packed.copy_(rows); }), 0, 2.0 * n);
  Tensor packed_f = kiln::empty({4, n / 8}, f.options());
  report("convert rows 4x8M of 4x16M bf16->f32", time_ms([&](int) { packed_f.copy_(rows); }), 0,
         3.0 * n);
  const Tensor sq = h.view({8192, 8192});
  Tensor t = kiln::empty({8192, 8192}, h.options());
  report("transpose 8192x8192 bf16", time_ms([&](int) { t.copy_(sq.t()); }), 0, 4.0 * n);
  report("fill 64M f32 with 1.5", time_ms([&](int) { to_f.fill_(1.5); }), 0, 4.0 * n);
}

// --- AdamW over the parameters of llama-3.2-1b (1.24 B) ----------------------------------------
// One optimizer step (the adam_update_ op's multi-tensor CUDA kernel, kernels/cuda/optim.cu)
// over the model's 146 tensors (tied embedding, 16 layers of q/k/v/o, gate/up/down and two
// norms, the final norm). Bytes per parameter: f32 params read p, g, m, v and write p, m, v
// (28 B); bf16 params with f32 state 22 B; bf16 params with bf16 state (state_in_param_dtype, as
// torch.optim.AdamW keeps it) 14 B.
std::vector<kiln::Shape> llama_1b_shapes() {
  const std::vector<kiln::Shape> layer = {{2048, 2048}, {512, 2048},  {512, 2048},
                                          {2048, 2048}, {8192, 2048}, {8192, 2048},
                                          {2048, 8192}, {2048},       {2048}};
  std::vector<kiln::Shape> shapes = {{128256, 2048}, {2048}};
  for (int i = 0; i < 16; ++i) shapes.insert(shapes.end(), layer.begin(), layer.end());
  return shapes;
}

void bench_adamw(kiln::ScalarType dtype, const std::string& name, bool state_in_param_dtype) {
  std::vector<Tensor> params;
  int64_t n = 0;
  for (const kiln::Shape& s : llama_1b_shapes()) {
    Tensor p = random(s, dtype, 0.5f);
    p.mutable_grad() = random(s, dtype, 1e-2f);
    p.requires_grad_(true);
    n += p.numel();
    params.push_back(p);
  }
  kiln::optim::AdamW opt(
      params,
      kiln::optim::AdamWOptions(1e-4).weight_decay(0.1).state_in_param_dtype(state_in_param_dtype));
  // p, g, m, v read and p, m, v written: 4 + 3 elements of the parameter or state dtype.
  const double param_bytes = static_cast<double>(kiln::element_size(dtype));
  const double state_bytes = state_in_param_dtype ? param_bytes : 4.0;
  const double bytes_per_param = 3 * param_bytes + 4 * state_bytes;
  std::printf("  (adamw over %.3f B parameters in %zu tensors)\n", static_cast<double>(n) / 1e9,
              params.size());
  report(name, time_ms([&](int) { opt.step(); }), 0, bytes_per_param * static_cast<double>(n));
}

// --- Gradient clipping (clip_grad_norm) over llama gradient lists
// --------------------------------- The total 2-norm of a model's gradients and their scaling by
// min(1, max_norm / (total + 1e-6)), as models/trainer.cpp's clip_grad_norm computes it in tensors
// (no host sync): the per-tensor way it had (per gradient norm, .to(f64), then stack, and mul_ per
// gradient: ~4 launches per tensor) against the foreach ops (tensor/foreach.h: foreach_norm, stack,
// one f64 norm, foreach_mul_). Also the two foreach ops alone, and nn::utils::clip_grad_norm_ (one
// item()). Bytes: the gradients read twice and written once (6 B per bf16 element). The coefficient
// is below 1 (max_norm 1e-3), so every row scales the gradients.
std::vector<kiln::Shape> llama_160m_shapes() {  // 768 hidden, 3072 MLP, 12 layers, tied 32000
  const std::vector<kiln::Shape> layer = {{768, 768},  {768, 768},  {768, 768},
                                          {768, 768},  {3072, 768}, {3072, 768},
                                          {768, 3072}, {768},       {768}};
  std::vector<kiln::Shape> shapes = {{32000, 768}, {768}};
  for (int i = 0; i < 12; ++i) shapes.insert(shapes.end(), layer.begin(), layer.end());
  return shapes;
}

void bench_clip(const std::vector<kiln::Shape>& shapes, const std::string& model) {
  kiln::NoGradGuard no_grad;
  constexpr double kMaxNorm = 1e-3;
  std::vector<Tensor> grads;
  int64_t n = 0;
  for (const kiln::Shape& s : shapes) {
    grads.push_back(random(s, kiln::kBFloat16, 1e-2f));
    n += grads.back().numel();
  }
  std::printf("  (clipping %.1f M bf16 gradients in %zu tensors)\n", static_cast<double>(n) / 1e6,
              grads.size());
  const double bytes = 6.0 * static_cast<double>(n);
  const std::string base = "clip " + model + " bf16 ";
  report(base + "per-tensor (norm, stack, mul_)", time_ms([&](int) {
           std::vector<Tensor> norms;
           for (const Tensor& g : grads) norms.push_back(g.norm(2.0).to(kiln::kFloat64));
           const Tensor total = kiln::stack(norms).square().sum().sqrt();
           const Tensor coef = (kMaxNorm / (total + 1e-6)).clamp_max(1.0);
           for (Tensor g : grads) g.mul_(coef);
         }),
         0, bytes);
  report(base + "foreach (foreach_norm, stack, foreach_mul_)", time_ms([&](int) {
           const Tensor total =
               kiln::stack(kiln::foreach_norm(grads)).to(kiln::kFloat64).square().sum().sqrt();
           kiln::foreach_mul_(grads, (kMaxNorm / (total + 1e-6)).clamp_max(1.0));
         }),
         0, bytes);
  report(base + "foreach_norm alone", time_ms([&](int) { (void)kiln::foreach_norm(grads); }), 0,
         2.0 * static_cast<double>(n));
  const Tensor scale =
      kiln::full({}, 0.999, kiln::TensorOptions(kiln::kFloat64).device(kiln::Device(kiln::kCUDA)));
  report(base + "foreach_mul_ alone", time_ms([&](int) { kiln::foreach_mul_(grads, scale); }), 0,
         4.0 * static_cast<double>(n));
  std::vector<Tensor> params;
  for (const Tensor& g : grads) {
    Tensor p = kiln::zeros(g.sizes(), kiln::TensorOptions(kiln::kBFloat16).device(g.device()));
    p.mutable_grad() = g;
    params.push_back(p);
  }
  // max_norm falls by 10% per call, so that every call scales (coefficient about 0.9).
  report(base + "nn::utils::clip_grad_norm_ (one item())", time_ms([&](int i) {
           (void)kiln::nn::utils::clip_grad_norm_(params, kMaxNorm * std::pow(0.9, i));
         }),
         0, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> sections = {"gemm",  "rmsnorm",    "layernorm", "cross-entropy",
                                             "flash", "rope",       "qkv",       "lm-loss",
                                             "glu",   "generic",    "fused",     "clip",
                                             "adamw", "fused-rows", "gelu-layer"};
  std::vector<std::string> selected = sections;
  const char* json_path = nullptr;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--no-gemm") {
      selected.erase(std::remove(selected.begin(), selected.end(), "gemm"), selected.end());
    } else if (arg == "--only" && i + 1 < argc) {
      selected.clear();
      std::string list = argv[++i];
      for (size_t start = 0; start <= list.size();) {
        const size_t end = std::min(list.find(',', start), list.size());
        const std::string name = list.substr(start, end - start);
        if (std::find(sections.begin(), sections.end(), name) == sections.end()) {
          std::fprintf(stderr, "kiln_gpu_bench: unknown section '%s' in --only\n", name.c_str());
          return 2;
        }
        selected.push_back(name);
        start = end + 1;
      }
    } else if (arg.rfind("--", 0) == 0) {
      std::fprintf(stderr, "usage: kiln_gpu_bench [results.json] [--no-gemm] [--only SECTIONS]\n");
      return 2;
    } else {
      json_path = argv[i];
    }
  }
  auto want = [&](const char* section) {
    return std::find(selected.begin(), selected.end(), section) != selected.end();
  };
  cudaDeviceProp prop{};
  KILN_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("kiln GPU benchmark on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);

  {  // The bandwidth ceiling: a 1 GiB device-to-device copy (bytes read + written).
    const int64_t bytes = int64_t{1} << 30;
    const Tensor a = random({bytes / 2}, kiln::kBFloat16), b = random({bytes / 2}, kiln::kBFloat16);
    const double ms = time_ms([&](int) {
      KILN_CUDA_CHECK(cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), bytes, cudaMemcpyDeviceToDevice));
    });
    report("d2d copy 1GiB", ms, 0, 2.0 * bytes);
    kiln::bench::copy_gbs() = kiln::bench::rows().back().gbs;
  }

  const bool gemm = want("gemm");
  if (gemm) bench_gemm({"ref", 8192, 8192, 8192}, false);
  const std::vector<Gemm> gemms = {
      {"1b-qkv", 8192, 3072, 2048},       {"1b-attn_out", 8192, 2048, 2048},
      {"1b-gate_up", 8192, 16384, 2048},  {"1b-down", 8192, 2048, 8192},
      {"1b-head", 8192, 128256, 2048},    {"160m-qkv", 16384, 2304, 768},
      {"160m-gate_up", 16384, 4096, 768}, {"160m-down", 16384, 768, 2048},
      {"160m-head", 16384, 32000, 768},
  };
  for (const Gemm& g : gemms) {
    if (gemm) bench_gemm(g, true);
  }
  if (gemm) {
    for (const Gemm& g : {Gemm{"1b-attn_out", 8192, 2048, 2048}, Gemm{"1b-up", 8192, 8192, 2048},
                          Gemm{"160m-up", 16384, 3072, 768}}) {
      bench_bias_grad(g);
    }
    bench_activation_epilogue({"1b-up", 8192, 8192, 2048});
    bench_activation_epilogue({"160m-up", 16384, 3072, 768});
  }
  if (want("gelu-layer")) {
    bench_gelu_layer({"1b-up", 8192, 8192, 2048});
    bench_gelu_layer({"gpt2-up", 16384, 3072, 768});
  }
  if (gemm)
    bench_gemm({"ref2", 8192, 8192, 8192}, false);  // again: the spread between the two is noise
  if (gemm) bench_gemm_autotune(gemms);

  // RMSNorm bf16 (bf16 weight) at llama-3.2-1b's training shape (8192 x 2048, 32 MiB) and a
  // large one (32768 x 4096, 256 MiB), 4 input sets in rotation. The same-size copy beside each
  // shows how much of the gap to the 1 GiB copy is the size (launch and tail) alone.
  if (want("rmsnorm"))
    for (const auto& [rows, d] :
         std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {32768, 4096}}) {
      std::vector<Tensor> xs, dys, rstds;
      const Tensor w = random({d}, kiln::kBFloat16);
      static const kiln::OpDef& fwd = KILN_OP(rms_norm);
      static const kiln::OpDef& bwd = KILN_OP(rms_norm_backward);
      for (int i = 0; i < 4; ++i) {
        xs.push_back(random({rows, d}, kiln::kBFloat16));
        dys.push_back(random({rows, d}, kiln::kBFloat16));
        rstds.push_back(kiln::call_op(fwd, {xs.back(), w}, {1e-6})[1]);
      }
      const double tensor_bytes = static_cast<double>(rows * d * 2);
      const std::string shape = std::to_string(rows) + "x" + std::to_string(d);
      const Tensor copy_dst = kiln::empty_like(xs[0]);
      report("d2d copy " + shape + " bf16", time_ms([&](int i) {
               KILN_CUDA_CHECK(cudaMemcpyAsync(copy_dst.data_ptr(), xs[i % 4].data_ptr(),
                                               static_cast<size_t>(tensor_bytes),
                                               cudaMemcpyDeviceToDevice));
             }),
             0, 2 * tensor_bytes);
      report("rmsnorm " + shape + " bf16 fwd",
             time_ms([&](int i) { (void)kiln::rms_norm(xs[i % 4], w, 1e-6); }), 0,
             2 * tensor_bytes);
      report("rmsnorm " + shape + " bf16 bwd", time_ms([&](int i) {
               (void)kiln::call_op(bwd, {dys[i % 4], xs[i % 4], w, rstds[i % 4]});
             }),
             0, 3 * tensor_bytes);
    }

  // LayerNorm (weight and bias) at the Llama-1B activation shape and a large one, bf16 x and
  // parameters, 4 input sets in rotation (32 MiB and 256 MiB each). Forward: x read, y written;
  // backward: x and dy read, dx written (the parameters and statistics are small).
  if (want("layernorm"))
    for (const auto& [rows, d] :
         std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {32768, 4096}}) {
      std::vector<Tensor> xs, dys, means, rstds;
      const Tensor w = random({d}, kiln::kBFloat16), b = random({d}, kiln::kBFloat16);
      static const kiln::OpDef& fwd = KILN_OP(layer_norm);
      static const kiln::OpDef& bwd = KILN_OP(layer_norm_backward);
      for (int i = 0; i < 4; ++i) {
        xs.push_back(random({rows, d}, kiln::kBFloat16));
        dys.push_back(random({rows, d}, kiln::kBFloat16));
        const kiln::TensorVec f = kiln::call_op(fwd, {xs.back(), w, b}, {kiln::Shape{d}, 1e-5});
        means.push_back(f[1]);
        rstds.push_back(f[2]);
      }
      const double tensor_bytes = static_cast<double>(rows * d * 2);
      const std::string shape = std::to_string(rows) + "x" + std::to_string(d);
      report("layernorm " + shape + " bf16 fwd",
             time_ms([&](int i) { (void)kiln::layer_norm(xs[i % 4], w, b, 1e-5); }), 0,
             2 * tensor_bytes);
      report("layernorm " + shape + " bf16 bwd", time_ms([&](int i) {
               (void)kiln::call_op(bwd, {dys[i % 4], xs[i % 4], w, means[i % 4], rstds[i % 4]});
             }),
             0, 3 * tensor_bytes);
    }

  if (want("cross-entropy")) {  // Cross-entropy 8192 x 128256 bf16 logits (2 GiB).
    const int64_t n = 8192, v = 128256;
    const Tensor logits = random({n, v}, kiln::kBFloat16, 8.0f);
    const Tensor targets = random_targets(n, v);
    static const kiln::OpDef& fwd = KILN_OP(cross_entropy_fused);
    static const kiln::OpDef& bwd = KILN_OP(cross_entropy_fused_backward);
    const kiln::TensorVec out = kiln::call_op(fwd, {logits, targets}, {int64_t{-100}});
    const Tensor g = kiln::full({}, 1.0, kiln::TensorOptions(kiln::kFloat).device(logits.device()));
    const double bytes = static_cast<double>(n * v * 2);
    std::printf("  (cross-entropy loss on uniform[-8, 8) logits: %.4f)\n", out[0].item<double>());
    report("cross_entropy 8192x128256 bf16 fwd", time_ms([&](int) {
             (void)kiln::call_op(fwd, {logits, targets}, {int64_t{-100}});
           }),
           0, bytes);
    report("cross_entropy 8192x128256 bf16 bwd", time_ms([&](int) {
             (void)kiln::call_op1(bwd, {g, logits, targets, out[1]}, {int64_t{-100}});
           }),
           0, 2 * bytes);
  }

  if (want("flash")) bench_flash_attention();
  if (want("rope")) {
    bench_rope(4, "1b");
    bench_rope(16, "1b x4");
  }
  if (want("qkv")) bench_qkv_heads();
  if (want("lm-loss")) {
    bench_linear_cross_entropy(16384, 768, 32000, "160m");
    bench_linear_cross_entropy(8192, 2048, 128256, "1b");
  }
  if (want("glu")) bench_glu();
  if (want("generic")) bench_generic();
  if (want("fused")) kiln::bench::bench_fused();
  if (want("fused-rows") && !want("fused"))
    kiln::bench::bench_fused_rows();  // the row kernels alone
  if (want("clip")) {
    bench_clip(llama_160m_shapes(), "llama-160m");
    bench_clip(llama_1b_shapes(), "llama-3.2-1b");
  }
  if (want("adamw")) {
    bench_adamw(kiln::kFloat, "adamw 1.24B f32", false);
    bench_adamw(kiln::kBFloat16, "adamw 1.24B bf16 params", false);
    bench_adamw(kiln::kBFloat16, "adamw 1.24B bf16 params bf16 state", true);
  }

  if (json_path != nullptr && !kiln::bench::write_json(json_path, prop.name)) return 1;
  return 0;
}
