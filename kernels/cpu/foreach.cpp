// CPU kernels of foreach_norm and foreach_mul_ (tensor/ops/foreach.cpp) over contiguous tensors
// (the support rule, tensor/ops/foreach.h), tensor by tensor, each pass split across threads.
//
// foreach_norm folds each tensor with norm's reducer and the CPU's reduction loop
// (kernels/cpu/reduce.h), in f64, over the [1, numel, 1] block t.norm(ord) reduces a contiguous
// tensor as: the same lanes, chunks and merges, so each result is t.to(kFloat).norm(ord)'s bits
// (t.norm(ord)'s for f32 and f64). foreach_mul_ computes t.mul_(scale)'s elements: the scale read
// once as opmath_t<T> (f32 for bf16/f16), each product rounded once to T.
#include "tensor/ops/foreach.h"

#include <type_traits>

#include "kernels/cpu/reduce.h"
#include "kernels/foreach_fn.h"
#include "kernels/scalar_fn.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

using scalar::NormKind;

void foreach_norm_cpu(OpCall& c) {
  const kiln::internal::ForeachNormCall f(c);
  if (f.tensors.empty()) return;
  visit_floating(f.tensors[0].dtype(), "foreach_norm", [&]<typename T>(TypeTag<T>) {
    using O = std::conditional_t<std::is_same_v<T, double>, double, float>;
    scalar::visit_norm_kind(f.ord, [&]<NormKind kKind>() {
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        const Tensor& t = f.tensors[i];
        const scalar::ForeachNormReducer<T, double, O, kKind> red{{nullptr, f.ord},
                                                                  c.outputs[i].data_ptr<O>()};
        reduce_loop<T>(red, t.numel() == 0 ? nullptr : t.data_ptr<T>(), 1, t.numel(), 1);
      }
    });
  });
}

void foreach_mul_cpu(OpCall& c) {
  const kiln::internal::ForeachMulCall m(c);
  if (m.tensors.empty()) return;
  visit_floating(m.tensors[0].dtype(), "foreach_mul_", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const M s = visit_floating(m.scale.dtype(), "foreach_mul_", [&]<typename S>(TypeTag<S>) {
      return scalar::convert<M>(*m.scale.data_ptr<S>());
    });
    for (const Tensor& t : m.tensors) {
      T* x = t.numel() == 0 ? nullptr : t.data_ptr<T>();
      kiln::internal::parallel_for(0, t.numel(), kiln::internal::kGrainSize,
                                   [=](int64_t b, int64_t e) {
                                     for (int64_t i = b; i < e; ++i) x[i] = T(M(x[i]) * s);
                                   });
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(foreach_norm, kCPU, "multi_tensor", foreach_norm_cpu,
                        kiln::internal::foreach_supported);
KILN_REGISTER_KERNEL_IF(foreach_mul_, kCPU, "multi_tensor", foreach_mul_cpu,
                        kiln::internal::foreach_supported);

}  // namespace kiln::cpu
