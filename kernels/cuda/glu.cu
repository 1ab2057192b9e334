// CUDA kernels of swiglu, geglu_tanh and their backward ops (tensor/ops/glu.cpp; reference:
// kernels/cpu/glu.cpp; the activation math is kernels/gated_act.h, shared with the CPU).
// Arithmetic in f32 for f16/bf16 (f64 for f64).
//
// Forward y = act(gate) * up, backward dgate = dy * up * act'(gate) and dup = dy * act(gate),
// both outputs from one read of dy, gate and up. Every operand moves in 16-byte packs whenever
// the layout allows it: dense tensors, and also views whose innermost dim is dense with rows
// that start on 16-byte boundaries (gate and up as the two halves of one fused gate/up
// projection are read in place). The index arithmetic is loops.cuh's Geometry, in units of
// packs; dense operands skip it. Other layouts take one element per step.
#include <cuda_runtime_api.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/gated_act.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::load_pack;
using internal::store_pack;
using loops::Geometry;

constexpr int kThreads = 256;

template <typename I, int K>
__device__ __forceinline__ void pack_offsets(const Geometry<K>& g, bool dense, I i, I (&off)[K]) {
  if (dense) {
#pragma unroll
    for (int k = 0; k < K; ++k) off[k] = i;
  } else {
    loops::offsets<I, K>(g, i, off);
  }
}

// Operands: 0 y, 1 gate, 2 up. Offsets are in packs of V elements.
template <typename Act, typename T, int V, typename I>
__global__ void __launch_bounds__(kThreads)
    glu_fwd_kernel(T* __restrict__ y, const T* __restrict__ gate, const T* __restrict__ up, I n,
                   Geometry<3> g, bool dense) {
  using Acc = opmath_t<T>;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    I off[3];
    pack_offsets<I, 3>(g, dense, i, off);
    Acc gv[V], uv[V], o[V];
    load_pack<V>(gate + off[1] * V, gv);
    load_pack<V>(up + off[2] * V, uv);
#pragma unroll
    for (int j = 0; j < V; ++j) o[j] = Act::act(gv[j]) * uv[j];
    store_pack<V>(y + off[0] * V, o);
  }
}

// Operands: 0 dgate, 1 dup, 2 dy, 3 gate, 4 up.
template <typename Act, typename T, int V, typename I>
__global__ void __launch_bounds__(kThreads)
    glu_bwd_kernel(T* __restrict__ dgate, T* __restrict__ dup, const T* __restrict__ dy,
                   const T* __restrict__ gate, const T* __restrict__ up, I n, Geometry<5> g,
                   bool dense) {
  using Acc = opmath_t<T>;
  const I step = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    I off[5];
    pack_offsets<I, 5>(g, dense, i, off);
    Acc dv[V], gv[V], uv[V], dg[V], du[V];
    load_pack<V>(dy + off[2] * V, dv);
    load_pack<V>(gate + off[3] * V, gv);
    load_pack<V>(up + off[4] * V, uv);
#pragma unroll
    for (int j = 0; j < V; ++j) {
      dg[j] = dv[j] * uv[j] * Act::grad(gv[j]);
      du[j] = dv[j] * Act::act(gv[j]);
    }
    store_pack<V>(dgate + off[0] * V, dg);
    store_pack<V>(dup + off[1] * V, du);
  }
}

// The loop over K operands of one shape (outputs first, fresh and contiguous): the merged
// geometry, in packs of `pack` elements when every operand allows it (else pack = 1).
template <int K>
struct Plan {
  Geometry<K> g;
  int64_t n = 0;  // packs
  int pack = 1;
  bool dense = false;
  bool small = false;  // 32-bit offsets suffice
};

template <int K>
Plan<K> make_plan(const Tensor (&ops)[K], int vec, const char* name) {
  const Tensor& out = ops[0];
  Shape strides[K];
  for (int k = 0; k < K; ++k) strides[k] = to_shape(ops[k].strides());
  Plan<K> p;
  p.g = loops::make_geometry<K>(out.sizes(), strides, name);
  Geometry<K>& g = p.g;
  bool packed = vec > 1 && g.ndim >= 1 && g.sizes[g.ndim - 1] % vec == 0;
  for (int k = 0; k < K && packed; ++k) {
    packed = aligned_to(ops[k].data_ptr(), 16) && g.strides[k][g.ndim - 1] == 1;
    for (int d = 0; d + 1 < g.ndim && packed; ++d) packed = g.strides[k][d] % vec == 0;
  }
  if (packed) {
    p.pack = vec;
    g.sizes[g.ndim - 1] /= vec;
    for (int k = 0; k < K; ++k) {
      for (int d = 0; d + 1 < g.ndim; ++d) g.strides[k][d] /= vec;
    }
    loops::update_divs(g);
  }
  p.n = out.numel() / p.pack;
  p.dense = g.ndim == 0 || g.ndim == 1;
  for (int k = 0; k < K && p.dense && g.ndim == 1; ++k) p.dense = g.strides[k][0] == 1;
  // Offsets are in packs; the element offset off * pack must fit too (2^30: the grid-stride
  // index must not overflow after its last step either).
  p.small = loops::fits_int32(g, p.n) && out.numel() < (int64_t{1} << 30);
  for (int k = 0; k < K && p.small; ++k) {
    int64_t e = 0;
    for (int d = 0; d < g.ndim; ++d) e += (g.sizes[d] - 1) * std::abs(g.strides[k][d]);
    p.small = (e + 1) * p.pack < (int64_t{1} << 30);
  }
  return p;
}

template <typename Act>
void glu_cuda(OpCall& c) {
  const Tensor& y = c.outputs[0];
  if (y.numel() == 0) return;
  const Tensor& gate = c.input(0);
  const Tensor& up = c.input(1);
  DeviceGuard guard(y.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(y.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    constexpr int kPack = 16 / sizeof(T);
    const Tensor ops[3] = {y, gate, up};
    const Plan<3> p = make_plan<3>(ops, kPack, c.op->name.c_str());
    auto launch = [&]<int V, typename I>(std::integral_constant<int, V>, TypeTag<I>) {
      glu_fwd_kernel<Act, T, V, I><<<loops::grid_for(p.n, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(y.data_ptr()), static_cast<const T*>(gate.data_ptr()),
          static_cast<const T*>(up.data_ptr()), static_cast<I>(p.n), p.g, p.dense);
      KILN_CUDA_LAUNCH_CHECK("glu_fwd_kernel");
    };
    if (p.pack == kPack) {
      if (p.small) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int32_t>{});
      } else {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int64_t>{});
      }
    } else if (p.small) {
      launch(std::integral_constant<int, 1>{}, TypeTag<int32_t>{});
    } else {
      launch(std::integral_constant<int, 1>{}, TypeTag<int64_t>{});
    }
  });
}

template <typename Act>
void glu_backward_cuda(OpCall& c) {
  const Tensor& dgate = c.outputs[0];
  const Tensor& dup = c.outputs[1];
  if (dgate.numel() == 0) return;
  DeviceGuard guard(dgate.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(dgate.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    constexpr int kPack = 16 / sizeof(T);
    const Tensor ops[5] = {dgate, dup, c.input(0), c.input(1), c.input(2)};
    const Plan<5> p = make_plan<5>(ops, kPack, c.op->name.c_str());
    auto launch = [&]<int V, typename I>(std::integral_constant<int, V>, TypeTag<I>) {
      glu_bwd_kernel<Act, T, V, I><<<loops::grid_for(p.n, kThreads), kThreads, 0, stream>>>(
          static_cast<T*>(dgate.data_ptr()), static_cast<T*>(dup.data_ptr()),
          static_cast<const T*>(ops[2].data_ptr()), static_cast<const T*>(ops[3].data_ptr()),
          static_cast<const T*>(ops[4].data_ptr()), static_cast<I>(p.n), p.g, p.dense);
      KILN_CUDA_LAUNCH_CHECK("glu_bwd_kernel");
    };
    if (p.pack == kPack) {
      if (p.small) {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int32_t>{});
      } else {
        launch(std::integral_constant<int, kPack>{}, TypeTag<int64_t>{});
      }
    } else if (p.small) {
      launch(std::integral_constant<int, 1>{}, TypeTag<int32_t>{});
    } else {
      launch(std::integral_constant<int, 1>{}, TypeTag<int64_t>{});
    }
  });
}

}  // namespace

// Every call the meta rule accepts (any strides and floating dtype).
KILN_REGISTER_KERNEL_IF(swiglu, kCUDA, "fused", glu_cuda<gated::SiluAct>, nullptr);
KILN_REGISTER_KERNEL(swiglu_backward, kCUDA, glu_backward_cuda<gated::SiluAct>);
KILN_REGISTER_KERNEL_IF(geglu_tanh, kCUDA, "fused", glu_cuda<gated::GeluTanhAct>, nullptr);
KILN_REGISTER_KERNEL(geglu_tanh_backward, kCUDA, glu_backward_cuda<gated::GeluTanhAct>);

}  // namespace kiln::cuda
