// cuDNN's fused attention (SDPA) as CUDA kernels of flash_attention and flash_attention_backward
// (tensor/ops/attention.cpp), built through cuDNN's backend graph API (cudnn_graph.h, cuDNN 9).
// Only compiled when CMake found cuDNN (KILN_WITH_CUDNN); kernels/cuda/flash_attention.cu holds
// the hand kernels it competes with.
//
// Two kernels per op, registered from cudnn_attention.cpp:
//   - "fastest" (tried first): for a call that both cuDNN and a hand kernel can run, the first
//     call per shape key times both on the call's own operands (CUDA events, after a warm-up)
//     and remembers the winner; later calls run the winner (when the hand kernel won, the rule
//     refuses and the dispatcher goes on to it). Graph capture never measures. cuDNN's side is
//     the fastest of the heuristics' first few engine configurations (up to 4, each timed on
//     the same call first): its heuristics' first choice is not always its fastest.
//   - "cudnn": cuDNN only. Tried after the hand kernels (a call none of them takes); tests and
//     the lab reach it by name:
//       call_op_with_kernel(KILN_OP(flash_attention), "cudnn", {q, k, v}, {scale, true, 0, 0.0})
//
// What cuDNN runs here: bf16/f16, head sizes 64, 128 and 256 (q, k, v one head size), GQA,
// top-left causal or no mask, any finite scale; no attn_mask, dropout, softcap or sliding window
// shorter than the queries (the support rule refuses them; a window of at least T hides nothing
// the causal mask shows and runs as causal attention). Operands are read in place through their
// strides (the views of a qkv projection qualify): each needs a contiguous last dim, strides that
// are multiples of 8 elements and a 16-byte aligned base, or the rule refuses the call.
//
// lse: cuDNN's "Stats" output is max_j s_ij + log(sum_j exp(s_ij - max)) of the scaled, masked
// scores, f32 [B, H, T, 1]: kiln's lse (natural log) in kiln's [B, H, T] layout.
//
// The backward's gradient of lse (dlse): kiln's Delta is rowsum(dO * O) - dlse, while cuDNN's
// usual backward graph computes rowsum(dO * O) itself ("Dsum") and has no place for dlse. Two
// backward graphs, chosen per call (and cached and measured per variant):
//   - dlse undefined (zeros: what flash_attention's backward rule passes when lse received no
//     gradient, as in training): cuDNN's usual graph, "dsum=cudnn" in keys and logs;
//   - dlse defined: a graph that takes Dsum as an input tensor ("dsum=input"), which kiln fills
//     with the hand kernels' Delta pass (it subtracts dlse). Where a cuDNN builds no plan for it
//     (9.14 on an H100 builds none), the rule refuses and the hand kernels run the call: a
//     gradient is never computed without dlse.
#pragma once

#include <cstdint>
#include <string>

#include "tensor/tensor.h"

namespace kiln::cuda::cudnn {

// Whether this build links cuDNN and a cuDNN library of version 9 or later loads.
bool available();
// The loaded cuDNN's version (cudnnGetVersion(), e.g. 91400), 0 without cuDNN.
int64_t version();

// For tests and benchmarks: what the "fastest" kernel decided for the last measured key of
// `op` ("flash_attention" or "flash_attention_backward"): "cudnn", the hand kernel's name, or ""
// when nothing was measured; with the key and the measured milliseconds.
struct Selection {
  std::string winner;
  std::string key;
  double cudnn_ms = 0.0;
  double hand_ms = 0.0;
  // cuDNN's candidate engines, each with its milliseconds, the chosen one starred ("" when
  // cuDNN offered one engine): "*engine 8 [knobs], workspace 0 bytes: 0.1021 ms; engine ...".
  std::string cudnn_engines;
};
Selection last_selection(const std::string& op);
// Forgets every measured choice (tests); built plans stay cached.
void clear_selections();
// Forgets every built plan and measured choice, as a new process starts (tests). The engines
// timed fastest stay in the disk cache (kernels/cuda/choices.h): a plan built again for a key
// found there finalizes only that engine.
void clear_plans();
// A line per cached plan: the shape key, the graph variant and cuDNN's engine index, or the
// reason no plan was built (for test logs).
std::string describe_plans();
// Diagnostics: builds (and caches) the forward graph and both backward graphs (the row sum
// rowsum(dO * O) - dlse as an input, which runs calls with a dlse, and computed by cuDNN, which
// runs calls without one) for attention over q, k, v with a dense dO, and says for each which
// engine cuDNN chose or why no plan was built.
std::string probe(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale);

}  // namespace kiln::cuda::cudnn

namespace kiln::cuda::flash {
// Defined in flash_attention.cu (the hand kernels' Delta pass): delta[row] = sum_d dout[row, d] *
// out[row, d] - dlse[row] (an undefined dlse: zeros, nothing read) for the B H T rows of dout
// and out ([B, H, T, D], rows 16-byte aligned, D 64, 128 or 256), and the row's D floats of
// dq_acc ([B, H, T, D] f32, contiguous) zeroed.
void delta_pass(const Tensor& dout, const Tensor& out, const Tensor& dlse, float* delta,
                float* dq_acc);
}  // namespace kiln::cuda::flash
