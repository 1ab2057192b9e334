// The CUDA kernels of foreach_norm and foreach_mul_ (tensor/ops/foreach.cpp) over contiguous
// tensors of one dtype on one GPU (the support rule, tensor/ops/foreach.h): the whole list in a
// few launches of multi-tensor kernels (tables of up to kMaxTensors tensors in the kernel's
// arguments, kernels/cuda/multi_tensor.cuh), each tensor cut into chunks of 16 KiB, one block
// per chunk; every thread moves 16 bytes per access (8 bf16/f16, 4 f32, 2 f64) where the tensor's
// data is 16-byte aligned, with kLoads accesses in flight in a full chunk. Nothing waits for the
// GPU.
//
// foreach_norm: a first kernel folds each chunk with norm's reducer (kernels/reduce_fn.h) into one
// partial accumulator per block (f32 for f32/bf16/f16 tensors, f64 for f64, as the GPU's norm
// kernels accumulate), written to a workspace; a second kernel merges each tensor's partials in
// a fixed order and finishes its norm (sqrt, pow 1/p): deterministic, and within rounding of the
// CPU's f64 accumulation. An empty tensor has no partials and gets the norm of nothing.
// foreach_mul_: t[i] = T(M(t[i]) * s) with M = opmath_t<T> and s the scale read as an M, on the
// device from a GPU scale (the conversion CUDA's mul_ makes of a 0-d GPU operand) or on the host
// from a CPU one: t.mul_(scale)'s bits.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/multi_tensor.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/foreach_fn.h"
#include "tensor/ops/foreach.h"
#include "tensor/registry.h"

namespace kiln::cuda::internal {
namespace {

using multi_tensor::Pack;
using scalar::NormKind;

constexpr int kThreads = 256;
constexpr int kLoads = 4;  // 16-byte accesses per thread in flight in a full chunk
constexpr int kMaxTensors = 160;

template <typename T>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));
template <typename T>
constexpr int64_t kChunkOf = int64_t{kThreads} * kVecOf<T>* kLoads;  // 16 KiB

// The accumulator (and result) type: f64 for f64 tensors, f32 otherwise.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

struct Entry {
  void* data;
  int64_t numel;
};
using Table = multi_tensor::Table<Entry, kMaxTensors>;
static_assert(sizeof(Table) + 3 * sizeof(int64_t) < multi_tensor::kMaxArgBytes,
              "kernel arguments are limited to 4 KiB");

// The chunk [begin, end) of the tensor that this block covers, and the tensor's data.
struct Chunk {
  void* data;
  int64_t begin, end;
  bool full, vectorised;
};

template <typename T>
__device__ __forceinline__ Chunk chunk_of(const Table& table) {
  constexpr int64_t kChunk = kChunkOf<T>;
  const int i = multi_tensor::entry_of(table, blockIdx.x);
  const Entry& e = table.t[i];
  const int64_t begin = (blockIdx.x - table.block_start[i]) * kChunk;
  const int64_t end = min(begin + kChunk, e.numel);
  return {e.data, begin, end, end - begin == kChunk, multi_tensor::aligned(e.data, 16)};
}

// Calls f(x[j]) -> new x[j] (kWrite) or f(x[j]) for every element of this block's chunk.
template <typename T, bool kWrite, typename F>
__device__ __forceinline__ void for_each_in_chunk(const Table& table, F&& f) {
  constexpr int kVec = kVecOf<T>;
  using V = Pack<T, kVec>;
  const Chunk c = chunk_of<T>(table);
  T* x = static_cast<T*>(c.data);
  auto apply = [&](T& v) {
    if constexpr (kWrite) {
      v = f(v);
    } else {
      f(v);
    }
  };
  if (c.vectorised && c.full) {
    V v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      v[u] = *reinterpret_cast<const V*>(x + c.begin + (u * kThreads + threadIdx.x) * kVec);
    }
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) apply(v[u].v[k]);
      if constexpr (kWrite) {
        *reinterpret_cast<V*>(x + c.begin + (u * kThreads + threadIdx.x) * kVec) = v[u];
      }
    }
    return;
  }
  int64_t scalar_from = c.begin;
  if (c.vectorised) {
    const int64_t vec_end = c.begin + (c.end - c.begin) / kVec * kVec;
    for (int64_t j = c.begin + threadIdx.x * kVec; j < vec_end; j += kThreads * kVec) {
      V v = *reinterpret_cast<const V*>(x + j);
#pragma unroll
      for (int k = 0; k < kVec; ++k) apply(v.v[k]);
      if constexpr (kWrite) *reinterpret_cast<V*>(x + j) = v;
    }
    scalar_from = vec_end;
  }
  for (int64_t j = scalar_from + threadIdx.x; j < c.end; j += kThreads) apply(x[j]);
}

// --- foreach_norm --------------------------------------------------------------------------------

// One partial accumulator per block: partials[first_block + blockIdx.x].
template <typename T, NormKind kKind>
__global__ void __launch_bounds__(kThreads)
    norm_partials_kernel(const __grid_constant__ Table table, acc_t<T>* partials,
                         int64_t first_block, acc_t<T> p) {
  using F = acc_t<T>;
  const scalar::NormReducer<T, F, kKind> red{nullptr, p};
  F a = red.init();
  for_each_in_chunk<T, false>(table, [&](T v) { red.step(a, v, 0); });
  a = block_reduce(red, a);
  if (threadIdx.x == 0) partials[first_block + blockIdx.x] = a;
}

// One tensor's result: its partials [first, first + count) and where its norm goes.
struct Finish {
  void* out;
  int64_t first, count;
};
struct FinishTable {
  Finish t[kMaxTensors];
  int count;
};
static_assert(sizeof(FinishTable) + 2 * sizeof(int64_t) < multi_tensor::kMaxArgBytes,
              "kernel arguments are limited to 4 KiB");

// One block per tensor: its partials merged in a fixed order, the norm finished.
template <typename T, NormKind kKind>
__global__ void __launch_bounds__(kThreads)
    norm_finish_kernel(const __grid_constant__ FinishTable table, const acc_t<T>* partials,
                       acc_t<T> p) {
  using F = acc_t<T>;
  const scalar::NormReducer<T, F, kKind> red{nullptr, p};
  const Finish& e = table.t[blockIdx.x];
  F a = red.init();
  for (int64_t j = threadIdx.x; j < e.count; j += kThreads) a = red.merge(a, partials[e.first + j]);
  a = block_reduce(red, a);
  if (threadIdx.x == 0) *static_cast<F*>(e.out) = scalar::norm_value<kKind>(a, p);
}

void foreach_norm_cuda(OpCall& c) {
  const kiln::internal::ForeachNormCall f(c);
  if (f.tensors.empty()) return;
  const Device device = f.tensors[0].device();
  DeviceGuard guard(device.index());
  const cudaStream_t stream = current_stream();
  visit_floating(f.tensors[0].dtype(), "foreach_norm", [&]<typename T>(TypeTag<T>) {
    using F = acc_t<T>;
    const F p = static_cast<F>(f.ord);
    int64_t total = 0;
    for (const Tensor& t : f.tensors) total += multi_tensor::chunks(t.numel(), kChunkOf<T>);
    const Tensor workspace = loops::empty_on({std::max<int64_t>(total, 1)}, dtype_of<F>(), device);
    F* partials = workspace.data_ptr<F>();
    scalar::visit_norm_kind(f.ord, [&]<NormKind kKind>() {
      auto tables = multi_tensor::table_filler<Table>([&](const Table& table, int64_t first) {
        norm_partials_kernel<T, kKind>
            <<<table.grid(), kThreads, 0, stream>>>(table, partials, first, p);
        KILN_CUDA_LAUNCH_CHECK("norm_partials_kernel");
      });
      std::vector<Finish> finishes;
      finishes.reserve(f.tensors.size());
      for (size_t i = 0; i < f.tensors.size(); ++i) {
        const Tensor& t = f.tensors[i];
        Finish fin{c.outputs[i].data_ptr(), 0, 0};
        if (t.numel() > 0) {
          fin.count = multi_tensor::chunks(t.numel(), kChunkOf<T>);
          fin.first = tables.add({t.data_ptr(), t.numel()}, fin.count);
        }
        finishes.push_back(fin);
      }
      tables.flush();
      for (size_t start = 0; start < finishes.size(); start += kMaxTensors) {
        FinishTable table{};
        table.count = static_cast<int>(std::min<size_t>(kMaxTensors, finishes.size() - start));
        std::copy_n(finishes.begin() + static_cast<std::ptrdiff_t>(start), table.count, table.t);
        norm_finish_kernel<T, kKind>
            <<<static_cast<unsigned>(table.count), kThreads, 0, stream>>>(table, partials, p);
        KILN_CUDA_LAUNCH_CHECK("norm_finish_kernel");
      }
    });
  });
}

// --- foreach_mul_ --------------------------------------------------------------------------------

// Every element of the table's tensors times the scale: *scale (a GPU scale of type S) or
// host_scale (scale null).
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    mul_kernel(const __grid_constant__ Table table, const S* scale, opmath_t<T> host_scale) {
  using M = opmath_t<T>;
  const M s = scale != nullptr ? loops::convert<M>(*scale) : host_scale;
  for_each_in_chunk<T, true>(table, [s](T v) { return static_cast<T>(static_cast<M>(v) * s); });
}

template <typename T, typename S>
void launch_mul(const kiln::internal::ForeachMulCall& m, const S* scale, opmath_t<T> host_scale,
                cudaStream_t stream) {
  auto tables = multi_tensor::table_filler<Table>([&](const Table& table, int64_t) {
    mul_kernel<T, S><<<table.grid(), kThreads, 0, stream>>>(table, scale, host_scale);
    KILN_CUDA_LAUNCH_CHECK("mul_kernel");
  });
  for (const Tensor& t : m.tensors) {
    if (t.numel() > 0)
      tables.add({t.data_ptr(), t.numel()}, multi_tensor::chunks(t.numel(), kChunkOf<T>));
  }
  tables.flush();
}

void foreach_mul_cuda(OpCall& c) {
  const kiln::internal::ForeachMulCall m(c);
  if (m.tensors.empty()) return;
  DeviceGuard guard(m.tensors[0].device().index());
  const cudaStream_t stream = current_stream();
  visit_floating(m.tensors[0].dtype(), "foreach_mul_", [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    if (loops::is_host_scalar(m.scale)) {
      launch_mul<T, M>(m, nullptr, loops::read_host_scalar<M>(m.scale), stream);
      return;
    }
    visit_floating(m.scale.dtype(), "foreach_mul_", [&]<typename S>(TypeTag<S>) {
      launch_mul<T, S>(m, m.scale.data_ptr<S>(), M(0), stream);
    });
  });
}

}  // namespace

KILN_REGISTER_KERNEL_IF(foreach_norm, kCUDA, "multi_tensor", foreach_norm_cuda,
                        kiln::internal::foreach_supported);
KILN_REGISTER_KERNEL_IF(foreach_mul_, kCUDA, "multi_tensor", foreach_mul_cuda,
                        kiln::internal::foreach_supported);

}  // namespace kiln::cuda::internal
