// What the GPU benchmark (gpu/gpu_bench.cu) and the kernel lab (lab/) share: random inputs
// written on the GPU, CUDA-event timing, and the result rows.
//
//   const kiln::Tensor x = kiln::bench::random({8192, 2048}, kiln::kBFloat16);
//   kiln::bench::report("rmsnorm 8192x2048 bf16 fwd",
//                       kiln::bench::time_ms([&](int) { (void)kiln::rms_norm(x, w, 1e-6); }),
//                       /*flops=*/0, /*bytes=*/2.0 * x.nbytes());
//
// Method (../shared/GPU.md): inputs are fresh random values (never zeros); every case is warmed
// up, then a long sleep kernel is queued so that the host enqueues all samples before the GPU
// reaches them (the timings are GPU time, not launch overhead); each sample is bracketed by CUDA
// events and the median is reported. Memory-bound cases rotate among several input sets (the
// `int` argument of the timed function counts calls) so that L2 does not hold the inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::bench {

// Uniform values in [-scale, scale) on GPU 0 (floating dtypes).
Tensor random(IntArrayRef sizes, ScalarType dtype, float scale = 1.7f);
// n int64 targets in [0, v) on GPU 0.
Tensor random_targets(int64_t n, int64_t v);

// Median GPU milliseconds of one call of fn(i) (i counts calls, for rotating inputs), over 20
// samples of `reps` calls each.
double time_ms(const std::function<void(int)>& fn, int reps = 1);

// The bandwidth (GB/s, read + written) of a device-to-device copy moving `bytes` in all (half
// read, half written), two buffer pairs in turn: the ceiling for a kernel of that size, which
// pays the same launch, ramp and tail as the copy.
double same_size_copy_gbs(double bytes);

struct Row {
  std::string name;
  double ms, tflops, gbs;
};
// The rows reported so far, and the bandwidth ceiling memory-bound rows are compared with (set it
// from a measured device-to-device copy; 0: not shown).
std::vector<Row>& rows();
double& copy_gbs();

// Prints a row (name, ms, TFLOP/s when flops > 0, GB/s and % of copy when bytes > 0) and keeps it.
void report(const std::string& name, double ms, double flops, double bytes);
// Prints, under the last row reported, its share of a same-size copy's bandwidth
// (same_size_copy_gbs of the row's bytes).
void report_same_size_share(double same_size_gbs);

// Writes the rows as {"device": ..., "results": [{name, ms, tflops, gbs, copy_frac}, ...]}.
bool write_json(const char* path, const char* device);

}  // namespace kiln::bench
