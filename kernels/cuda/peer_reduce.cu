// peer_sum (kernels/cuda/peer_reduce.h): a grid-stride loop over 16-byte packs where every
// pointer is 16-byte aligned, else over elements; f32 accumulation (f64 for f64).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/peer_reduce.h"
#include "tensor/error.h"

namespace kiln::cuda::internal {
namespace {

struct Inputs {
  const void* p[kMaxPeerInputs];
};

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Each thread sums kUnroll packs of kVec elements per iteration, all kInputs x kUnroll loads
// issued before the first add: with a quarter of the SMs the kernel is bound by the bytes it
// keeps in flight (one pack per thread and input moved about 230 GB/s on an H200 beside a
// backward; benchmarks/RESULTS.md, session 23).
constexpr int kThreads = 512;

template <typename T, int kVec, int kInputs, int kUnroll>
__global__ void __launch_bounds__(kThreads)
    peer_sum_kernel(Inputs in, T* out0, T* out1, int64_t n, acc_t<T> scale) {
  using Acc = acc_t<T>;
  using P = RawPack<T, kVec>;  // 16-bit elements stay packed two to a register
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t packs = n / kVec;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t v0 = first; v0 < packs; v0 += stride * kUnroll) {
    P x[kInputs][kUnroll];
#pragma unroll
    for (int j = 0; j < kInputs; ++j) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * stride;
        if (v < packs) x[j][u] = reinterpret_cast<const P*>(in.p[j])[v];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * stride;
      if (v >= packs) break;
      Acc acc[kVec];
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] = raw_elem<T, kVec, Acc>(x[0][u], e);
#pragma unroll
      for (int j = 1; j < kInputs; ++j) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += raw_elem<T, kVec, Acc>(x[j][u], e);
      }
#pragma unroll
      for (int e = 0; e < kVec; ++e) acc[e] *= scale;
      store_pack<kVec>(out0 + v * kVec, acc);
      if (out1 != nullptr) store_pack<kVec>(out1 + v * kVec, acc);
    }
  }
  // The elements after the last whole pack.
  for (int64_t i = packs * kVec + first; i < n; i += stride) {
    Acc acc = static_cast<Acc>(static_cast<const T*>(in.p[0])[i]);
#pragma unroll
    for (int j = 1; j < kInputs; ++j) acc += static_cast<Acc>(static_cast<const T*>(in.p[j])[i]);
    acc *= scale;
    out0[i] = T(acc);
    if (out1 != nullptr) out1[i] = T(acc);
  }
}

template <typename T, int kVec, int kInputs>
void launch_inputs(const Inputs& in, void* out0, void* out1, int64_t n, double scale,
                   unsigned blocks, int threads, cudaStream_t stream) {
  // Up to 16 packs in flight a thread (64 registers of loads).
  constexpr int kUnroll = kVec == 1 ? 1 : (kInputs <= 4 ? 4 : (kInputs <= 5 ? 3 : 2));
  peer_sum_kernel<T, kVec, kInputs, kUnroll><<<blocks, threads, 0, stream>>>(
      in, static_cast<T*>(out0), static_cast<T*>(out1), n, static_cast<acc_t<T>>(scale));
  KILN_CUDA_LAUNCH_CHECK("peer_sum_kernel");
}

// launch_inputs with kInputs = k, for k in [1, kMax] (peer_sum checked the range).
template <typename T, int kVec, int kMax = kMaxPeerInputs>
void launch_vec(const Inputs& in, int k, void* out0, void* out1, int64_t n, double scale,
                unsigned blocks, int threads, cudaStream_t stream) {
  if constexpr (kMax > 1) {
    if (k < kMax) {
      return launch_vec<T, kVec, kMax - 1>(in, k, out0, out1, n, scale, blocks, threads, stream);
    }
  }
  launch_inputs<T, kVec, kMax>(in, out0, out1, n, scale, blocks, threads, stream);
}

template <typename T>
void launch(const void* const* inputs, int k, void* out0, void* out1, int64_t n, double scale,
            cudaStream_t stream) {
  Inputs in{};
  bool aligned =
      reinterpret_cast<uintptr_t>(out0) % 16 == 0 && reinterpret_cast<uintptr_t>(out1) % 16 == 0;
  for (int j = 0; j < k; ++j) {
    in.p[j] = inputs[j];
    aligned = aligned && reinterpret_cast<uintptr_t>(inputs[j]) % 16 == 0;
  }
  constexpr int kVec = 16 / sizeof(T);
  const int sms = loops::multiprocessor_count();
  const int64_t work = aligned ? (n + kVec - 1) / kVec : n;
  // A quarter of the SMs: the sum runs beside the compute it overlaps.
  const auto blocks = static_cast<unsigned>(
      std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, std::max(1, sms / 4)));
  if (aligned) {
    launch_vec<T, kVec>(in, k, out0, out1, n, scale, blocks, kThreads, stream);
  } else {
    launch_vec<T, 1>(in, k, out0, out1, n, scale, blocks, kThreads, stream);
  }
}

}  // namespace

void peer_sum(ScalarType dtype, const void* const* inputs, int num_inputs, void* out0, void* out1,
              int64_t n, double scale, CUstream_st* stream) {
  KILN_CHECK(num_inputs >= 1 && num_inputs <= kMaxPeerInputs, "[peer_sum] takes 1 to ",
             kMaxPeerInputs, " inputs, got ", num_inputs);
  if (n <= 0) return;
  switch (dtype) {
    case kFloat:
      return launch<float>(inputs, num_inputs, out0, out1, n, scale, stream);
    case kDouble:
      return launch<double>(inputs, num_inputs, out0, out1, n, scale, stream);
    case kBFloat16:
      return launch<BFloat16>(inputs, num_inputs, out0, out1, n, scale, stream);
    case kHalf:
      return launch<Half>(inputs, num_inputs, out0, out1, n, scale, stream);
    default:
      break;
  }
  KILN_FAIL("[peer_sum] takes f32, f64, bf16 or f16, got ", dtype);
}

}  // namespace kiln::cuda::internal
