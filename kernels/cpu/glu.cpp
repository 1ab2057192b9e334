// CPU kernels of swiglu, geglu_tanh and their backward ops (tensor/ops/glu.cpp): the reference
// the CUDA kernels are tested against. Elementwise over the inputs read in place (any strides,
// through loops.h), in the compute type (f32 for f16/bf16, f64 for f64); the activation math is
// kernels/gated_act.h, shared with the CUDA kernels. The backward writes dgate and dup in one
// pass over contiguous copies of its inputs, from one exp (tanh) per element.
#include "kernels/cpu/loops.h"
#include "kernels/gated_act.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

template <typename Act>
void glu_cpu(OpCall& c) {
  visit_floating(c.outputs[0].dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    elementwise<T, T>(
        c.outputs[0],
        [](T g, T u) {
          const Acc gv = static_cast<Acc>(g);
          return T(Act::act(gv) * static_cast<Acc>(u));
        },
        c.input(0), c.input(1));
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
      for (int64_t i = b; i < e; ++i) {
        const Acc g = static_cast<Acc>(pg[i]), d = static_cast<Acc>(pdy[i]);
        Acc a, da;
        Act::act_and_grad(g, &a, &da);
        pdg[i] = T(d * static_cast<Acc>(pu[i]) * da);
        pdu[i] = T(d * a);
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

}  // namespace kiln::cpu
