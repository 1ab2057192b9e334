// CPU kernels of flash_attention and flash_attention_backward (tensor/ops/attention.cpp): plain
// loops over (batch, head, query) in f64 whatever the input dtype, the reference the CUDA
// kernels are tested against. Scores are recomputed row by row (nothing T x S is stored).
//
// With s_ij the (capped) score, p_ij = exp(s_ij - lse_i) and Delta_i = dout_i . out_i - dlse_i
// (dlse_i = 0 when dlse is undefined):
//   dv_j += p_ij dout_i,   dp_ij = dout_i . v_j,   ds_ij = p_ij (dp_ij - Delta_i),
//   dz_ij = ds_ij (1 - (s_ij / softcap)^2) with softcap (d/dz of c tanh(z / c)), else ds_ij,
//   dq_i += scale dz_ij k_j,   dk_j += scale dz_ij q_i.
// The backward runs one (batch, kv head) per task, so dk and dv of a group sum over its query
// heads in a fixed order without races.
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/loops.h"
#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

struct Geometry {
  int64_t b, h, hkv, t, s, d, rep;
  double scale, softcap;
  bool causal;
  int64_t window;
  bool visible(int64_t i, int64_t j) const {
    return (!causal || j <= i) && (window == 0 || j > i - window);
  }
};

Geometry geometry(const OpCall& c, const Tensor& q, const Tensor& k) {
  Geometry g{};
  g.b = q.size(0);
  g.h = q.size(1);
  g.t = q.size(2);
  g.d = q.size(3);
  g.hkv = k.size(1);
  g.s = k.size(2);
  g.rep = g.h / g.hkv;
  g.scale = c.attr<double>(0);
  g.window = c.attr<int64_t>(2);
  g.causal = c.attr<bool>(1) || g.window > 0;  // a window is causal (as the composite)
  g.softcap = c.attr<double>(3);
  return g;
}

// Scores of query row qi against every key of head kv (k [S, D]); -inf where not visible.
template <typename T>
void row_scores(const Geometry& g, const T* qi, const T* k, int64_t i, std::vector<double>& s) {
  for (int64_t j = 0; j < g.s; ++j) {
    if (!g.visible(i, j)) {
      s[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double dot = 0;
    for (int64_t e = 0; e < g.d; ++e) {
      dot += static_cast<double>(qi[e]) * static_cast<double>(k[j * g.d + e]);
    }
    double x = dot * g.scale;
    if (g.softcap > 0) x = g.softcap * std::tanh(x / g.softcap);
    s[j] = x;
  }
}

void flash_attention_cpu(OpCall& c) {
  const Tensor q = c.input(0).contiguous();
  const Tensor k = c.input(1).contiguous();
  const Tensor v = c.input(2).contiguous();
  const Tensor& out = c.outputs[0];
  const Tensor& lse = c.outputs[1];
  const Geometry g = geometry(c, q, k);
  visit_floating(q.dtype(), "flash_attention", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    const T* pq = q.data_ptr<T>();
    const T* pk = k.data_ptr<T>();
    const T* pv = v.data_ptr<T>();
    T* po = out.data_ptr<T>();
    Acc* pl = lse.data_ptr<Acc>();
    internal::parallel_for(0, g.b * g.h, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> s(static_cast<size_t>(g.s)), o(static_cast<size_t>(g.d));
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t kv = (bh / g.h) * g.hkv + (bh % g.h) / g.rep;
        const T* kb = pk + kv * g.s * g.d;
        const T* vb = pv + kv * g.s * g.d;
        // out may be strided (q's memory order); its last dim is dense.
        T* ob = po + (bh / g.h) * out.stride(0) + (bh % g.h) * out.stride(1);
        for (int64_t i = 0; i < g.t; ++i) {
          const int64_t row = bh * g.t + i;
          T* orow = ob + i * out.stride(2);
          row_scores(g, pq + row * g.d, kb, i, s);
          double m = -std::numeric_limits<double>::infinity();
          for (int64_t j = 0; j < g.s; ++j) m = std::max(m, s[j]);
          std::fill(o.begin(), o.end(), 0.0);
          if (m == -std::numeric_limits<double>::infinity()) {  // sees no key
            for (int64_t e = 0; e < g.d; ++e) orow[e] = T(0.0f);
            pl[row] = -std::numeric_limits<Acc>::infinity();
            continue;
          }
          double l = 0;
          for (int64_t j = 0; j < g.s; ++j) {
            if (s[j] == -std::numeric_limits<double>::infinity()) continue;
            const double p = std::exp(s[j] - m);
            l += p;
            for (int64_t e = 0; e < g.d; ++e) o[e] += p * static_cast<double>(vb[j * g.d + e]);
          }
          for (int64_t e = 0; e < g.d; ++e) orow[e] = T(static_cast<Acc>(o[e] / l));
          pl[row] = static_cast<Acc>(m + std::log(l));
        }
      }
    });
  });
}

void flash_attention_backward_cpu(OpCall& c) {
  const Tensor dout = c.input(0).contiguous();
  const Tensor q = c.input(1).contiguous();
  const Tensor k = c.input(2).contiguous();
  const Tensor v = c.input(3).contiguous();
  const Tensor out = c.input(4).contiguous();
  const Tensor lse = c.input(5).contiguous();
  const Tensor dlse = c.input(6).defined() ? c.input(6).contiguous() : Tensor();  // else zeros
  const Tensor& dq = c.outputs[0];
  const Tensor& dk = c.outputs[1];
  const Tensor& dv = c.outputs[2];
  const Geometry g = geometry(c, q, k);
  visit_floating(q.dtype(), "flash_attention_backward", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    const T* pdo = dout.data_ptr<T>();
    const T* pq = q.data_ptr<T>();
    const T* pk = k.data_ptr<T>();
    const T* pv = v.data_ptr<T>();
    const T* po = out.data_ptr<T>();
    const Acc* pl = lse.data_ptr<Acc>();
    const Acc* pdl = dlse.defined() ? dlse.data_ptr<Acc>() : nullptr;
    T* pdq = dq.data_ptr<T>();
    T* pdk = dk.data_ptr<T>();
    T* pdv = dv.data_ptr<T>();
    const auto f = [](T x) { return static_cast<double>(x); };
    // One task per (batch, kv head): its query heads' dq rows and its own dk, dv.
    internal::parallel_for(0, g.b * g.hkv, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> s(static_cast<size_t>(g.s)), dqr(static_cast<size_t>(g.d));
      std::vector<double> dka(static_cast<size_t>(g.s * g.d)), dva(dka.size());
      for (int64_t bk = begin; bk < end; ++bk) {
        const int64_t b = bk / g.hkv, kv = bk % g.hkv;
        const T* kb = pk + bk * g.s * g.d;
        const T* vb = pv + bk * g.s * g.d;
        std::fill(dka.begin(), dka.end(), 0.0);
        std::fill(dva.begin(), dva.end(), 0.0);
        for (int64_t h = kv * g.rep; h < (kv + 1) * g.rep; ++h) {
          for (int64_t i = 0; i < g.t; ++i) {
            const int64_t row = (b * g.h + h) * g.t + i;
            const T* qi = pq + row * g.d;
            const T* doi = pdo + row * g.d;
            std::fill(dqr.begin(), dqr.end(), 0.0);
            const double l = static_cast<double>(pl[row]);
            if (l != -std::numeric_limits<double>::infinity()) {
              row_scores(g, qi, kb, i, s);
              // -0.0 without dlse: the same arithmetic as with zeros (bitwise equal results).
              double delta = -static_cast<double>(pdl != nullptr ? pdl[row] : Acc(0));
              for (int64_t e = 0; e < g.d; ++e) delta += f(doi[e]) * f(po[row * g.d + e]);
              for (int64_t j = 0; j < g.s; ++j) {
                if (s[j] == -std::numeric_limits<double>::infinity()) continue;
                const double p = std::exp(s[j] - l);
                double dp = 0;
                for (int64_t e = 0; e < g.d; ++e) {
                  dp += f(doi[e]) * f(vb[j * g.d + e]);
                  dva[j * g.d + e] += p * f(doi[e]);
                }
                double dz = p * (dp - delta);
                if (g.softcap > 0) {
                  const double r = s[j] / g.softcap;
                  dz *= 1.0 - r * r;
                }
                dz *= g.scale;
                for (int64_t e = 0; e < g.d; ++e) {
                  dqr[e] += dz * f(kb[j * g.d + e]);
                  dka[j * g.d + e] += dz * f(qi[e]);
                }
              }
            }
            for (int64_t e = 0; e < g.d; ++e) pdq[row * g.d + e] = T(static_cast<Acc>(dqr[e]));
          }
        }
        for (int64_t x = 0; x < g.s * g.d; ++x) {
          pdk[bk * g.s * g.d + x] = T(static_cast<Acc>(dka[x]));
          pdv[bk * g.s * g.d + x] = T(static_cast<Acc>(dva[x]));
        }
      }
    });
  });
}

}  // namespace

// The reference takes what the CUDA kernels take: no mask, no dropout, one head size for k and v.
bool flash_attention_cpu_supports(const OpCall& c) {
  return (c.inputs.size() < 4 || !c.input(3).defined()) &&
         (!c.has_attr(4) || c.attr<double>(4) == 0.0) && c.input(2).size(3) == c.input(0).size(3);
}

KILN_REGISTER_KERNEL_IF(flash_attention, kCPU, "reference", flash_attention_cpu,
                        flash_attention_cpu_supports);
KILN_REGISTER_KERNEL(flash_attention_backward, kCPU, flash_attention_backward_cpu);
// flash_attention_backward_qkv (tensor/ops/attention.cpp): the backward's kernel, then
// merge_qkv_rotary's, as the decomposition runs them (the same bits).
KILN_REGISTER_KERNEL_IF(flash_attention_backward_qkv, kCPU, "in_parts",
                        attention_backward_qkv_in_parts, attention_backward_qkv_supported);

}  // namespace kiln::cpu
