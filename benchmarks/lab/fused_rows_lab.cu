// Variants of the generated row kernels (compiler/fused_cuda_rows.cpp, fused_cuda_prelude.cpp):
// the kernel fused_cuda generates for a program written with ops, then the same kernel with its
// source edited, each run through the executor's own compile and launch path
// (compiler::internal::run_fused_kernel), checked against the library's kernel and timed beside
// it over the shapes of `kiln_gpu_bench --only fused-rows`.
//
// A variant is the kernel planned with other row-planner choices, or a text edit of the generated
// source (the same entries, parameters and launch geometry, only the code of a helper changed),
// or both. An edit computes eager's bits by construction (an exact rewrite), so it must match the
// library's kernel bit for bit (checked with no tolerance); one that does not is a failure, not a
// result. A variant whose text is not found in a kernel's source (the generator changed) is
// reported as not applicable.
//
// The variants. Measured on one H200 in session 35 (.gpu/val35a.sh), the library then dividing
// out of line and at two blocks a multiprocessor; the two winners are now the library's, and the
// variants below undo them or try what lost:
//   div out of line  kdiv_row_bf16 as before session 35: x * (1 / y) where |y| is in
//               [2^-126, 2^126], an out-of-line IEEE division otherwise (the library's branch-free
//               scaling was 12% faster on softmax 8192x32000 bf16, 2% on 8192x2048);
//   kbf-f2fp    the rounding to bf16 through the paired conversion (cvt.rn.bf16x2.f32, F2FP) of
//               which the low half is kept, instead of cvt.rn.bf16.f32 (F2F): 4-7% slower on
//               log_softmax and logsumexp 8192x32000 bf16, within 2% elsewhere;
//   kbf-int     the rounding to bf16 on the integer pipes (add 0x7fff and the kept bit, shift),
//               NaN as the canonical 0x7fff that cvt writes: F2F and the MUFU share the
//               conversion pipe, a sixteenth of the FMA's rate (not yet measured);
//   2 blocks an SM  long rows cached in shared memory at __launch_bounds__(512, 2) instead of the
//               library's three blocks where three rows fit (three were 4-10% faster on the rows
//               of 32000 bf16; since session 37 the executor builds a kernel that spills at three
//               at two, so this variant's log_softmax is the library's kernel in all but text);
//   no row cache  long rows read again by each pass (from L2, mostly), planned as for a device
//               without opt-in shared memory (session 36: whether the shared-memory cache still
//               wins since the row kernels take fewer instructions);
//   pass 0 by cp.async  a long row cached in shared memory copied there by cp.async (each thread
//               its own accesses, all at once, no registers) instead of loaded and stored; with
//               the next row's copies issued at the end of a row or during the last pass, a block
//               a row (the library's grid, so no next row: the copies before the row loop) or 396
//               persistent blocks. On an H200 (session 37, the library folding amax in bf16
//               pairs): softmax 8192x32000 bf16 4% faster, log_softmax 13% faster, logsumexp 2%
//               slower; the persistent blocks 10-19% slower;
// and other geometries, planned with compiler::internal::RowPlanOptions: 8 or 2 accesses a thread
// instead of 4 (a row of 2048 bf16 to one warp, or to 128 threads), blocks of 512 threads (all
// slower on the rows of 2048: 1795, 2364 and 2244 GB/s against the library's 2516). Those add a
// row's terms in another order, so their outputs are checked within 2^-6 of each output's largest
// magnitude, not bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "compiler/compile.h"
#include "compiler/fused_cuda.h"
#include "kiln.h"
#include "lab/lab.h"

namespace kiln::lab {
namespace {

using compiler::internal::FusedKernel;
using Program = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Every occurrence of `from` replaced by `to`, or nullopt where there is none.
std::optional<std::string> replaced_all(const std::string& s, const std::string& from,
                                        const std::string& to) {
  if (s.find(from) == std::string::npos) return std::nullopt;
  std::string out = s;
  for (size_t at = out.find(from); at != std::string::npos; at = out.find(from, at + to.size())) {
    out.replace(at, from.size(), to);
  }
  return out;
}

const std::string kDivLibrary =
    R"(  const float s = ay < 0x1p-126f ? 0x1p64f : ay > 0x1p126f && ay <= 0x1.fffffep127f ? 0x1p-64f : 1.0f;
  return x * (1.0f / (y * s)) * s;)";
const std::string kDivOutOfLine =
    R"(  return ay >= 0x1p-126f && ay <= 0x1p126f ? x * (1.0f / y) : kdiv_ieee(x, y);)";
const std::string kDivIeee =
    "__device__ __noinline__ float kdiv_ieee(float x, float y) { return x / y; }\n";
const std::string kKbfLibrary = R"(  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.x) : "f"(f));)";
const std::string kKbfPaired = R"(  unsigned int p;
  asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(p) : "f"(f));
  r.x = (unsigned short)p;)";
// Round to nearest even on the integer pipes; NaN as cvt.rn.bf16.f32 writes it, the canonical
// 0x7fff (as cuda_bf16.hpp's host conversion, which matches the device's).
const std::string kKbfInteger = R"(  const unsigned int u = __float_as_uint(f);
  r.x = (u & 0x7fffffffu) > 0x7f800000u ? (unsigned short)0x7fffu
                                         : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);)";

// A variant: the kernel planned with `plan` (the library's by default) for a device of
// `shared_limit` bytes of opt-in shared memory a block, then its source edited by `edit` (none: as
// generated).
struct Variant {
  std::string name;
  compiler::internal::RowPlanOptions plan;
  std::function<std::optional<std::string>(const std::string&)> edit;
  int64_t shared_limit = compiler::internal::kDefaultSharedLimit;
};
// The out-of-line division (kdiv_ieee declared before kdiv_row_bf16, which calls it).
std::optional<std::string> div_out_of_line(const std::string& s) {
  const auto d = replaced_all(s, kDivLibrary, kDivOutOfLine);
  const std::string row_div = "__device__ __forceinline__ float kdiv_row_bf16(";
  if (!d || d->find(row_div) == std::string::npos) return std::nullopt;
  std::string out = *d;
  out.insert(out.find(row_div), kDivIeee);
  return out;
}
// Pass 0 of a row cached in shared memory (in0, the vector entry) loaded by cp.async: each
// thread copies all of its accesses of the row to their places at once (no registers, a whole row
// in flight), waits for its own copies, and reads them back. With a prefetch the first row's
// copies are issued before the row loop and the next row's early: at the end of a row (kAtRowEnd,
// overlapping the block's tail) or chunk by chunk in the last pass, once the chunk is used
// (kInLastPass, overlapping that pass). Each thread overwrites only its own accesses, which it
// has read: no barrier.
enum class Prefetch { kNone, kAtRowEnd, kInLastPass };
// `blocks` > 0: that many blocks run (the others return at once), each taking every blocks-th row,
// so that a block has a next row to prefetch (the library launches a block a row).
std::optional<std::string> pass0_cp_async(const std::string& s, Prefetch prefetch, int blocks = 0) {
  const size_t vec = s.find("kiln_rows_vector(");
  const std::string sin = "    bf16* sin0 = (bf16*)(ksm + 0);  // the row, in shared memory\n";
  const std::string load = "xv0[u] = *(const kpack<bf16, 8>*)(rin0 + c0);";
  const std::string store = "      *(kpack<bf16, 8>*)(sin0 + c0) = xv0[u];\n";
  const std::string step = "const int c0 = cb + u * ";
  if (vec == std::string::npos || s.find(sin, vec) == std::string::npos ||
      s.find(load, vec) == std::string::npos || s.find(store, vec) == std::string::npos ||
      s.find(step, vec) == std::string::npos)
    return std::nullopt;
  std::string out = s;
  const size_t at = out.find(step, vec) + step.size();
  const std::string stride = out.substr(at, out.find(';', at) - at);
  out.replace(out.find(load, vec), load.size(), "xv0[u] = *(const kpack<bf16, 8>*)(sin0 + c0);");
  out.erase(out.find(store, vec), store.size());
  const std::string copy = "for (int c = lane * 8; c < C; c += " + stride +
                           ") asm volatile(\"cp.async.cg.shared.global [%0], [%1], 16;\" :: "
                           "\"r\"((unsigned)__cvta_generic_to_shared(SIN + c)), "
                           "\"l\"(__cvta_generic_to_global(RIN + c)) : \"memory\");\n";
  auto with = [&](const std::string& sp, const std::string& rp) {
    std::string c = copy;
    c.replace(c.find("SIN"), 3, sp);
    c.replace(c.find("RIN"), 3, rp);
    return c;
  };
  const std::string wait = "    asm volatile(\"cp.async.wait_all;\" ::: \"memory\");\n";
  const size_t sat = out.find(sin, vec) + sin.size();
  if (prefetch == Prefetch::kNone) {
    out.insert(sat, "    if (active) {\n      " + with("sin0", "rin0") + "    }\n" + wait);
    return out;
  }
  out.insert(sat, wait);
  // The first row's copies before the row loop; the next row's at the end of each row.
  const std::string loop = "  for (long long base = ";
  const size_t lat = out.find(loop, vec);
  if (lat == std::string::npos ||
      out.find("const int g = threadIdx.x / 512", vec) == std::string::npos)
    return std::nullopt;
  out.insert(lat,
             "  if ((long long)blockIdx.x < R) { const int lane = threadIdx.x; const bf16* rin0 = "
             "in0 + blockIdx.x * C; bf16* sin0 = (bf16*)ksm;\n    " +
                 with("sin0", "rin0") + "  }\n");
  std::string grid = "(long long)gridDim.x";
  if (blocks > 0) {
    grid = std::to_string(blocks) + "LL";
    const std::string from = "base += (long long)gridDim.x * 1)";
    const size_t f = out.find(from, lat);
    if (f == std::string::npos) return std::nullopt;
    out.replace(f, from.size(), "base += " + grid + ")");
    out.insert(lat, "  if (blockIdx.x >= " + std::to_string(blocks) + ") return;\n");
  }
  if (prefetch == Prefetch::kInLastPass) {
    // The last pass's chunk loop: the next row's copies of the chunk, once the chunk is used.
    const std::string loop_head = "    for (int cb = lane * 8; cb < C; cb += ";
    const size_t h = out.rfind(loop_head);
    if (h == std::string::npos || h < vec) return std::nullopt;
    const size_t n_at = h + loop_head.size();
    const std::string chunk = out.substr(n_at, out.find(')', n_at) - n_at);
    size_t i = out.find('{', h), depth = 0;
    for (; i < out.size(); ++i) {
      if (out[i] == '{') ++depth;
      if (out[i] == '}' && --depth == 0) break;
    }
    if (i == out.size()) return std::nullopt;
    std::string copy_chunk = copy;
    copy_chunk.replace(copy_chunk.find("for (int c = lane * 8; c < C; c += " + stride + ")"),
                       std::string("for (int c = lane * 8; c < C; c += " + stride + ")").size(),
                       "for (int c = cb; c < C && c < cb + " + chunk + "; c += " + stride + ")");
    copy_chunk.replace(copy_chunk.find("SIN"), 3, "sin0");
    copy_chunk.replace(copy_chunk.find("RIN"), 3, "nin0");
    out.insert(i, "      if (base + " + grid + " < R) { const bf16* nin0 = rin0 + " + grid +
                      " * C;\n        " + copy_chunk + "      }\n");
    return out;
  }
  const size_t end = out.rfind("  }\n}");
  if (end == std::string::npos || end < vec) return std::nullopt;
  out.insert(end, "    if (base + " + grid + " < R) { const bf16* nin0 = rin0 + " + grid +
                      " * C;\n      " + with("sin0", "nin0") + "    }\n");
  return out;
}
const std::vector<Variant>& variants() {
  using compiler::internal::RowPlanOptions;
  static const std::vector<Variant> v = {
      {"div out of line", {}, div_out_of_line},
      {"kbf-f2fp",
       {},
       [](const std::string& s) { return replaced_all(s, kKbfLibrary, kKbfPaired); }},
      {"kbf-int",
       {},
       [](const std::string& s) { return replaced_all(s, kKbfLibrary, kKbfInteger); }},
      {"kbf-int, 2 blocks an SM",
       {},
       [](const std::string& s) {
         const auto k = replaced_all(s, kKbfLibrary, kKbfInteger);
         return k ? replaced_all(*k, "__launch_bounds__(512, 3)", "__launch_bounds__(512, 2)")
                  : std::nullopt;
       }},
      // Geometry: 8 accesses a thread (a row of 2048 bf16 to one warp: no barrier), or 2.
      {"8 a thread", RowPlanOptions{8, 256}, nullptr},
      {"2 a thread", RowPlanOptions{2, 256}, nullptr},
      {"blocks of 512", RowPlanOptions{4, 512}, nullptr},
      // Long rows cached in shared memory (a bf16 row of 32000: 64 KB a block): two blocks to a
      // multiprocessor instead of three (ptxas may then take 64 registers a thread, not 42).
      {"2 blocks an SM",
       {},
       [](const std::string& s) {
         return replaced_all(s, "__launch_bounds__(512, 3)", "__launch_bounds__(512, 2)");
       }},
      // Long rows read again from global memory by each pass (L2, mostly), not cached in shared
      // memory: no shared memory to bound the blocks an SM.
      {"no row cache", {}, nullptr, 0},
      // Pass 0's loads of a long row by cp.async, straight to shared memory; then with the next
      // row's copies issued at the end of each row.
      {"pass 0 by cp.async",
       {},
       [](const std::string& s) { return pass0_cp_async(s, Prefetch::kNone); }},
      {"cp.async, next row at row end",
       {},
       [](const std::string& s) { return pass0_cp_async(s, Prefetch::kAtRowEnd); }},
      {"cp.async, next row in last pass",
       {},
       [](const std::string& s) { return pass0_cp_async(s, Prefetch::kInLastPass); }},
      // Persistent blocks (3 an SM of an H100 or H200), so that each has a next row to prefetch.
      {"cp.async, 396 blocks, next row at row end",
       {},
       [](const std::string& s) { return pass0_cp_async(s, Prefetch::kAtRowEnd, 396); }},
      {"cp.async, 396 blocks, next row in last pass",
       {},
       [](const std::string& s) { return pass0_cp_async(s, Prefetch::kInLastPass, 396); }},
  };
  return v;
}

// The whole program as one region: its trace (eager executor) on the GPU arguments, and which
// argument each of the kernel's inputs is.
struct Lowered {
  compiler::Trace trace;
  FusedKernel k;                 // the library's kernel
  std::vector<size_t> argument;  // per entry of k.inputs
  std::vector<Tensor> inputs(const std::vector<Tensor>& args) const {
    std::vector<Tensor> in;
    for (size_t a : argument) in.push_back(args[a]);
    return in;
  }
  // The kernel fused_cuda generates for all of the trace's ops under `plan`, for a device of
  // `shared_limit` bytes of opt-in shared memory.
  FusedKernel kernel(const compiler::internal::RowPlanOptions& plan,
                     int64_t shared_limit = compiler::internal::kDefaultSharedLimit) const {
    std::string why;
    std::optional<FusedKernel> k = compiler::internal::generate_fused_kernel(
        trace, 0, trace.ops.size(), &why, shared_limit, plan);
    KILN_CHECK(k.has_value(), "[fused_rows lab] no kernel for the program: ", why, "\n",
               trace.str());
    KILN_CHECK(k->row_kernel, "[fused_rows lab] the program's kernel is not a row kernel");
    return std::move(*k);
  }
};
Lowered lower(const Program& fn, const std::vector<Tensor>& args) {
  auto f = compile(fn, CompileOptions().executors({"eager"}));
  (void)f(args);
  Lowered l{f.traces().front(), {}, {}};
  l.k = l.kernel({});
  for (const auto& o : l.k.inputs) {
    const auto it = std::find(l.trace.arguments.begin(), l.trace.arguments.end(), o.value);
    KILN_CHECK(it != l.trace.arguments.end(), "[fused_rows lab] the kernel reads a value that ",
               "is not an argument of the program (a captured constant)\n", l.trace.str());
    l.argument.push_back(static_cast<size_t>(it - l.trace.arguments.begin()));
  }
  return l;
}

void run_case(const std::string& name, const Program& fn,
              const std::function<std::vector<Tensor>()>& make_args) {
  const std::vector<std::vector<Tensor>> sets = {make_args(), make_args()};
  const Lowered l = lower(fn, sets[0]);
  const std::vector<std::vector<Tensor>> in = {l.inputs(sets[0]), l.inputs(sets[1])};
  const std::vector<Tensor> want = compiler::internal::run_fused_kernel(l.k, in[0]);
  double bytes = 0;
  for (const Tensor& a : in[0]) bytes += static_cast<double>(a.nbytes());
  for (const Tensor& o : want) bytes += static_cast<double>(o.nbytes());
  const auto timed = [&](const FusedKernel& k) {
    return bench::time_ms([&](int i) {
      (void)compiler::internal::run_fused_kernel(k, in[static_cast<size_t>(i % 2)]);
    });
  };
  std::printf("%s: the library's kernel has %d threads a row, %d rows a block\n", name.c_str(),
              l.k.row_threads, l.k.rows_per_block);
  bench::report(name + " [library]", timed(l.k), 0, bytes);
  for (const Variant& v : variants()) {
    FusedKernel kv = l.kernel(v.plan, v.shared_limit);
    if (v.edit) {
      const std::optional<std::string> source = v.edit(kv.source);
      if (!source) {
        std::printf("%s [%s]: not applicable (its text is not in the generated source)\n",
                    name.c_str(), v.name.c_str());
        continue;
      }
      kv.source = *source;
    }
    if (kv.source == l.k.source) {
      std::printf("%s [%s]: the library's kernel\n", name.c_str(), v.name.c_str());
      continue;
    }
    const std::vector<Tensor> got = compiler::internal::run_fused_kernel(kv, in[0]);
    // Another geometry adds a row's terms in another order, so the outputs may differ by rounding:
    // within 2^-6 of each output's largest magnitude (a row sum near zero has no relative bound).
    // An edit changes no bits.
    const bool same_order = kv.row_threads == l.k.row_threads;
    for (size_t i = 0; i < want.size(); ++i) {
      const double atol =
          same_order ? 0 : want[i].to(kCPU).to(kDouble).abs().max().item<double>() / 64;
      check(name + " [" + v.name + "] output " + std::to_string(i), got[i], want[i], atol, 0);
    }
    bench::report(name + " [" + v.name + "] (" + std::to_string(kv.row_threads) + " a row)",
                  timed(kv), 0, bytes);
  }
}

KILN_LAB_CASE(fused_rows, [] {
  const auto one = [](int64_t n, int64_t d) {
    return [n, d] { return std::vector<Tensor>{bench::random({n, d}, kBFloat16)}; };
  };
  const Program softmax_ops = [](const std::vector<Tensor>& a) {
    const Tensor e = exp(a[0] - amax(a[0], {-1}, true));
    return std::vector<Tensor>{e / sum(e, {-1}, true)};
  };
  run_case("rows softmax(ops) 8192x2048 bf16", softmax_ops, one(8192, 2048));
  run_case("rows softmax(ops) 8192x32000 bf16", softmax_ops, one(8192, 32000));
  run_case(
      "rows log_softmax(ops) 8192x32000 bf16",
      [](const std::vector<Tensor>& a) {
        const Tensor z = a[0] - amax(a[0], {-1}, true);
        return std::vector<Tensor>{z - log(sum(exp(z), {-1}, true))};
      },
      one(8192, 32000));
  run_case(
      "rows logsumexp(ops) 8192x32000 bf16",
      [](const std::vector<Tensor>& a) {
        const Tensor m = amax(a[0], {-1}, true);
        return std::vector<Tensor>{log(sum(exp(a[0] - m), {-1}, true)) + m};
      },
      one(8192, 32000));
  run_case(
      "rows rms_norm(ops) 8192x2048 bf16",
      [](const std::vector<Tensor>& a) {
        const Tensor x = a[0].to(kFloat);
        const Tensor y = x * rsqrt(mean(x * x, {-1}, true) + a[2]);
        return std::vector<Tensor>{y.to(kBFloat16) * a[1]};
      },
      [] {
        // eps as an argument (a 0-d f64 on the host), not a captured constant: the lab feeds
        // the kernel the program's arguments only.
        return std::vector<Tensor>{bench::random({8192, 2048}, kBFloat16),
                                   bench::random({2048}, kBFloat16), scalar_tensor(1e-6, kDouble)};
      });
  run_case(
      "rows row sum(x*s[D]) 8192x2048 bf16",
      [](const std::vector<Tensor>& a) {
        return std::vector<Tensor>{sum(a[0] * a[1], {-1}, true)};
      },
      [] {
        return std::vector<Tensor>{bench::random({8192, 2048}, kBFloat16),
                                   bench::random({2048}, kBFloat16)};
      });
});

}  // namespace
}  // namespace kiln::lab
