// The reduction step of dist's copy-engine all-reduce (dist/peer_all_reduce.cpp): the sum of a
// few equally long buffers of one GPU, times a scale, written to one or two outputs.
//
//   const void* in[] = {chunk_of_rank0, chunk_of_rank1, ...};   // in rank order
//   kiln::cuda::internal::peer_sum(kBFloat16, in, 4, out, own_chunk, n, 0.25f, stream);
//
// Each element is summed in f32 (f64 for f64) in the order of `inputs`, scaled, and rounded to
// the dtype once, so every rank that reduces a chunk gets the same bits. An output may be one of
// the inputs (it is read before it is written, element by element). Internal to kiln; includes
// no CUDA header.
#pragma once

#include <cstdint>

#include "tensor/dtype.h"

struct CUstream_st;

namespace kiln::cuda::internal {

// The most inputs peer_sum takes (the GPUs of one host).
inline constexpr int kMaxPeerInputs = 8;

// out0[i] = out1[i] = scale * sum_j inputs[j][i] for i < n, dtype f32, f64, bf16 or f16; out1
// may be null. Queued on `stream`.
void peer_sum(ScalarType dtype, const void* const* inputs, int num_inputs, void* out0, void* out1,
              int64_t n, double scale, CUstream_st* stream);

}  // namespace kiln::cuda::internal
