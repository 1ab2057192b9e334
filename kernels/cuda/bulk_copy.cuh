// Bulk copies global -> shared memory on sm_90's TMA unit (cp.async.bulk), completing on an
// mbarrier: a whole row in flight at once without registers.
//
//   __shared__ alignas(8) uint64_t bar;
//   if (threadIdx.x == 0) {
//     bulk::init(&bar);                      // one arrival per phase
//     bulk::expect(&bar, bytes);             // this phase's transaction bytes, then
//     bulk::copy(dst, src, bytes, &bar);     // the copies (16-byte aligned, multiples of 16)
//   }
//   __syncthreads();                         // the initialised barrier visible to all
//   bulk::wait(&bar, /*parity=*/0);          // phase 0 done: the bytes have landed
//
// A barrier reused for the next copy completes phase 1, then 0 again: wait with parity
// (use count) & 1. Shared memory that threads have read and a later bulk copy overwrites: a
// __syncthreads() after the reads, then bulk::fence_before_copy() in the issuing thread.
// Compiled only for sm_90 and later (KILN_BULK_COPY); callers keep a path through registers.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KILN_BULK_COPY 1
#endif

namespace kiln::cuda::bulk {

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

#if defined(KILN_BULK_COPY)
// Initialises `bar` for one arrival per phase and makes it visible to the copy engine.
__device__ __forceinline__ void init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_address(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The calling thread's arrival on `bar`, announcing `bytes` of copies for this phase.
__device__ __forceinline__ void expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_address(bar)),
               "r"(bytes)
               : "memory");
}

// Copies `bytes` (a multiple of 16; src and dst 16-byte aligned) from global src to shared dst,
// in pieces of at most 16 KiB, each completing its bytes on `bar`.
__device__ __forceinline__ void copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  constexpr uint32_t kChunk = 16384;
  const uint32_t b = smem_address(bar);
  for (uint32_t off = 0; off < bytes; off += kChunk) {
    const uint32_t n = bytes - off < kChunk ? bytes - off : kChunk;
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(smem_address(static_cast<char*>(dst) + off)),
        "l"(static_cast<const char*>(src) + off), "r"(n), "r"(b)
        : "memory");
  }
}

// Orders this thread's (and, after a barrier, the block's) earlier shared-memory accesses before
// the bulk copies it issues next.
__device__ __forceinline__ void fence_before_copy() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Waits until the phase of `bar` with parity `parity` has completed (its copies have landed and
// are visible to the waiting thread).
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  const uint32_t b = smem_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(b), "r"(parity)
        : "memory");
  } while (done == 0);
}
#endif

}  // namespace kiln::cuda::bulk
