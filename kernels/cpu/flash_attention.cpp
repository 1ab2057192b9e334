// CPU kernels of flash_attention and flash_attention_backward (tensor/ops/attention.cpp).
//
// f64 inputs run plain loops over (batch, head, query) in f64, the reference the CUDA kernels and
// the f32 path are tested against. Scores are recomputed row by row (nothing T x S is stored).
//
// f32, bf16 and f16 inputs run in f32 on blocks of query rows: a block's scores against every key
// its rows can see are one matrix product (kernels/cpu/gemm.h, the CPU's widest registers), the
// softmax is taken over whole rows, and the output is a second product. The backward recomputes
// a block's probabilities the same way and takes dp, dq, dk and dv as four more products. bf16 and
// f16 are converted to f32 on the way in and rounded once on the way out.
//
// With s_ij the (capped) score, p_ij = exp(s_ij - lse_i) and Delta_i = dout_i . out_i - dlse_i
// (dlse_i = 0 when dlse is undefined):
//   dv_j += p_ij dout_i,   dp_ij = dout_i . v_j,   ds_ij = p_ij (dp_ij - Delta_i),
//   dz_ij = ds_ij (1 - (s_ij / softcap)^2) with softcap (d/dz of c tanh(z / c)), else ds_ij,
//   dq_i += scale dz_ij k_j,   dk_j += scale dz_ij q_i.
// The backward runs one (batch, kv head) per task, so dk and dv of a group sum over its query
// heads in a fixed order without races.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu/gemm.h"
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

// --- The f32 path: blocks of query rows, scores and outputs as matrix products ---------------

// Query rows per block: the block's scores are [rows, visible keys] in f32.
int64_t query_block(const Geometry& g) { return g.s > 8192 ? 16 : 64; }

// The keys rows [i0, i1) can see: [lo, hi) (hi <= lo: none).
void visible_keys(const Geometry& g, int64_t i0, int64_t i1, int64_t* lo, int64_t* hi) {
  *hi = g.causal ? std::min(g.s, i1) : g.s;
  *lo = g.window > 0 ? std::max<int64_t>(0, i0 - g.window + 1) : 0;
}

// n elements of src as f32: src itself for f32, else converted into dst.
template <typename T>
const float* as_f32(const T* src, int64_t n, std::vector<float>& dst) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    dst.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) dst[static_cast<size_t>(i)] = static_cast<float>(src[i]);
    return dst.data();
  }
}

// The scores of rows [i0, i0 + nq) against keys [lo, lo + ns) into sc [nq, ns]: scale q k^T.
void block_scores(const Geometry& g, const float* q, const float* k, int64_t nq, int64_t lo,
                  int64_t ns, float* sc) {
  std::fill(sc, sc + nq * ns, 0.0f);
  gemm(sc, ns, q, {true, g.d}, k + lo * g.d, {false, g.d}, nq, g.d, ns,
       static_cast<float>(g.scale));
}

// The columns of a block starting at key lo that row i sees: [*c0, *c1) (empty: none). A row's
// visible keys are one run: (i - window, i] under a window, [0, i] when causal, else all.
void row_columns(const Geometry& g, int64_t i, int64_t lo, int64_t ns, int64_t* c0, int64_t* c1) {
  const int64_t first = g.window > 0 ? std::max<int64_t>(0, i - g.window + 1) : 0;
  const int64_t last = g.causal ? std::min(g.s, i + 1) : g.s;  // exclusive
  *c0 = std::clamp<int64_t>(first - lo, 0, ns);
  *c1 = std::clamp<int64_t>(last - lo, *c0, ns);
}

template <typename T>
void flash_forward_f32(const Geometry& g, const T* pq, const T* pk, const T* pv, T* po,
                       const Tensor& out, float* pl) {
  const int64_t bq = query_block(g), blocks = (g.t + bq - 1) / bq;
  internal::parallel_for(0, g.b * g.h * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qbuf, kbuf, vbuf, sc, o, inv_l;
    int64_t kv_loaded = -1;
    const float *kf = nullptr, *vf = nullptr;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, i0 = (task % blocks) * bq;
      const int64_t nq = std::min(bq, g.t - i0);
      const int64_t kv = (bh / g.h) * g.hkv + (bh % g.h) / g.rep;
      T* ob = po + (bh / g.h) * out.stride(0) + (bh % g.h) * out.stride(1);
      int64_t lo = 0, hi = 0;
      visible_keys(g, i0, i0 + nq, &lo, &hi);
      const int64_t ns = std::max<int64_t>(hi - lo, 0);
      if (kv != kv_loaded) {
        kf = as_f32(pk + kv * g.s * g.d, g.s * g.d, kbuf);
        vf = as_f32(pv + kv * g.s * g.d, g.s * g.d, vbuf);
        kv_loaded = kv;
      }
      const float* qf = as_f32(pq + (bh * g.t + i0) * g.d, nq * g.d, qbuf);
      sc.resize(static_cast<size_t>(nq * std::max<int64_t>(ns, 1)));
      if (ns > 0) block_scores(g, qf, kf, nq, lo, ns, sc.data());
      // Softmax of each row's visible run in place (capped first): sc becomes the
      // probabilities, unnormalised, and 0 where a row sees no key.
      const auto cap = static_cast<float>(g.softcap);
      inv_l.assign(static_cast<size_t>(nq), 0.0f);
      for (int64_t r = 0; r < nq; ++r) {
        float* row = sc.data() + r * ns;
        const int64_t i = bh * g.t + i0 + r;
        int64_t c0 = 0, c1 = 0;
        row_columns(g, i0 + r, lo, ns, &c0, &c1);
        std::fill(row, row + c0, 0.0f);
        std::fill(row + c1, row + ns, 0.0f);
        if (c1 == c0) {  // sees no key
          pl[i] = -std::numeric_limits<float>::infinity();
          continue;
        }
        if (cap > 0) tanh_cap(row + c0, c1 - c0, cap);
        const float m = *std::max_element(row + c0, row + c1);
        const float l = exp_sum(row + c0, c1 - c0, m);
        inv_l[static_cast<size_t>(r)] = 1.0f / l;
        pl[i] = m + std::log(l);
      }
      o.assign(static_cast<size_t>(nq * g.d), 0.0f);
      if (ns > 0)
        gemm(o.data(), g.d, sc.data(), {true, ns}, vf + lo * g.d, {true, g.d}, nq, ns, g.d, 1.0f);
      for (int64_t r = 0; r < nq; ++r) {
        T* orow = ob + (i0 + r) * out.stride(2);
        const float w = inv_l[static_cast<size_t>(r)];
        for (int64_t e = 0; e < g.d; ++e) orow[e] = T(o[static_cast<size_t>(r * g.d + e)] * w);
      }
    }
  });
}

template <typename T>
void flash_backward_f32(const Geometry& g, const T* pdo, const T* pq, const T* pk, const T* pv,
                        const T* po, const float* pl, const float* pdl, T* pdq, T* pdk, T* pdv) {
  const int64_t bq = query_block(g);
  internal::parallel_for(0, g.b * g.hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kbuf, vbuf, qbuf, dobuf, obuf, sc, dp, dq, dka, dva, delta;
    for (int64_t bk = begin; bk < end; ++bk) {
      const int64_t b = bk / g.hkv, kv = bk % g.hkv;
      const float* kf = as_f32(pk + bk * g.s * g.d, g.s * g.d, kbuf);
      const float* vf = as_f32(pv + bk * g.s * g.d, g.s * g.d, vbuf);
      dka.assign(static_cast<size_t>(g.s * g.d), 0.0f);
      dva.assign(dka.size(), 0.0f);
      for (int64_t h = kv * g.rep; h < (kv + 1) * g.rep; ++h) {
        for (int64_t i0 = 0; i0 < g.t; i0 += bq) {
          const int64_t nq = std::min(bq, g.t - i0);
          const int64_t row0 = (b * g.h + h) * g.t + i0;
          int64_t lo = 0, hi = 0;
          visible_keys(g, i0, i0 + nq, &lo, &hi);
          const int64_t ns = std::max<int64_t>(hi - lo, 0);
          dq.assign(static_cast<size_t>(nq * g.d), 0.0f);
          if (ns > 0) {
            // The same arithmetic as the forward's q, so that p matches the forward's.
            const float* qf = as_f32(pq + row0 * g.d, nq * g.d, qbuf);
            const float* dof = as_f32(pdo + row0 * g.d, nq * g.d, dobuf);
            const float* of = as_f32(po + row0 * g.d, nq * g.d, obuf);
            delta.resize(static_cast<size_t>(nq));
            for (int64_t r = 0; r < nq; ++r) {
              // -0.0 without dlse: the same arithmetic as with zeros (bitwise equal results).
              float d = -(pdl != nullptr ? pdl[row0 + r] : 0.0f);
              for (int64_t e = 0; e < g.d; ++e) d += dof[r * g.d + e] * of[r * g.d + e];
              delta[static_cast<size_t>(r)] = d;
            }
            sc.resize(static_cast<size_t>(nq * ns));
            block_scores(g, qf, kf, nq, lo, ns, sc.data());
            // dp = dout v^T over the visible keys.
            dp.assign(static_cast<size_t>(nq * ns), 0.0f);
            gemm(dp.data(), ns, dof, {true, g.d}, vf + lo * g.d, {false, g.d}, nq, g.d, ns, 1.0f);
            const auto cap = static_cast<float>(g.softcap);
            const auto scale = static_cast<float>(g.scale);
            for (int64_t r = 0; r < nq; ++r) {
              const float l = pl[row0 + r];
              float* srow = sc.data() + r * ns;  // scores, then probabilities
              float* drow = dp.data() + r * ns;  // dp, then dz
              int64_t c0 = 0, c1 = 0;
              row_columns(g, i0 + r, lo, ns, &c0, &c1);
              if (l == -std::numeric_limits<float>::infinity()) c1 = c0;  // a dead row
              std::fill(srow, srow + c0, 0.0f);
              std::fill(srow + c1, srow + ns, 0.0f);
              std::fill(drow, drow + c0, 0.0f);
              std::fill(drow + c1, drow + ns, 0.0f);
              if (c1 == c0) continue;
              if (cap > 0) {
                tanh_cap(srow + c0, c1 - c0, cap);
                for (int64_t c = c0; c < c1; ++c) {  // d/dz of cap tanh(z / cap), into dp's row
                  const float x = srow[c] / cap;
                  drow[c] = (drow[c] - delta[static_cast<size_t>(r)]) * (1.0f - x * x);
                }
              } else {
                for (int64_t c = c0; c < c1; ++c) drow[c] -= delta[static_cast<size_t>(r)];
              }
              exp_sum(srow + c0, c1 - c0, l);
              for (int64_t c = c0; c < c1; ++c) drow[c] *= srow[c] * scale;
            }
            // dv += p^T dout, dq = dz k, dk += dz^T q.
            gemm(dva.data() + lo * g.d, g.d, sc.data(), {false, ns}, dof, {true, g.d}, ns, nq, g.d,
                 1.0f);
            gemm(dq.data(), g.d, dp.data(), {true, ns}, kf + lo * g.d, {true, g.d}, nq, ns, g.d,
                 1.0f);
            gemm(dka.data() + lo * g.d, g.d, dp.data(), {false, ns}, qf, {true, g.d}, ns, nq, g.d,
                 1.0f);
          }
          for (int64_t x = 0; x < nq * g.d; ++x)
            pdq[row0 * g.d + x] = T(dq[static_cast<size_t>(x)]);
        }
      }
      for (int64_t x = 0; x < g.s * g.d; ++x) {
        pdk[bk * g.s * g.d + x] = T(dka[static_cast<size_t>(x)]);
        pdv[bk * g.s * g.d + x] = T(dva[static_cast<size_t>(x)]);
      }
    }
  });
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
    if constexpr (std::is_same_v<Acc, float>) {
      flash_forward_f32<T>(g, pq, pk, pv, po, out, pl);
      return;
    }
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
    if constexpr (std::is_same_v<Acc, float>) {
      flash_backward_f32<T>(g, pdo, pq, pk, pv, po, pl, pdl, pdq, pdk, pdv);
      return;
    }
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

// The CPU kernel takes what the CUDA kernels take: no mask, no dropout, one head size for k and
// v. Named "blocked" for its f32 path (f64 runs the reference loops).
bool flash_attention_cpu_supports(const OpCall& c) {
  return (c.inputs.size() < 4 || !c.input(3).defined()) &&
         (!c.has_attr(4) || c.attr<double>(4) == 0.0) && c.input(2).size(3) == c.input(0).size(3);
}

KILN_REGISTER_KERNEL_IF(flash_attention, kCPU, "blocked", flash_attention_cpu,
                        flash_attention_cpu_supports);
KILN_REGISTER_KERNEL(flash_attention_backward, kCPU, flash_attention_backward_cpu);
// flash_attention_backward_qkv (tensor/ops/attention.cpp): the backward's kernel, then
// merge_qkv_rotary's, as the decomposition runs them (the same bits).
KILN_REGISTER_KERNEL_IF(flash_attention_backward_qkv, kCPU, "in_parts",
                        attention_backward_qkv_in_parts, attention_backward_qkv_supported);

}  // namespace kiln::cpu
