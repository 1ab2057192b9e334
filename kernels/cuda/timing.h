// Timing on the GPU for the kernels that choose among candidates by measurement (cuDNN's
// attention engines against each other and against the hand kernels, cuBLASLt's algorithms).
//
//   std::vector<std::function<void()>> candidates = ...;
//   std::vector<double> ms = kiln::cuda::best_times(candidates, /*rounds=*/5, /*runs=*/2);
//
// Internal to kiln's CUDA code.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace kiln::cuda {

// Keeps `stream` busy for about `us` microseconds (one thread spinning on the GPU's timer), so
// that launches the host queues meanwhile start back to back: timed work queued behind it is
// timed without the host's launch overhead.
void busy_wait(cudaStream_t stream, int64_t us);

// Each candidate's best time per run, in milliseconds, on the current stream (where the
// candidates run): every candidate runs once to warm up (plans built, modules loaded), then
// `rounds` interleaved rounds run each candidate `runs` times between two events, all queued
// behind a busy_wait so that the GPU runs them back to back; the host waits once. Timed one
// call after the other with the GPU idle in between, the host's launch overhead was counted,
// and cuDNN's engines for llama-160m's forward were ranked differently from run to run (the
// 64x256 tile, 1.10 ms a step, chosen over the 64x128 one, 1.02; benchmarks/RESULTS.md,
// session 26).
std::vector<double> best_times(const std::vector<std::function<void()>>& candidates, int rounds,
                               int runs);

}  // namespace kiln::cuda
