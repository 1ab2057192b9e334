// The CUDA driver API's stream memory operations, for kiln's CUDA code: the copy-engine
// all-reduce's flags (dist/peer_all_reduce.cpp) and the marks of work a CUDA graph leaves to the
// host (kernels/cuda/graph.cpp, defer_to_each_launch).
//
//   const kiln::cuda::internal::StreamMemOps& ops = kiln::cuda::internal::stream_mem_ops();
//   if (ops.ok) ops.wait(stream, address, 1, CU_STREAM_WAIT_VALUE_EQ);
#pragma once

#include <cuda.h>

namespace kiln::cuda::internal {

// cuStreamWriteValue32 and cuStreamWaitValue32, reached through the runtime
// (driver_entry_point, kernels/cuda/check.h); `ok` is false where the driver lacks them.
struct StreamMemOps {
  CUresult (*write)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  CUresult (*wait)(CUstream, CUdeviceptr, cuuint32_t, unsigned) = nullptr;
  bool ok = false;
};
const StreamMemOps& stream_mem_ops();

}  // namespace kiln::cuda::internal
