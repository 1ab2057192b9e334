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
// fits (the inputs were kept there by the first pass), else read again.
//
// Each member computes as in the pointwise kernels (the same expressions, fused_cuda_expr.cpp);
// only the reductions' summation order differs from eager's kernels (kernels/cuda/reduce.cu), so
// their results may differ by rounding (the tests' tolerances say how much), and amax/amin are
// exact.
#include <algorithm>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {
namespace {

// The register cache: elements of the row a thread keeps, all inputs together (half as many in
// blocks of 1024 threads, which get at most 64 registers each).
constexpr int kCacheElements = 64;

bool is_reduction(const std::string& n) {
  return n == "sum" || n == "mean" || n == "amax" || n == "amin";
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

bool row_op_generated(const Trace& t, const BoundOp& op) {
  if (!is_reduction(op.name()) || op.inputs.size() != 1 || op.outputs.size() != 1 ||
      op.inputs[0] < 0 || op.outputs[0] < 0) {
    return false;
  }
  const TensorSpec& in = t.value(op.inputs[0]).spec;
  const TensorSpec& out = t.value(op.outputs[0]).spec;
  if (!is_float(in.dtype) || !is_float(out.dtype) || in.sizes.size() < 2) return false;
  if (op.name().starts_with("am") && in.dtype != out.dtype) return false;
  const Shape* dims = attr_if<Shape>(op, 0);
  const bool* keepdim = attr_if<bool>(op, 1);
  if (dims == nullptr || keepdim == nullptr || dims->empty()) return false;
  // The reduced dims are the trailing ones, from some k >= 1.
  const auto rank = static_cast<int64_t>(in.sizes.size());
  std::vector<bool> reduced(static_cast<size_t>(rank), false);
  for (int64_t d : *dims) {
    const int64_t w = ((d % rank) + rank) % rank;
    if (reduced[static_cast<size_t>(w)]) return false;
    reduced[static_cast<size_t>(w)] = true;
  }
  const int64_t k = rank - static_cast<int64_t>(dims->size());
  if (k < 1) return false;
  for (int64_t d = 0; d < rank; ++d) {
    if (reduced[static_cast<size_t>(d)] != (d >= k)) return false;
  }
  return true;
}

bool Generator::plan_rows(std::string* why) {
  auto fail = [&](std::string m) {
    if (why != nullptr) *why = std::move(m);
    return false;
  };
  // The domain: the shape every reduction reads, reduced over the same trailing dims.
  int64_t k = -1;
  for (size_t i = begin_; i < end_; ++i) {
    const BoundOp& op = t_.ops[i];
    if (!is_reduction(op.name())) continue;
    if (!row_op_generated(t_, op)) return fail("the generator does not write this " + op.name());
    const Shape& s = spec(op.inputs[0]).sizes;
    const auto kk = static_cast<int64_t>(s.size() - attr_if<Shape>(op, 0)->size());
    if (k >= 0 && (s != k_.sizes || kk != k)) {
      return fail("reductions of different shapes or dims in one region");
    }
    k_.sizes = s;
    k = kk;
  }
  const Shape& S = k_.sizes;
  const size_t rank = S.size();
  if (rank > static_cast<size_t>(kMaxRank)) return fail("more than 8 dimensions");
  row_dims_ = static_cast<int>(k);
  k_.row_kernel = true;
  k_.rows = 1;
  k_.cols = 1;
  for (size_t d = 0; d < rank; ++d) (static_cast<int64_t>(d) < k ? k_.rows : k_.cols) *= S[d];
  if (k_.rows == 0 || k_.cols == 0) return fail("no elements");
  // Rows of one element (every reduced dim of size 1): a row's value and its elements have the
  // same shape, so which members are per row and which per element is ambiguous; eager's
  // kernels run them (4 of GpuRandomProgram's programs differed from eager here).
  if (k_.cols == 1) return fail("rows of one element");
  Shape keep(S.begin(), S.end()), drop(S.begin(), S.begin() + k);
  for (size_t d = static_cast<size_t>(k); d < rank; ++d) keep[d] = 1;
  // A value of shape `s` to the kernel: the domain's shape (one per element), constant along
  // the columns (one per row), or neither.
  auto is_full = [&](const Shape& s) { return s == S; };
  auto per_row = [&](const Shape& s) {
    if (s.size() > rank) return false;
    const size_t lead = rank - s.size();
    for (size_t d = 0; d < s.size(); ++d) {
      const size_t dd = d + lead;
      if (static_cast<int64_t>(dd) >= k ? s[d] != 1 : (s[d] != 1 && s[d] != S[dd])) return false;
    }
    return true;
  };

  absl::flat_hash_set<int> produced;
  absl::flat_hash_map<int, int> level;  // of each value: the passes before it is known
  absl::flat_hash_map<int, bool> full;  // whether a value varies along the columns
  for (size_t i = begin_; i < end_; ++i) {
    const BoundOp& op = t_.ops[i];
    const bool reduction = is_reduction(op.name());
    if (!reduction && !fused_cuda_generates(t_, op)) {
      return fail("the generator does not write " + op.name());
    }
    for (int v : op.inputs) {
      if (produced.contains(v) || name_.contains(v)) continue;
      const TensorSpec& s = spec(v);
      FusedKernel::Operand o;
      o.value = v;
      o.dtype = s.dtype;
      o.host_scalar = s.device.is_cpu();
      if (o.host_scalar && !s.sizes.empty()) return fail("a CPU input with dimensions");
      // A 0-d tensor on the GPU (a full reduction's result, a 0-d argument): declined, as the
      // programs of GpuRandomProgram that read one in a row region differed from eager.
      if (!o.host_scalar && s.sizes.empty()) return fail("a 0-d GPU input in a row region");
      o.sizes = s.sizes;
      try {
        if (broadcast_shapes(S, s.sizes, "fused_cuda") != S) {
          return fail("an input that does not broadcast to the domain");
        }
      } catch (const std::exception&) {
        return fail("an input that does not broadcast to the domain");
      }
      level[v] = 0;
      full[v] = !o.host_scalar && (s.sizes == S || !per_row(s.sizes));
      name_[v] = "x" + std::to_string(k_.inputs.size());
      k_.inputs.push_back(std::move(o));
    }
    const int v = op.outputs[0];
    const Shape& s = spec(v).sizes;
    RowMember m;
    m.reduction = reduction;
    if (reduction) {
      if (!full[op.inputs[0]] || spec(op.inputs[0]).sizes != S) {
        return fail("a reduction of a value that is not of the domain's shape");
      }
      m.full = false;
      m.level = level[op.inputs[0]] + 1;
    } else {
      for (int in : op.inputs) {
        // A reduction's result without keepdim would broadcast along the trailing dims, not
        // per row (the region rule keeps such readers out; checked here all the same).
        if (produced.contains(in) && spec(in).sizes.size() < rank) {
          return fail("a member reads a reduction without keepdim");
        }
        m.full = m.full || full[in];
        m.level = std::max(m.level, level[in]);
      }
      if (m.full ? !is_full(s) : s != keep) {
        // A reduction's result without keepdim is read by no member: its dims would align with
        // the domain's trailing ones.
        if (!m.full && s == drop) return fail("a member reads a reduction without keepdim");
        return fail("a member of shape " + shape_str(s) + " in a row region over " + shape_str(S));
      }
    }
    produced.insert(v);
    level[v] = m.level;
    full[v] = m.full;
    name_[v] = "y" + std::to_string(members_.size());
    members_.push_back(&op);
    row_members_.push_back(m);
  }
  // The region's outputs.
  const absl::flat_hash_set<int> read_outside = values_read_outside(t_, begin_, end_);
  for (const BoundOp* op : members_) {
    const int v = op->outputs[0];
    if (!read_outside.contains(v)) continue;
    FusedKernel::Operand o;
    o.value = v;
    o.dtype = spec(v).dtype;
    o.sizes = spec(v).sizes;
    o.leading = o.sizes == drop && o.sizes != keep;
    k_.outputs.push_back(std::move(o));
  }
  if (k_.outputs.empty()) return fail("the region has no outputs");
  for (FusedKernel::Operand& o : k_.inputs) {
    o.slot = k_.slots;
    k_.slots += o.host_scalar ? 1 : 1 + (o.sizes.empty() ? 0 : static_cast<int>(rank));
  }
  for (FusedKernel::Operand& o : k_.outputs) {
    o.slot = k_.slots;
    k_.slots += 1 + (o.sizes.empty() ? 0 : static_cast<int>(rank));
  }
  // Threads: the vector entry's accesses of a row spread over a group of about a quarter as
  // many threads (32 to 1024), 256 threads or more per block.
  size_t narrowest = 16;
  for (const auto* list : {&k_.inputs, &k_.outputs}) {
    for (const auto& o : *list) {
      if (o.sizes == S) narrowest = std::min(narrowest, element_size(o.dtype));
    }
  }
  const auto width = static_cast<int64_t>(16 / narrowest);
  k_.vector_width = width > 1 && k_.cols % width == 0 ? static_cast<int>(width) : 0;
  const int64_t accesses = ceil_div(k_.cols, std::max<int64_t>(k_.vector_width, 1));
  k_.row_threads =
      static_cast<int>(std::clamp<int64_t>(ceil_div(ceil_div(accesses, 4), 32) * 32, 32, 1024));
  k_.rows_per_block = std::max(1, 256 / k_.row_threads);
  k_.has_dense = true;
  return true;
}

// The code of one row entry: `width` elements per access (1: kiln_rows_dense).
std::string Generator::row_entry(int width) {
  const Shape& S = k_.sizes;
  const auto rank = static_cast<int>(S.size());
  const int k = row_dims_;
  const int T = k_.row_threads, G = k_.rows_per_block, W = width;
  const int64_t C = k_.cols;
  const int n_members = static_cast<int>(members_.size());
  std::ostringstream os;
  const std::string entry = W > 1 ? "kiln_rows_vector" : "kiln_rows_dense";
  os << "\nextern \"C\" __global__ void __launch_bounds__(" << T * G << ") " << entry
     << "(const Params p) {\n"
     << operand_decls() << "  const long long R = " << k_.rows << "LL, C = " << C << "LL;\n"
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
    if (row_members_[static_cast<size_t>(i)].reduction && T > 32) {
      os << "  __shared__ " << acc_type(*members_[static_cast<size_t>(i)]) << " ks" << i << "["
         << T * G / 32 << "];\n";
    }
  }
  // Operand classes.
  auto input_full = [&](size_t j) { return !k_.inputs[j].host_scalar && k_.inputs[j].sizes == S; };
  auto varies = [&](const FusedKernel::Operand& o) {  // along the columns
    if (o.sizes.empty() || o.leading) return false;
    const size_t lead = static_cast<size_t>(rank) - o.sizes.size();
    for (size_t d = std::max<size_t>(lead, static_cast<size_t>(k)); d < static_cast<size_t>(rank);
         ++d) {
      if (o.sizes[d - lead] != 1) return true;
    }
    return false;
  };
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
  // Which inputs each pass reads, and the register cache.
  const int passes =
      1 + std::max_element(row_members_.begin(), row_members_.end(),
                           [](const RowMember& a, const RowMember& b) { return a.level < b.level; })
              ->level;
  // Outputs written per element (else once per row: one-element rows have both of S's shape).
  std::vector<bool> output_member(static_cast<size_t>(n_members), false);
  std::vector<bool> out_full(k_.outputs.size(), false);
  bool full_outputs = false;
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    for (int i = 0; i < n_members; ++i) {
      if (members_[static_cast<size_t>(i)]->outputs[0] == k_.outputs[j].value) {
        output_member[static_cast<size_t>(i)] = true;
        out_full[j] = row_members_[static_cast<size_t>(i)].full;
        full_outputs = full_outputs || out_full[j];
      }
    }
  }
  // The element passes: one per level of the reductions' inputs, then one for the full outputs.
  struct Pass {
    int level;
    bool writes;
  };
  std::vector<Pass> plan;
  for (int l = 0; l + 1 < passes; ++l) plan.push_back({l, false});
  if (full_outputs) plan.push_back({passes - 1, true});
  int n_full_inputs = 0;
  for (size_t j = 0; j < k_.inputs.size(); ++j) n_full_inputs += input_full(j) ? 1 : 0;
  const int64_t iters = ceil_div(ceil_div(C, W), T);
  const int budget = T * G >= 1024 ? kCacheElements / 2 : kCacheElements;
  const bool cache = plan.size() > 1 && iters * W * n_full_inputs <= budget;
  // The members each pass computes per element: those its reductions or outputs read.
  auto needed = [&](const Pass& pass) {
    std::vector<bool> need(static_cast<size_t>(n_members), false);
    absl::flat_hash_map<int, int> member_of;
    for (int i = 0; i < n_members; ++i) member_of[members_[static_cast<size_t>(i)]->outputs[0]] = i;
    std::vector<int> stack;
    for (int i = 0; i < n_members; ++i) {
      const RowMember& m = row_members_[static_cast<size_t>(i)];
      const BoundOp& op = *members_[static_cast<size_t>(i)];
      if (m.reduction && !pass.writes && m.level == pass.level + 1) {
        if (auto it = member_of.find(op.inputs[0]); it != member_of.end())
          stack.push_back(it->second);
      }
      if (pass.writes && m.full && output_member[static_cast<size_t>(i)]) stack.push_back(i);
    }
    while (!stack.empty()) {
      const int i = stack.back();
      stack.pop_back();
      if (need[static_cast<size_t>(i)] || !row_members_[static_cast<size_t>(i)].full) continue;
      need[static_cast<size_t>(i)] = true;
      for (int v : members_[static_cast<size_t>(i)]->inputs) {
        if (auto it = member_of.find(v); it != member_of.end()) stack.push_back(it->second);
      }
    }
    return need;
  };
  auto statement = [&](int i) {
    const BoundOp& op = *members_[static_cast<size_t>(i)];
    const ScalarType out = spec(op.outputs[0]).dtype;
    const bool fence = out == kFloat || out == kDouble;
    return absl::StrCat("const ", ctype(out), " y", i, " = ",
                        fence ? "kopaque(" + exprs_[static_cast<size_t>(i)] + ", kzero)"
                              : exprs_[static_cast<size_t>(i)],
                        ";  // ", lines_[static_cast<size_t>(i)], "\n");
  };
  auto row_members_of_level = [&](int l, const std::string& indent) {
    std::string s;
    for (int i = 0; i < n_members; ++i) {
      const RowMember& m = row_members_[static_cast<size_t>(i)];
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
    if (o.host_scalar || input_full(j)) continue;
    if (varies(o)) {
      os << "    const long long ri" << j << " = " << row_offset(o) << ";\n";
    } else {
      os << "    const " << ctype(o.dtype) << " x" << j << " = in" << j << "[" << row_offset(o)
         << "];\n";
    }
  }
  os << row_members_of_level(0, I4);
  if (cache) {
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (input_full(j))
        os << "    " << ctype(k_.inputs[j].dtype) << " xc" << j << "[" << iters * W << "];\n";
    }
  }
  for (size_t pi = 0; pi < plan.size(); ++pi) {
    const Pass& pass = plan[pi];
    const std::vector<bool> need = needed(pass);
    std::vector<int> reductions;
    if (!pass.writes) {
      for (int i = 0; i < n_members; ++i) {
        if (row_members_[static_cast<size_t>(i)].reduction &&
            row_members_[static_cast<size_t>(i)].level == pass.level + 1) {
          reductions.push_back(i);
        }
      }
    }
    os << "    // Pass " << pi << (pass.writes ? ": the outputs" : ": reductions") << "\n";
    for (int i : reductions) {
      const BoundOp& op = *members_[static_cast<size_t>(i)];
      const std::string a = acc_type(op);
      std::string init = a + "(0)";
      if (op.name() == "amax") init = "-kinf<" + a + ">()";
      if (op.name() == "amin") init = "kinf<" + a + ">()";
      os << "    " << a << " a" << i << " = " << init << ";\n";
    }
    const bool from_cache = cache && pi > 0;
    if (cache) {
      os << "    if (active) {\n#pragma unroll\n"
         << "    for (int it = 0; it < " << iters << "; ++it) {\n"
         << "      const long long c0 = ((long long)it * " << T << " + lane) * " << W << ";\n"
         << "      if (c0 >= C) break;\n";
    } else {
      os << "    if (active) {\n"
         << "    for (long long c0 = (long long)lane * " << W << "; c0 < C; c0 += " << T * W
         << "LL) {\n";
    }
    // Loads of the inputs of the domain's shape (whole packs where W > 1).
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (!input_full(j) || from_cache) continue;
      const std::string t = ctype(k_.inputs[j].dtype);
      if (W > 1) {
        const std::string pk = absl::StrCat("kpack<", t, ", ", W, ">");
        os << I6 << "const " << pk << " vx" << j << " = *(const " << pk << "*)(in" << j
           << " + r * C + c0);\n";
        if (cache) {
          os << "#pragma unroll\n"
             << I6 << "for (int e = 0; e < " << W << "; ++e) xc" << j << "[it * " << W
             << " + e] = vx" << j << ".v[e];\n";
        }
      } else {
        os << I6 << "const " << t << " vx" << j << " = in" << j << "[r * C + c0];\n";
        if (cache) os << I6 << "xc" << j << "[it] = vx" << j << ";\n";
      }
    }
    if (pass.writes) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        if (!out_full[j] || W == 1) continue;
        os << I6 << "kpack<" << ctype(k_.outputs[j].dtype) << ", " << W << "> vy" << j << ";\n";
      }
    }
    os << "#pragma unroll\n"
       << I6 << "for (int e = 0; e < " << W << "; ++e) {\n"
       << I8 << "const long long c = c0 + e;\n"
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
      if (input_full(j)) {
        os << I8 << "const " << t << " x" << j << " = "
           << (from_cache ? absl::StrCat("xc", j, "[it * ", W, " + e]")
               : W > 1    ? absl::StrCat("vx", j, ".v[e]")
                          : absl::StrCat("vx", j))
           << ";\n";
      } else if (varies(o)) {
        os << I8 << "const " << t << " x" << j << " = in" << j << "[ri" << j << " + "
           << col_offset(o) << "];\n";
      }
    }
    for (int i = 0; i < n_members; ++i) {
      if (need[static_cast<size_t>(i)]) os << I8 << statement(i);
    }
    for (int i : reductions) {
      const BoundOp& op = *members_[static_cast<size_t>(i)];
      const int in = op.inputs[0];
      const ScalarType out = spec(op.outputs[0]).dtype;
      const std::string v =
          "(" + acc_type(op) + ")" + to_m(convert(var(in), spec(in).dtype, out), out);
      os << I8 << "a" << i << " = " << combine(op, "a" + std::to_string(i), v) << ";\n";
    }
    if (pass.writes) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        const FusedKernel::Operand& o = k_.outputs[j];
        if (!out_full[j]) continue;
        if (W > 1) {
          os << I8 << "vy" << j << ".v[e] = " << var(o.value) << ";\n";
        } else {
          os << I8 << "out" << j << "[r * C + c] = " << var(o.value) << ";\n";
        }
      }
    }
    os << I6 << "}\n";
    if (pass.writes && W > 1) {
      for (size_t j = 0; j < k_.outputs.size(); ++j) {
        const FusedKernel::Operand& o = k_.outputs[j];
        if (!out_full[j]) continue;
        os << I6 << "*(kpack<" << ctype(o.dtype) << ", " << W << ">*)(out" << j
           << " + r * C + c0) = vy" << j << ";\n";
      }
    }
    os << "    }\n    }\n";
    if (reductions.empty()) continue;
    // The group's partial results combined: the warp's, then the group's warps' (in order).
    for (int i : reductions) {
      const BoundOp& op = *members_[static_cast<size_t>(i)];
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
        const BoundOp& op = *members_[static_cast<size_t>(i)];
        os << "    a" << i << " = ks" << i << "[g * " << T / 32 << "];\n"
           << "    for (int w = 1; w < " << T / 32 << "; ++w) a" << i << " = "
           << combine(op, absl::StrCat("a", i), absl::StrCat("ks", i, "[g * ", T / 32, " + w]"))
           << ";\n";
      }
    }
    // Each reduction's result as eager's finish writes it, then the per-row members it allows.
    for (int i : reductions) {
      const BoundOp& op = *members_[static_cast<size_t>(i)];
      const ScalarType out = spec(op.outputs[0]).dtype;
      std::string e = "a" + std::to_string(i);
      if (op.name() == "mean") e = "(" + e + " * " + mean_scale_.at(i) + ")";
      exprs_[static_cast<size_t>(i)] = from_m(e, out);
      os << I4 << statement(i);
    }
    os << row_members_of_level(pass.level + 1, I4);
  }
  // Per-row outputs: written by the group's first thread.
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.outputs[j];
    if (out_full[j]) continue;
    os << "    if (active && lane == 0) out" << j << "[" << row_offset(o) << "] = " << var(o.value)
       << ";\n";
  }
  os << "  }\n}\n";
  return os.str();
}

void Generator::emit_rows() {
  for (size_t i = 0; i < members_.size(); ++i) {
    const BoundOp& op = *members_[i];
    exprs_.push_back(row_members_[i].reduction ? std::string() : member_expr(op));
    lines_.push_back(member_line(op));
  }
  // A mean's 1 / count: eager's scale, in the accumulator's type.
  for (size_t i = 0; i < members_.size(); ++i) {
    if (members_[i]->name() != "mean") continue;
    const double scale = 1.0 / static_cast<double>(k_.cols);
    mean_scale_[static_cast<int>(i)] = spec(members_[i]->outputs[0]).dtype == kDouble
                                           ? constant_of(scale)
                                           : constant_of(static_cast<float>(scale));
  }
  for (size_t c = 0; c < constants_.size(); ++c) {
    k_.constants.emplace_back(k_.slots, constants_[c].second);
    ++k_.slots;
  }
  k_.zero_slot = k_.slots++;
  const int w = k_.vector_width;
  const std::string dense = row_entry(1);
  const std::string vector = w > 1 ? row_entry(w) : std::string();
  std::ostringstream os;
  os << "// Headers " << rtc_headers_digest() << "\n#define KILN_SLOTS " << std::max(k_.slots, 1)
     << "\n"
     << kPrelude << "\n";
  os << "// Rows " << shape_str(k_.sizes) << " reduced over its last "
     << k_.sizes.size() - static_cast<size_t>(row_dims_) << " dims; inputs:";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    os << " x" << j << " " << spec_str(spec(k_.inputs[j].value));
  }
  os << "\n";
  os << dense;
  if (w > 1) os << vector;
  k_.source = os.str();
}

}  // namespace kiln::compiler::internal
