// CPU kernels of rotary_emb, rotary_emb_qk, split_qkv_rotary, merge_qkv_rotary and rotary_qkv_
// (tensor/ops/rotary.cpp): the reference the CUDA kernels are tested against. Rows (positions of
// every leading index) run in parallel; the arithmetic is in the compute type (f32 for f16/bf16,
// f64 for f64) with one rounding to x's dtype, the formulas of tensor/ops/rotary.cpp.
#include "tensor/ops/rotary.h"

#include <absl/container/inlined_vector.h>

#include <algorithm>

#include "kernels/cpu/loops.h"
#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// Runs f(x_offset, out_offset, position) for rows [b, e) of x and out (rows: every index but the
// last, in logical order; position: the row's index along dim -2), walking the row index like an
// odometer: one division per dim at b, none per row.
template <typename F>
void for_rows(const Tensor& x, const Tensor& out, int64_t b, int64_t e, F&& f) {
  const int64_t nd = x.dim() - 1;
  absl::InlinedVector<int64_t, 6> idx(nd), size(nd), xs(nd), ys(nd);
  int64_t xo = 0, yo = 0;
  for (int64_t d = nd - 1, r = b; d >= 0; --d) {
    size[d] = x.size(d);
    xs[d] = x.stride(d);
    ys[d] = out.stride(d);
    idx[d] = r % size[d];
    r /= size[d];
    xo += idx[d] * xs[d];
    yo += idx[d] * ys[d];
  }
  for (int64_t r = b; r < e; ++r) {
    f(xo, yo, idx[nd - 1]);
    for (int64_t d = nd - 1; d >= 0; --d) {
      xo += xs[d];
      yo += ys[d];
      if (++idx[d] < size[d]) break;
      xo -= size[d] * xs[d];
      yo -= size[d] * ys[d];
      idx[d] = 0;
    }
  }
}

// out = rotary_emb(x; transpose), or out = x where !rotation; out has x's shape and a dense last
// dim (any row order). Rows of x are read where they lie when its last dim is dense (the head
// views of a packed qkv), else from a contiguous copy. In place (out == x) each pair (i, i + D/2)
// is read before it is written. The loops over a row have no branch, so that the compiler
// vectorises them (the same arithmetic, so the same bits, as one element at a time).
void rotate(const Tensor& x_in, const Tensor& cos_in, const Tensor& sin_in, const Tensor& out,
            bool transpose, bool rotation = true) {
  KILN_CHECK(x_in.dim() >= 2, "[rotary_emb] expected x of shape [..., T, D], got ",
             shape_str(x_in.sizes()));
  const Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  const Tensor cos = cos_in.contiguous();
  const Tensor sin = sin_in.contiguous();
  const int64_t d = x.size(-1), h = d / 2;
  const int64_t rows = d == 0 ? 0 : x.numel() / d;
  if (rows == 0) return;
  KILN_CHECK(out.stride(-1) == 1,
             "[rotary_emb] expected an output with a dense last dim, got strides ",
             shape_str(out.strides()));
  visit_floating(x.dtype(), "rotary_emb", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    auto run = [&]<typename C>(TypeTag<C>) {
      const T* px = x.data_ptr<T>();
      const C* pc = cos.data_ptr<C>();
      const C* ps = sin.data_ptr<C>();
      T* py = out.data_ptr<T>();
      internal::parallel_for(0, rows, std::max<int64_t>(1, 16384 / d), [&](int64_t b, int64_t e) {
        for_rows(x, out, b, e, [&](int64_t xo, int64_t yo, int64_t t) {
          const T* xr = px + xo;
          T* yr = py + yo;
          if (!rotation) {
            if (xr != yr) std::copy(xr, xr + d, yr);
            return;
          }
          const C* cr = pc + t * d;
          const C* sr = ps + t * d;
          if (transpose) {
            for (int64_t i = 0; i < h; ++i) {
              const Acc x1 = static_cast<Acc>(xr[i]), x2 = static_cast<Acc>(xr[i + h]);
              const Acc c1 = static_cast<Acc>(cr[i]), c2 = static_cast<Acc>(cr[i + h]);
              const Acc s1 = static_cast<Acc>(sr[i]), s2 = static_cast<Acc>(sr[i + h]);
              yr[i] = T(x1 * c1 + x2 * s2);
              yr[i + h] = T(x2 * c2 + x1 * -s1);
            }
          } else {
            for (int64_t i = 0; i < h; ++i) {
              const Acc x1 = static_cast<Acc>(xr[i]), x2 = static_cast<Acc>(xr[i + h]);
              const Acc c1 = static_cast<Acc>(cr[i]), c2 = static_cast<Acc>(cr[i + h]);
              const Acc s1 = static_cast<Acc>(sr[i]), s2 = static_cast<Acc>(sr[i + h]);
              yr[i] = T(x1 * c1 + x2 * -s1);
              yr[i + h] = T(x2 * c2 + x1 * s2);
            }
          }
        });
      });
    };
    if (cos.dtype() == x.dtype()) {
      run(TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      run(TypeTag<float>{});
    } else {
      KILN_FAIL("[rotary_emb] unsupported cos/sin dtype ", dtype_name(cos.dtype()));
    }
  });
}

void rotary_emb_cpu(OpCall& c) {
  rotate(c.input(0), c.input(1), c.input(2), c.outputs[0], c.attr<bool>(0));
}

void rotary_emb_qk_cpu(OpCall& c) {
  rotate(c.input(0), c.input(2), c.input(3), c.outputs[0], c.attr<bool>(0));
  rotate(c.input(1), c.input(2), c.input(3), c.outputs[1], c.attr<bool>(0));
}

void split_qkv_rotary_cpu(OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
  const Tensor& qkv = c.input(0);
  rotate(internal::qkv_heads(qkv, 0, h, n), c.input(1), c.input(2), c.outputs[0], transpose);
  rotate(internal::qkv_heads(qkv, h, g, n), c.input(1), c.input(2), c.outputs[1], transpose);
  rotate(internal::qkv_heads(qkv, h + g, g, n), c.input(1), c.input(2), c.outputs[2], transpose,
         false);
}

// In place: rotate reads each pair of a row before it writes it (a view whose last dim is not
// dense through a contiguous copy).
void rotary_qkv_cpu(OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  const int64_t h = c.attr<int64_t>(1), g = c.attr<int64_t>(2), n = h + 2 * g;
  const Tensor& qkv = c.outputs[0];
  const Tensor q = internal::qkv_heads(qkv, 0, h, n), k = internal::qkv_heads(qkv, h, g, n);
  rotate(q, c.input(1), c.input(2), q, transpose);
  rotate(k, c.input(1), c.input(2), k, transpose);
}

void merge_qkv_rotary_cpu(OpCall& c) {
  const bool transpose = c.attr<bool>(0);
  const int64_t h = c.input(0).size(-3), g = c.input(1).size(-3), n = h + 2 * g;
  const Tensor& out = c.outputs[0];
  rotate(c.input(0), c.input(3), c.input(4), internal::qkv_heads(out, 0, h, n), transpose);
  rotate(c.input(1), c.input(3), c.input(4), internal::qkv_heads(out, h, g, n), transpose);
  rotate(c.input(2), c.input(3), c.input(4), internal::qkv_heads(out, h + g, g, n), transpose,
         false);
}

}  // namespace

KILN_REGISTER_KERNEL_IF(rotary_emb, kCPU, "fused", rotary_emb_cpu, rotary_emb_supported);
KILN_REGISTER_KERNEL_IF(rotary_emb_qk, kCPU, "fused", rotary_emb_qk_cpu, rotary_emb_qk_supported);
KILN_REGISTER_KERNEL_IF(split_qkv_rotary, kCPU, "fused", split_qkv_rotary_cpu,
                        split_qkv_rotary_supported);
KILN_REGISTER_KERNEL_IF(merge_qkv_rotary, kCPU, "fused", merge_qkv_rotary_cpu,
                        merge_qkv_rotary_supported);
KILN_REGISTER_KERNEL_IF(rotary_qkv_, kCPU, "fused", rotary_qkv_cpu, rotary_qkv_supported);

}  // namespace kiln::cpu
