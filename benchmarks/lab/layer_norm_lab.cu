// The layer_norm configurations that lost (kernels/cuda/layer_norm.cu ships the winners): the
// library's register kernels (kernels/cuda/layer_norm.cuh) at other threads per row and rows per
// iteration, validated against an f64 reference composed of kiln ops on the CPU and timed beside
// the library's choice, bf16 x, weight and bias, at 8192 x 2048 (llama-3.2-1b) and 32768 x 4096.
//
// The library: forward a warp per row under 2048 elements, else 128 threads per row (512 for rows
// too long for 128 x 16 packs); backward a warp under 2048 elements, else 256 threads per row, two
// rows per iteration where a thread holds at most 2 packs (512 threads for long rows).
// The variants: forward a warp, 256 or 512 threads per row, and the library's warp and 128
// threads without the test for rows out of the f32 range (kernels/norm_range.h); backward 128
// threads per row, 256 threads one row per iteration, 512 threads one or two rows per iteration.
// measurements: benchmarks/RESULTS.md (sessions 4 and 6, LayerNorm).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/layer_norm.cuh"
#include "lab/lab.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::lab {
namespace {

using BF = BFloat16;
constexpr int kPack = 8;  // bf16 elements per 16-byte pack
constexpr double kEps = 1e-5;

// Inputs and outputs of one call of either pass (bf16; mean and rstd f32).
struct Args {
  Tensor x, w, b, dy;    // inputs
  Tensor y, mean, rstd;  // forward outputs (mean and rstd also the backward's inputs)
  Tensor dx, dw, db;     // backward outputs
};

Args make_args(int64_t rows, int64_t d) {
  Args a;
  a.x = bench::random({rows, d}, kBFloat16);
  a.w = bench::random({d}, kBFloat16);
  a.b = bench::random({d}, kBFloat16);
  a.dy = bench::random({rows, d}, kBFloat16);
  const TensorVec f = call_op(KILN_OP(layer_norm), {a.x, a.w, a.b}, {Shape{d}, kEps});
  a.y = empty_like(a.x);
  a.mean = f[1].contiguous();
  a.rstd = f[2].contiguous();
  a.dx = empty_like(a.x);
  a.dw = empty_like(a.w);
  a.db = empty_like(a.b);
  return a;
}

template <typename T>
T* ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// A variant: runs one pass on `a` and says whether it applied to the row length.
using Run = std::function<bool(Args& a)>;

template <int TPR, int BLOCK, bool kRangeCheck = true>
bool forward(Args& a) {
  const int64_t d = a.w.numel();
  return cuda::internal::launch_layer_norm_fwd<BF, BF, kPack, TPR, BLOCK, kRangeCheck>(
      ptr<BF>(a.y), ptr<float>(a.mean), ptr<float>(a.rstd), ptr<const BF>(a.x), ptr<const BF>(a.w),
      ptr<const BF>(a.b), a.mean.numel(), d, static_cast<float>(kEps), cuda::current_stream());
}

template <int TPR, int BLOCK, int R>
bool backward(Args& a) {
  const int64_t d = a.w.numel();
  return cuda::internal::launch_layer_norm_bwd<BF, BF, kPack, TPR, BLOCK, R>(
      ptr<BF>(a.dx), ptr<BF>(a.dw), ptr<BF>(a.db), ptr<const BF>(a.dy), ptr<const BF>(a.x),
      ptr<const BF>(a.w), ptr<const float>(a.mean), ptr<const float>(a.rstd), a.mean.numel(), d,
      a.x.device(), cuda::current_stream());
}

const std::vector<std::pair<std::string, Run>>& forward_variants() {
  static const std::vector<std::pair<std::string, Run>> v = {
      {"warp", forward<32, 256>},
      {"256 threads", forward<256, 256>},
      {"512 threads", forward<512, 512>},
      // The library's kernels without the test for rows out of the f32 range (issue 21): what
      // the test costs the common path.
      {"warp, no range test", forward<32, 256, false>},
      {"128 threads, no range test", forward<128, 128, false>},
  };
  return v;
}

const std::vector<std::pair<std::string, Run>>& backward_variants() {
  static const std::vector<std::pair<std::string, Run>> v = {
      {"warp", backward<32, 256, 1>},
      {"128 threads", backward<128, 256, 1>},
      {"256 threads, 1 row", backward<256, 256, 1>},
      {"512 threads", backward<512, 512, 1>},
      {"512 threads, 2 rows", backward<512, 512, 2>},
  };
  return v;
}

// The f64 reference on the CPU, composed of kiln ops.
struct Reference {
  Tensor y, mean, rstd, dx, dw, db;
};
Reference reference(const Args& a) {
  auto f64 = [](const Tensor& t) { return t.to(kCPU).to(kDouble); };
  const Tensor x = f64(a.x), w = f64(a.w), b = f64(a.b), dy = f64(a.dy);
  const Tensor m = mean(x, {-1}, true);
  const Tensor r = rsqrt(mean(square(x - m), {-1}, true) + kEps);
  const Tensor xh = (x - m) * r;
  const Tensor g = dy * w;
  const Tensor dx = r * (g - mean(g, {-1}, true) - xh * mean(g * xh, {-1}, true));
  return {xh * w + b, m.view({-1}), r.view({-1}), dx, sum(dy * xh, {0}), sum(dy, {0})};
}

void check_variants(int64_t rows, int64_t d) {
  Args a = make_args(rows, d);
  const Reference ref = reference(a);
  const std::string shape = std::to_string(rows) + "x" + std::to_string(d);
  for (const auto& [name, run] : forward_variants()) {
    if (!run(a)) continue;
    check("layernorm " + shape + " fwd y [" + name + "]", a.y, ref.y, 2e-2, 1e-2);
    check("layernorm " + shape + " fwd mean [" + name + "]", a.mean, ref.mean, 1e-6, 1e-5);
    check("layernorm " + shape + " fwd rstd [" + name + "]", a.rstd, ref.rstd, 1e-6, 1e-5);
  }
  // The backward from the reference's statistics.
  a.mean = ref.mean.to(kFloat).to(a.x.device());
  a.rstd = ref.rstd.to(kFloat).to(a.x.device());
  for (const auto& [name, run] : backward_variants()) {
    if (!run(a)) continue;
    check("layernorm " + shape + " bwd dx [" + name + "]", a.dx, ref.dx, 2e-2, 1e-2);
    // dweight and dbias: bf16 of sums over the rows (about sqrt(rows) in size).
    check("layernorm " + shape + " bwd dw [" + name + "]", a.dw, ref.dw, 0.1, 1e-2);
    check("layernorm " + shape + " bwd db [" + name + "]", a.db, ref.db, 0.1, 1e-2);
  }
}

// The library's op and each variant that applies, timed on 4 input sets in rotation. Bytes:
// forward x read and y written, backward x and dy read and dx written.
void time_variants(int64_t rows, int64_t d) {
  std::vector<Args> as;
  for (int i = 0; i < 4; ++i) as.push_back(make_args(rows, d));
  const double bytes = static_cast<double>(rows * d * 2);
  const std::string base = "layernorm " + std::to_string(rows) + "x" + std::to_string(d) + " bf16 ";
  static const OpDef& bwd = KILN_OP(layer_norm_backward);
  bench::report(base + "fwd [library]", bench::time_ms([&](int i) {
                  const Args& a = as[i % 4];
                  (void)layer_norm(a.x, a.w, a.b, kEps);
                }),
                0, 2 * bytes);
  for (const auto& [name, run] : forward_variants()) {
    if (!run(as[0])) continue;
    bench::report(base + "fwd [" + name + "]",
                  bench::time_ms([&, &run = run](int i) { (void)run(as[i % 4]); }), 0, 2 * bytes);
  }
  bench::report(base + "bwd [library]", bench::time_ms([&](int i) {
                  const Args& a = as[i % 4];
                  (void)call_op(bwd, {a.dy, a.x, a.w, a.mean, a.rstd});
                }),
                0, 3 * bytes);
  for (const auto& [name, run] : backward_variants()) {
    if (!run(as[0])) continue;
    bench::report(base + "bwd [" + name + "]",
                  bench::time_ms([&, &run = run](int i) { (void)run(as[i % 4]); }), 0, 3 * bytes);
  }
}

KILN_LAB_CASE(layer_norm, [] {
  for (const auto& [rows, d] :
       std::vector<std::pair<int64_t, int64_t>>{{1031, 2048}, {257, 4096}, {3, 8192}, {333, 768}}) {
    check_variants(rows, d);
  }
  for (const auto& [rows, d] :
       std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {32768, 4096}}) {
    time_variants(rows, d);
  }
});

}  // namespace
}  // namespace kiln::lab
