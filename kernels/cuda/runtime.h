// The internal part of the CUDA runtime (kernels/cuda/runtime.cpp), for kernels/ and the tensor
// code that moves data: the pinned host memory cache behind Tensor::pin_memory and non-blocking
// copies. The public API (devices, memory statistics, streams, events, the runtime knobs) is
// kernels/cuda.h, which this header includes; users include that one.
//
//   kiln::Storage block = kiln::cuda::internal::allocate_pinned(nbytes);
//   ... cudaMemcpyAsync(dst, block->data(), nbytes, cudaMemcpyHostToDevice, stream) ...
//   kiln::cuda::internal::record_pinned_use(*block, stream);  // not reused before the copy
//
// Like kernels/cuda.h it includes no CUDA header and compiles in every build
// (kernels/cpu/cuda_unavailable.cpp is the CPU-only stand-in).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda.h"
#include "tensor/storage.h"

namespace kiln::cuda {

namespace internal {
// A block of page-locked host memory (from a cache, cudaHostAlloc on a miss), for
// Tensor::pin_memory and non-blocking device-to-host copies.
Storage allocate_pinned(size_t nbytes);
// Notes that an asynchronous copy queued on `stream` reads or writes the pinned `storage`: its
// block is not reused before that work is done, even after the tensor dies.
void record_pinned_use(const StorageImpl& storage, CUstream_st* stream);
// Bytes of pinned memory held by the cache (in use or free), and freeing the unused blocks.
int64_t pinned_cached_bytes();
void empty_pinned_cache();
}  // namespace internal

}  // namespace kiln::cuda
