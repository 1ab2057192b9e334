// CUDA kernels of cross_entropy_fused, its backward and cross_entropy_fused_with_grad
// (tensor/ops/cross_entropy.cpp; reference: kernels/cpu/cross_entropy.cpp). Never materialises an
// f32 copy of the logits.
//
// Forward: one block per row streams the row once in 16-byte packs (several packs in flight per
// thread), keeping a running maximum and a sum rescaled whenever the maximum grows (online
// logsumexp, f32 for f16/bf16/f32, f64 for f64); the block then merges the threads' (max, sum)
// pairs. It writes lse[row] and the row's loss lse - logits[target]; a one-block kernel takes
// the mean over non-ignored rows (in f64, fixed order: deterministic). A target out of range
// makes the loss NaN (a kernel cannot raise; the CPU kernel raises kiln::Error).
// Backward: one pass, dlogits = (exp(logits - lse) - onehot) * grad / count in the logits'
// dtype, zero on ignored rows; grad / count is computed on the device first (no host sync).
// Both in one call (cross_entropy_fused_with_grad): where a row fits in registers, one kernel
// reads it once for the loss and the gradient (ce_fwd_bwd_kernel); else the two kernels.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <limits>

#include "kernels/cuda/check.h"
#include "kernels/cuda/fused_util.cuh"
#include "tensor/ops.h"
#include "kernels/fused_support.h"
#include "tensor/registry.h"

namespace kiln::cuda {
namespace {

using internal::aligned_to;
using internal::load_pack;
using internal::store_pack;

constexpr int kUnroll = 4;     // packs loaded before any is used
constexpr int kMaxThreads = 512;

template <typename Acc>
__device__ __forceinline__ Acc exp_of(Acc v) {
  if constexpr (std::is_same_v<Acc, double>) {
    return ::exp(v);
  } else {
    return __expf(v);
  }
}

template <typename Acc>
__device__ __forceinline__ Acc neg_inf() {
  return -std::numeric_limits<Acc>::infinity();
}

// Folds N values into the running (m, s): s = sum exp(x - m) over the values seen so far.
template <int N, typename Acc>
__device__ __forceinline__ void online_update(Acc& m, Acc& s, const Acc (&x)[N]) {
  Acc lm = x[0];
#pragma unroll
  for (int i = 1; i < N; ++i) lm = ::fmax(lm, x[i]);
  if (lm > m) {
    s *= exp_of(m - lm);  // m == -inf: s is 0 and stays 0
    m = lm;
  }
  if (m == neg_inf<Acc>()) return;  // everything so far is -inf: contributes nothing
#pragma unroll
  for (int i = 0; i < N; ++i) s += exp_of(x[i] - m);
}

// Merges (om, os) into (m, s): the part whose maximum is below the other's is rescaled to it (by
// 0 when its maximum is -inf; a NaN sum stays NaN).
template <typename Acc>
__device__ __forceinline__ void merge(Acc& m, Acc& s, Acc om, Acc os) {
  const Acc mm = ::fmax(m, om);
  s = (m == mm ? s : s * exp_of(m - mm)) + (om == mm ? os : os * exp_of(om - mm));
  m = mm;
}

template <typename Acc>
__device__ __forceinline__ void block_merge(Acc& m, Acc& s, Acc* sm, Acc* ss) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) {
    sm[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  const int warps = static_cast<int>(blockDim.x >> 5);
  m = lane < warps ? sm[lane] : neg_inf<Acc>();
  s = lane < warps ? ss[lane] : Acc(0);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    merge(m, s, __shfl_xor_sync(0xffffffffu, m, off), __shfl_xor_sync(0xffffffffu, s, off));
  }
}

// A row's loss, lse - logits[target]: 0 on an ignored row, NaN for a target out of range.
template <typename T, typename Acc>
__device__ __forceinline__ Acc row_loss_of(Acc l, const T* xr, int64_t t, int64_t v,
                                           int64_t ignore) {
  if (t == ignore) return Acc(0);
  return t >= 0 && t < v ? l - static_cast<Acc>(xr[t]) : std::numeric_limits<Acc>::quiet_NaN();
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads)
    ce_fwd_kernel(opmath_t<T>* __restrict__ row_loss, opmath_t<T>* __restrict__ lse,
                  const T* __restrict__ logits, int64_t row_stride,
                  const int64_t* __restrict__ targets, int64_t n, int64_t v, int64_t ignore) {
  using Acc = opmath_t<T>;
  __shared__ Acc sm[32], ss[32];
  const int64_t nvec = v / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = logits + row * row_stride;
    Acc m = neg_inf<Acc>(), s = 0;
    int64_t p = tid;
    for (; p + static_cast<int64_t>(kUnroll - 1) * bd < nvec; p += static_cast<int64_t>(kUnroll) * bd) {
      Acc t[kUnroll][N];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_pack<N>(xr + (p + u * bd) * N, t[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) online_update<N>(m, s, t[u]);
    }
    for (; p < nvec; p += bd) {
      Acc t[N];
      load_pack<N>(xr + p * N, t);
      online_update<N>(m, s, t);
    }
    for (int64_t j = nvec * N + tid; j < v; j += bd) {
      const Acc t[1] = {static_cast<Acc>(xr[j])};
      online_update<1>(m, s, t);
    }
    block_merge(m, s, sm, ss);
    if (tid == 0) {
      const Acc l = m + ::log(s);
      lse[row] = l;
      row_loss[row] = row_loss_of(l, xr, targets[row], v, ignore);
    }
  }
}

// loss = sum of row_loss over non-ignored rows / their count (NaN when there are none).
template <typename Acc>
__global__ void ce_mean_kernel(Acc* __restrict__ loss, const Acc* __restrict__ row_loss,
                               const int64_t* __restrict__ targets, int64_t n, int64_t ignore) {
  __shared__ double sums[32];
  __shared__ double counts[32];
  double sum = 0, count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (targets[i] == ignore) continue;
    sum += static_cast<double>(row_loss[i]);
    count += 1;
  }
  sum = internal::block_sum(sum, sums);
  count = internal::block_sum(count, counts);
  if (threadIdx.x == 0) loss[0] = static_cast<Acc>(sum / count);
}

// scale = grad / count of non-ignored rows.
template <typename Acc>
__global__ void ce_scale_kernel(Acc* __restrict__ scale, const Acc* __restrict__ grad,
                                const int64_t* __restrict__ targets, int64_t n, int64_t ignore) {
  __shared__ double counts[32];
  double count = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) count += targets[i] != ignore ? 1 : 0;
  count = internal::block_sum(count, counts);
  if (threadIdx.x == 0) scale[0] = static_cast<Acc>(static_cast<double>(grad[0]) / count);
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads)
    ce_bwd_kernel(T* __restrict__ dlogits, const T* __restrict__ logits, int64_t row_stride,
                  const int64_t* __restrict__ targets, const opmath_t<T>* __restrict__ lse,
                  const opmath_t<T>* __restrict__ scale_ptr, int64_t n, int64_t v,
                  int64_t ignore) {
  using Acc = opmath_t<T>;
  const int64_t nvec = v / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  const Acc scale = *scale_ptr;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = logits + row * row_stride;
    T* dr = dlogits + row * v;
    const int64_t t = targets[row];
    if (t == ignore) {
      Acc z[N];
#pragma unroll
      for (int i = 0; i < N; ++i) z[i] = 0;
      for (int64_t p = tid; p < nvec; p += bd) store_pack<N>(dr + p * N, z);
      for (int64_t j = nvec * N + tid; j < v; j += bd) dr[j] = T(Acc(0));
      continue;
    }
    const Acc l = lse[row];
    int64_t p = tid;
    for (; p + static_cast<int64_t>(kUnroll - 1) * bd < nvec; p += static_cast<int64_t>(kUnroll) * bd) {
      Acc x[kUnroll][N];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_pack<N>(xr + (p + u * bd) * N, x[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j0 = (p + u * bd) * N;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          x[u][i] = exp_of(x[u][i] - l) * scale - (j0 + i == t ? scale : Acc(0));
        }
        store_pack<N>(dr + j0, x[u]);
      }
    }
    for (; p < nvec; p += bd) {
      Acc x[N];
      load_pack<N>(xr + p * N, x);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        x[i] = exp_of(x[i] - l) * scale - (p * N + i == t ? scale : Acc(0));
      }
      store_pack<N>(dr + p * N, x);
    }
    for (int64_t j = nvec * N + tid; j < v; j += bd) {
      const Acc x = static_cast<Acc>(xr[j]);
      dr[j] = T(exp_of(x - l) * scale - (j == t ? scale : Acc(0)));
    }
  }
}

// Forward and backward in one pass over a row that fits in registers
// (cross_entropy_fused_with_grad): each thread loads its K packs of N (pack p = tid + k *
// blockDim.x) before using any, takes their maximum and the sum of exp(x - that maximum), and the
// block merges the threads' (max, sum) pairs in one reduction; then it writes lse and the row's
// loss as ce_fwd_kernel does, and dlogits from the registers as ce_bwd_kernel does. The logits
// are read once instead of twice. The kernel is bound by its barriers more than by memory: the
// row's maximum and then its sum as two block reductions (four barriers) took 352-381 us a chunk
// of llama-160m's logits (H200, .gpu/val24k.sh); with softmax.cuh's block_all_reduce for the
// maximum (a third barrier) 520-536 us.
template <typename T, int N, int K>
__global__ void __launch_bounds__(kMaxThreads)
    ce_fwd_bwd_kernel(T* __restrict__ dlogits, opmath_t<T>* __restrict__ row_loss,
                      opmath_t<T>* __restrict__ lse, const T* __restrict__ logits,
                      int64_t row_stride, const int64_t* __restrict__ targets,
                      const opmath_t<T>* __restrict__ scale_ptr, int64_t n, int64_t v,
                      int64_t ignore) {
  using Acc = opmath_t<T>;
  using Raw = internal::RawPack<T, N>;
  __shared__ Acc sm[32], ss[32];
  const int64_t nvec = v / N;
  const int tid = threadIdx.x, bd = blockDim.x;
  const Acc scale = *scale_ptr;
  for (int64_t row = blockIdx.x; row < n; row += gridDim.x) {
    const T* xr = logits + row * row_stride;
    T* dr = dlogits + row * v;
    Raw raw[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = tid + static_cast<int64_t>(k) * bd;
      if (p < nvec) raw[k] = *reinterpret_cast<const Raw*>(xr + p * N);
    }
    Acc m = neg_inf<Acc>();
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (tid + static_cast<int64_t>(k) * bd < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) m = ::fmax(m, internal::raw_elem<T, N, Acc>(raw[k], i));
      }
    }
    // Relative to 0 when every value is -inf (each adds 0) or NaN (each adds NaN).
    const Acc base = m == neg_inf<Acc>() ? Acc(0) : m;
    Acc s = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (tid + static_cast<int64_t>(k) * bd < nvec) {
#pragma unroll
        for (int i = 0; i < N; ++i) s += exp_of(internal::raw_elem<T, N, Acc>(raw[k], i) - base);
      }
    }
    block_merge(m, s, sm, ss);
    const Acc l = m + ::log(s);
    const int64_t t = targets[row];
    if (tid == 0) {
      lse[row] = l;
      row_loss[row] = row_loss_of(l, xr, t, v, ignore);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int64_t p = tid + static_cast<int64_t>(k) * bd;
      if (p >= nvec) continue;
      Acc y[N];
#pragma unroll
      for (int i = 0; i < N; ++i) {
        y[i] = t == ignore ? Acc(0)
                           : exp_of(internal::raw_elem<T, N, Acc>(raw[k], i) - l) * scale -
                                 (p * N + i == t ? scale : Acc(0));
      }
      store_pack<N>(dr + p * N, y);
    }
  }
}

int threads_for(int64_t nvec) {
  return static_cast<int>(std::clamp<int64_t>((nvec + 31) / 32 * 32, 32, kMaxThreads));
}

// logits with unit stride along the classes (copied otherwise).
Tensor rows_of(const Tensor& logits) {
  return logits.size(1) <= 1 || logits.stride(1) == 1 ? logits : logits.contiguous();
}

template <typename T>
bool packable(const Tensor& logits, const Tensor* out) {
  constexpr int kPack = 16 / sizeof(T);
  const int64_t v = logits.size(1), rs = logits.size(0) > 1 ? logits.stride(0) : v;
  return v % kPack == 0 && rs % kPack == 0 && aligned_to(logits.data_ptr(), 16) &&
         (out == nullptr || aligned_to(out->data_ptr(), 16));
}

void cross_entropy_cuda(OpCall& c) {
  const Tensor logits = rows_of(c.input(0));
  const Tensor targets = c.input(1).contiguous();
  const int64_t ignore = c.attr<int64_t>(0);
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t rs = n > 1 ? logits.stride(0) : v;
  DeviceGuard guard(logits.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(logits.dtype(), "cross_entropy_fused", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    constexpr int kPack = 16 / sizeof(T);
    const Tensor row_loss =
        empty({std::max<int64_t>(n, 1)}, TensorOptions(dtype_of<Acc>()).device(logits.device()));
    if (n > 0) {
      const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
      auto launch = [&]<int N>(std::integral_constant<int, N>) {
        ce_fwd_kernel<T, N><<<grid, threads_for(v / N), 0, stream>>>(
            static_cast<Acc*>(row_loss.data_ptr()), static_cast<Acc*>(c.outputs[1].data_ptr()),
            static_cast<const T*>(logits.data_ptr()), rs,
            static_cast<const int64_t*>(targets.data_ptr()), n, v, ignore);
        KILN_CUDA_LAUNCH_CHECK("ce_fwd_kernel");
      };
      if (packable<T>(logits, nullptr)) {
        launch(std::integral_constant<int, kPack>{});
      } else {
        launch(std::integral_constant<int, 1>{});
      }
    }
    ce_mean_kernel<Acc><<<1, 1024, 0, stream>>>(
        static_cast<Acc*>(c.outputs[0].data_ptr()), static_cast<const Acc*>(row_loss.data_ptr()),
        static_cast<const int64_t*>(targets.data_ptr()), n, ignore);
    KILN_CUDA_LAUNCH_CHECK("ce_mean_kernel");
  });
}

void cross_entropy_backward_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  const Tensor logits = rows_of(c.input(1));
  const Tensor targets = c.input(2).contiguous();
  const Tensor lse = c.input(3).contiguous();
  const int64_t ignore = c.attr<int64_t>(0);
  const int64_t n = logits.size(0), v = logits.size(1);
  if (n == 0) return;
  const int64_t rs = n > 1 ? logits.stride(0) : v;
  const Tensor grad = c.input(0).is_cuda() ? c.input(0) : c.input(0).to(logits.device());
  DeviceGuard guard(logits.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(logits.dtype(), "cross_entropy_fused_backward", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    constexpr int kPack = 16 / sizeof(T);
    const Tensor scale = empty({}, TensorOptions(dtype_of<Acc>()).device(logits.device()));
    ce_scale_kernel<Acc><<<1, 1024, 0, stream>>>(
        static_cast<Acc*>(scale.data_ptr()), static_cast<const Acc*>(grad.data_ptr()),
        static_cast<const int64_t*>(targets.data_ptr()), n, ignore);
    KILN_CUDA_LAUNCH_CHECK("ce_scale_kernel");
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(n, 1 << 20));
    auto launch = [&]<int N>(std::integral_constant<int, N>) {
      ce_bwd_kernel<T, N><<<grid, threads_for(v / N), 0, stream>>>(
          static_cast<T*>(out.data_ptr()), static_cast<const T*>(logits.data_ptr()), rs,
          static_cast<const int64_t*>(targets.data_ptr()),
          static_cast<const Acc*>(lse.data_ptr()), static_cast<const Acc*>(scale.data_ptr()), n,
          v, ignore);
      KILN_CUDA_LAUNCH_CHECK("ce_bwd_kernel");
    };
    if (packable<T>(logits, &out)) {
      launch(std::integral_constant<int, kPack>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
  });
}

// Packs a thread holds in ce_fwd_bwd_kernel, and the rows it takes: up to 512 threads x 8
// packs (32768 f16/bf16 classes, 16384 f32: Llama-2's, Mistral's and llama-160m's 32000).
constexpr int kRegisterPacks = 8;

template <typename T>
bool fits_registers(const Tensor& logits) {
  constexpr int kPack = 16 / sizeof(T);
  return sizeof(T) <= 4 && logits.size(1) <= int64_t{kMaxThreads} * kRegisterPacks * kPack;
}

// cross_entropy_fused_with_grad: ce_fwd_bwd_kernel where the rows fit in registers and pack,
// else the forward and backward kernels one after the other.
void cross_entropy_with_grad_cuda(OpCall& c) {
  const Tensor logits = rows_of(c.input(0));
  const Tensor targets = c.input(1).contiguous();
  const Tensor& grad = c.input(2);
  const int64_t ignore = c.attr<int64_t>(0);
  const int64_t n = logits.size(0), v = logits.size(1);
  Tensor& dlogits = c.outputs[2];
  bool fused = false;
  visit_floating(logits.dtype(), "cross_entropy_fused_with_grad", [&]<typename T>(TypeTag<T>) {
    fused = packable<T>(logits, &dlogits) && fits_registers<T>(logits);
  });
  if (!fused) {
    cross_entropy_with_grad_in_two(c, cross_entropy_cuda, cross_entropy_backward_cuda);
    return;
  }
  const int64_t rs = n > 1 ? logits.stride(0) : v;
  DeviceGuard guard(logits.device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(logits.dtype(), "cross_entropy_fused_with_grad", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    if constexpr (sizeof(T) <= 4) {
      constexpr int kPack = 16 / sizeof(T);
      const TensorOptions acc(dtype_of<Acc>());
      const Tensor row_loss = empty({std::max<int64_t>(n, 1)}, acc.device(logits.device()));
      const Tensor scale = empty({}, acc.device(logits.device()));
      ce_scale_kernel<Acc><<<1, 1024, 0, stream>>>(
          static_cast<Acc*>(scale.data_ptr()), static_cast<const Acc*>(grad.data_ptr()),
          static_cast<const int64_t*>(targets.data_ptr()), n, ignore);
      KILN_CUDA_LAUNCH_CHECK("ce_scale_kernel");
      if (n > 0) {
        const int64_t nvec = v / kPack;
        const int threads = threads_for((nvec + kRegisterPacks - 1) / kRegisterPacks);
        ce_fwd_bwd_kernel<T, kPack, kRegisterPacks>
            <<<static_cast<unsigned>(std::min<int64_t>(n, 1 << 20)), threads, 0, stream>>>(
                static_cast<T*>(dlogits.data_ptr()), static_cast<Acc*>(row_loss.data_ptr()),
                static_cast<Acc*>(c.outputs[1].data_ptr()),
                static_cast<const T*>(logits.data_ptr()), rs,
                static_cast<const int64_t*>(targets.data_ptr()),
                static_cast<const Acc*>(scale.data_ptr()), n, v, ignore);
        KILN_CUDA_LAUNCH_CHECK("ce_fwd_bwd_kernel");
      }
      ce_mean_kernel<Acc><<<1, 1024, 0, stream>>>(
          static_cast<Acc*>(c.outputs[0].data_ptr()), static_cast<const Acc*>(row_loss.data_ptr()),
          static_cast<const int64_t*>(targets.data_ptr()), n, ignore);
      KILN_CUDA_LAUNCH_CHECK("ce_mean_kernel");
    }
  });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(cross_entropy_fused, kCUDA, "fused", cross_entropy_cuda,
                        cross_entropy_supported);
KILN_REGISTER_KERNEL(cross_entropy_fused_backward, kCUDA, cross_entropy_backward_cuda);
KILN_REGISTER_KERNEL(cross_entropy_fused_with_grad, kCUDA, cross_entropy_with_grad_cuda);

}  // namespace kiln::cuda
