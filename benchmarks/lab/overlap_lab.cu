// Memory-bound work beside compute-bound GEMMs, for issue 19's llama-3.2-1b step, which runs at
// the board's power cap: its GEMMs take ~75% of the step at lowered clocks, and the memory-bound
// kernels (AdamW, SwiGLU, norms, RoPE) run between them, one at a time. Does a memory-bound kernel
// cost less time when it runs on a second stream beside GEMMs than between them? Session 28 read
// the capped step as energy / 700 W; a memory-bound kernel alone may draw less than the cap, and
// then the time it takes alone is not what it costs beside GEMMs.
//
// Not a kernel variant but a schedule: the same library kernels (cuBLASLt's GEMMs, the
// multi-tensor AdamW, the SwiGLU kernel), timed
//   - alone,
//   - one after the other on one stream ("serial"),
//   - at once, the memory-bound work on a pool stream beside the GEMMs ("beside"),
// with the saving read as serial - beside, in ms and as a share of the memory-bound work alone;
// then each alone for ~3 s between printed wall-clock times, to read its power and SM clock from
// nvidia-smi's samples (`.gpu/val43b.sh` in benchmarks/RESULTS.md, session 43).
// The GEMMs: llama-3.2-1b's MLP products (8192 tokens: x [8192, 2048] by gate [8192, 2048]^T,
// h [8192, 8192] by down [2048, 8192]^T), repeated to ~80 ms, about the step's GEMM time.
// The memory-bound work: one AdamW step over llama-3.2-1b's 1.24 B parameters with bf16 state
// (the step's optimizer), or SwiGLU forward over [8192, 8192] 48 times (the step's 16 layers'
// forward, recompute and backward passes in bytes, roughly).
// measurements: benchmarks/RESULTS.md (session 43).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda.h"
#include "lab/lab.h"
#include "nn/optim/adamw.h"
#include "tensor/ops.h"

namespace kiln::lab {
namespace {

std::vector<Shape> llama_1b_param_shapes() {
  const std::vector<Shape> layer = {{2048, 2048}, {512, 2048},  {512, 2048},
                                    {2048, 2048}, {8192, 2048}, {8192, 2048},
                                    {2048, 8192}, {2048},       {2048}};
  std::vector<Shape> shapes = {{128256, 2048}, {2048}};
  for (int i = 0; i < 16; ++i) shapes.insert(shapes.end(), layer.begin(), layer.end());
  return shapes;
}

// The host's wall clock, to align nvidia-smi's samples (--query-gpu=timestamp,...) with a phase.
std::string wall_clock() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  char buf[32];
  std::strftime(buf, sizeof buf, "%H:%M:%S", std::gmtime(&t));
  return std::string(buf) + "." + std::to_string(1000 + ms).substr(1);
}

// Runs `work` back to back for about `seconds` (after one timed call), between two printed wall
// clock times: a phase long enough for nvidia-smi's samples of power and SM clock.
void sustained(const std::string& what, const std::function<void()>& work, double seconds) {
  const double once = bench::time_ms([&](int) { work(); });
  const int reps = static_cast<int>(seconds * 1000.0 / once) + 1;
  cuda::synchronize();
  std::printf("  sustained %s: %d calls from %s UTC", what.c_str(), reps, wall_clock().c_str());
  for (int i = 0; i < reps; ++i) work();
  cuda::synchronize();
  std::printf(" to %s UTC\n", wall_clock().c_str());
}

// Times `gemms` and `side` alone, serial and beside each other; prints the saving.
void schedules(const std::string& what, const std::function<void()>& gemms,
               const std::function<void()>& side_work) {
  const cuda::Stream side = cuda::Stream::create();
  const double g = bench::time_ms([&](int) { gemms(); });
  const double m = bench::time_ms([&](int) { side_work(); });
  const double serial = bench::time_ms([&](int) {
    gemms();
    side_work();
  });
  const double beside = bench::time_ms([&](int) {
    side.wait_stream(cuda::current_stream());
    {
      cuda::StreamGuard guard(side);
      side_work();
    }
    gemms();
    cuda::current_stream().wait_stream(side);
  });
  bench::report("gemms [alone]", g, 0, 0);
  bench::report(what + " [alone]", m, 0, 0);
  bench::report("gemms then " + what + " [serial]", serial, 0, 0);
  bench::report("gemms and " + what + " [beside]", beside, 0, 0);
  sustained(what, side_work, 3.0);
  sustained("gemms", gemms, 3.0);
  std::printf(
      "  %s beside the GEMMs saves %.2f ms of serial's %.2f (%.0f%% of its %.2f ms alone)\n",
      what.c_str(), serial - beside, serial, 100.0 * (serial - beside) / m, m);
}

KILN_LAB_CASE(overlap, [] {
  const Tensor x = bench::random({8192, 2048}, kBFloat16, 1.0f);
  const Tensor wg = bench::random({8192, 2048}, kBFloat16, 0.02f);
  const Tensor h = bench::random({8192, 8192}, kBFloat16, 1.0f);
  const Tensor wd = bench::random({2048, 8192}, kBFloat16, 0.02f);
  constexpr int kPairs = 110;  // 2 x 275 GFLOP each: ~80 ms at the capped step's ~720 TFLOP/s
  const auto gemms = [&] {
    for (int i = 0; i < kPairs; ++i) {
      (void)matmul(x, wg.t());
      (void)matmul(h, wd.t());
    }
  };

  std::vector<Tensor> params;
  for (const Shape& s : llama_1b_param_shapes()) {
    Tensor p = bench::random(s, kBFloat16, 0.5f);
    p.mutable_grad() = bench::random(s, kBFloat16, 1e-2f);
    p.requires_grad_(true);
    params.push_back(p);
  }
  optim::AdamW opt(params, optim::AdamWOptions(1e-4).weight_decay(0.1).state_in_param_dtype(true));
  opt.step();  // the state exists before the timings
  // Correctness of the schedule itself: an update on the side stream equals one on the default
  // stream (the same kernel, ordered by the stream waits).
  {
    Tensor p = bench::random({4096, 1024}, kBFloat16, 0.5f);
    p.mutable_grad() = bench::random({4096, 1024}, kBFloat16, 1e-2f);
    p.requires_grad_(true);
    Tensor q = p.detach().clone();
    q.mutable_grad() = p.grad().clone();
    q.requires_grad_(true);
    optim::AdamW a({p}, optim::AdamWOptions(1e-3).weight_decay(0.1).state_in_param_dtype(true));
    optim::AdamW b({q}, optim::AdamWOptions(1e-3).weight_decay(0.1).state_in_param_dtype(true));
    a.step();
    const cuda::Stream side = cuda::Stream::create();
    side.wait_stream(cuda::current_stream());
    {
      cuda::StreamGuard guard(side);
      b.step();
    }
    gemms();
    cuda::current_stream().wait_stream(side);
    check("adamw on a side stream beside the GEMMs", q.detach(), p.detach(), 0.0, 0.0);
  }
  schedules("adamw 1.24B bf16 state", gemms, [&] { opt.step(); });

  const Tensor gate = bench::random({8192, 8192}, kBFloat16, 2.0f);
  const Tensor up = bench::random({8192, 8192}, kBFloat16, 2.0f);
  schedules("swiglu 8192x8192 bf16 x48", gemms, [&] {
    for (int i = 0; i < 48; ++i) (void)swiglu(gate, up);
  });
});

}  // namespace
}  // namespace kiln::lab
