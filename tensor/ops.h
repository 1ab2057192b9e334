// The free-function spelling of kiln's ops, as in libtorch (`kiln::matmul(a, b)`,
// `kiln::cat({a, b}, 1)`), plus the factories and the RNG seed. Tensor methods are declared in
// tensor/tensor.h; both are implemented by family in tensor/ops/*.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "tensor/tensor.h"

namespace kiln {

// --- Free-function spellings of Tensor methods (libtorch has both) ----------------------------
inline Tensor reshape(const Tensor& a, IntArrayRef sizes) { return a.reshape(sizes); }
inline Tensor flatten(const Tensor& a, int64_t start_dim = 0, int64_t end_dim = -1) {
  return a.flatten(start_dim, end_dim);
}
inline Tensor transpose(const Tensor& a, int64_t dim0, int64_t dim1) {
  return a.transpose(dim0, dim1);
}
inline Tensor permute(const Tensor& a, IntArrayRef dims) { return a.permute(dims); }
inline Tensor unsqueeze(const Tensor& a, int64_t dim) { return a.unsqueeze(dim); }
inline Tensor squeeze(const Tensor& a) { return a.squeeze(); }
inline Tensor squeeze(const Tensor& a, int64_t dim) { return a.squeeze(dim); }
inline Tensor narrow(const Tensor& a, int64_t dim, int64_t start, int64_t length) {
  return a.narrow(dim, start, length);
}
inline Tensor select(const Tensor& a, int64_t dim, int64_t index) { return a.select(dim, index); }
inline Tensor clone(const Tensor& a) { return a.clone(); }

// --- Factories ----------------------------------------------------------------------------------
Tensor empty(IntArrayRef sizes, const TensorOptions& options = {});
Tensor zeros(IntArrayRef sizes, const TensorOptions& options = {});
Tensor ones(IntArrayRef sizes, const TensorOptions& options = {});
Tensor full(IntArrayRef sizes, const Scalar& value, const TensorOptions& options = {});
Tensor empty_like(const Tensor& t, const TensorOptions& options = {});
Tensor zeros_like(const Tensor& t, const TensorOptions& options = {});
Tensor ones_like(const Tensor& t, const TensorOptions& options = {});
Tensor full_like(const Tensor& t, const Scalar& value, const TensorOptions& options = {});
Tensor rand_like(const Tensor& t, const TensorOptions& options = {});
Tensor randn_like(const Tensor& t, const TensorOptions& options = {});
// Values start, start + step, ... below end. Integer arguments give int64, floats the default
// dtype, unless options say otherwise.
Tensor arange(const Scalar& end, const TensorOptions& options = {});
Tensor arange(const Scalar& start, const Scalar& end, const TensorOptions& options = {});
Tensor arange(const Scalar& start, const Scalar& end, const Scalar& step,
              const TensorOptions& options = {});
Tensor linspace(const Scalar& start, const Scalar& end, int64_t steps,
                const TensorOptions& options = {});
Tensor eye(int64_t n, const TensorOptions& options = {});
Tensor eye(int64_t n, int64_t m, const TensorOptions& options = {});
// Wraps existing memory without copying; `deleter` (optional) frees it with the last tensor.
Tensor from_blob(void* data, IntArrayRef sizes, const TensorOptions& options = {});
Tensor from_blob(void* data, IntArrayRef sizes, IntArrayRef strides,
                 const TensorOptions& options = {});
Tensor from_blob(void* data, IntArrayRef sizes, std::function<void(void*)> deleter,
                 const TensorOptions& options = {});
Tensor scalar_tensor(const Scalar& value, const TensorOptions& options = {});
// `o` with the dtype and device of `t` filled in where `o` leaves them unset.
TensorOptions options_like(const Tensor& t, const TensorOptions& o);

// --- Random (Philox 4x32-10, counter-based: same numbers for the same seed on every run) ----
void manual_seed(uint64_t seed);
Tensor rand(IntArrayRef sizes, const TensorOptions& options = {});
Tensor randn(IntArrayRef sizes, const TensorOptions& options = {});
Tensor randint(int64_t high, IntArrayRef sizes, const TensorOptions& options = {});
Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, const TensorOptions& options = {});
Tensor bernoulli(const Tensor& p);
Tensor bernoulli(const Tensor& t, double p);
Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement = false);
Tensor randperm(int64_t n, const TensorOptions& options = kInt64);

// --- Type promotion -------------------------------------------------------------------------
// torch.result_type: dimensioned tensors over 0-d tensors over scalars, by category.
ScalarType result_type(const Tensor& a, const Tensor& b);
ScalarType result_type(const Tensor& a, const Scalar& b);

// --- Elementwise ----------------------------------------------------------------------------
Tensor neg(const Tensor& a);
Tensor abs(const Tensor& a);
Tensor exp(const Tensor& a);
Tensor log(const Tensor& a);
Tensor log1p(const Tensor& a);
Tensor expm1(const Tensor& a);
Tensor sqrt(const Tensor& a);
Tensor rsqrt(const Tensor& a);
Tensor sin(const Tensor& a);
Tensor cos(const Tensor& a);
Tensor tanh(const Tensor& a);
Tensor sigmoid(const Tensor& a);
Tensor relu(const Tensor& a);
Tensor gelu(const Tensor& a, std::string_view approximate = "none");
Tensor silu(const Tensor& a);
Tensor erf(const Tensor& a);
Tensor reciprocal(const Tensor& a);
Tensor sign(const Tensor& a);
Tensor floor(const Tensor& a);
Tensor ceil(const Tensor& a);
Tensor round(const Tensor& a);
Tensor square(const Tensor& a);
Tensor logical_not(const Tensor& a);
Tensor pow(const Tensor& a, const Scalar& exponent);
Tensor pow(const Tensor& a, const Tensor& exponent);
Tensor pow(const Scalar& a, const Tensor& exponent);
Tensor add(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor add(const Tensor& a, const Scalar& b, const Scalar& alpha = 1);
Tensor sub(const Tensor& a, const Tensor& b, const Scalar& alpha = 1);
Tensor sub(const Tensor& a, const Scalar& b, const Scalar& alpha = 1);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Scalar& b);
Tensor div(const Tensor& a, const Tensor& b,
           std::optional<std::string_view> rounding_mode = std::nullopt);
Tensor div(const Tensor& a, const Scalar& b,
           std::optional<std::string_view> rounding_mode = std::nullopt);
Tensor floor_divide(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor atan2(const Tensor& a, const Tensor& b);
Tensor eq(const Tensor& a, const Tensor& b);
Tensor ne(const Tensor& a, const Tensor& b);
Tensor lt(const Tensor& a, const Tensor& b);
Tensor le(const Tensor& a, const Tensor& b);
Tensor gt(const Tensor& a, const Tensor& b);
Tensor ge(const Tensor& a, const Tensor& b);
Tensor logical_and(const Tensor& a, const Tensor& b);
Tensor logical_or(const Tensor& a, const Tensor& b);
Tensor logical_xor(const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& condition, const Tensor& a, const Scalar& b);
Tensor where(const Tensor& condition, const Scalar& a, const Tensor& b);
Tensor clamp(const Tensor& a, std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt);
Tensor lerp(const Tensor& start, const Tensor& end, const Scalar& weight);
Tensor lerp(const Tensor& start, const Tensor& end, const Tensor& weight);
// allclose/isclose: |a - b| <= atol + rtol * |b|, elementwise; NaNs equal when equal_nan.
Tensor isclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8,
               bool equal_nan = false);
bool allclose(const Tensor& a, const Tensor& b, double rtol = 1e-5, double atol = 1e-8,
              bool equal_nan = false);
bool equal(const Tensor& a, const Tensor& b);  // same shape and equal elements

// --- Reductions -----------------------------------------------------------------------------
Tensor sum(const Tensor& a, IntArrayRef dims = {}, bool keepdim = false,
           std::optional<ScalarType> dtype = std::nullopt);
Tensor mean(const Tensor& a, IntArrayRef dims = {}, bool keepdim = false,
            std::optional<ScalarType> dtype = std::nullopt);
Tensor amax(const Tensor& a, IntArrayRef dims = {}, bool keepdim = false);
Tensor amin(const Tensor& a, IntArrayRef dims = {}, bool keepdim = false);
Tensor argmax(const Tensor& a, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor argmin(const Tensor& a, std::optional<int64_t> dim = std::nullopt, bool keepdim = false);
Tensor var(const Tensor& a, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor std(const Tensor& a, IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false);
Tensor norm(const Tensor& a, const Scalar& p = 2, IntArrayRef dims = {}, bool keepdim = false);
Tensor logsumexp(const Tensor& a, IntArrayRef dims, bool keepdim = false);
Tensor cumsum(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype = std::nullopt);

// --- Linear algebra (Eigen on the CPU; f16/bf16 computed in f32) ------------------------------
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor mm(const Tensor& a, const Tensor& b);
Tensor bmm(const Tensor& a, const Tensor& b);
Tensor addmm(const Tensor& self, const Tensor& mat1, const Tensor& mat2, const Scalar& beta = 1,
             const Scalar& alpha = 1);
// y = x W^T + b, W of shape [out, in], as torch.nn.functional.linear.
Tensor linear(const Tensor& input, const Tensor& weight, const Tensor& bias = {});
Tensor outer(const Tensor& a, const Tensor& b);
Tensor dot(const Tensor& a, const Tensor& b);

// --- Joining, indexing, sorting ---------------------------------------------------------------
Tensor cat(TensorList tensors, int64_t dim = 0);
Tensor stack(TensorList tensors, int64_t dim = 0);
// x's consecutive slices of `sizes` along dim as fresh contiguous tensors (PyTorch's
// split_with_sizes_copy); the gradient is one cat of the slices' gradients.
std::vector<Tensor> split_with_sizes_copy(const Tensor& x, IntArrayRef sizes, int64_t dim = 0);
Tensor index_select(const Tensor& a, int64_t dim, const Tensor& index);
Tensor gather(const Tensor& a, int64_t dim, const Tensor& index);
Tensor scatter(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src);
Tensor scatter_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& src);
Tensor index_add(const Tensor& a, int64_t dim, const Tensor& index, const Tensor& source,
                 const Scalar& alpha = 1);
Tensor masked_fill(const Tensor& a, const Tensor& mask, const Scalar& value);
Tensor masked_select(const Tensor& a, const Tensor& mask);
// Rows of `weight` picked by integer `indices` (any shape): output [*indices.shape, dim].
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor triu(const Tensor& a, int64_t diagonal = 0);
Tensor tril(const Tensor& a, int64_t diagonal = 0);
// int64 indices in [0, num_classes) -> int64 one-hot rows; num_classes -1 infers max + 1.
Tensor one_hot(const Tensor& indices, int64_t num_classes = -1);
std::tuple<Tensor, Tensor> topk(const Tensor& a, int64_t k, int64_t dim = -1, bool largest = true,
                                bool sorted = true);
std::tuple<Tensor, Tensor> sort(const Tensor& a, int64_t dim = -1, bool descending = false,
                                bool stable = false);
Tensor argsort(const Tensor& a, int64_t dim = -1, bool descending = false, bool stable = false);
Tensor softmax(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype = std::nullopt);
Tensor log_softmax(const Tensor& a, int64_t dim, std::optional<ScalarType> dtype = std::nullopt);

// --- Fused ops (tensor/ops/{norm,cross_entropy,rotary,glu,attention}.cpp) -------------------
// Each is one registry op with a decomposition into the ops above: its kernels take the common
// cases (support rules: kernels/fused_support.h, kernels/cuda/flash_attention.cu) and the
// decomposition runs the rest, so every call the op accepts works on every device.
//
// RMSNorm over the trailing dims that `weight` spans (or normalized_shape, without a weight):
// x * rsqrt(mean(x^2) + eps) * weight, in f32 for f16/bf16 (f64 for f64), returned in x's dtype.
// One kernel forward, one backward ("rms_norm_backward": dx and dweight) for a weight of x's
// dtype or f32 for a f16/bf16 x.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
// With a normalized_shape (libtorch's spelling): eps defaults to the machine epsilon of x's dtype.
Tensor rms_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight = {},
                std::optional<double> eps = std::nullopt);
// LayerNorm over the trailing dims that `weight` (or, without a weight, `bias`) spans, or
// normalized_shape: (x - mean) * rsqrt(var + eps) * weight + bias with the biased variance, in
// f32 for f16/bf16 (f64 for f64), returned in x's dtype. weight and bias are optional
// (undefined: 1 and 0). One kernel forward, one backward ("layer_norm_backward": dx, dweight and
// dbias) for parameters of x's dtype, or f32 for a f16/bf16 x, of one dtype.
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
Tensor layer_norm(const Tensor& x, IntArrayRef normalized_shape, const Tensor& weight = {},
                  const Tensor& bias = {}, double eps = 1e-5);
// Cross-entropy of logits [N, C, d...] (or [C]) against integer class indices [N, d...] (or []),
// as F::cross_entropy with class-index targets: an optional class weight [C] (undefined: none),
// targets equal to ignore_index left out, reduction "mean", "sum" or "none", label smoothing.
// Returns the loss in f32 (f64 for f64 logits). The fused kernels take [N, V] logits with int64
// targets and the plain mean (LM training): they never materialise an f32 copy of the logits,
// and the backward writes dlogits in one pass.
Tensor cross_entropy_fused(const Tensor& logits, const Tensor& targets,
                           int64_t ignore_index = -100);
Tensor cross_entropy_fused(const Tensor& logits, const Tensor& targets, const Tensor& weight,
                           int64_t ignore_index, std::string_view reduction,
                           double label_smoothing);
// The fused case's loss and gradient in one call: {loss, lse, dlogits} for logits [N, V], int64
// targets [N] and a 0-d grad of the loss's dtype (f32, f64 for f64 logits): loss and lse as
// cross_entropy_fused's (the mean), dlogits = (softmax(logits) - onehot(targets)) * grad / count,
// zero on ignored rows. Not differentiable (its callers take the gradient it returns). On CUDA,
// rows of up to 32768 f16/bf16 classes are read once.
std::tuple<Tensor, Tensor, Tensor> cross_entropy_fused_with_grad(const Tensor& logits,
                                                                 const Tensor& targets,
                                                                 const Tensor& grad,
                                                                 int64_t ignore_index = -100);
// Rotary position embedding (tensor/ops/rotary.cpp), rotate-half layout: x * cos +
// rotate_half(x) * sin with rotate_half(x) = [-x2, x1] over the halves of the last dim. x is
// [..., T, D] (any strides, read in place: the q/k views of a fused qkv projection), cos and sin
// broadcast to x. f32 arithmetic for f16/bf16, result in x's dtype. The kernels take [T, D]
// tables (F::rope_cache) of x's dtype, or f32 for a f16/bf16 x; the backward is the transposed
// rotation, one kernel.
Tensor rotary_emb(const Tensor& x, const Tensor& cos, const Tensor& sin);
// rotary_emb of q and of k (same T and D; the head counts may differ) in one launch.
std::tuple<Tensor, Tensor> rotary_emb_qk(const Tensor& q, const Tensor& k, const Tensor& cos,
                                         const Tensor& sin);
// The heads of a fused qkv projection, qkv [..., T, (H + 2 G) D], as q [..., H, T, D] and k, v
// [..., G, T, D] with RoPE applied to q and k: one kernel that reads qkv once and writes three
// new tensors (stored [..., T, heads, D]). Its backward is merge_qkv_rotary, one kernel writing
// the whole qkv gradient, where narrow views would cost three zero-filled gradients and their
// sum. cos/sin are [T, D] tables (as rotary_emb's kernels take them).
std::tuple<Tensor, Tensor, Tensor> split_qkv_rotary(const Tensor& qkv, const Tensor& cos,
                                                    const Tensor& sin, int64_t n_head,
                                                    int64_t n_kv_head);
// The adjoint of split_qkv_rotary: dq, dk, dv rotated back (transposed RoPE on dq, dk) and
// laid side by side as one contiguous [..., T, (H + 2 G) D] tensor.
Tensor merge_qkv_rotary(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& cos,
                        const Tensor& sin);
// Gated MLP activations (tensor/ops/glu.cpp): silu(gate) * up and gelu(gate, "tanh") * up for
// gate and up of one shape and dtype (any strides), in f32 for f16/bf16. One kernel forward,
// one backward writing dgate and dup together.
Tensor swiglu(const Tensor& gate, const Tensor& up);
Tensor geglu_tanh(const Tensor& gate, const Tensor& up);
// Fused recurrent cells (tensor/ops/rnn.cpp), the pointwise part of one LSTM / GRU step in one
// kernel: lstm_cell_fused(gates [B, 4H], cx [B, H]) -> (hy, cy) with gates i, f, g, o summed
// over the input and hidden projections; gru_cell_fused(igates [B, 3H], hgates [B, 3H], hx) -> hy
// with gates r, z, n (the hidden projection's n is gated by r). nn::LSTM and nn::GRU use them.
std::tuple<Tensor, Tensor> lstm_cell_fused(const Tensor& gates, const Tensor& cx);
Tensor gru_cell_fused(const Tensor& igates, const Tensor& hgates, const Tensor& hx);
// The slices x.select(dim, i) as fresh tensors, whose gradient is one stack (unbind's views each
// give back a gradient of x's full size): how the recurrent layers split their inputs into steps.
std::vector<Tensor> unbind_copy(const Tensor& x, int64_t dim = 0);

// Fused attention (tensor/ops/attention.cpp): q [B, H, T, D], k [B, H_kv, S, D] and v
// [B, H_kv, S, Dv] (H a multiple of H_kv), softmax(scale * q k^T) v with causal (top-left
// aligned) and sliding-window masks and tanh softcapping as F::scaled_dot_product_attention.
// Returns (out [B, H, T, Dv], logsumexp [B, H, T] in f32, f64 for f64 inputs). The flash kernels
// never materialise the T x S scores (CUDA: bf16/f16 and the head sizes of
// kernels/cuda/flash_attention.cu; CPU: blocks of query rows as f32 products, f64 loops for f64
// inputs, kernels/cpu/flash_attention.cpp); an attn_mask (bool: true attends;
// floating: added to the scores) or dropout_p > 0 runs the decomposition. Backward: one fused
// op, "flash_attention_backward".
std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           double scale, bool causal = false,
                                           int64_t sliding_window = 0, double softcap = 0.0);
std::tuple<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const Tensor& attn_mask, double scale, bool causal,
                                           int64_t sliding_window, double softcap,
                                           double dropout_p);

// --- Optimizer updates (tensor/ops/optim.cpp) ---------------------------------------------------
// Multi-tensor, in place, as torch._fused_adam_ / _fused_adamw_ / _fused_sgd_: what
// kiln::optim's Adam, AdamW and SGD step() run, one call per device and dtype. Call them under
// NoGradGuard (they have no backward). Lists are parallel: entry i of each belongs to params[i].
// Parameters of one floating dtype and device; grads of their dtype and shape; state of one
// dtype, the parameters' or f32 for bf16/f16 parameters. Arithmetic in f32 (f64 for f64), each
// stored value rounded once.
//
// What changes from step to step is a tensor, so that a recorded step (kiln::compile) replays
// with the current values: `lr` is a 0-d f64 CPU tensor (an optimizer passes its parameter
// group's, which set_lr writes in place) and each step count a 0-d int64 CPU tensor (the
// parameter's optimizer state), on the CPU whatever the parameters' device.
//
// Adds 1 to each tensor: 0-d int64 CPU tensors (step counts; one call for all of a step's).
void increment_(TensorList tensors);
// Adam (L2 decay added to the gradient) or, with decoupled_weight_decay, AdamW (p *= 1 - lr *
// weight_decay). state_steps[i] holds params[i]'s step count t after this step (1 on the first:
// increment_ them before the call); max_exp_avg_sqs is empty unless amsgrad.
void adam_update_(TensorList params, TensorList grads, TensorList exp_avgs, TensorList exp_avg_sqs,
                  TensorList max_exp_avg_sqs, TensorList state_steps, const Tensor& lr,
                  double beta1, double beta2, double weight_decay, double eps, bool amsgrad,
                  bool decoupled_weight_decay);
// SGD with momentum, dampening, Nesterov momentum and L2 weight decay (torch.optim.SGD).
// momentum_buffers and new_buffers are empty when momentum == 0; new_buffers[i] is 1 where
// momentum_buffers[i] is new (it is set to the gradient; its values are not read), else 0.
void sgd_update_(TensorList params, TensorList grads, TensorList momentum_buffers,
                 IntArrayRef new_buffers, const Tensor& lr, double momentum, double dampening,
                 double weight_decay, bool nesterov);

}  // namespace kiln
