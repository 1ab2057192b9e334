// fused_cuda's code generator (compiler/fused_cuda_codegen.h): the row kernels' planner, which
// reductions it writes (row_op_generated), the region's domain, members, operands and passes
// (Generator::plan_rows), the shared-memory row cache (Generator::plan_row_cache, and the
// blocks a multiprocessor: row_source_at_two_blocks), and each entry's passes over the row
// (Generator::row_passes, plan_passes) and the registers they take (row_cache_registers). The
// kernels' source is written by fused_cuda_rows.cpp, which says what they compute.
#include <algorithm>
#include <optional>
#include <string>

#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {
namespace {

// The shared-memory row cache (Generator::plan_rows): threads per block (one row each), and the
// bytes per block left to the static shared memory (the groups' partial results) and the
// system's 1 KiB per block.
constexpr int kSharedThreads = 512;
constexpr int64_t kSharedReserve = 2048;

bool is_reduction(const std::string& n) {
  return n == "sum" || n == "mean" || n == "amax" || n == "amin";
}

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
  // same shape; each member is per row or per element by what it reads, and each output is
  // written as its member is (row_entry), not by its shape.
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
      FusedKernel::Operand o = operand_of(v, s);
      if (o.host_scalar && !s.sizes.empty()) return fail("a CPU input with dimensions");
      // A 0-d tensor on the GPU (a full reduction's result, a 0-d argument) is read once per row.
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
  for (const auto& [v, f] : full) {
    if (!f) per_row_.insert(v);
  }
  // The region's outputs.
  const absl::flat_hash_set<int> read_outside = values_read_outside(t_, begin_, end_);
  for (const BoundOp* op : members_) {
    const int v = op->outputs[0];
    if (!read_outside.contains(v)) continue;
    FusedKernel::Operand o = operand_of(v, spec(v));
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
  // Inputs that vary along the columns as the domain does (a weight [D] of rows [N, D]): packs in
  // the vector entry, where their columns are contiguous and aligned (choose_row_entry).
  for (FusedKernel::Operand& o : k_.inputs) {
    if (k_.vector_width == 0 || o.host_scalar || o.sizes == S || o.sizes.size() < rank - k)
      continue;
    const size_t lead = rank - o.sizes.size();
    bool same = true;
    for (size_t d = static_cast<size_t>(k); d < rank; ++d) same = same && o.sizes[d - lead] == S[d];
    o.row_packed = same;
  }
  const int64_t accesses = ceil_div(k_.cols, std::max<int64_t>(k_.vector_width, 1));
  k_.row_threads = static_cast<int>(std::clamp<int64_t>(
      ceil_div(ceil_div(accesses, row_plan_.accesses_per_thread), 32) * 32, 32, 1024));
  k_.rows_per_block = std::max(1, row_plan_.block_threads / k_.row_threads);
  plan_row_cache(read_outside, full);
  k_.has_dense = true;
  return true;
}

// The shared-memory row cache: a long row (a group of 512 threads or more, whose registers hold
// little of it, or hold it in blocks of 1024 threads, one block to a multiprocessor) read by
// several passes is read from global memory once, by the first pass reading each input, into
// shared memory, which the later passes read. One row per block of kSharedThreads threads, where
// two such blocks fit a multiprocessor's shared memory (rows in flight while others reduce), three
// where three fit; else the registers or a read per pass, as before. Sets row_stored_ (and the
// kernel's block shape, row_shared_bytes and row_blocks_ when the cache is taken).
void Generator::plan_row_cache(const absl::flat_hash_set<int>& read_outside,
                               const absl::flat_hash_map<int, bool>& full) {
  const Shape& S = k_.sizes;
  int max_level = 0;
  for (const RowMember& m : row_members_) max_level = std::max(max_level, m.level);
  bool full_outputs = false;
  for (const FusedKernel::Operand& o : k_.outputs) full_outputs = full_outputs || full.at(o.value);
  // The inputs of the domain's shape several passes read (as row_entry plans its passes without
  // the register cache: each pass computes the members of the domain's shape it needs from the
  // inputs): each reduction's input in the pass before its level, each output in the last.
  absl::flat_hash_map<int, absl::flat_hash_set<int>> from;  // value -> the inputs it is made of
  for (const FusedKernel::Operand& o : k_.inputs) {
    if (!o.host_scalar && o.sizes == S) from[o.value] = {o.value};
  }
  absl::flat_hash_map<int, absl::flat_hash_set<int>> read_in;  // input -> the passes reading it
  for (size_t i = 0; i < members_.size(); ++i) {
    const BoundOp& op = *members_[i];
    const RowMember& m = row_members_[i];
    if (m.reduction) {
      if (auto it = from.find(op.inputs[0]); it != from.end()) {
        for (int x : it->second) read_in[x].insert(m.level - 1);
      }
      continue;
    }
    if (!m.full) continue;
    absl::flat_hash_set<int> made_of;
    for (int v : op.inputs) {
      if (auto it = from.find(v); it != from.end())
        made_of.insert(it->second.begin(), it->second.end());
    }
    if (read_outside.contains(op.outputs[0])) {
      for (int x : made_of) read_in[x].insert(max_level);
    }
    from[op.outputs[0]] = std::move(made_of);
  }
  int64_t row_bytes = 0;
  row_stored_.assign(k_.inputs.size(), false);
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (o.host_scalar || o.sizes != S || read_in[o.value].size() < 2) continue;
    row_stored_[j] = true;
    row_bytes += ceil_div(k_.cols * static_cast<int64_t>(element_size(o.dtype)), 16) * 16;
  }
  if (max_level + (full_outputs ? 1 : 0) > 1 && k_.row_threads >= kSharedThreads && row_bytes > 0 &&
      row_bytes <= (shared_limit_ - kSharedReserve) / 2) {
    k_.row_threads = kSharedThreads;
    k_.rows_per_block = 1;
    k_.row_shared_bytes = row_bytes;
    row_blocks_ = row_cache_blocks(row_bytes, full_outputs);
  } else {
    row_stored_.assign(k_.inputs.size(), false);
  }
}

// Rows written out element by element (softmax, log_softmax): two blocks. Rows only reduced
// (logsumexp): three where their rows fit (ptxas then keeps a thread to 42 registers). bf16 rows
// of 32000 on an H200 (the kernel lab's fused_rows, session 39): log_softmax 3.3% faster at two,
// softmax the same, logsumexp 1.4% slower. (In session 35, before exp and its rounding took fewer
// instructions, three had been 4-10% faster for all.)
int Generator::row_cache_blocks(int64_t row_bytes, bool written) const {
  return !written && row_bytes <= (shared_limit_ - kSharedReserve) / 3 ? 3 : 2;
}

Generator::RowPasses Generator::row_passes() const {
  const int n_members = static_cast<int>(members_.size());
  RowPasses rp;
  rp.passes =
      1 + std::max_element(row_members_.begin(), row_members_.end(),
                           [](const RowMember& a, const RowMember& b) { return a.level < b.level; })
              ->level;
  // Outputs written per element (else once per row: one-element rows have both of S's shape).
  rp.output_member.assign(sz(n_members), false);
  rp.out_full.assign(k_.outputs.size(), false);
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    for (int i = 0; i < n_members; ++i) {
      if (members_[sz(i)]->outputs[0] == k_.outputs[j].value) {
        rp.output_member[sz(i)] = true;
        rp.out_full[j] = row_members_[sz(i)].full;
        rp.full_outputs = rp.full_outputs || rp.out_full[j];
      }
    }
  }
  rp.n_passes = rp.passes - 1 + (rp.full_outputs ? 1 : 0);
  for (int i = 0; i < n_members; ++i) rp.member_of[members_[sz(i)]->outputs[0]] = i;
  for (size_t j = 0; j < k_.inputs.size(); ++j) rp.input_of[k_.inputs[j].value] = j;
  return rp;
}

// Which members each pass computes and which inputs it reads; a member of a lower level (but a
// cast) that `keep` allows is read from where the pass that computed it left it (registers, or
// the shared-memory row cache).
Generator::PassPlan Generator::plan_passes(const RowPasses& rp,
                                           const std::vector<bool>& keep) const {
  const int n_members = static_cast<int>(members_.size());
  const int n_passes = rp.n_passes;
  PassPlan pp;
  pp.computes.assign(sz(n_passes), std::vector<bool>(sz(n_members), false));
  pp.reads.assign(sz(n_passes), std::vector<bool>(k_.inputs.size(), false));
  pp.kept_until.assign(sz(n_members), -1);
  pp.read_until.assign(k_.inputs.size(), -1);
  pp.kept_in.assign(sz(n_members), -1);
  std::vector<std::vector<int>> roots(sz(n_passes));
  for (int i = 0; i < n_members; ++i) {
    const RowMember& m = row_members_[sz(i)];
    const BoundOp& op = *members_[sz(i)];
    if (m.reduction && m.level - 1 < n_passes) {
      if (auto it = rp.member_of.find(op.inputs[0]); it != rp.member_of.end())
        roots[sz(m.level - 1)].push_back(it->second);
      if (auto it = rp.input_of.find(op.inputs[0]); it != rp.input_of.end())
        pp.reads[sz(m.level - 1)][it->second] = true;
    }
    if (m.full && rp.output_member[sz(i)]) roots[sz(rp.passes - 1)].push_back(i);
  }
  for (int pass = n_passes; pass-- > 0;) {
    std::vector<int> stack = roots[sz(pass)];
    while (!stack.empty()) {
      const int i = stack.back();
      stack.pop_back();
      const RowMember& m = row_members_[sz(i)];
      if (pp.computes[sz(pass)][sz(i)] || !m.full) continue;
      const BoundOp& op = *members_[sz(i)];
      if (keep[sz(i)] && m.level < pass && op.name() != "to_copy") {
        pp.kept_until[sz(i)] = std::max(pp.kept_until[sz(i)], pass);
        roots[sz(m.level)].push_back(i);  // computed (and kept) where it is first known
        continue;
      }
      pp.computes[sz(pass)][sz(i)] = true;
      for (int v : op.inputs) {
        if (auto it = rp.member_of.find(v); it != rp.member_of.end()) stack.push_back(it->second);
        if (auto it = rp.input_of.find(v); it != rp.input_of.end() && row_input_full(it->second))
          pp.reads[sz(pass)][it->second] = true;
      }
    }
  }
  for (int pass = 0; pass < n_passes; ++pass) {
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (pp.reads[sz(pass)][j]) pp.read_until[j] = pass;
    }
  }
  return pp;
}

// The registers a thread's share of the row takes in the fullest pass: the inputs loaded
// before the first pass while this or a later pass reads them, the kept members from the pass
// computing them to the last reading them (both in the pass computing them: ptxas does not
// reuse one's registers for the other element by element). In half registers: 16-bit elements
// moved in packs (or kept two to a register) take one, 8-byte ones four, others two.
int64_t Generator::row_cache_registers(const PassPlan& pp, int width, int64_t iters) const {
  const int n_members = static_cast<int>(members_.size());
  const int n_passes = static_cast<int>(pp.computes.size());
  auto halves_of = [&](ScalarType t) -> int64_t {
    return element_size(t) > 4 ? 4 : two_to_register(t, width) ? 1 : 2;
  };
  int64_t most = 0;
  for (int pass = 0; pass < n_passes; ++pass) {
    int64_t n = 0;
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (pp.read_until[j] >= pass) n += halves_of(k_.inputs[j].dtype);
    }
    for (int i = 0; i < n_members; ++i) {
      if (row_members_[sz(i)].level <= pass && pp.kept_until[sz(i)] >= pass)
        n += halves_of(spec(members_[sz(i)]->outputs[0]).dtype);
    }
    most = std::max(most, n);
  }
  return most * iters * width / 2;
}

bool Generator::two_to_register(ScalarType t, int width) {
  return element_size(t) == 2 && width % 2 == 0;
}

std::optional<std::string> row_source_at_two_blocks(const std::string& source) {
  const std::string three = launch_bounds(kSharedThreads, 3);
  if (source.find(three) == std::string::npos) return std::nullopt;
  const std::string two = launch_bounds(kSharedThreads, 2);
  std::string out = source;
  for (size_t at = out.find(three); at != std::string::npos; at = out.find(three, at))
    out.replace(at, three.size(), two);
  return out;
}

}  // namespace kiln::compiler::internal
