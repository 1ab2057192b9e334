// CPU kernels of lstm_cell_fused, gru_cell_fused and their backward ops (tensor/ops/rnn.cpp; the
// formulas: kernels/rnn_cell.h, shared with kernels/cuda/rnn.cu). One pass over contiguous
// copies of the operands (the gate tensors of nn::LSTM / nn::GRU are contiguous already), rows
// split across threads, arithmetic in f32 for f16/bf16 (f64 for f64). And unbind_copy's kernel.
#include "autograd/grad_mode.h"
#include "kernels/rnn_cell.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// Runs body(b) for each row b of `rows`, in parallel when the work is large.
template <typename Body>
void for_rows(int64_t rows, int64_t hidden, Body&& body) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1));
  internal::parallel_for(0, rows, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) body(b);
  });
}

void lstm_cell_cpu(OpCall& c) {
  const Tensor gates = c.input(0).contiguous(), cx = c.input(1).contiguous();
  const int64_t rows = cx.size(0), h = cx.size(1);
  visit_floating(gates.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const T* pg = gates.data_ptr<T>();
    const T* pc = cx.data_ptr<T>();
    T* phy = c.outputs[0].data_ptr<T>();
    T* pcy = c.outputs[1].data_ptr<T>();
    T* pws = c.outputs[2].data_ptr<T>();
    for_rows(rows, h, [&](int64_t b) {
      const T* g = pg + b * 4 * h;
      T* ws = pws + b * 5 * h;
      for (int64_t j = 0; j < h; ++j) {
        const auto o = rnn_cell::lstm_forward<M>(M(g[j]), M(g[h + j]), M(g[2 * h + j]),
                                                 M(g[3 * h + j]), M(pc[b * h + j]));
        phy[b * h + j] = T(o.h);
        pcy[b * h + j] = T(o.c);
        ws[j] = T(o.i);
        ws[h + j] = T(o.f);
        ws[2 * h + j] = T(o.g);
        ws[3 * h + j] = T(o.o);
        ws[4 * h + j] = T(o.tc);
      }
    });
  });
}

void lstm_cell_backward_cpu(OpCall& c) {
  const Tensor ghy = c.input(0).contiguous(), gcy = c.input(1).contiguous();
  const Tensor ws = c.input(2).contiguous(), cx = c.input(3).contiguous();
  const int64_t rows = cx.size(0), h = cx.size(1);
  visit_floating(ws.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const T *pghy = ghy.data_ptr<T>(), *pgcy = gcy.data_ptr<T>(), *pws = ws.data_ptr<T>();
    const T* pcx = cx.data_ptr<T>();
    T* pdg = c.outputs[0].data_ptr<T>();
    T* pdcx = c.outputs[1].data_ptr<T>();
    for_rows(rows, h, [&](int64_t b) {
      const T* w = pws + b * 5 * h;
      T* dg = pdg + b * 4 * h;
      for (int64_t j = 0; j < h; ++j) {
        const int64_t k = b * h + j;
        const auto d = rnn_cell::lstm_backward<M>(M(pghy[k]), M(pgcy[k]), M(w[j]), M(w[h + j]),
                                                  M(w[2 * h + j]), M(w[3 * h + j]), M(w[4 * h + j]),
                                                  M(pcx[k]));
        dg[j] = T(d.ai);
        dg[h + j] = T(d.af);
        dg[2 * h + j] = T(d.ag);
        dg[3 * h + j] = T(d.ao);
        pdcx[k] = T(d.cx);
      }
    });
  });
}

void gru_cell_cpu(OpCall& c) {
  const Tensor ig = c.input(0).contiguous(), hg = c.input(1).contiguous();
  const Tensor hx = c.input(2).contiguous();
  const int64_t rows = hx.size(0), h = hx.size(1);
  visit_floating(ig.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const T *pi = ig.data_ptr<T>(), *ph = hg.data_ptr<T>(), *px = hx.data_ptr<T>();
    T* phy = c.outputs[0].data_ptr<T>();
    for_rows(rows, h, [&](int64_t b) {
      const T* i = pi + b * 3 * h;
      const T* g = ph + b * 3 * h;
      for (int64_t j = 0; j < h; ++j) {
        phy[b * h + j] =
            T(rnn_cell::gru_forward<M>(M(i[j]), M(i[h + j]), M(i[2 * h + j]), M(g[j]), M(g[h + j]),
                                       M(g[2 * h + j]), M(px[b * h + j])));
      }
    });
  });
}

void gru_cell_backward_cpu(OpCall& c) {
  const Tensor ghy = c.input(0).contiguous(), ig = c.input(1).contiguous();
  const Tensor hg = c.input(2).contiguous(), hx = c.input(3).contiguous();
  const int64_t rows = hx.size(0), h = hx.size(1);
  visit_floating(ig.dtype(), c.op->name, [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    const T *pgy = ghy.data_ptr<T>(), *pi = ig.data_ptr<T>(), *ph = hg.data_ptr<T>();
    const T* px = hx.data_ptr<T>();
    T* pdi = c.outputs[0].data_ptr<T>();
    T* pdh = c.outputs[1].data_ptr<T>();
    T* pdx = c.outputs[2].data_ptr<T>();
    for_rows(rows, h, [&](int64_t b) {
      const T* i = pi + b * 3 * h;
      const T* g = ph + b * 3 * h;
      T* di = pdi + b * 3 * h;
      T* dh = pdh + b * 3 * h;
      for (int64_t j = 0; j < h; ++j) {
        const int64_t k = b * h + j;
        const auto d = rnn_cell::gru_backward<M>(M(pgy[k]), M(i[j]), M(i[h + j]), M(i[2 * h + j]),
                                                 M(g[j]), M(g[h + j]), M(g[2 * h + j]), M(px[k]));
        di[j] = dh[j] = T(d.r);
        di[h + j] = dh[h + j] = T(d.z);
        di[2 * h + j] = T(d.in);
        dh[2 * h + j] = T(d.hn);
        pdx[k] = T(d.hx);
      }
    });
  });
}

}  // namespace

// unbind_copy's kernel, for every device (registered for CUDA in kernels/cuda/rnn.cu): one copy
// per slice, through copy_ (device-agnostic).
void unbind_copy_kernel(OpCall& c) {
  NoGradGuard no_grad;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), c.input(0).dim(), "unbind_copy");
  for (size_t i = 0; i < c.outputs.size(); ++i) {
    c.outputs[i].copy_(c.input(0).select(d, static_cast<int64_t>(i)));
  }
}

KILN_REGISTER_KERNEL(unbind_copy, kCPU, unbind_copy_kernel);

// Every call the meta rules accept.
KILN_REGISTER_KERNEL_IF(lstm_cell_fused, kCPU, "fused", lstm_cell_cpu, nullptr);
KILN_REGISTER_KERNEL(lstm_cell_fused_backward, kCPU, lstm_cell_backward_cpu);
KILN_REGISTER_KERNEL_IF(gru_cell_fused, kCPU, "fused", gru_cell_cpu, nullptr);
KILN_REGISTER_KERNEL(gru_cell_fused_backward, kCPU, gru_cell_backward_cpu);

}  // namespace kiln::cpu
