// fused_cuda's code generator (compiler/fused_cuda_codegen.h): row kernels, for regions with
// reductions (sum, mean, amax, amin) over the trailing dims of one shape S, such as softmax,
// RMSNorm or logsumexp written with ops.
//
// The domain is S seen as rows x cols (the reduced dims are the trailing ones). A group of
// row_threads threads takes a row: the members of S's shape are computed element by element
// while the row is read, each reduction accumulates in its eager accumulator (float for
// f32/bf16/f16, double for f64), then the group combines its threads' partial results (warp
// shuffles, then shared memory across the group's warps). Members of the reduced shape ([rows,
// 1, ...]: rsqrt(mean + eps)) are computed once per row. A member that reads a reduction's result
// is computed in a later pass over the row: from registers where the row's share of every thread
// fits (the row is read once, before the first pass, and a member one pass computes and a later
// one reads, softmax's exp(x - max), is kept there too), from shared memory where a long row
// fits there (the first pass reading it stores it: FusedKernel::row_shared_bytes; such a member
// is kept there too, in the place of an input no later pass reads), else read again.
//
// Each member computes as in the pointwise kernels (the same expressions, fused_cuda_expr.cpp);
// only the reductions' summation order differs from eager's kernels (kernels/cuda/reduce.cu), so
// their results may differ by rounding (the tests' tolerances say how much), and amax/amin are
// exact.
#include <algorithm>
#include <optional>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {
namespace {

// The register cache: the registers a thread's share of the row may take, its inputs and kept
// members together (half as many in blocks of 1024 threads, which get at most 64 each).
constexpr int kCacheRegisters = 64;
// Elements of a row a thread loads before using any, on rows too long for registers (at most 4
// accesses; more spill registers at 1024 threads).
constexpr int kChunkElements = 8;

}  // namespace

bool Generator::row_input_full(size_t j) const {
  return !k_.inputs[j].host_scalar && k_.inputs[j].sizes == k_.sizes;
}

bool Generator::row_varies(const FusedKernel::Operand& o) const {
  const auto rank = static_cast<int>(k_.sizes.size());
  if (o.sizes.empty() || o.leading) return false;
  const size_t lead = static_cast<size_t>(rank) - o.sizes.size();
  for (size_t d = std::max<size_t>(lead, static_cast<size_t>(row_dims_));
       d < static_cast<size_t>(rank); ++d) {
    if (o.sizes[d - lead] != 1) return true;
  }
  return false;
}

bool Generator::reads_kept(const PassPlan& pp, int i, int pass) const {
  return pp.kept_in[sz(i)] >= 0 && row_members_[sz(i)].level < pass && pp.kept_until[sz(i)] >= pass;
}

bool Generator::keeps_shared(const PassPlan& pp, int i, int pass) const {
  return pp.kept_in[sz(i)] >= 0 && pp.computes[sz(pass)][sz(i)] && pp.kept_until[sz(i)] > pass;
}

// The code of one row entry: `width` elements per access (1: kiln_rows_dense).
//
// A pass over the row computes, per element, the members its reductions (or, in the last pass,
// the outputs) read. Where the row fits in registers, the entry first loads each input of the
// domain's shape whole (every access issued before any is used: one read of the row), then each
// pass computes from registers; a member computed in one pass and read in a later one (softmax's
// exp(x - max), read by the sum and by the division) is kept there too rather than computed
// again, except casts, which are recomputed from what they read. Longer rows are read again by
// each pass, kChunk accesses per thread loaded before they are used.
std::string Generator::row_entry(int width) {
  const Shape& S = k_.sizes;
  const auto rank = static_cast<int>(S.size());
  const int k = row_dims_;
  const int T = k_.row_threads, G = k_.rows_per_block, W = width;
  const int64_t C = k_.cols;
  const int n_members = static_cast<int>(members_.size());
  std::ostringstream os;
  const std::string entry = W > 1 ? "kiln_rows_vector" : "kiln_rows_dense";
  os << operand_decls() << "  const long long R = " << k_.rows << "LL, C = " << C << "LL;\n"
     << "  const int g = threadIdx.x / " << T << ", lane = threadIdx.x % " << T << ";\n";
  // Reductions: accumulator types and shared memory across a group's warps.
  auto acc_type = [&](const BoundOp& op) {
    return spec(op.outputs[0]).dtype == kDouble ? std::string("double") : std::string("float");
  };
  auto combine = [&](const BoundOp& op, const std::string& a, const std::string& b) {
    if (op.name() == "amax" || op.name() == "amin") {
      return "kpick<" + std::string(op.name() == "amax" ? "true" : "false") + ">(" + a + ", " + b +
             ")";
    }
    return "(" + a + " + " + b + ")";
  };
  for (int i = 0; i < n_members; ++i) {
    if (row_members_[sz(i)].reduction && T > 32) {
      os << "  __shared__ " << acc_type(*members_[sz(i)]) << " ks" << i << "[" << T * G / 32
         << "];\n";
    }
  }
  const bool shared = k_.row_shared_bytes > 0;  // the shared-memory row cache (plan_rows)
  if (shared) os << "  extern __shared__ __align__(16) unsigned char ksm[];\n";
  auto row_offset = [&](const FusedKernel::Operand& o) {
    std::string s;
    if (o.sizes.empty()) return std::string("0");
    for (int d = 0; d < k; ++d) {
      if (S[static_cast<size_t>(d)] == 1) continue;
      s += (s.empty() ? "" : " + ") + absl::StrCat("rc", d, " * p.v[", o.slot + 1 + d, "]");
    }
    return s.empty() ? std::string("0") : s;
  };
  auto col_offset = [&](const FusedKernel::Operand& o) {
    std::string s;
    for (int d = k; d < rank; ++d) {
      if (S[static_cast<size_t>(d)] == 1) continue;
      s += (s.empty() ? "" : " + ") + absl::StrCat("cc", d, " * p.v[", o.slot + 1 + d, "]");
    }
    return s.empty() ? std::string("0") : s;
  };
  const RowPasses rp = row_passes();
  const int64_t iters = ceil_div(ceil_div(C, W), T);             // a thread's accesses of a row
  const int64_t full_iters = C / (static_cast<int64_t>(T) * W);  // in the row for every lane
  // Accesses per chunk. With the shared-memory cache (blocks of 512 threads, 64 registers a
  // thread), twice the elements, shared by the inputs of the domain's shape (an 8-byte one
  // counting 8: its math takes more registers).
  int weight = 0;
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (row_input_full(j)) weight += element_size(k_.inputs[j].dtype) == 8 ? 8 : 1;
  }
  const int kChunk = shared ? std::clamp(2 * kChunkElements / (W * std::max(weight, 1)), 1, 4)
                            : std::clamp(kChunkElements / W, 1, 4);
  // Column indices in 32 bits where a row allows it (fewer registers than 64-bit ones).
  const std::string col_t = C + int64_t{kChunk} * T * W < (int64_t{1} << 31) ? "int" : "long long";
  const int budget = T * G >= 1024 ? kCacheRegisters / 2 : kCacheRegisters;
  const std::vector<bool> keep_none(sz(n_members), false);
  std::vector<bool> keep_all(sz(n_members), true);
  PassPlan pp = plan_passes(rp, keep_all);
  bool cache = !shared && rp.n_passes > 1 && row_cache_registers(pp, W, iters) <= budget;
  if (!cache && !shared) {
    pp = plan_passes(rp, keep_none);
    cache = rp.n_passes > 1 && row_cache_registers(pp, W, iters) <= budget;
  }
  // With the shared-memory cache, an input of the domain's shape that several passes read
  // (plan_rows) is stored there by the first (each thread stores the accesses it loaded, and later
  // passes, over the same columns, read back their own: no barrier needed), at its 16-byte
  // aligned place; the others are read from global memory by the one pass reading them.
  //
  // A member of the domain's shape that a later pass reads (softmax's exp(x - max), read by the
  // sum's pass and the output's) is kept there too, in the place of a stored input of its element
  // size that no pass reads after the one computing the member (each thread overwrites the
  // accesses it has read); a member finding no such place is computed again by each pass.
  std::vector<int> first_pass(k_.inputs.size(), -1);
  std::vector<bool> stored(k_.inputs.size(), false);
  std::vector<int64_t> shared_at(k_.inputs.size(), 0);
  if (shared) {
    std::vector<int> by_level(sz(n_members));
    for (int i = 0; i < n_members; ++i) by_level[sz(i)] = i;
    std::stable_sort(by_level.begin(), by_level.end(), [&](int a, int b) {
      return row_members_[sz(a)].level < row_members_[sz(b)].level;
    });
    for (bool placed = false; !placed;) {
      pp = plan_passes(rp, keep_all);
      placed = true;
      std::vector<int> busy_until(k_.inputs.size());  // the last pass reading a place
      for (size_t j = 0; j < k_.inputs.size(); ++j)
        busy_until[j] = row_stored_[j] ? pp.read_until[j] : rp.n_passes;
      for (int i : by_level) {
        if (pp.kept_until[sz(i)] < 0) continue;
        const int p = row_members_[sz(i)].level;
        const size_t bytes = element_size(spec(members_[sz(i)]->outputs[0]).dtype);
        for (size_t j = 0; j < k_.inputs.size() && pp.kept_in[sz(i)] < 0; ++j) {
          if (busy_until[j] > p || element_size(k_.inputs[j].dtype) != bytes) continue;
          pp.kept_in[sz(i)] = static_cast<int>(j);
          busy_until[j] = pp.kept_until[sz(i)];
        }
        if (pp.kept_in[sz(i)] < 0) {
          keep_all[sz(i)] = false;  // and plan again
          placed = false;
          break;
        }
      }
    }
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (!row_stored_[j]) continue;
      for (int pass = rp.n_passes; pass-- > 0;) {
        if (pp.reads[sz(pass)][j]) first_pass[j] = pass;
      }
      // Stored where a later pass reads it back (plan_rows counts the passes without the kept
      // members, which may leave only one).
      stored[j] = first_pass[j] >= 0 && pp.read_until[j] > first_pass[j];
    }
    // The places, 16-byte aligned, of the inputs stored or keeping a member. Fewer than
    // plan_row_cache counted where kept members leave an input to one pass (logsumexp(x * y)
    // keeps x * y, not x and y): the block then takes less, and more blocks may fit.
    std::vector<bool> has_place(k_.inputs.size(), false);
    for (int i = 0; i < n_members; ++i) {
      if (pp.kept_in[sz(i)] >= 0) has_place[sz(pp.kept_in[sz(i)])] = true;
    }
    int64_t at = 0;
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (!stored[j] && !has_place[j]) continue;
      shared_at[j] = at;
      at += ceil_div(C * static_cast<int64_t>(element_size(k_.inputs[j].dtype)), 16) * 16;
    }
    if (at > 0 && at < k_.row_shared_bytes) {
      k_.row_shared_bytes = at;
      row_blocks_ = row_cache_blocks(at, rp.full_outputs);
    }
  }
  // Each input of the domain's shape moves `W` elements per access; `arr[idx]` is one access.
  auto access_type = [&](ScalarType t) {
    return W > 1 ? absl::StrCat("kpack<", ctype(t), ", ", W, ">") : ctype(t);
  };
  auto element = [&](const std::string& arr, const std::string& idx) {
    return W > 1 ? absl::StrCat(arr, "[", idx, "].v[e]") : absl::StrCat(arr, "[", idx, "]");
  };
  auto load = [&](size_t j, const std::string& c0) {
    const std::string t = access_type(k_.inputs[j].dtype);
    return W > 1 ? absl::StrCat("*(const ", t, "*)(rin", j, " + ", c0, ")")
                 : absl::StrCat("rin", j, "[", c0, "]");
  };
  auto statement = [&](int i) {
    return absl::StrCat(member_decl(sz(i)), "  // ", lines_[sz(i)], "\n");
  };
  auto row_members_of_level = [&](int l, const std::string& indent) {
    std::string s;
    for (int i = 0; i < n_members; ++i) {
      const RowMember& m = row_members_[sz(i)];
      if (!m.reduction && !m.full && m.level == l) s += indent + statement(i);
    }
    return s;
  };
  const std::string I4 = "    ", I6 = "      ", I8 = "        ";
  os << "  for (long long base = (long long)blockIdx.x * " << G
     << "; base < R; base += (long long)gridDim.x * " << G << ") {\n"
     << "    const long long r = base + g;\n"
     << "    const bool active = r < R;\n"
     << "    long long q = active ? r : 0;  // a valid row for the per-row reads\n";
  for (int d = k; d-- > 0;) {
    if (S[static_cast<size_t>(d)] == 1) continue;
    os << "    const long long rc" << d << " = q % " << S[static_cast<size_t>(d)] << "LL;\n";
    if (d > 0) os << "    q /= " << S[static_cast<size_t>(d)] << "LL;\n";
  }
  os << "    (void)q;\n";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (o.host_scalar || row_input_full(j)) continue;
    if (row_varies(o)) {
      os << "    const long long ri" << j << " = " << row_offset(o) << ";\n";
    } else {
      os << "    const " << ctype(o.dtype) << " x" << j << " = in" << j << "[" << row_offset(o)
         << "];\n";
    }
  }
  os << row_members_of_level(0, I4);
  // The row's start in each operand of the domain's shape.
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (row_input_full(j)) {
      os << "    const " << ctype(k_.inputs[j].dtype) << "* __restrict__ rin" << j << " = in" << j
         << " + r * C;\n";
    }
    if (stored[j]) {
      os << "    " << ctype(k_.inputs[j].dtype) << "* sin" << j << " = ("
         << ctype(k_.inputs[j].dtype) << "*)(ksm + " << shared_at[j]
         << ");  // the row, in shared memory\n";
    }
  }
  for (int i = 0; i < n_members; ++i) {
    if (pp.kept_in[sz(i)] < 0) continue;
    const std::string t = ctype(spec(members_[sz(i)]->outputs[0]).dtype);
    os << "    " << t << "* skm" << i << " = (" << t << "*)(ksm + "
       << shared_at[sz(pp.kept_in[sz(i)])] << ");  // y" << i << ", kept in x" << pp.kept_in[sz(i)]
       << "'s place\n";
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    if (rp.out_full[j]) {
      os << "    " << ctype(k_.outputs[j].dtype) << "* __restrict__ rout" << j << " = out" << j
         << " + r * C;\n";
    }
  }
  if (cache) {
    // The row's one read: every access issued before any is used.
    os << "    // The row, read once into registers\n";
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (pp.read_until[j] >= 0)
        os << "    " << access_type(k_.inputs[j].dtype) << " xc" << j << "[" << iters << "];\n";
    }
    for (int i = 0; i < n_members; ++i) {
      if (pp.kept_until[sz(i)] < 0) continue;
      const ScalarType t = spec(members_[sz(i)]->outputs[0]).dtype;
      if (two_to_register(t, W)) {
        os << "    u32 yc" << i << "[" << iters * W / 2 << "];\n";
      } else {
        os << "    " << ctype(t) << " yc" << i << "[" << iters * W << "];\n";
      }
    }
    os << "    if (active) {\n#pragma unroll\n"
       << "    for (int it = 0; it < " << iters << "; ++it) {\n"
       << "      const " << col_t << " c0 = (it * " << T << " + lane) * " << W << ";\n";
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (pp.read_until[j] < 0) continue;
      os << "      if (it < " << full_iters << " || c0 < C) xc" << j << "[it] = " << load(j, "c0")
         << ";\n";
    }
    os << "    }\n    }\n";
    // A row of 1024 threads holds a multiprocessor's registers, one block to it, so nothing reads
    // memory there while the block reduces its row. Where the kernel writes only per-row results,
    // each block then prefetches into L2 the row that its multiprocessor likely runs next (blocks
    // start in order: the row %nsmid later; %nsmid may exceed the multiprocessors, which only
    // prefetches a little further ahead), one prefetch a 128-byte line. f32 logsumexp over 8192 x
    // 32000 on an H200 ran 9% faster so; softmax, which writes its rows, 17% slower (RESULTS.md,
    // session 39).
    if (T * G == 1024 && !rp.full_outputs) {
      os << "    if (active) {\n"
         << "      u32 nsm;\n"
         << "      asm(\"mov.u32 %0, %%nsmid;\" : \"=r\"(nsm));\n"
         << "      if (r + nsm < R) {\n#pragma unroll\n"
         << "      for (int it = 0; it < " << iters << "; ++it) {\n"
         << "        const " << col_t << " c0 = (it * " << T << " + lane) * " << W << ";\n";
      for (size_t j = 0; j < k_.inputs.size(); ++j) {
        if (pp.read_until[j] < 0 || !row_input_full(j)) continue;
        const int64_t lanes = std::max<int64_t>(1, 128 / (W * element_size(k_.inputs[j].dtype)));
        os << "        if ((lane & " << lanes - 1
           << ") == 0 && c0 < C) asm volatile(\"prefetch.global.L2 "
           << "[%0];\" :: \"l\"(rin" << j << " + (long long)nsm * C + c0));\n";
      }
      os << "      }\n      }\n    }\n";
    }
  }
  for (int pass = 0; pass < rp.n_passes; ++pass) {
    const std::vector<bool>& need = pp.computes[sz(pass)];
    std::vector<int> reductions;
    for (int i = 0; i < n_members; ++i) {  // none in the pass writing the outputs
      if (row_members_[sz(i)].reduction && row_members_[sz(i)].level == pass + 1)
        reductions.push_back(i);
    }
    os << "    // Pass " << pass << (rp.writes(pass) ? ": the outputs" : ": reductions") << "\n";
    const std::string arr = cache ? "xc" : "xv", idx = cache ? "it" : "u";  // this pass's inputs
    // bf16 members of this pass computed a pair of elements at a time, and reductions folded so
    // (bf16_pairs), before the elements.
    const Pairs pairs = bf16_pairs(rp, pp, W, pass, reductions, arr, idx);
    for (int i : reductions) {
      const BoundOp& op = *members_[sz(i)];
      const std::string a = acc_type(op);
      std::string init = a + "(0)";
      if (op.name() == "amax") init = "-kinf<" + a + ">()";
      if (op.name() == "amin") init = "kinf<" + a + ">()";
      os << "    " << a << " a" << i << " = " << init << ";\n";
      if (!pairs.fold[sz(i)].empty()) {  // infinities of that sign, as bf16
        os << "    u32 ap" << i << " = " << (op.name() == "amax" ? "0xff80ff80u" : "0x7f807f80u")
           << ";\n";
      }
    }
    if (cache) {
      os << "    if (active) {\n#pragma unroll\n"
         << "    for (int it = 0; it < " << iters << "; ++it) {\n"
         << "      const " << col_t << " c0 = (it * " << T << " + lane) * " << W << ";\n"
         << "      if (it >= " << full_iters << " && c0 >= C) break;\n";
    } else {
      os << "    if (active) {\n"
         << "    for (" << col_t << " cb = lane * " << W << "; cb < C; cb += " << kChunk * T * W
         << ") {\n";
      for (size_t j = 0; j < k_.inputs.size(); ++j) {
        if (!pp.reads[sz(pass)][j]) continue;
        os << I6 << access_type(k_.inputs[j].dtype) << " xv" << j << "[" << kChunk << "];\n";
      }
      for (int i = 0; i < n_members; ++i) {
        if (!reads_kept(pp, i, pass)) continue;
        os << I6 << access_type(spec(members_[sz(i)]->outputs[0]).dtype) << " kv" << i << "["
           << kChunk << "];\n";
      }
      os << "#pragma unroll\n"
         << I6 << "for (int u = 0; u < " << kChunk << "; ++u) {\n"
         << I8 << "const " << col_t << " c0 = cb + u * " << T * W << ";\n";
      for (size_t j = 0; j < k_.inputs.size(); ++j) {
        if (!pp.reads[sz(pass)][j]) continue;
        if (stored[j] && pass > first_pass[j]) {
          os << I8 << "if (c0 < C) xv" << j << "[u] = *(const " << access_type(k_.inputs[j].dtype)
             << "*)(sin" << j << " + c0);\n";
        } else {
          os << I8 << "if (c0 < C) xv" << j << "[u] = " << load(j, "c0") << ";\n";
        }
      }
      for (int i = 0; i < n_members; ++i) {
        if (!reads_kept(pp, i, pass)) continue;
        os << I8 << "if (c0 < C) kv" << i << "[u] = *(const "
           << access_type(spec(members_[sz(i)]->outputs[0]).dtype) << "*)(skm" << i << " + c0);\n";
      }
      os << I6 << "}\n"
         << "#pragma unroll\n"
         << I6 << "for (int u = 0; u < " << kChunk << "; ++u) {\n"
         << I6 << "const " << col_t << " c0 = cb + u * " << T * W << ";\n"
         << I6 << "if (c0 >= C) break;\n";
      for (size_t j = 0; j < k_.inputs.size(); ++j) {
        if (stored[j] && pass == first_pass[j]) {
          os << I6 << "*(" << access_type(k_.inputs[j].dtype) << "*)(sin" << j << " + c0) = xv" << j
             << "[u];\n";
        }
      }
    }
    if (rp.writes(pass)) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        if (!rp.out_full[j] || W == 1) continue;
        os << I6 << "kpack<" << ctype(k_.outputs[j].dtype) << ", " << W << "> vy" << j << ";\n";
      }
    }
    for (int i = 0; i < n_members; ++i) {
      if (W > 1 && keeps_shared(pp, i, pass))
        os << I6 << access_type(spec(members_[sz(i)]->outputs[0]).dtype) << " kw" << i << ";\n";
    }
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      const FusedKernel::Operand& o = k_.inputs[j];
      if (W == 1 || !o.row_packed) continue;
      const std::string t = access_type(o.dtype);
      os << I6 << "const " << t << " vr" << j << " = *(const " << t << "*)(in" << j << " + ri" << j
         << " + c0);\n";
    }
    for (int i = 0; i < n_members; ++i) {
      if (pairs.member[sz(i)].empty()) continue;
      os << I6 << "u32 yp" << i << "[" << W / 2 << "];  // " << lines_[sz(i)] << ", in pairs\n"
         << "#pragma unroll\n"
         << I6 << "for (int h = 0; h < " << W / 2 << "; ++h) yp" << i
         << "[h] = " << pairs.member[sz(i)] << ";\n";
    }
    for (int i : reductions) {
      if (pairs.fold[sz(i)].empty()) continue;
      const bool max = members_[sz(i)]->name() == "amax";
      os << "#pragma unroll\n"
         << I6 << "for (int h = 0; h < " << W / 2 << "; ++h) ap" << i << " = kpick_bf16x2<"
         << (max ? "true" : "false") << ">(ap" << i << ", " << pairs.fold[sz(i)] << ");\n";
    }
    os << "#pragma unroll\n"
       << I6 << "for (int e = 0; e < " << W << "; ++e) {\n"
       << I8 << "const " << col_t << " c = c0 + e;\n"
       << I8 << "(void)c;\n";
    if (rank - k > 1) {
      os << I8 << "long long cq = c;\n";
      for (int d = rank; d-- > k;) {
        if (S[static_cast<size_t>(d)] == 1) continue;
        os << I8 << "const long long cc" << d << " = cq % " << S[static_cast<size_t>(d)] << "LL;\n";
        if (d > k) os << I8 << "cq /= " << S[static_cast<size_t>(d)] << "LL;\n";
      }
    } else if (S[static_cast<size_t>(k)] != 1) {
      os << I8 << "const long long cc" << k << " = c;\n";
    }
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      const FusedKernel::Operand& o = k_.inputs[j];
      if (o.host_scalar) continue;
      const std::string t = ctype(o.dtype);
      if (row_input_full(j)) {
        if (pp.reads[sz(pass)][j])
          os << I8 << "const " << t << " x" << j << " = " << element(arr + std::to_string(j), idx)
             << ";\n";
      } else if (W > 1 && o.row_packed) {
        os << I8 << "const " << t << " x" << j << " = vr" << j << ".v[e];\n";
      } else if (row_varies(o)) {
        os << I8 << "const " << t << " x" << j << " = in" << j << "[ri" << j << " + "
           << col_offset(o) << "];\n";
      }
    }
    for (int i = 0; i < n_members; ++i) {
      if (reads_kept(pp, i, pass)) {
        os << I8 << "const " << ctype(spec(members_[sz(i)]->outputs[0]).dtype) << " y" << i << " = "
           << element("kv" + std::to_string(i), "u") << ";\n";
      } else if (pp.kept_until[sz(i)] >= pass && row_members_[sz(i)].level < pass) {
        const ScalarType t = spec(members_[sz(i)]->outputs[0]).dtype;
        if (two_to_register(t, W)) {
          os << I8 << ctype(t) << " y" << i << ";\n"
             << I8 << "y" << i << ".x = (unsigned short)(yc" << i << "[(it * " << W
             << " + e) >> 1] >> ((e & 1) * 16));\n";
        } else {
          os << I8 << "const " << ctype(t) << " y" << i << " = yc" << i << "[it * " << W
             << " + e];\n";
        }
      }
    }
    for (int i = 0; i < n_members; ++i) {
      if (!need[sz(i)]) continue;
      if (pairs.member[sz(i)].empty()) {
        os << I8 << statement(i);
      } else {
        os << I8 << "const bf16 y" << i << " = kbf_half(yp" << i << "[e >> 1], e & 1);\n";
      }
      if (pp.kept_until[sz(i)] <= pass) continue;
      if (shared) {
        os << I8 << (W > 1 ? absl::StrCat("kw", i, ".v[e]") : absl::StrCat("skm", i, "[c]"))
           << " = y" << i << ";\n";
        continue;
      }
      if (two_to_register(spec(members_[sz(i)]->outputs[0]).dtype, W)) {
        const std::string at = absl::StrCat("yc", i, "[(it * ", W, " + e) >> 1]");
        os << I8 << "if (e & 1) " << at << " |= (u32)y" << i << ".x << 16; else " << at << " = y"
           << i << ".x;\n";
      } else {
        os << I8 << "yc" << i << "[it * " << W << " + e] = y" << i << ";\n";
      }
    }
    for (int i : reductions) {
      if (!pairs.fold[sz(i)].empty()) continue;
      const BoundOp& op = *members_[sz(i)];
      const int in = op.inputs[0];
      const ScalarType out = spec(op.outputs[0]).dtype;
      const std::string v =
          "(" + acc_type(op) + ")" + to_m(convert(var(in), spec(in).dtype, out), out);
      os << I8 << "a" << i << " = " << combine(op, "a" + std::to_string(i), v) << ";\n";
    }
    if (rp.writes(pass)) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        const FusedKernel::Operand& o = k_.outputs[j];
        if (!rp.out_full[j]) continue;
        if (W > 1) {
          os << I8 << "vy" << j << ".v[e] = " << var(o.value) << ";\n";
        } else {
          os << I8 << "rout" << j << "[c] = " << var(o.value) << ";\n";
        }
      }
    }
    os << I6 << "}\n";
    for (int i = 0; i < n_members; ++i) {
      if (W > 1 && keeps_shared(pp, i, pass)) {
        os << I6 << "*(" << access_type(spec(members_[sz(i)]->outputs[0]).dtype) << "*)(skm" << i
           << " + c0) = kw" << i << ";\n";
      }
    }
    if (rp.writes(pass) && W > 1) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        const FusedKernel::Operand& o = k_.outputs[j];
        if (!rp.out_full[j]) continue;
        os << I6 << "*(kpack<" << ctype(o.dtype) << ", " << W << ">*)(rout" << j << " + c0) = vy"
           << j << ";\n";
      }
    }
    os << (cache ? "    }\n    }\n" : "    }\n    }\n    }\n");
    if (reductions.empty()) continue;
    for (int i : reductions) {  // a fold's two halves into the thread's result
      if (pairs.fold[sz(i)].empty()) continue;
      const std::string pick = members_[sz(i)]->name() == "amax" ? "kpick<true>" : "kpick<false>";
      os << "    a" << i << " = " << pick << "(a" << i << ", " << pick << "(__uint_as_float(ap" << i
         << " << 16), __uint_as_float(ap" << i << " & 0xffff0000u)));\n";
    }
    // The group's partial results combined: the warp's, then the group's warps' (in order).
    for (int i : reductions) {
      const BoundOp& op = *members_[sz(i)];
      os << "    for (int o = 16; o > 0; o >>= 1) a" << i << " = "
         << combine(op, absl::StrCat("a", i),
                    absl::StrCat("__shfl_xor_sync(0xffffffffu, a", i, ", o)"))
         << ";\n";
    }
    if (T > 32) {
      os << "    __syncthreads();\n";
      for (int i : reductions) {
        os << "    if ((threadIdx.x & 31) == 0) ks" << i << "[threadIdx.x >> 5] = a" << i << ";\n";
      }
      os << "    __syncthreads();\n";
      for (int i : reductions) {
        const BoundOp& op = *members_[sz(i)];
        os << "    a" << i << " = ks" << i << "[g * " << T / 32 << "];\n"
           << "    for (int w = 1; w < " << T / 32 << "; ++w) a" << i << " = "
           << combine(op, absl::StrCat("a", i), absl::StrCat("ks", i, "[g * ", T / 32, " + w]"))
           << ";\n";
      }
    }
    // Each reduction's result as eager's finish writes it, then the per-row members it allows.
    for (int i : reductions) {
      const BoundOp& op = *members_[sz(i)];
      const ScalarType out = spec(op.outputs[0]).dtype;
      std::string e = "a" + std::to_string(i);
      if (op.name() == "mean") e = "(" + e + " * " + mean_scale_.at(i) + ")";
      exprs_[sz(i)] = from_m(e, out);
      os << I4 << statement(i);
    }
    os << row_members_of_level(pass + 1, I4);
  }
  // Per-row outputs: written by the group's first thread.
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.outputs[j];
    if (rp.out_full[j]) continue;
    os << "    if (active && lane == 0) out" << j << "[" << row_offset(o) << "] = " << var(o.value)
       << ";\n";
  }
  os << "  }\n}\n";
  // The head, once the cache's places are known. With the shared-memory cache, the blocks a
  // multiprocessor holds (two or three rows in its shared memory): 64 or 42 registers a thread at
  // most.
  return absl::StrCat("\nextern \"C\" __global__ void ",
                      launch_bounds(T * G, k_.row_shared_bytes > 0 ? row_blocks_ : 0), " ", entry,
                      "(const Params p) {\n", os.str());
}

// The members of a pass computed two elements at a time, in a 32-bit register of two bf16
// values (yp<i>[h], pair h of the pack), where each operand of the domain's shape is such a pair
// (an input this pass reads or a member kept in shared memory, as two elements of the pack, or
// a member in pairs) and the others have one value for the row:
//   - a bf16 add or sub (alpha 1 or -1) of two bf16 operands: one bf16x2 fma (b * alpha + a,
//     rounded once) for the two. That is eager's bits: a + alpha * b of two bf16 values is exact
//     in float but where one is below 2^-15 of the other, and then both roundings give the
//     larger, as far from a tie. One instruction for two elements, where eager's formula takes
//     four each (two conversions, the add, a rounding on the XU pipe);
//   - any other member of bf16 result that the pass writes out (softmax's division), or that a
//     reduction of the pass reads (logsumexp's exp(x - max)): its formula on each half, in
//     float, both rounded by one conversion (cvt.rn.bf16x2.f32, kbf2): the same roundings, half
//     the XU pipe's. With exp in three instructions (kexp_bf16) the XU pipe bounds logsumexp's
//     sum pass, and bf16 logsumexp over 8192 x 32000 ran 8% faster in pairs (RESULTS.md,
//     session 39; with expf it had run 1% slower, session 36).
//   - an amax or amin of a bf16 operand that comes in pairs, reduced by this pass: folded two
//     elements an instruction (kpick_bf16x2, max.NaN.bf16x2) into a pair of partial results,
//     the two combined after the pass (kpick: amax and amin have one result in any order,
//     kernels/reduce_fn.h). Where the max was three instructions an element and the unpacking
//     one, logsumexp's first pass took a quarter of its time (session 37).
Generator::Pairs Generator::bf16_pairs(const RowPasses& rp, const PassPlan& pp, int width, int pass,
                                       const std::vector<int>& reductions, const std::string& arr,
                                       const std::string& idx) const {
  const int n_members = static_cast<int>(members_.size());
  const std::vector<bool>& need = pp.computes[sz(pass)];
  const std::vector<bool>& reads = pp.reads[sz(pass)];
  Pairs out{std::vector<std::string>(sz(n_members)), std::vector<std::string>(sz(n_members))};
  std::vector<std::string>& pair = out.member;
  if (width < 2 || width % 2 != 0) return out;
  // Value v's pair h (a u32; empty where v is not bf16) and its two halves (bf16 values); one
  // value for the row (or the kernel) is the same in both (`per_row`).
  struct Halves {
    std::string pair, half[2];
    bool per_row = false;
    // Read back from the shared-memory cache: not a bf16x2 fma's operand (log_softmax's
    // z - log(sum) so ran 7% slower on an H100, its registers spilled; RESULTS.md, session 36).
    bool kept = false;
  };
  auto halves = [&](int v) -> std::optional<Halves> {
    const bool bf16 = spec(v).dtype == kBFloat16;
    Halves r;
    auto from_pack = [&](const std::string& a) -> std::optional<Halves> {
      if (!bf16) return std::nullopt;
      r.half[0] = a + ".v[2 * h]";
      r.half[1] = a + ".v[2 * h + 1]";
      r.pair = "kbf_pair(" + r.half[0] + ", " + r.half[1] + ")";
      return r;
    };
    if (auto it = rp.member_of.find(v); it != rp.member_of.end()) {
      const int k = it->second;
      if (!pair[sz(k)].empty()) {
        r.pair = absl::StrCat("yp", k, "[h]");
        r.half[0] = "kbf_half(" + r.pair + ", 0)";
        r.half[1] = "kbf_half(" + r.pair + ", 1)";
        return r;
      }
      if (reads_kept(pp, k, pass)) {
        r.kept = true;
        return from_pack(absl::StrCat("kv", k, "[u]"));
      }
      if (row_members_[sz(k)].full) return std::nullopt;
    } else if (auto jt = rp.input_of.find(v); jt != rp.input_of.end()) {
      const size_t j = jt->second;
      const FusedKernel::Operand& o = k_.inputs[j];
      if (row_input_full(j)) {
        return reads[j] ? from_pack(absl::StrCat(arr, j, "[", idx, "]")) : std::nullopt;
      }
      if (o.row_packed) return from_pack(absl::StrCat("vr", j));
      if (row_varies(o)) return std::nullopt;
    } else {
      return std::nullopt;
    }
    if (!per_row_.contains(v)) return std::nullopt;
    r.per_row = true;
    r.half[0] = r.half[1] = var(v);
    if (bf16 && !spec(v).sizes.empty()) r.pair = "kbf_pair(" + var(v) + ", " + var(v) + ")";
    return r;
  };
  for (int i = 0; i < n_members; ++i) {
    const BoundOp& op = *members_[sz(i)];
    const RowMember& m = row_members_[sz(i)];
    if (!need[sz(i)] || m.reduction || !m.full || spec(op.outputs[0]).dtype != kBFloat16 ||
        fast_.contains(op.outputs[0])) {
      continue;
    }
    std::vector<std::optional<Halves>> in;
    bool paired = true, any = false;
    for (int v : op.inputs) {
      in.push_back(halves(v));
      paired = paired && in.back().has_value();
      any = any || (in.back() && !in.back()->per_row);
    }
    if (!paired || !any) continue;
    if ((op.name() == "add" || op.name() == "sub") && common_dtype(t_, op, 1) == kBFloat16 &&
        !in[0]->pair.empty() && !in[1]->pair.empty() && !in[0]->kept && !in[1]->kept) {
      const double alpha =
          std::get<Scalar>(op.attrs[0]).to<double>() * (op.name() == "sub" ? -1 : 1);
      if (alpha == 1.0 || alpha == -1.0) {
        pair[sz(i)] =
            absl::StrCat("kfma_bf16x2(", in[1]->pair, ", ",
                         alpha > 0 ? "0x3f803f80u" : "0xbf80bf80u", ", ", in[0]->pair, ")");
        continue;
      }
    }
    // Eager's formula on each half, rounded together: for a member the pass writes out, or one
    // that a reduction of this pass reads (unpacked again for it).
    const bool reduced = std::ranges::any_of(reductions, [&](int r) {
      return std::ranges::find(members_[sz(r)]->inputs, op.outputs[0]) !=
             members_[sz(r)]->inputs.end();
    });
    if (!(rp.writes(pass) && rp.output_member[sz(i)]) && !reduced) continue;
    absl::flat_hash_map<std::string, std::string> lo, hi;
    for (size_t j = 0; j < op.inputs.size(); ++j) {
      if (in[j]->per_row) continue;
      lo[var(op.inputs[j])] = in[j]->half[0];
      hi[var(op.inputs[j])] = in[j]->half[1];
    }
    pair[sz(i)] = pair_expr(sz(i), lo, hi);
  }
  for (int i : reductions) {
    const BoundOp& op = *members_[sz(i)];
    if ((op.name() != "amax" && op.name() != "amin") || spec(op.outputs[0]).dtype != kBFloat16)
      continue;
    const std::optional<Halves> in = halves(op.inputs[0]);
    if (in && !in->per_row && !in->pair.empty()) out.fold[sz(i)] = in->pair;
  }
  return out;
}

}  // namespace kiln::compiler::internal