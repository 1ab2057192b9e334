// CUDA kernels of flash_attention and flash_attention_backward (tensor/ops/attention.cpp; the
// reference is kernels/cpu/flash_attention.cpp): two kernel families, each registered for both
// ops with one support rule that both passes share.
//   - "flash_hopper" (tried first): warpgroup MMAs on compute capability 9.x, when the build holds
//     sm_90a code (flash_fwd_hopper.cu, flash_bwd_hopper.cu). Head sizes 64, 128 and 256; a
//     positive scale (the forward folds it into the exponent).
//   - "flash_sm80": mma.sync on compute capability 8.0 and later (flash_fwd_sm80.cu,
//     flash_bwd_sm80.cu). Head sizes 64 and 128, any scale.
// Where cuDNN was found, kernels/cuda/cudnn_attention.cpp adds cuDNN's fused attention: a
// "fastest" kernel tried before these, which measures cuDNN against the family that takes a call
// on the first call of each shape and keeps the winner, and a "cudnn" kernel tried after them.
// When no kernel supports a call, the dispatcher runs the op's decomposition. Tests and the kernel
// lab reach a family by name: call_op_with_kernel(op, "flash_sm80", ...).
//
// This file holds what both families share around their kernels: the operands (views whose rows
// are not 16-byte aligned are copied), Params, the backward's Delta pass (Delta = rowsum(dO * O) -
// dlse, dlse undefined meaning zeros, fused with zeroing dQ's f32 accumulator; cuDNN's backward
// reads it too when dlse is defined: delta_pass) and the rounding of dQ to the dtype afterwards.
// Shared device code: flash_common.cuh. Measurements and the kernels' history:
// benchmarks/RESULTS.md ("Flash attention kernels: history"); the variants that lost: the kernel
// lab (benchmarks/lab/flash_attention_lab.cu).
#include <algorithm>
#include <climits>

#include "kernels/cuda/cudnn_attention.h"
#include "kernels/cuda/flash_common.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/fused_support.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"

namespace kiln::cuda::flash {
namespace {

// delta[row] = sum_d dout[row, d] * out[row, d] - dlse[row] (dlse null: zeros), and the row's D
// f32 of the dQ accumulator zeroed (the memset the backward kernels need, fused into this pass).
// D / 8 threads per row, each one 16-byte pack of dout and out (rows of both are 16-byte
// aligned: kernel_operand: dout and out are read through their strides) and two float4 of zeros.
template <typename E, int D>
__global__ void __launch_bounds__(256)
    flash_bwd_delta_kernel(float* __restrict__ delta, float* __restrict__ dq_acc,
                           const E* __restrict__ dout, Strides sdo, const E* __restrict__ out,
                           Strides so, const float* __restrict__ dlse, int h, int t, int64_t rows) {
  constexpr int TPR = D / 8;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / TPR;
  const int c = static_cast<int>(threadIdx.x % TPR);
  if (r >= rows) return;  // whole row groups leave together (TPR divides the block)
  const int64_t b = r / (static_cast<int64_t>(h) * t), hh = (r / t) % h, i = r % t;
  const uint4 dv =
      *reinterpret_cast<const uint4*>(dout + b * sdo.b + hh * sdo.h + i * sdo.t + c * 8);
  const uint4 ov = *reinterpret_cast<const uint4*>(out + b * so.b + hh * so.h + i * so.t + c * 8);
  const E* de = reinterpret_cast<const E*>(&dv);
  const E* oe = reinterpret_cast<const E*>(&ov);
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc += to_f32(de[e]) * to_f32(oe[e]);
#pragma unroll
  for (int off = TPR / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (c == 0) delta[r] = dlse != nullptr ? acc - dlse[r] : acc;
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

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// t itself when its last dim is contiguous and every other stride and the base allow 16-byte
// rows (the views of a qkv projection split + transpose qualify); a fresh contiguous copy
// otherwise (clone, not contiguous(): a contiguous view at a misaligned offset stays one).
Tensor kernel_operand(const Tensor& t) {
  bool ok = t.stride(3) == 1 || t.size(3) <= 1;
  for (int d = 0; d < 3 && ok; ++d) ok = t.stride(d) % 8 == 0 || t.size(d) <= 1;
  return ok && aligned16(t) ? t : t.clone();
}

Strides strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

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

LaunchInfo launch_info(const Tensor& q) {
  return {q.dtype(), q.size(0), static_cast<int>(q.size(3)), q.device()};
}

// --- Support rules -----------------------------------------------------------------------------
// One rule per family, shared by its forward and its backward: it accepts a call only when both
// passes can run it, since flash_attention's backward rule calls flash_attention_backward with
// the same q, k, v and attributes. The meta rules have checked the rest (4-d q [B, H, T, D],
// k [B, H_kv, S, D] and v [B, H_kv, S, Dv] of one floating dtype on one device, H a multiple of
// H_kv, the attributes).

bool is_forward(const OpCall& c) {
  static const OpDef* const forward = &KILN_OP(flash_attention);
  return c.op == forward;
}
// q, k and v of a flash_attention (q, k, v[, attn_mask]) or flash_attention_backward
// (dout, q, k, v, out, lse, dlse) call.
const Tensor& query_of(const OpCall& c) { return c.input(is_forward(c) ? 0 : 1); }
const Tensor& keys_of(const OpCall& c) { return c.input(is_forward(c) ? 1 : 2); }
const Tensor& values_of(const OpCall& c) { return c.input(is_forward(c) ? 2 : 3); }

// The compute capability major of t's device, queried once per device (no device switch).
int capability_major(const Tensor& t) {
  return loops::device_attribute<cudaDevAttrComputeCapabilityMajor>(t.device().index());
}

// What every kernel of both families needs:
//   - no attn_mask and no dropout (the forward's optional 4th input and 5th attribute), and one
//     head size for q, k and v;
//   - bf16 or f16 operands (the tensor-core instructions);
//   - query and key blocks of 64 (the smallest block of any kernel) at most 65535, the grids'
//     y limit: every kernel puts its query (forward) or key (backward) blocks in grid.y or, the
//     v1 backward, in grid.x. This also keeps T and S far below 2^31 (int indices);
//   - B H (forward grids' x) and the backward's Delta pass grid (B H T D / 2048 blocks) at most
//     2^31 - 1.
bool takes_call(const OpCall& c) {
  if (is_forward(c) && ((c.inputs.size() > 3 && c.input(3).defined()) ||
                        (c.has_attr(4) && c.attr<double>(4) != 0.0))) {
    return false;
  }
  const Tensor& q = query_of(c);
  const Tensor& k = keys_of(c);
  constexpr int64_t kMaxLength = int64_t{65535} * 64;
  return values_of(c).size(3) == q.size(3) && (q.dtype() == kBFloat16 || q.dtype() == kHalf) &&
         q.size(2) <= kMaxLength && k.size(2) <= kMaxLength && q.size(0) * q.size(1) <= INT_MAX &&
         (q.numel() + 2047) / 2048 <= INT_MAX;
}

// Whether the wgmma kernels can run on t's device: sm_90a code in the build (CMake defines
// KILN_CUDA_SM90A when 90a is among CMAKE_CUDA_ARCHITECTURES) and a compute-capability-9 device.
bool wgmma_device(const Tensor& t) {
#if defined(KILN_CUDA_SM90A)
  return capability_major(t) == 9;
#else
  (void)t;
  return false;
#endif
}

// flash_hopper: head sizes 64, 128 and 256 on wgmma; a positive scale (the forward's softmax folds
// it into the exponent: the maximum of the raw scores times scale is the maximum of the scaled
// ones only when scale > 0). The backward grids put B H_kv (times the head split, at most H / H_kv)
// in x.
bool hopper_supports(const OpCall& c) {
  const int64_t d = query_of(c).size(3);
  return takes_call(c) && (d == 64 || d == 128 || d == 256) && c.attr<double>(0) > 0 &&
         wgmma_device(query_of(c));
}

// flash_sm80: head sizes 64 and 128 on mma.sync (compute capability 8.0 and later); any scale
// (the forward takes v2 where v3 needs a positive one). The v1 backward (head size 128) puts
// B H_kv in grid.y: at most 65535.
bool sm80_supports(const OpCall& c) {
  const Tensor& k = keys_of(c);
  const int64_t d = query_of(c).size(3);
  return takes_call(c) && (d == 64 || d == 128) && k.size(0) * k.size(1) <= 65535 &&
         capability_major(k) >= 8;
}

// --- The op's kernels --------------------------------------------------------------------------

void forward_hopper(OpCall& c) { run_forward(c, launch_fwd_hopper); }
void forward_sm80(OpCall& c) { run_forward(c, launch_fwd_sm80); }
void backward_hopper(OpCall& c) {
  run_backward(c, [](const Params& p, const LaunchInfo& info) { launch_bwd_hopper(p, info); });
}
void backward_sm80(OpCall& c) { run_backward(c, launch_bwd_sm80); }

}  // namespace

void store_rounded(void* dst, const float* src, int64_t n, ScalarType dtype) {
  const int64_t n4 = n / 4;
  visit_e(dtype, [&]<typename E>(TypeTag<E>) {
    flash_bwd_convert_kernel<E><<<static_cast<unsigned>(std::min<int64_t>((n4 + 255) / 256, 65536)),
                                  256, 0, current_stream()>>>(static_cast<E*>(dst), src, n4);
    KILN_CUDA_LAUNCH_CHECK("flash_bwd_convert_kernel");
  });
}

void delta_pass(const Tensor& dout, const Tensor& out, const Tensor& dlse_in, float* delta,
                float* dq_acc) {
  const Tensor dlse = dlse_in.defined() ? dlse_in.contiguous() : Tensor();  // undefined: zeros
  const int64_t h = dout.size(1), t = dout.size(2);
  const int64_t rows = dout.size(0) * h * t;
  if (rows == 0) return;
  const cudaStream_t stream = current_stream();
  visit_e(dout.dtype(), [&]<typename E>(TypeTag<E>) {
    auto run = [&]<int D>(std::integral_constant<int, D>) {
      constexpr int kRowsPerBlock = 256 / (D / 8);
      flash_bwd_delta_kernel<E, D>
          <<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0, stream>>>(
              delta, dq_acc, static_cast<const E*>(dout.data_ptr()), strides_of(dout),
              static_cast<const E*>(out.data_ptr()), strides_of(out),
              dlse.defined() ? static_cast<const float*>(dlse.data_ptr()) : nullptr,
              static_cast<int>(h), static_cast<int>(t), rows);
      KILN_CUDA_LAUNCH_CHECK("flash_bwd_delta_kernel");
    };
    if (dout.size(3) == 64) {
      run(std::integral_constant<int, 64>{});
    } else if (dout.size(3) == 128) {
      run(std::integral_constant<int, 128>{});
    } else {
      run(std::integral_constant<int, 256>{});
    }
  });
}

void run_forward(OpCall& c, Launcher launch_kernel) {
  const Tensor q = kernel_operand(c.input(0));
  const Tensor k = kernel_operand(c.input(1));
  const Tensor v = kernel_operand(c.input(2));
  if (q.numel() == 0) return;
  DeviceGuard guard(q.device().index());
  Params p = make_params(c, q, k, v);
  // The output follows q's memory order (tensor/ops/attention.cpp): [B, T, H, D] for the heads of
  // a qkv projection, so that the projection after attention reads it as [B T, H D] in place.
  const Tensor& out = c.outputs[0];
  KILN_CHECK(out.stride(3) == 1 || out.size(3) <= 1,
             "[flash_attention] expected an output with a contiguous last dim, got strides ",
             shape_str(out.strides()));
  p.out = out.data_ptr();
  p.so = strides_of(out);
  p.lse = static_cast<float*>(c.outputs[1].data_ptr());
  launch_kernel(p, launch_info(q));
}

void run_backward(OpCall& c, Launcher launch_kernel) {
  const Tensor dout = kernel_operand(c.input(0));
  const Tensor q = kernel_operand(c.input(1));
  const Tensor k = kernel_operand(c.input(2));
  const Tensor v = kernel_operand(c.input(3));
  const Tensor out = kernel_operand(c.input(4));  // read in 16-byte packs by the delta pass
  const Tensor lse = c.input(5).contiguous();
  const Tensor& dlse = c.input(6);  // undefined: zeros (delta_pass reads none)
  const Tensor& dq = c.outputs[0];
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
  p.dk = c.outputs[1].data_ptr();
  p.dv = c.outputs[2].data_ptr();
  if (rows > 0) delta_pass(dout, out, dlse, static_cast<float*>(delta.data_ptr()), p.dq_acc);
  launch_kernel(p, launch_info(q));
  if (q.numel() > 0) store_rounded(dq.data_ptr(), p.dq_acc, q.numel(), q.dtype());  // D % 4 == 0
}

// The backwards add dQ parts from several key blocks with float atomics: with deterministic
// algorithms (tensor/deterministic.h) they refuse, and the op's decomposition runs.
bool hopper_backward_supports(const OpCall& c) {
  return !are_deterministic_algorithms_enabled() && hopper_supports(c);
}
bool sm80_backward_supports(const OpCall& c) {
  return !are_deterministic_algorithms_enabled() && sm80_supports(c);
}

KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "flash_hopper", forward_hopper, hopper_supports);
KILN_REGISTER_KERNEL_IF(flash_attention_backward, kCUDA, "flash_hopper", backward_hopper,
                        hopper_backward_supports);
KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "flash_sm80", forward_sm80, sm80_supports, 1);
KILN_REGISTER_KERNEL_IF(flash_attention_backward, kCUDA, "flash_sm80", backward_sm80,
                        sm80_backward_supports, 1);
// flash_attention_backward_qkv where cuDNN does not write its parts in place
// (kernels/cuda/cudnn_attention.cpp): the backward's kernel, then merge_qkv_rotary's.
KILN_REGISTER_KERNEL_IF(flash_attention_backward_qkv, kCUDA, "in_parts",
                        attention_backward_qkv_in_parts, attention_backward_qkv_supported);

}  // namespace kiln::cuda::flash
