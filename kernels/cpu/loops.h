// Elementwise loops for CPU kernels: broadcasting, strides, dtype conversion at the edges,
// contiguous fast paths that the compiler vectorises, and splitting across threads.
//
//   // out[i] = a[i] + alpha * b[i], a and b broadcast to out's shape, all of dtype T:
//   cpu::elementwise<T>(out, [=](T x, T y) { return x + alpha * y; }, a, b);
//
// Inputs must already have the element types the functor takes (kernels convert operands
// whose dtype differs with .to() first); the output may have any strides (in-place ops write
// into views). Internal to kernels/: not part of the public API.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "tensor/parallel.h"
#include "tensor/tensor.h"

namespace kiln::cpu {

// The strides (in bytes) of `t` read as if broadcast to `sizes`.
Shape broadcast_byte_strides(const Tensor& t, IntArrayRef sizes);

// N-d iteration over `sizes` for N operands with byte strides. Calls
// body(std::array<char*, N> ptrs, std::array<int64_t, N> inner_strides, int64_t count) for each
// run along the innermost (coalesced) dim. Splits across threads when `parallel` and large.
template <size_t N, typename Body>
void for_each_run(IntArrayRef sizes_in, std::array<char*, N> base,
                  std::array<Shape, N> strides_in, Body&& body, bool parallel = true) {
  // Coalesce: drop size-1 dims, merge dims that are contiguous with their inner neighbour
  // for every operand.
  Shape sizes;
  std::array<Shape, N> strides;
  for (size_t d = 0; d < sizes_in.size(); ++d) {
    if (sizes_in[d] == 1) continue;
    if (sizes_in[d] == 0) return;
    bool merge = !sizes.empty();
    for (size_t k = 0; k < N && merge; ++k) {
      merge = strides[k].back() == strides_in[k][d] * sizes_in[d];
    }
    if (merge) {
      sizes.back() *= sizes_in[d];
      for (size_t k = 0; k < N; ++k) strides[k].back() = strides_in[k][d];
    } else {
      sizes.push_back(sizes_in[d]);
      for (size_t k = 0; k < N; ++k) strides[k].push_back(strides_in[k][d]);
    }
  }
  if (sizes.empty()) {
    sizes.push_back(1);
    for (size_t k = 0; k < N; ++k) strides[k].push_back(0);
  }
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  const int64_t inner = sizes.back();
  const int64_t total = numel_of(sizes);

  auto run_range = [&](int64_t begin, int64_t end) {
    // Multi-index of `begin`, then walk runs of the innermost dim.
    Shape idx(ndim, 0);
    int64_t rem = begin;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      idx[d] = rem % sizes[d];
      rem /= sizes[d];
    }
    std::array<char*, N> ptrs;
    for (size_t k = 0; k < N; ++k) {
      ptrs[k] = base[k];
      for (int64_t d = 0; d < ndim; ++d) ptrs[k] += idx[d] * strides[k][d];
    }
    std::array<int64_t, N> inner_strides;
    for (size_t k = 0; k < N; ++k) inner_strides[k] = strides[k][ndim - 1];
    int64_t pos = begin;
    while (pos < end) {
      const int64_t count = std::min(inner - idx[ndim - 1], end - pos);
      body(ptrs, inner_strides, count);
      pos += count;
      idx[ndim - 1] += count;
      for (size_t k = 0; k < N; ++k) ptrs[k] += count * inner_strides[k];
      // Carry into outer dims.
      for (int64_t d = ndim - 1; d > 0 && idx[d] == sizes[d]; --d) {
        idx[d] = 0;
        ++idx[d - 1];
        for (size_t k = 0; k < N; ++k) {
          ptrs[k] += strides[k][d - 1] - sizes[d] * strides[k][d];
        }
      }
    }
  };
  if (parallel) {
    internal::parallel_for(0, total, internal::kGrainSize, run_range);
  } else {
    run_range(0, total);
  }
}

// out[i] = f(in[i]...) with the inputs broadcast to out's shape. Out is the output element
// type; the input element types are deduced from the functor's parameter types through Ins.
template <typename T>
using TensorFor = const Tensor&;

template <typename Out, typename... Ins, typename F>
void elementwise_typed(const Tensor& out, F&& f, TensorFor<Ins>... in) {
  constexpr size_t N = sizeof...(Ins) + 1;
  std::array<char*, N> base{static_cast<char*>(out.data_ptr()),
                            static_cast<char*>(in.data_ptr())...};
  Shape out_strides;
  for (int64_t s : out.strides()) out_strides.push_back(s * static_cast<int64_t>(sizeof(Out)));
  std::array<Shape, N> strides{out_strides, broadcast_byte_strides(in, out.sizes())...};
  for_each_run<N>(out.sizes(), base, strides,
                  [&](std::array<char*, N> p, std::array<int64_t, N> s, int64_t n) {
                    constexpr std::array<int64_t, N> kDense{static_cast<int64_t>(sizeof(Out)),
                                                            static_cast<int64_t>(sizeof(Ins))...};
                    if (s == kDense) {
                      [&]<size_t... I>(std::index_sequence<I...>) {
                        Out* __restrict o = reinterpret_cast<Out*>(p[0]);
                        std::tuple<const Ins* __restrict...> ins{
                            reinterpret_cast<const Ins*>(p[I + 1])...};
                        for (int64_t i = 0; i < n; ++i) o[i] = Out(f(std::get<I>(ins)[i]...));
                      }(std::index_sequence_for<Ins...>{});
                    } else {
                      [&]<size_t... I>(std::index_sequence<I...>) {
                        for (int64_t i = 0; i < n; ++i) {
                          *reinterpret_cast<Out*>(p[0] + i * s[0]) = Out(
                              f(*reinterpret_cast<const Ins*>(p[I + 1] + i * s[I + 1])...));
                        }
                      }(std::index_sequence_for<Ins...>{});
                    }
                  });
}

// The common case: every input has element type T.
template <typename Out, typename T, typename F, typename... Tensors>
void elementwise(const Tensor& out, F&& f, const Tensors&... in) {
  elementwise_typed<Out, std::conditional_t<true, T, Tensors>...>(out, std::forward<F>(f), in...);
}

// dst[i] = src[i] converted to dst's dtype, src broadcast to dst's shape, any strides on both
// sides (kernels/cpu/copy.cpp: the kernel of copy_ and to).
void copy_elements(const Tensor& dst, const Tensor& src);

// `t` converted to dtype (a no-op when it already has it).
inline Tensor as_dtype(const Tensor& t, ScalarType dtype) {
  return t.dtype() == dtype ? t : t.to(dtype);
}

}  // namespace kiln::cpu
