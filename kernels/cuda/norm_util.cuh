// Pieces the fused norm kernels share (kernels/cuda/norm.cuh: rms_norm,
// kernels/cuda/layer_norm.cuh: layer_norm): the dtype dispatch of (x, parameter), the 16-byte-pack
// test, the choice of the packs per thread of a register kernel, and the deterministic column sum
// of per-block parameter-gradient partials.
//
//   visit_x_weight("rms_norm", x.dtype(), w.dtype(), [&]<typename T, typename W>(TypeTag<T>,
//                                                                               TypeTag<W>) {
//     const bool packed = packable<T, W>(d, {x.data_ptr(), y.data_ptr()}, {w.data_ptr()});
//     ...
//     launch_column_sums<Acc, W>(dw, partial, nullptr, nullptr, blocks, d, stream);
//   });
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "tensor/dtype.h"
#include "tensor/error.h"

namespace kiln::cuda::internal {

// Calls f(TypeTag<T>, TypeTag<W>) for x's dtype T and the parameters' dtype W (T, or float for
// reduced-precision x); errors name `op`.
template <typename F>
void visit_x_weight(const char* op, ScalarType xt, ScalarType wt, F&& f) {
  visit_floating(xt, op, [&]<typename T>(TypeTag<T>) {
    if (wt == xt) {
      f(TypeTag<T>{}, TypeTag<T>{});
    } else if constexpr (!std::is_same_v<T, double> && !std::is_same_v<T, float>) {
      f(TypeTag<T>{}, TypeTag<float>{});
    } else {
      KILN_FAIL("[", op, "] unsupported parameter dtype ", dtype_name(wt));
    }
  });
}

// 1 / sqrt(v) in the accumulator type (rsqrtf for float, rsqrt for double).
template <typename Acc>
__device__ __forceinline__ Acc rsqrt_of(Acc v) {
  if constexpr (std::is_same_v<Acc, double>) {
    return ::rsqrt(v);
  } else {
    return rsqrtf(v);
  }
}

// Whether rows of length d can be accessed in 16-byte packs of T through every row pointer, and
// the parameter pointers (null ones skipped) in packs of the same element count.
template <typename T, typename W>
bool packable(int64_t d, std::initializer_list<const void*> t_ptrs,
              std::initializer_list<const void*> w_ptrs) {
  constexpr int kPack = 16 / sizeof(T);
  if (d % kPack != 0) return false;
  for (const void* p : t_ptrs) {
    if (!aligned_to(p, 16)) return false;
  }
  for (const void* p : w_ptrs) {
    if (p != nullptr && !aligned_to(p, static_cast<int64_t>(sizeof(W)) * kPack)) return false;
  }
  return true;
}

// The smallest P of `Ps` (ascending) with TPR * P >= nvec: calls f(integral_constant<P>) and
// returns true, or returns false where none is large enough (the row is too long for a kernel
// that holds TPR * P packs in registers).
template <int TPR, int... Ps, typename F>
bool with_packs(int64_t nvec, std::integer_sequence<int, Ps...>, F&& f) {
  bool done = false;
  ((!done && nvec <= static_cast<int64_t>(TPR) * Ps
        ? (f(std::integral_constant<int, Ps>{}), done = true)
        : false),
   ...);
  return done;
}

// out0[j] = sum over rows q of part0[q, j] (blockIdx.y == 0), out1 from part1 likewise
// (blockIdx.y == 1); blocks of 32 columns x 32 partial rows, summed in a fixed order.
template <typename Acc, typename W>
__global__ void column_sum_kernel(W* __restrict__ out0, const Acc* __restrict__ part0,
                                  W* __restrict__ out1, const Acc* __restrict__ part1, int64_t nb,
                                  int64_t d) {
  __shared__ Acc s[32][33];
  const Acc* part = blockIdx.y == 0 ? part0 : part1;
  W* out = blockIdx.y == 0 ? out0 : out1;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  Acc acc = 0;
  if (j < d) {
    for (int64_t q = threadIdx.y; q < nb; q += 32) acc += part[q * d + j];
  }
  s[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < d) {
    Acc sum = 0;
    for (int i = 0; i < 32; ++i) sum += s[i][threadIdx.x];
    out[j] = W(sum);
  }
}

// Sums the partials [nb, d] part0 into out0 and, where out1 is not null, part1 into out1, in one
// launch on `stream`.
template <typename Acc, typename W>
void launch_column_sums(W* out0, const Acc* part0, W* out1, const Acc* part1, int64_t nb, int64_t d,
                        cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((d + 31) / 32), out1 != nullptr ? 2 : 1);
  column_sum_kernel<Acc, W><<<grid, dim3(32, 32), 0, stream>>>(out0, part0, out1, part1, nb, d);
  KILN_CUDA_LAUNCH_CHECK("column_sum_kernel");
}

}  // namespace kiln::cuda::internal
