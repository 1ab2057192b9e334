// CUDA kernels of lstm_cell_fused, gru_cell_fused and their backward ops (tensor/ops/rnn.cpp;
// reference: kernels/cpu/rnn.cpp; the formulas: kernels/rnn_cell.h, shared with the CPU). One
// thread per (row, unit) over contiguous operands (the gates of nn::LSTM / nn::GRU come
// contiguous from addmm; other layouts are copied first), arithmetic in f32 for f16/bf16 (f64 for
// f64). A step of a recurrent layer is one GEMM and one of these launches.
#include <cuda_runtime_api.h>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/rnn_cell.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads)
    lstm_fwd_kernel(T* __restrict__ hy, T* __restrict__ cy, T* __restrict__ ws,
                    const T* __restrict__ gates, const T* __restrict__ cx, int64_t n, int64_t h) {
  using M = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += step) {
    const int64_t b = k / h, j = k - b * h;
    const T* g = gates + b * 4 * h + j;
    T* w = ws + b * 5 * h + j;
    const auto o = rnn_cell::lstm_forward<M>(M(g[0]), M(g[h]), M(g[2 * h]), M(g[3 * h]), M(cx[k]));
    hy[k] = T(o.h);
    cy[k] = T(o.c);
    w[0] = T(o.i);
    w[h] = T(o.f);
    w[2 * h] = T(o.g);
    w[3 * h] = T(o.o);
    w[4 * h] = T(o.tc);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    lstm_bwd_kernel(T* __restrict__ dgates, T* __restrict__ dcx, const T* __restrict__ ghy,
                    const T* __restrict__ gcy, const T* __restrict__ ws, const T* __restrict__ cx,
                    int64_t n, int64_t h) {
  using M = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += step) {
    const int64_t b = k / h, j = k - b * h;
    const T* w = ws + b * 5 * h + j;
    T* dg = dgates + b * 4 * h + j;
    const auto d = rnn_cell::lstm_backward<M>(M(ghy[k]), M(gcy[k]), M(w[0]), M(w[h]), M(w[2 * h]),
                                              M(w[3 * h]), M(w[4 * h]), M(cx[k]));
    dg[0] = T(d.ai);
    dg[h] = T(d.af);
    dg[2 * h] = T(d.ag);
    dg[3 * h] = T(d.ao);
    dcx[k] = T(d.cx);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gru_fwd_kernel(T* __restrict__ hy, const T* __restrict__ ig, const T* __restrict__ hg,
                   const T* __restrict__ hx, int64_t n, int64_t h) {
  using M = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += step) {
    const int64_t b = k / h, j = k - b * h;
    const T* i = ig + b * 3 * h + j;
    const T* g = hg + b * 3 * h + j;
    hy[k] = T(rnn_cell::gru_forward<M>(M(i[0]), M(i[h]), M(i[2 * h]), M(g[0]), M(g[h]), M(g[2 * h]),
                                       M(hx[k])));
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gru_bwd_kernel(T* __restrict__ dig, T* __restrict__ dhg, T* __restrict__ dhx,
                   const T* __restrict__ ghy, const T* __restrict__ ig, const T* __restrict__ hg,
                   const T* __restrict__ hx, int64_t n, int64_t h) {
  using M = opmath_t<T>;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < n; k += step) {
    const int64_t b = k / h, j = k - b * h, off = b * 3 * h + j;
    const T* i = ig + off;
    const T* g = hg + off;
    const auto d = rnn_cell::gru_backward<M>(M(ghy[k]), M(i[0]), M(i[h]), M(i[2 * h]), M(g[0]),
                                             M(g[h]), M(g[2 * h]), M(hx[k]));
    dig[off] = dhg[off] = T(d.r);
    dig[off + h] = dhg[off + h] = T(d.z);
    dig[off + 2 * h] = T(d.in);
    dhg[off + 2 * h] = T(d.hn);
    dhx[k] = T(d.hx);
  }
}

template <typename T>
const T* in_ptr(const Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}
template <typename T>
T* out_ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Runs launch(stream, grid) for n = rows * hidden threads' worth of work on `out`'s device.
template <typename F>
void run(const Tensor& out, int64_t n, const char* op, F&& launch) {
  if (n == 0) return;
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(out.dtype(), op, [&]<typename T>(TypeTag<T>) {
    launch(TypeTag<T>{}, stream, loops::grid_for(n, kThreads));
  });
}

void lstm_cell_cuda(OpCall& c) {
  const Tensor gates = c.input(0).contiguous(), cx = c.input(1).contiguous();
  const Tensor &hy = c.outputs[0], &cy = c.outputs[1], &ws = c.outputs[2];
  run(hy, hy.numel(), "lstm_cell_fused",
      [&]<typename T>(TypeTag<T>, cudaStream_t s, unsigned grid) {
        lstm_fwd_kernel<T><<<grid, kThreads, 0, s>>>(out_ptr<T>(hy), out_ptr<T>(cy), out_ptr<T>(ws),
                                                     in_ptr<T>(gates), in_ptr<T>(cx), hy.numel(),
                                                     hy.size(1));
        KILN_CUDA_LAUNCH_CHECK("lstm_fwd_kernel");
      });
}

void lstm_cell_backward_cuda(OpCall& c) {
  const Tensor ghy = c.input(0).contiguous(), gcy = c.input(1).contiguous();
  const Tensor ws = c.input(2).contiguous(), cx = c.input(3).contiguous();
  const Tensor &dg = c.outputs[0], &dcx = c.outputs[1];
  run(dcx, dcx.numel(), "lstm_cell_fused_backward",
      [&]<typename T>(TypeTag<T>, cudaStream_t s, unsigned grid) {
        lstm_bwd_kernel<T><<<grid, kThreads, 0, s>>>(out_ptr<T>(dg), out_ptr<T>(dcx),
                                                     in_ptr<T>(ghy), in_ptr<T>(gcy), in_ptr<T>(ws),
                                                     in_ptr<T>(cx), dcx.numel(), dcx.size(1));
        KILN_CUDA_LAUNCH_CHECK("lstm_bwd_kernel");
      });
}

void gru_cell_cuda(OpCall& c) {
  const Tensor ig = c.input(0).contiguous(), hg = c.input(1).contiguous();
  const Tensor hx = c.input(2).contiguous();
  const Tensor& hy = c.outputs[0];
  run(hy, hy.numel(), "gru_cell_fused", [&]<typename T>(TypeTag<T>, cudaStream_t s, unsigned grid) {
    gru_fwd_kernel<T><<<grid, kThreads, 0, s>>>(out_ptr<T>(hy), in_ptr<T>(ig), in_ptr<T>(hg),
                                                in_ptr<T>(hx), hy.numel(), hy.size(1));
    KILN_CUDA_LAUNCH_CHECK("gru_fwd_kernel");
  });
}

void gru_cell_backward_cuda(OpCall& c) {
  const Tensor ghy = c.input(0).contiguous(), ig = c.input(1).contiguous();
  const Tensor hg = c.input(2).contiguous(), hx = c.input(3).contiguous();
  const Tensor &dig = c.outputs[0], &dhg = c.outputs[1], &dhx = c.outputs[2];
  run(dhx, dhx.numel(), "gru_cell_fused_backward",
      [&]<typename T>(TypeTag<T>, cudaStream_t s, unsigned grid) {
        gru_bwd_kernel<T><<<grid, kThreads, 0, s>>>(
            out_ptr<T>(dig), out_ptr<T>(dhg), out_ptr<T>(dhx), in_ptr<T>(ghy), in_ptr<T>(ig),
            in_ptr<T>(hg), in_ptr<T>(hx), dhx.numel(), dhx.size(1));
        KILN_CUDA_LAUNCH_CHECK("gru_bwd_kernel");
      });
}

}  // namespace

// kernels/cpu/rnn.cpp's: one copy_ per slice, on any device.
KILN_REGISTER_KERNEL(unbind_copy, kCUDA, ::kiln::cpu::unbind_copy_kernel);

// Every call the meta rules accept.
KILN_REGISTER_KERNEL_IF(lstm_cell_fused, kCUDA, "fused", lstm_cell_cuda, nullptr);
KILN_REGISTER_KERNEL(lstm_cell_fused_backward, kCUDA, lstm_cell_backward_cuda);
KILN_REGISTER_KERNEL_IF(gru_cell_fused, kCUDA, "fused", gru_cell_cuda, nullptr);
KILN_REGISTER_KERNEL(gru_cell_fused_backward, kCUDA, gru_cell_backward_cuda);

}  // namespace kiln::cuda
