// The GPU benchmark's shared harness (bench_util.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>

#include "gpu/bench_util.h"
#include "kernels/cuda/check.h"
#include "tensor/ops.h"

namespace kiln::bench {
namespace {

constexpr int kSamples = 20;

__global__ void sleep_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Uniform values in [-scale, scale) from a hash of the index and seed.
template <typename T>
__global__ void random_fill_kernel(T* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed ^ static_cast<uint32_t>(i >> 32);
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    const float u = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    p[i] = T((2.0f * u - 1.0f) * scale);
  }
}

__global__ void random_targets_kernel(int64_t* p, int64_t n, int64_t v, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (static_cast<uint64_t>(i) + seed) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    p[i] = static_cast<int64_t>(h % static_cast<uint64_t>(v));
  }
}

uint32_t g_seed = 1;

}  // namespace

Tensor random(IntArrayRef sizes, ScalarType dtype, float scale) {
  Tensor t = empty(sizes, TensorOptions(dtype).device(Device(kCUDA, 0)));
  visit_floating(dtype, "random", [&]<typename T>(TypeTag<T>) {
    random_fill_kernel<T>
        <<<4096, 256>>>(static_cast<T*>(t.data_ptr()), t.numel(), ++g_seed * 7919u, scale);
  });
  KILN_CUDA_LAUNCH_CHECK("random_fill_kernel");
  return t;
}

Tensor random_targets(int64_t n, int64_t v) {
  Tensor t = empty({n}, TensorOptions(kInt64).device(Device(kCUDA, 0)));
  random_targets_kernel<<<256, 256>>>(static_cast<int64_t*>(t.data_ptr()), n, v, ++g_seed);
  KILN_CUDA_LAUNCH_CHECK("random_targets_kernel");
  return t;
}

// Median GPU milliseconds of one call of fn(i) (i counts calls, for rotating inputs).
double time_ms(const std::function<void(int)>& fn, int reps) {
  for (int i = 0; i < 3; ++i) fn(i);
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<cudaEvent_t> ev(2 * kSamples);
  for (auto& e : ev) KILN_CUDA_CHECK(cudaEventCreate(&e));
  sleep_kernel<<<1, 1>>>(200'000'000);  // ~100 ms: the host queues everything meanwhile
  int call = 0;
  for (int s = 0; s < kSamples; ++s) {
    KILN_CUDA_CHECK(cudaEventRecord(ev[2 * s]));
    for (int r = 0; r < reps; ++r) fn(call++);
    KILN_CUDA_CHECK(cudaEventRecord(ev[2 * s + 1]));
  }
  KILN_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int s = 0; s < kSamples; ++s) {
    float t = 0;
    KILN_CUDA_CHECK(cudaEventElapsedTime(&t, ev[2 * s], ev[2 * s + 1]));
    ms.push_back(static_cast<double>(t) / reps);
  }
  for (auto& e : ev) KILN_CUDA_CHECK(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return 0.5 * (ms[kSamples / 2 - 1] + ms[kSamples / 2]);
}

double same_size_copy_gbs(double bytes) {
  const auto half = static_cast<size_t>(bytes / 2) / 16 * 16;
  const auto on_gpu = TensorOptions().dtype(kByte).device(Device(kCUDA, 0));
  std::vector<Tensor> buf;  // two pairs in turn, as the benchmarks rotate two input sets
  for (int b = 0; b < 4; ++b) buf.push_back(empty({static_cast<int64_t>(half)}, on_gpu));
  const double ms = time_ms([&](int i) {
    const size_t pair = 2 * static_cast<size_t>(i % 2);
    KILN_CUDA_CHECK(cudaMemcpyAsync(buf[pair + 1].data_ptr(), buf[pair].data_ptr(), half,
                                    cudaMemcpyDeviceToDevice));
  });
  return 2.0 * static_cast<double>(half) / ms / 1e6;
}

void report_same_size_share(double same_size_gbs) {
  std::printf("%-34s   %5.1f%% of a same-size copy (%.0f GB/s)\n", "",
              100 * rows().back().gbs / same_size_gbs, same_size_gbs);
}

std::vector<Row>& rows() {
  static std::vector<Row> r;
  return r;
}

double& copy_gbs() {
  static double c = 0;
  return c;
}

void report(const std::string& name, double ms, double flops, double bytes) {
  const Row r{name, ms, flops > 0 ? flops / ms / 1e9 : 0, bytes > 0 ? bytes / ms / 1e6 : 0};
  rows().push_back(r);
  std::printf("%-34s %10.4f ms", name.c_str(), ms);
  if (flops > 0) std::printf("  %8.1f TFLOP/s", r.tflops);
  if (bytes > 0) std::printf("  %8.1f GB/s", r.gbs);
  if (bytes > 0 && copy_gbs() > 0) std::printf("  %5.1f%% of copy", 100 * r.gbs / copy_gbs());
  std::printf("\n");
  std::fflush(stdout);
}

bool write_json(const char* path, const char* device) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) {
    std::perror(path);
    return false;
  }
  std::fprintf(f, "{\"device\": \"%s\", \"results\": [\n", device);
  const std::vector<Row>& all = rows();
  for (size_t i = 0; i < all.size(); ++i) {
    const Row& r = all[i];
    std::fprintf(f,
                 "  {\"name\": \"%s\", \"ms\": %.6f, \"tflops\": %.3f, \"gbs\": %.3f, "
                 "\"copy_frac\": %.4f}%s\n",
                 r.name.c_str(), r.ms, r.tflops, r.gbs, copy_gbs() > 0 ? r.gbs / copy_gbs() : 0.0,
                 i + 1 < all.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  return true;
}

}  // namespace kiln::bench
