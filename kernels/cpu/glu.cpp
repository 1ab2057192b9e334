// CPU kernels of swiglu, geglu_tanh and their backward ops (tensor/ops/glu.cpp), and of gelu's
// gradient (gelu_backward, tensor/ops/unary.cpp): the reference
// the CUDA kernels are tested against. Elementwise over the inputs read in place (any strides,
// through loops.h), in the compute type (f32 for f16/bf16, f64 for f64); the activation math is
// kernels/gated_act.h, shared with the CUDA kernels. The backward writes dgate and dup in one
// pass over contiguous copies of its inputs, from one exp per element.
//
// In f32 (and f16/bf16) the activations take their exp forms (gated_act.h: geglu_tanh's through
// exp(-2u), not tanh(u)), and the exp runs in chunks of kChunk elements through the packet exp
// of the CPU's widest build (kernels/cpu/gemm.h: AVX-512 / AVX2 / baseline), every element in a
// full packet: a result depends on its value and the build only, so a tensor gives the same bits
// whole or split into row blocks (the compiler's fused_cpu executor). f64 keeps std::exp /
// std::tanh one element at a time.
#include <Eigen/Core>
#include <algorithm>
#include <array>
#include <type_traits>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/loops.h"
#include "kernels/gated_act.h"
#include "kernels/scalar_fn.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

constexpr int64_t kChunk = 256;  // elements a chunk: its scratch stays in L1

// t[i] = exp(t[i]) for i < m <= kChunk, by packet_exp, the tail of the last packet padded with
// zeros.
void exp_chunk(float* t, int64_t m) {
  const int64_t padded = (m + kPacketFloats - 1) / kPacketFloats * kPacketFloats;
  std::fill(t + m, t + padded, 0.0f);
  packet_exp(t, padded);
}

// t[i] = erf(t[i]) likewise, by packet_erf.
void erf_chunk(float* t, int64_t m) {
  const int64_t padded = (m + kPacketFloats - 1) / kPacketFloats * kPacketFloats;
  std::fill(t + m, t + padded, 0.0f);
  packet_erf(t, padded);
}

// One chunk of gelu_backward (below) of m <= kChunk elements in f32; kTanh picks the form. The
// derivative's arithmetic runs as Eigen array expressions (their selects vectorise; a loop of ?: on
// floats does not): only exact operations there, so their bits do not depend on the packet path
// either.
template <bool kTanh, typename T>
void gelu_backward_chunk(const T* pg, const T* px, T* po, int64_t m) {
  using Chunk = Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64>;
  constexpr float k = static_cast<float>(scalar::kSqrt2OverPi);
  constexpr float cubic = static_cast<float>(scalar::kGeluTanhCoeff);
  alignas(64) float xs[kChunk], v[kChunk], t[kChunk], d[kChunk];
  for (int64_t i = 0; i < m; ++i) xs[i] = static_cast<float>(px[i]);
  Chunk x(xs, m), vv(v, m), tt(t, m), dd(d, m);
  if constexpr (kTanh) {
    vv = k * (x + cubic * x * x * x);  // u
    tt = -2.0f * vv.abs();
  } else {
    vv = x * static_cast<float>(scalar::kSqrt1_2);
    tt = -0.5f * x * x;
  }
  exp_chunk(t, m);
  if constexpr (kTanh) {
    // s = sigmoid(2u) and 1 - s are r and ex r in some order (ex = exp(-2|u|), r = 1 / (1 + ex)),
    // so s (1 - s) = ex r^2; past |u| = 40, 1 or 0.
    dd = (1.0f + tt).inverse();  // r
    const auto s = (vv >= 0.0f).select(dd, tt * dd);
    const auto du = k * (1.0f + 3.0f * cubic * x * x);
    dd = (vv.abs() > 40.0f).select((vv > 0.0f).cast<float>(), s + 2.0f * x * du * tt * dd * dd);
  } else {
    erf_chunk(v, m);
    const auto xp = x * tt * static_cast<float>(scalar::kInvSqrt2Pi);
    dd = 0.5f * (1.0f + vv) + (xp == xp).select(xp, 0.0f);
  }
  dd = (x == x).select(dd, x);  // NaN stays NaN (the packet erf clamps its argument)
  for (int64_t i = 0; i < m; ++i) po[i] = T(static_cast<float>(pg[i]) * d[i]);
}

// gelu_backward(grad, self; approximate) = grad * gelu'(self) (tensor/ops/unary.cpp), the
// formulas of kernels/scalar_fn.h's GeluExactGrad / GeluTanhGrad (which the CUDA kernel and f64
// here run): over contiguous copies, in f32 for f16/bf16 with the exp and erf in chunks through
// the packet functions, so that, as above, a result depends on its value and the build only.
void gelu_backward_cpu(OpCall& c) {
  const bool tanh_form = c.attr<std::string>(0) == "tanh";
  const Tensor& out = c.outputs[0];
  const Tensor g = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const int64_t n = x.numel();
  visit_floating(x.dtype(), "gelu_backward", [&]<typename T>(TypeTag<T>) {
    const T* pg = g.data_ptr<T>();
    const T* px = x.data_ptr<T>();
    T* po = out.data_ptr<T>();
    internal::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, double>) {
        for (int64_t i = b; i < e; ++i) {
          po[i] = pg[i] * (tanh_form ? scalar::GeluTanhGrad::apply(px[i])
                                     : scalar::GeluExactGrad::apply(px[i]));
        }
      } else {
        for (int64_t c0 = b; c0 < e; c0 += kChunk) {
          const int64_t m = std::min(kChunk, e - c0);
          if (tanh_form) {
            gelu_backward_chunk<true>(pg + c0, px + c0, po + c0, m);
          } else {
            gelu_backward_chunk<false>(pg + c0, px + c0, po + c0, m);
          }
        }
      }
    });
  });
}

template <typename Act>
void glu_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_floating(out.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    if constexpr (std::is_same_v<T, double>) {
      elementwise<T, T>(
          out, [](T g, T u) { return Act::act(g) * u; }, c.input(0), c.input(1));
    } else {
      Shape out_strides;
      for (int64_t s : out.strides()) out_strides.push_back(s * static_cast<int64_t>(sizeof(T)));
      const std::array<char*, 3> base{static_cast<char*>(out.data_ptr()),
                                      static_cast<char*>(c.input(0).data_ptr()),
                                      static_cast<char*>(c.input(1).data_ptr())};
      const std::array<Shape, 3> strides{out_strides,
                                         broadcast_byte_strides(c.input(0), out.sizes()),
                                         broadcast_byte_strides(c.input(1), out.sizes())};
      for_each_run<3>(out.sizes(), base, strides,
                      [](std::array<char*, 3> p, std::array<int64_t, 3> s, int64_t n) {
                        alignas(64) float g[kChunk], t[kChunk];
                        auto at = [&](int k, int64_t i) -> T& {
                          return *reinterpret_cast<T*>(p[k] + i * s[k]);
                        };
                        for (int64_t b = 0; b < n; b += kChunk) {
                          const int64_t m = std::min(kChunk, n - b);
                          for (int64_t i = 0; i < m; ++i) {
                            g[i] = static_cast<float>(at(1, b + i));
                            t[i] = Act::exp_arg(g[i]);
                          }
                          exp_chunk(t, m);
                          for (int64_t i = 0; i < m; ++i) {
                            at(0, b + i) =
                                T(Act::act_of_exp(g[i], t[i]) * static_cast<float>(at(2, b + i)));
                          }
                        }
                      });
    }
  });
}

template <typename Act>
void glu_backward_cpu(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor gate = c.input(1).contiguous();
  const Tensor up = c.input(2).contiguous();
  const int64_t n = gate.numel();
  visit_floating(gate.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    const T* pdy = dy.data_ptr<T>();
    const T* pg = gate.data_ptr<T>();
    const T* pu = up.data_ptr<T>();
    T* pdg = c.outputs[0].data_ptr<T>();
    T* pdu = c.outputs[1].data_ptr<T>();
    internal::parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
      if constexpr (std::is_same_v<T, double>) {
        for (int64_t i = b; i < e; ++i) {
          Acc a, da;
          Act::act_and_grad(pg[i], &a, &da);
          pdg[i] = pdy[i] * pu[i] * da;
          pdu[i] = pdy[i] * a;
        }
      } else {
        alignas(64) float g[kChunk], t[kChunk];
        for (int64_t c0 = b; c0 < e; c0 += kChunk) {
          const int64_t m = std::min(kChunk, e - c0);
          for (int64_t i = 0; i < m; ++i) {
            g[i] = static_cast<float>(pg[c0 + i]);
            t[i] = Act::exp_arg(g[i]);
          }
          exp_chunk(t, m);
          for (int64_t i = 0; i < m; ++i) {
            float a, da;
            Act::act_and_grad_of_exp(g[i], t[i], &a, &da);
            const float d = static_cast<float>(pdy[c0 + i]);
            pdg[c0 + i] = T(d * static_cast<float>(pu[c0 + i]) * da);
            pdu[c0 + i] = T(d * a);
          }
        }
      }
    });
  });
}

}  // namespace

// Every call the meta rule accepts (any strides and floating dtype).
KILN_REGISTER_KERNEL_IF(swiglu, kCPU, "fused", glu_cpu<gated::SiluAct>, nullptr);
KILN_REGISTER_KERNEL(swiglu_backward, kCPU, glu_backward_cpu<gated::SiluAct>);
KILN_REGISTER_KERNEL_IF(geglu_tanh, kCPU, "fused", glu_cpu<gated::GeluTanhAct>, nullptr);
KILN_REGISTER_KERNEL(geglu_tanh_backward, kCPU, glu_backward_cpu<gated::GeluTanhAct>);
KILN_REGISTER_KERNEL(gelu_backward, kCPU, gelu_backward_cpu);

}  // namespace kiln::cpu
