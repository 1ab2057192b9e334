// kiln_gpu_bench's generated-kernel sections (`--only fused`, `--only fused-rows`): see
// gpu/fused_bench.h.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "compiler/compile.h"
#include "compiler/fused_cuda.h"
#include "gpu/bench_util.h"
#include "gpu/fused_bench.h"
#include "kernels/cuda/check.h"
#include "tensor/ops.h"

namespace kiln::bench {
namespace {

// --- Generated kernels (compiler/fused_cuda.h) -------------------------------------------------
// Elementwise chains that kiln::compile runs as one fused_cuda region, at the 160m and 1b
// activation shapes: the compiled program's time per call, then the same chain run eagerly (a
// kernel per op) beside it. Bytes: the region's inputs read once and its outputs written once,
// what the generated kernel must move (the eager chain moves more: its intermediates). Two
// argument sets in rotation. The compiled row names the entry its kernel ran (vector, dense,
// rowvec, tiled or strided: compiler/fused_cuda.h). Each case checks once that the compiled outputs
// equal eager's bit for bit and prints a FAILED line if not (or if the chain did not become a
// fused_cuda region).
using Chain = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const Tensor x = a.to(kiln::kCPU).contiguous(), y = b.to(kiln::kCPU).contiguous();
  return std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// Row kernels (regions with reductions) add in another order than eager's reduction kernels:
// equal within the rounding of their sums (tests/compiler/fused_cuda_test.cpp's expect_close).
bool close_to(const Tensor& got, const Tensor& want) {
  if (got.dtype() != want.dtype() || got.sizes() != want.sizes()) return false;
  const double rtol = want.dtype() == kiln::kBFloat16 ? 1.0 / 128
                      : want.dtype() == kiln::kHalf   ? 1.0 / 512
                                                      : 1e-5;
  const Tensor a = got.to(kiln::kDouble), b = want.to(kiln::kDouble);
  const double atol = rtol * b.abs().max().item<double>();
  return ((a - b).abs() > b.abs() * rtol + atol).sum().item<int64_t>() == 0;
}

// `rows`: the chain has reductions (a row kernel, compared within rounding, not bitwise). A row
// kernel of 16-bit values is also compiled with CompileOptions::emulate_precision_casts(false)
// (its values kept in float inside the kernel, rounded where stored, as torch.compile's kernels
// do): the row "... [entry, casts not emulated]", compared with eager within rounding too.
void bench_fused_case(const std::string& name, const Chain& chain,
                      const std::function<std::vector<Tensor>()>& make_args, bool rows = false) {
  const std::vector<std::vector<Tensor>> sets = {make_args(), make_args()};
  const std::vector<Tensor> want = chain(sets[0]);
  double bytes = 0;
  bool half = false;
  for (const Tensor& a : sets[0]) {
    bytes += static_cast<double>(a.numel() * a.element_size());
    half = half || a.element_size() == 2;
  }
  for (const Tensor& o : want) bytes += static_cast<double>(o.numel() * o.element_size());
  // How much of the gap to the 1 GiB copy is the size alone, printed beside each compiled row.
  const double same_size_gbs = same_size_copy_gbs(bytes);
  for (const bool emulate : {true, false}) {
    if (!emulate && !(rows && half)) break;
    // Without CUDA graphs: a graph replay copies each argument into its static buffer and each
    // returned value out of it (compiler/cuda_graph.h), which for one bandwidth-bound kernel fed
    // new arguments on every call triples the bytes moved (session 18: 22-27% of copy instead
    // of the kernel's 85-95%). These rows measure the generated kernels, as eager's rows
    // measure its.
    auto f =
        kiln::compile([chain](const std::vector<Tensor>& a) { return chain(a); },
                      kiln::CompileOptions().cuda_graphs(false).emulate_precision_casts(emulate));
    kiln::compiler::reset_fused_cuda_stats();
    const std::vector<Tensor> got = f(sets[0]);  // traces, and compiles the kernel (or disk)
    KILN_CUDA_CHECK(cudaDeviceSynchronize());
    const kiln::compiler::FusedCudaStats st = kiln::compiler::fused_cuda_stats();
    const std::string entry = std::string(st.vector_launches > 0       ? "vector"
                                          : st.rowvec_launches > 0     ? "rowvec"
                                          : st.tiled_half_launches > 0 ? "tiled, packs, half tiles"
                                          : st.tiled_pack_launches > 0 ? "tiled, packs"
                                          : st.tiled_launches > 0      ? "tiled"
                                          : st.dense_launches > 0      ? "dense"
                                          : st.strided_launches > 0    ? "strided"
                                                                       : "no kernel") +
                              (emulate ? "" : ", casts not emulated");
    std::string listing;
    for (const kiln::compiler::Trace& t : f.traces()) listing += t.str();
    if (listing.find("# region [fused_cuda]") == std::string::npos) {
      std::printf("  FAILED: %s [%s]: no fused_cuda region in the compiled program\n", name.c_str(),
                  entry.c_str());
    }
    if (rows && st.row_regions == 0) {
      std::printf("  FAILED: %s [%s]: no row kernel in the compiled program\n", name.c_str(),
                  entry.c_str());
    }
    for (size_t i = 0; i < want.size(); ++i) {
      if (i >= got.size() || !(rows ? close_to(got[i], want[i]) : same_bits(got[i], want[i]))) {
        std::printf("  FAILED: %s [%s]: compiled output %zu differs from eager\n", name.c_str(),
                    entry.c_str(), i);
      }
    }
    report(name + " [" + entry + "]", time_ms([&](int i) { (void)f(sets[i % 2]); }), 0, bytes);
    report_same_size_share(same_size_gbs);
  }
  report(name + " [eager]", time_ms([&](int i) { (void)chain(sets[i % 2]); }), 0, bytes);
}

}  // namespace

// Row kernels: softmax and RMSNorm written with ops (max, exp, sum, divide; mean of squares,
// rsqrt, scale), at the 1b hidden size and a vocabulary, and a weighted row sum. Bytes: the
// inputs read once and the outputs written once (a softmax of [N, V] moves 2 N V elements).
void bench_fused_rows() {
  using kiln::kBFloat16;
  using kiln::kFloat;
  auto softmax_ops = [](const std::vector<Tensor>& a) {
    const Tensor e = kiln::exp(a[0] - kiln::amax(a[0], {-1}, true));
    return std::vector<Tensor>{e / kiln::sum(e, {-1}, true)};
  };
  for (const auto& nd : std::vector<std::pair<int64_t, int64_t>>{{8192, 2048}, {8192, 32000}}) {
    const int64_t n = nd.first, d = nd.second;
    const std::string shape = std::to_string(n) + "x" + std::to_string(d);
    for (kiln::ScalarType dt : {kBFloat16, kFloat}) {
      const std::string tn = dt == kFloat ? "f32" : "bf16";
      bench_fused_case(
          "fused softmax(ops) " + shape + " " + tn, softmax_ops,
          [n, d, dt] {
            return std::vector<Tensor>{random({n, d}, dt)};
          },
          true);
    }
  }
  // The vocabulary's rows of a loss: log_softmax (a per-element output) and logsumexp (a per-row
  // one) written with ops.
  for (kiln::ScalarType dt : {kBFloat16, kFloat}) {
    const std::string tn = dt == kFloat ? "f32" : "bf16";
    auto logits = [dt] { return std::vector<Tensor>{random({8192, 32000}, dt)}; };
    bench_fused_case(
        "fused log_softmax(ops) 8192x32000 " + tn,
        [](const std::vector<Tensor>& a) {
          const Tensor z = a[0] - kiln::amax(a[0], {-1}, true);
          return std::vector<Tensor>{z - kiln::log(kiln::sum(kiln::exp(z), {-1}, true))};
        },
        logits, true);
    bench_fused_case(
        "fused logsumexp(ops) 8192x32000 " + tn,
        [](const std::vector<Tensor>& a) {
          const Tensor m = kiln::amax(a[0], {-1}, true);
          return std::vector<Tensor>{kiln::log(kiln::sum(kiln::exp(a[0] - m), {-1}, true)) + m};
        },
        logits, true);
  }
  bench_fused_case(
      "fused rms_norm(ops) 8192x2048 bf16",
      [](const std::vector<Tensor>& a) {
        const Tensor x = a[0].to(kFloat);
        const Tensor y = x * kiln::rsqrt(kiln::mean(x * x, {-1}, true) + 1e-6);
        return std::vector<Tensor>{y.to(kBFloat16) * a[1]};
      },
      [] {
        return std::vector<Tensor>{random({8192, 2048}, kBFloat16), random({2048}, kBFloat16)};
      },
      true);
  for (kiln::ScalarType dt : {kBFloat16, kFloat}) {
    bench_fused_case(
        std::string("fused row sum(x*s[D]) 8192x2048 ") + (dt == kFloat ? "f32" : "bf16"),
        [](const std::vector<Tensor>& a) {
          return std::vector<Tensor>{kiln::sum(a[0] * a[1], {-1}, true)};
        },
        [dt] {
          return std::vector<Tensor>{random({8192, 2048}, dt), random({2048}, dt)};
        },
        true);
  }
}

void bench_fused() {
  using kiln::kBFloat16;
  using kiln::kFloat;
  for (const auto& nd : std::vector<std::pair<int64_t, int64_t>>{{16384, 768}, {8192, 2048}}) {
    const int64_t n = nd.first, d = nd.second;
    const std::string shape = std::to_string(n) + "x" + std::to_string(d);
    for (kiln::ScalarType dt : {kBFloat16, kFloat}) {
      const std::string tn = dt == kFloat ? "f32" : "bf16";
      auto two = [n, d, dt] { return std::vector<Tensor>{random({n, d}, dt), random({n, d}, dt)}; };
      // The residual stream's add, then the cast to the other dtype (f32 -> bf16 for the next
      // GEMM, bf16 -> f32 for an f32 accumulation).
      const kiln::ScalarType other = dt == kFloat ? kBFloat16 : kFloat;
      bench_fused_case(
          "fused residual add+cast " + shape + " " + tn + "->" + (other == kFloat ? "f32" : "bf16"),
          [other](const std::vector<Tensor>& a) {
            return std::vector<Tensor>{(a[0] + a[1]).to(other)};
          },
          two);
      // SwiGLU's elementwise part, x * sigmoid(x) * y, in f32 math (bf16 in and out for bf16).
      bench_fused_case(
          "fused x*sigmoid(x)*y " + shape + " " + tn,
          [dt](const std::vector<Tensor>& a) {
            const Tensor x = a[0].to(kFloat);
            const Tensor y = a[1].to(kFloat);
            return std::vector<Tensor>{(x * kiln::sigmoid(x) * y).to(dt)};
          },
          two);
      // A scaled residual a + b * s with a broadcast row s[D] (the strided entry).
      bench_fused_case(
          "fused a+b*s[D] " + shape + " " + tn,
          [](const std::vector<Tensor>& a) { return std::vector<Tensor>{a[0] + a[1] * a[2]}; },
          [n, d, dt] {
            return std::vector<Tensor>{random({n, d}, dt), random({n, d}, dt), random({d}, dt)};
          });
      // A transposed input (a [D, N] tensor read as [N, D]: the tiled entry, in packs).
      bench_fused_case(
          "fused (x.t()+y)*0.5 " + shape + " " + tn,
          [](const std::vector<Tensor>& a) { return std::vector<Tensor>{(a[0] + a[1]) * 0.5}; },
          [n, d, dt] {
            return std::vector<Tensor>{random({d, n}, dt).t(), random({n, d}, dt)};
          });
      // where and clamp: a comparison, a select, a scale and a clamp.
      bench_fused_case(
          "fused where/clamp " + shape + " " + tn,
          [](const std::vector<Tensor>& a) {
            const Tensor w = kiln::where(a[0] > a[1], a[0], a[1] * 0.1);
            return std::vector<Tensor>{kiln::clamp(w, -1.0, 1.0)};
          },
          two);
    }
  }
  bench_fused_rows();
}

}  // namespace kiln::bench
