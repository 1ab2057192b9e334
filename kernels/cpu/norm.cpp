// CPU kernels of rms_norm and rms_norm_backward (tensor/ops/norm.cpp): the reference the CUDA
// kernels are tested against. Rows run in parallel; all arithmetic is in the compute type
// (f32 for f16/bf16, f64 for f64), with one rounding to the output dtype.
//
// With r = rstd of a row, g = dy * w and D the row length:
//   y = x * r * w,   dx = r * g - x * r^3 * sum(g * x) / D,   dw = sum over rows of dy * x * r.
// dweight sums per-chunk partials in a fixed order, so the result does not depend on threads.
#include <cmath>
#include <vector>

#include "kernels/cpu/loops.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// Calls f(TypeTag<T>, TypeTag<W>) for x's dtype T and weight's dtype W (T, or float).
template <typename F>
void visit_x_weight(ScalarType xt, ScalarType wt, F&& f) {
  visit_floating(xt, "rms_norm", [&]<typename T>(TypeTag<T>) {
    if (wt == xt) {
      f(TypeTag<T>{}, TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      f(TypeTag<T>{}, TypeTag<float>{});
    } else {
      KILN_FAIL("[rms_norm] unsupported weight dtype ", dtype_name(wt));
    }
  });
}

void rms_norm_cpu(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).contiguous();
  const Tensor& y = c.outputs[0];
  const Tensor& rstd = c.outputs[1];
  const double eps = c.attr<double>(0);
  const int64_t d = w.numel(), rows = d == 0 ? rstd.numel() : x.numel() / d;
  visit_x_weight(x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const T* px = x.data_ptr<T>();
    const W* pw = w.data_ptr<W>();
    T* py = y.data_ptr<T>();
    Acc* pr = rstd.data_ptr<Acc>();
    internal::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
                           [&](int64_t begin, int64_t end) {
                             for (int64_t i = begin; i < end; ++i) {
                               const T* xr = px + i * d;
                               Acc ss = 0;
                               for (int64_t j = 0; j < d; ++j) {
                                 const Acc v = static_cast<Acc>(xr[j]);
                                 ss += v * v;
                               }
                               const Acc mean = d > 0 ? ss / static_cast<Acc>(d) : Acc(0);
                               const Acc r = Acc(1) / std::sqrt(mean + static_cast<Acc>(eps));
                               pr[i] = r;
                               for (int64_t j = 0; j < d; ++j) {
                                 py[i * d + j] = T(static_cast<Acc>(xr[j]) * r *
                                                   static_cast<Acc>(pw[j]));
                               }
                             }
                           });
  });
}

void rms_norm_backward_cpu(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const Tensor w = c.input(2).contiguous();
  const Tensor rstd = c.input(3).contiguous();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const int64_t d = w.numel(), rows = rstd.numel();
  visit_x_weight(x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const T* px = x.data_ptr<T>();
    const T* pdy = dy.data_ptr<T>();
    const W* pw = w.data_ptr<W>();
    const Acc* pr = rstd.data_ptr<Acc>();
    T* pdx = dx.data_ptr<T>();
    // Fixed chunks of rows, each with its own dweight partial, summed in chunk order.
    const int64_t chunks = std::min<int64_t>(rows, 64);
    std::vector<Acc> partial(static_cast<size_t>(std::max<int64_t>(chunks, 1) * d), Acc(0));
    internal::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t chunk = cb; chunk < ce; ++chunk) {
        Acc* part = partial.data() + chunk * d;
        const int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
        for (int64_t i = r0; i < r1; ++i) {
          const T* xr = px + i * d;
          const T* gr = pdy + i * d;
          const Acc r = pr[i];
          Acc dot = 0;
          for (int64_t j = 0; j < d; ++j) {
            dot += static_cast<Acc>(gr[j]) * static_cast<Acc>(pw[j]) * static_cast<Acc>(xr[j]);
          }
          const Acc k = r * r * r * dot / static_cast<Acc>(d);
          for (int64_t j = 0; j < d; ++j) {
            const Acc xv = static_cast<Acc>(xr[j]), gv = static_cast<Acc>(gr[j]);
            pdx[i * d + j] = T(r * gv * static_cast<Acc>(pw[j]) - xv * k);
            part[j] += gv * xv * r;
          }
        }
      }
    });
    W* pdw = dw.data_ptr<W>();
    for (int64_t j = 0; j < d; ++j) {
      Acc s = 0;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) s += partial[chunk * d + j];
      pdw[j] = W(s);
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL(rms_norm, kCPU, rms_norm_cpu);
KILN_REGISTER_KERNEL(rms_norm_backward, kCPU, rms_norm_backward_cpu);

}  // namespace kiln::cpu
