// The fused recurrent cells' arithmetic (lstm_cell_fused, gru_cell_fused and their backward ops,
// tensor/ops/rnn.cpp), shared by the CPU (kernels/cpu/rnn.cpp) and CUDA (kernels/cuda/rnn.cu)
// kernels so that both compute the same formulas. M is the arithmetic type (float, or double for
// f64 tensors). One call handles one (row, unit) position: the gates of unit j of row b sit at
// columns j, H + j, 2H + j (and 3H + j) of the row's gate vector, PyTorch's layout.
//
//   LSTM (gates i, f, g, o):  c' = sigmoid(f) c + sigmoid(i) tanh(g),  h' = sigmoid(o) tanh(c')
//   GRU  (gates r, z, n):     r = sigmoid(ir + hr), z = sigmoid(iz + hz),
//                             n = tanh(in + r hn),   h' = (1 - z) n + z h
//
// Internal to kernels/.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define KILN_RNN_HD __host__ __device__ __forceinline__
#else
#define KILN_RNN_HD inline
#endif

namespace kiln {
struct OpCall;
namespace cpu {
// unbind_copy's kernel (kernels/cpu/rnn.cpp), registered for every device: one copy_ per slice.
void unbind_copy_kernel(OpCall& c);
}  // namespace cpu
}  // namespace kiln

namespace kiln::rnn_cell {

KILN_RNN_HD float sigmoid_of(float x) { return 1.0f / (1.0f + ::expf(-x)); }
KILN_RNN_HD double sigmoid_of(double x) { return 1.0 / (1.0 + ::exp(-x)); }
KILN_RNN_HD float tanh_of(float x) { return ::tanhf(x); }
KILN_RNN_HD double tanh_of(double x) { return ::tanh(x); }

// The cell's outputs and its workspace: the activated gates and tanh(c'), which the backward
// reads instead of recomputing five transcendentals per unit.
template <typename M>
struct LstmOut {
  M h, c, i, f, g, o, tc;
};

// gates a_i, a_f, a_g, a_o (pre-activation) and the previous cell state.
template <typename M>
KILN_RNN_HD LstmOut<M> lstm_forward(M ai, M af, M ag, M ao, M cx) {
  const M i = sigmoid_of(ai), f = sigmoid_of(af), g = tanh_of(ag), o = sigmoid_of(ao);
  const M c = f * cx + i * g;
  const M tc = tanh_of(c);
  return {o * tc, c, i, f, g, o, tc};
}

template <typename M>
struct LstmGrad {
  M ai, af, ag, ao, cx;
};

// Gradients of the pre-activation gates and of cx from those of h' and c', given the workspace
// (activated gates i, f, g, o and tc = tanh(c')).
template <typename M>
KILN_RNN_HD LstmGrad<M> lstm_backward(M ghy, M gcy, M i, M f, M g, M o, M tc, M cx) {
  const M dc = gcy + ghy * o * (M(1) - tc * tc);
  return {dc * g * i * (M(1) - i), dc * cx * f * (M(1) - f), dc * i * (M(1) - g * g),
          ghy * tc * o * (M(1) - o), dc * f};
}

template <typename M>
KILN_RNN_HD M gru_forward(M ir, M iz, M in, M hr, M hz, M hn, M hx) {
  const M r = sigmoid_of(ir + hr), z = sigmoid_of(iz + hz);
  const M n = tanh_of(in + r * hn);
  return (M(1) - z) * n + z * hx;
}

template <typename M>
struct GruGrad {
  M r, z, in, hn, hx;  // r and z: of both gate sets; in: of the input's n; hn: of the hidden's n
};

template <typename M>
KILN_RNN_HD GruGrad<M> gru_backward(M ghy, M ir, M iz, M in, M hr, M hz, M hn, M hx) {
  const M r = sigmoid_of(ir + hr), z = sigmoid_of(iz + hz);
  const M n = tanh_of(in + r * hn);
  const M dn = ghy * (M(1) - z) * (M(1) - n * n);
  const M dz = ghy * (hx - n) * z * (M(1) - z);
  const M dr = dn * hn * r * (M(1) - r);
  return {dr, dz, dn, dn * r, ghy * z};
}

}  // namespace kiln::rnn_cell
