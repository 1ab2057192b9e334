// CPU kernels of rms_norm, layer_norm and their backwards (tensor/ops/norm.cpp): the reference
// the CUDA kernels are tested against. Rows run in parallel; all arithmetic is in the compute type
// (f32 for f16/bf16, f64 for f64), with one rounding to the output dtype.
//
// With r = rstd of a row, g = dy * w and D the row length:
//   y = x * r * w,   dx = r * g - x * r^3 * sum(g * x) / D,   dw = sum over rows of dy * x * r.
// dweight sums per-chunk partials in a fixed order, so the result does not depend on threads.
//
// layer_norm and layer_norm_backward likewise, with m = mean, r = rstd, xh = (x - m) * r,
// g = dy * w (w = 1 and b = 0 where absent):
//   y = xh * w + b,   dx = r * (g - sum(g) / D - xh * sum(g * xh) / D),
//   dw = sum over rows of dy * xh,   db = sum over rows of dy.
// The mean and variance are two passes over the row (no cancellation of E[x^2] - E[x]^2).
//
// Large and tiny magnitudes: a row whose f32 sums leave their accurate range (|x| beyond about
// 1e19, or below about 1e-19 with an eps under 2^-36; for layer_norm |x - mean|;
// kernels/norm_range.h) is summed again in f64, as is rms_norm's backward's x * r^3 * dot of such
// a row; every other row keeps its f32 arithmetic.
#include <cmath>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/fused_support.h"
#include "kernels/norm_range.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// 1 / sqrt(mean(x^2) + eps) of a row, in f64.
template <typename T>
double rms_rstd_f64(const T* x, int64_t d, double eps) {
  double ss = 0;
  for (int64_t j = 0; j < d; ++j) {
    const double v = static_cast<double>(x[j]);
    ss += v * v;
  }
  return 1 / std::sqrt((d > 0 ? ss / static_cast<double>(d) : 0.0) + eps);
}

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
    internal::parallel_for(
        0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)),
        [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const T* xr = px + i * d;
            Acc ss = 0;
            for (int64_t j = 0; j < d; ++j) {
              const Acc v = static_cast<Acc>(xr[j]);
              ss += v * v;
            }
            const Acc mean = d > 0 ? ss / static_cast<Acc>(d) : Acc(0);
            const Acc r = kiln::internal::rms_sum_in_range(ss, static_cast<Acc>(eps))
                              ? Acc(1) / std::sqrt(mean + static_cast<Acc>(eps))
                              : static_cast<Acc>(rms_rstd_f64(xr, d, eps));
            pr[i] = r;
            for (int64_t j = 0; j < d; ++j) {
              py[i * d + j] = T(static_cast<Acc>(xr[j]) * r * static_cast<Acc>(pw[j]));
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
  const Tensor res =
      c.inputs.size() > 4 && c.input(4).defined() ? c.input(4).contiguous() : Tensor();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const int64_t d = w.numel(), rows = rstd.numel();
  visit_x_weight(x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const T* px = x.data_ptr<T>();
    const T* pdy = dy.data_ptr<T>();
    const T* pres = res.defined() ? res.data_ptr<T>() : nullptr;  // added before the rounding
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
          if (!kiln::internal::rms_backward_in_range(r, dot)) {
            // r^3 under- or overflows f32 (|x| beyond about 1e10): the row in f64.
            double dot64 = 0;
            for (int64_t j = 0; j < d; ++j) {
              dot64 += static_cast<double>(gr[j]) * static_cast<double>(pw[j]) *
                       static_cast<double>(xr[j]);
            }
            const double r64 = r, k64 = r64 * r64 * r64 * dot64 / static_cast<double>(d);
            for (int64_t j = 0; j < d; ++j) {
              const double xv = static_cast<double>(xr[j]), gv = static_cast<double>(gr[j]);
              double v = r64 * gv * static_cast<double>(pw[j]) - xv * k64;
              if (pres != nullptr) v += static_cast<double>(pres[i * d + j]);
              pdx[i * d + j] = T(v);
              part[j] += static_cast<Acc>(gv * xv * r64);
            }
            continue;
          }
          const Acc k = r * r * r * dot / static_cast<Acc>(d);
          for (int64_t j = 0; j < d; ++j) {
            const Acc xv = static_cast<Acc>(xr[j]), gv = static_cast<Acc>(gr[j]);
            Acc v = r * gv * static_cast<Acc>(pw[j]) - xv * k;
            if (pres != nullptr) v += static_cast<Acc>(pres[i * d + j]);
            pdx[i * d + j] = T(v);
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

// layer_norm's parameter dtype: weight's, else bias's, else x's (then no parameter is read).
ScalarType param_dtype(const Tensor& x, const Tensor& w, const Tensor& b) {
  return w.defined() ? w.dtype() : b.defined() ? b.dtype() : x.dtype();
}

void layer_norm_cpu(OpCall& c) {
  const Tensor x = c.input(0).contiguous();
  const Tensor w = c.input(1).defined() ? c.input(1).contiguous() : Tensor();
  const Tensor b = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor& y = c.outputs[0];
  const Tensor& mean = c.outputs[1];
  const Tensor& rstd = c.outputs[2];
  const double eps = c.attr<double>(1);
  const int64_t rows = mean.numel(), d = rows == 0 ? 0 : x.numel() / rows;
  visit_x_weight(x.dtype(), param_dtype(x, w, b),
                 [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
                   using Acc = opmath_t<T>;
                   const T* px = x.data_ptr<T>();
                   const W* pw = w.defined() ? w.data_ptr<W>() : nullptr;
                   const W* pb = b.defined() ? b.data_ptr<W>() : nullptr;
                   T* py = y.data_ptr<T>();
                   Acc* pm = mean.data_ptr<Acc>();
                   Acc* pr = rstd.data_ptr<Acc>();
                   const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1));
                   internal::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
                     for (int64_t i = begin; i < end; ++i) {
                       const T* xr = px + i * d;
                       Acc s = 0;
                       for (int64_t j = 0; j < d; ++j) s += static_cast<Acc>(xr[j]);
                       Acc m = d > 0 ? s / static_cast<Acc>(d) : Acc(0);
                       Acc ss = 0;
                       for (int64_t j = 0; j < d; ++j) {
                         const Acc v = static_cast<Acc>(xr[j]) - m;
                         ss += v * v;
                       }
                       const Acc var = d > 0 ? ss / static_cast<Acc>(d) : Acc(0);
                       Acc r = Acc(1) / std::sqrt(var + static_cast<Acc>(eps));
                       if (d > 0 && !kiln::internal::layer_norm_sums_in_range(
                                        s, ss, static_cast<Acc>(eps))) {
                         // |x - mean| beyond about 1e19, or below about 1e-19 with a tiny eps:
                         // the mean and variance in f64.
                         double s64 = 0, ss64 = 0;
                         for (int64_t j = 0; j < d; ++j) s64 += static_cast<double>(xr[j]);
                         const double m64 = s64 / static_cast<double>(d);
                         for (int64_t j = 0; j < d; ++j) {
                           const double v = static_cast<double>(xr[j]) - m64;
                           ss64 += v * v;
                         }
                         m = static_cast<Acc>(m64);
                         r = static_cast<Acc>(1 / std::sqrt(ss64 / static_cast<double>(d) + eps));
                       }
                       pm[i] = m;
                       pr[i] = r;
                       for (int64_t j = 0; j < d; ++j) {
                         Acc o = (static_cast<Acc>(xr[j]) - m) * r;
                         if (pw != nullptr) o *= static_cast<Acc>(pw[j]);
                         if (pb != nullptr) o += static_cast<Acc>(pb[j]);
                         py[i * d + j] = T(o);
                       }
                     }
                   });
                 });
}

void layer_norm_backward_cpu(OpCall& c) {
  const Tensor dy = c.input(0).contiguous();
  const Tensor x = c.input(1).contiguous();
  const Tensor w = c.input(2).defined() ? c.input(2).contiguous() : Tensor();
  const Tensor mean = c.input(3).contiguous();
  const Tensor rstd = c.input(4).contiguous();
  const Tensor& dx = c.outputs[0];
  const Tensor& dw = c.outputs[1];
  const Tensor& db = c.outputs[2];
  const int64_t d = dw.numel(), rows = rstd.numel();
  visit_x_weight(x.dtype(), dw.dtype(), [&]<typename T, typename W>(TypeTag<T>, TypeTag<W>) {
    using Acc = opmath_t<T>;
    const T* px = x.data_ptr<T>();
    const T* pdy = dy.data_ptr<T>();
    const W* pw = w.defined() ? w.data_ptr<W>() : nullptr;
    const Acc* pm = mean.data_ptr<Acc>();
    const Acc* pr = rstd.data_ptr<Acc>();
    T* pdx = dx.data_ptr<T>();
    // Fixed chunks of rows, each with its own dweight and dbias partials, summed in chunk order.
    const int64_t chunks = std::min<int64_t>(rows, 64);
    const size_t part_size = static_cast<size_t>(std::max<int64_t>(chunks, 1) * d);
    std::vector<Acc> part_w(part_size, Acc(0)), part_b(part_size, Acc(0));
    internal::parallel_for(0, chunks, 1, [&](int64_t cb, int64_t ce) {
      for (int64_t chunk = cb; chunk < ce; ++chunk) {
        Acc* pwc = part_w.data() + chunk * d;
        Acc* pbc = part_b.data() + chunk * d;
        const int64_t r0 = rows * chunk / chunks, r1 = rows * (chunk + 1) / chunks;
        for (int64_t i = r0; i < r1; ++i) {
          const T* xr = px + i * d;
          const T* gr = pdy + i * d;
          const Acc m = pm[i], r = pr[i];
          Acc sum_g = 0, sum_gx = 0;
          for (int64_t j = 0; j < d; ++j) {
            const Acc g = static_cast<Acc>(gr[j]) * (pw != nullptr ? static_cast<Acc>(pw[j]) : 1);
            sum_g += g;
            sum_gx += g * (static_cast<Acc>(xr[j]) - m) * r;
          }
          const Acc a = sum_g / static_cast<Acc>(d), k = sum_gx / static_cast<Acc>(d);
          for (int64_t j = 0; j < d; ++j) {
            const Acc gv = static_cast<Acc>(gr[j]);
            const Acc xh = (static_cast<Acc>(xr[j]) - m) * r;
            const Acc g = gv * (pw != nullptr ? static_cast<Acc>(pw[j]) : 1);
            pdx[i * d + j] = T(r * (g - a - xh * k));
            pwc[j] += gv * xh;
            pbc[j] += gv;
          }
        }
      }
    });
    W* pdw = dw.data_ptr<W>();
    W* pdb = db.data_ptr<W>();
    for (int64_t j = 0; j < d; ++j) {
      Acc sw = 0, sb = 0;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        sw += part_w[chunk * d + j];
        sb += part_b[chunk * d + j];
      }
      pdw[j] = W(sw);
      pdb[j] = W(sb);
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(rms_norm, kCPU, "fused", rms_norm_cpu, rms_norm_supported);
KILN_REGISTER_KERNEL(rms_norm_backward, kCPU, rms_norm_backward_cpu);
KILN_REGISTER_KERNEL_IF(layer_norm, kCPU, "fused", layer_norm_cpu, layer_norm_supported);
KILN_REGISTER_KERNEL(layer_norm_backward, kCPU, layer_norm_backward_cpu);

}  // namespace kiln::cpu
