// Multi-tensor Adam/AdamW (kernels/cuda/optim.h): every parameter of a group in a few launches.
//
// A launch carries a table of up to kMaxTensors parameters in its kernel arguments (no
// host-to-device copy of a pointer list). Each parameter is cut into chunks of kChunk
// elements, one block per chunk; block b finds its parameter by scanning the table's block
// offsets (uniform across the block, read from the constant bank). Within a chunk each thread
// moves 4 elements per access (16-byte loads of f32 state, 8- or 16-byte loads of the
// parameter and grad) when the pointers allow it.
//
// The arithmetic is the CPU fused loop's (nn/optim/adam.cpp), operation by operation, with
// explicitly rounded intrinsics so that nvcc does not contract a*b+c into an FMA: the GPU
// gives the CPU optimizer's bits for f32 parameters, and for bf16/f16 parameters the same
// f32 update rounded once into the parameter.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/optim.h"
#include "tensor/error.h"

namespace kiln::cuda::internal {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int64_t kChunk = kThreads * kVec * 8;  // 8192 elements per block
constexpr int kMaxTensors = 36;

struct Entry {
  void* param;
  const void* grad;
  float* m;
  float* v;
  float* vmax;
  int64_t numel;
  float neg_step;
  float bc2_sqrt;
  int64_t vectorised;  // 1 when every pointer allows 4-element accesses
};

struct Table {
  Entry t[kMaxTensors];
  int64_t block_start[kMaxTensors + 1];  // block_start[count] = the launch's grid size
  int count;
};
static_assert(sizeof(Table) + sizeof(AdamHyper) < 4000, "kernel arguments are limited to 4 KiB");

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
__device__ __forceinline__ float adam_element(float pv, float g, float& m, float& v, float* vmax,
                                              const AdamHyper& h, float neg_step, float bc2_sqrt) {
  if constexpr (kDecay) pv = __fmul_rn(pv, h.decay);
  if constexpr (kL2) g = __fadd_rn(g, __fmul_rn(h.wd, pv));
  const float diff = __fsub_rn(g, m);
  float mi;
  if constexpr (kLerpFromStart) {
    mi = __fadd_rn(m, __fmul_rn(h.w1, diff));
  } else {
    mi = __fsub_rn(g, __fmul_rn(diff, __fsub_rn(1.0f, h.w1)));
  }
  m = mi;
  float vi = __fmul_rn(v, h.b2);
  vi = __fadd_rn(vi, __fmul_rn(h.w2, __fmul_rn(g, g)));
  v = vi;
  if constexpr (kAmsgrad) {
    const float mx = *vmax;
    vi = (mx > vi || mx != mx) ? mx : vi;  // maximum, propagating nan
    *vmax = vi;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), h.eps);
  return __fadd_rn(pv, __fmul_rn(neg_step, __fdiv_rn(mi, denom)));
}

template <typename T, bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const __grid_constant__ Table table, const AdamHyper h) {
  const int64_t block = blockIdx.x;
  int i = 0;
  while (i + 1 < table.count && block >= table.block_start[i + 1]) ++i;
  const Entry& e = table.t[i];
  const int64_t begin = (block - table.block_start[i]) * kChunk;
  const int64_t end = min(begin + kChunk, e.numel);
  T* p = static_cast<T*>(e.param);
  const T* g = static_cast<const T*>(e.grad);
  float* m = e.m;
  float* v = e.v;
  float* vmax = e.vmax;
  if (e.vectorised) {
    for (int64_t j = begin + threadIdx.x * kVec; j < end; j += kThreads * kVec) {
      if (j + kVec <= end) {
        Pack<T, kVec> pp = *reinterpret_cast<const Pack<T, kVec>*>(p + j);
        const Pack<T, kVec> gp = *reinterpret_cast<const Pack<T, kVec>*>(g + j);
        Pack<float, kVec> mp = *reinterpret_cast<const Pack<float, kVec>*>(m + j);
        Pack<float, kVec> vp = *reinterpret_cast<const Pack<float, kVec>*>(v + j);
        Pack<float, kVec> xp;
        if constexpr (kAmsgrad) xp = *reinterpret_cast<const Pack<float, kVec>*>(vmax + j);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float r = adam_element<kDecay, kL2, kAmsgrad, kLerpFromStart>(
              loops::convert<float>(pp.v[k]), loops::convert<float>(gp.v[k]), mp.v[k], vp.v[k],
              &xp.v[k], h, e.neg_step, e.bc2_sqrt);
          pp.v[k] = loops::convert<T>(r);
        }
        *reinterpret_cast<Pack<T, kVec>*>(p + j) = pp;
        *reinterpret_cast<Pack<float, kVec>*>(m + j) = mp;
        *reinterpret_cast<Pack<float, kVec>*>(v + j) = vp;
        if constexpr (kAmsgrad) *reinterpret_cast<Pack<float, kVec>*>(vmax + j) = xp;
      } else {
        for (int64_t k = j; k < end; ++k) {
          p[k] = loops::convert<T>(adam_element<kDecay, kL2, kAmsgrad, kLerpFromStart>(
              loops::convert<float>(p[k]), loops::convert<float>(g[k]), m[k], v[k],
              kAmsgrad ? vmax + k : nullptr, h, e.neg_step, e.bc2_sqrt));
        }
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) {
      p[k] = loops::convert<T>(adam_element<kDecay, kL2, kAmsgrad, kLerpFromStart>(
          loops::convert<float>(p[k]), loops::convert<float>(g[k]), m[k], v[k],
          kAmsgrad ? vmax + k : nullptr, h, e.neg_step, e.bc2_sqrt));
    }
  }
}

bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// Launches adam_kernel<T, flags...> for the runtime flags.
template <typename T, bool... kFlags, typename... Rest>
void launch(const Table& table, const AdamHyper& h, cudaStream_t stream, bool flag, Rest... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    const unsigned grid = static_cast<unsigned>(table.block_start[table.count]);
    if (flag) {
      adam_kernel<T, kFlags..., true><<<grid, kThreads, 0, stream>>>(table, h);
    } else {
      adam_kernel<T, kFlags..., false><<<grid, kThreads, 0, stream>>>(table, h);
    }
    KILN_CUDA_LAUNCH_CHECK("adam_kernel");
  } else {
    flag ? launch<T, kFlags..., true>(table, h, stream, rest...)
         : launch<T, kFlags..., false>(table, h, stream, rest...);
  }
}

}  // namespace

void multi_tensor_adam(ScalarType param_dtype, int device, const std::vector<AdamTensor>& tensors,
                       const AdamHyper& h) {
  KILN_CHECK(param_dtype == kFloat || param_dtype == kBFloat16 || param_dtype == kHalf,
             "[adam] the multi-tensor CUDA kernel takes f32, bf16 or f16 parameters, got ",
             dtype_name(param_dtype));
  DeviceGuard guard(device);
  const cudaStream_t stream = current_stream();
  const bool decay = h.decoupled && h.wd != 0;
  const bool l2 = !h.decoupled && h.wd != 0;
  const bool from_start = std::abs(h.w1) < 0.5f;
  const size_t elem = element_size(param_dtype);
  // The grid of one launch stays below 2^31 blocks.
  constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;
  Table table{};
  auto flush = [&] {
    if (table.count == 0) return;
    visit_dtype(param_dtype, [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16> ||
                    std::is_same_v<T, Half>) {
        launch<T>(table, h, stream, decay, l2, h.amsgrad, from_start);
      }
    });
    table = Table{};
  };
  for (const AdamTensor& a : tensors) {
    if (a.numel == 0) continue;
    const int64_t blocks = (a.numel + kChunk - 1) / kChunk;
    KILN_CHECK(blocks < kMaxBlocks, "[adam] a parameter of ", a.numel,
               " elements is too large for one launch");
    if (table.count == kMaxTensors || table.block_start[table.count] + blocks > kMaxBlocks) {
      flush();
    }
    Entry& e = table.t[table.count];
    e.param = a.param;
    e.grad = a.grad;
    e.m = a.exp_avg;
    e.v = a.exp_avg_sq;
    e.vmax = a.max_exp_avg_sq;
    e.numel = a.numel;
    e.neg_step = a.neg_step_size;
    e.bc2_sqrt = a.bc2_sqrt;
    const bool vec = aligned(a.param, elem * kVec) && aligned(a.grad, elem * kVec) &&
                     aligned(a.exp_avg, 16) && aligned(a.exp_avg_sq, 16) &&
                     (a.max_exp_avg_sq == nullptr || aligned(a.max_exp_avg_sq, 16));
    e.vectorised = vec ? 1 : 0;
    table.block_start[table.count + 1] = table.block_start[table.count] + blocks;
    ++table.count;
  }
  flush();
}

}  // namespace kiln::cuda::internal
