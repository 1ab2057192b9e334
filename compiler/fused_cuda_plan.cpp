// fused_cuda's code generator (compiler/fused_cuda_codegen.h): which ops and regions it writes,
// and the plan of a region (its inputs, domain, outputs and parameter slots).
#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler {
namespace internal {

std::optional<FusedKernel> Generator::run(std::string* why) {
  try {
    bool rows = false;
    for (size_t i = begin_; i < end_; ++i) rows = rows || fuse_kind(t_.ops[i]) == FuseKind::kRow;
    if (rows) {
      if (!plan_rows(why)) return std::nullopt;
      emit_rows();
    } else {
      if (!plan(why)) return std::nullopt;
      emit();
    }
  } catch (const std::exception& e) {  // an attribute eager would reject at run time
    if (why != nullptr) *why = e.what();
    return std::nullopt;
  }
  return std::move(k_);
}

// Value ids: region inputs and member results get local names x<i> and y<i>.
bool Generator::plan(std::string* why) {
  auto fail = [&](std::string m) {
    if (why != nullptr) *why = std::move(m);
    return false;
  };
  absl::flat_hash_set<int> produced;
  Shape domain;
  for (size_t i = begin_; i < end_; ++i) {
    const BoundOp& op = t_.ops[i];
    if (!fused_cuda_generates(t_, op)) return fail("the generator does not write " + op.name());
    for (int v : op.inputs) {
      if (produced.contains(v) || name_.contains(v)) continue;
      FusedKernel::Operand o = operand_of(v, t_.value(v).spec);
      if (o.host_scalar && !o.sizes.empty()) return fail("a CPU input with dimensions");
      name_[v] = "x" + std::to_string(k_.inputs.size());
      k_.inputs.push_back(std::move(o));
    }
    const int v = op.outputs[0];
    produced.insert(v);
    name_[v] = "y" + std::to_string(members_.size());
    members_.push_back(&op);
    const Shape& s = t_.value(v).spec.sizes;
    try {
      domain = domain.empty() ? s : broadcast_shapes(domain, s, "fused_cuda");
    } catch (const std::exception&) {
      return fail("the members' shapes do not broadcast to one domain");
    }
  }
  for (const FusedKernel::Operand& in : k_.inputs) {
    if (in.sizes.size() > domain.size()) return fail("an input of higher rank than the domain");
    try {
      if (broadcast_shapes(domain, in.sizes, "fused_cuda") != domain)
        return fail("an input that does not broadcast to the domain");
    } catch (const std::exception&) {
      return fail("an input that does not broadcast to the domain");
    }
  }
  if (domain.size() > static_cast<size_t>(kMaxRank)) return fail("more than 8 dimensions");
  if (numel_of(domain) == 0) return fail("no elements");  // the eager kernels launch nothing
  k_.sizes = domain;
  // The region's outputs: its values that later ops, the program's outputs or grads read.
  const absl::flat_hash_set<int> read_outside = values_read_outside(t_, begin_, end_);
  for (const BoundOp* op : members_) {
    const int v = op->outputs[0];
    if (!read_outside.contains(v)) continue;
    k_.outputs.push_back(operand_of(v, t_.value(v).spec));
  }
  if (k_.outputs.empty()) return fail("the region has no outputs");
  // Parameter slots.
  const int rank = static_cast<int>(domain.size());
  for (FusedKernel::Operand& o : k_.inputs) {
    o.slot = k_.slots;
    k_.slots += o.host_scalar ? 1 : 1 + (o.sizes.empty() ? 0 : rank);
  }
  for (FusedKernel::Operand& o : k_.outputs) {
    o.slot = k_.slots;
    k_.slots += 1 + (o.sizes.empty() ? 0 : rank);
  }
  return true;
}

bool fused_cuda_generates(const Trace& t, const BoundOp& op) {
  if (fuse_kind(op) == FuseKind::kRow) return row_op_generated(t, op);
  if (fuse_kind(op) != FuseKind::kPointwise || op.outputs.size() != 1 || op.outputs[0] < 0) {
    return false;
  }
  for (int v : op.inputs) {
    if (v < 0) return false;
  }
  const std::string& n = op.name();
  const ScalarType out = t.value(op.outputs[0]).spec.dtype;
  auto in_dtype = [&](size_t j) { return t.value(op.inputs[j]).spec.dtype; };
  if (float_unary_ops().contains(n)) return is_float(out) && op.inputs.size() == 1;
  if (numeric_unary_ops().contains(n))
    return op.inputs.size() == 1 && (out != kBool || n == "sign");
  if (n == "logical_not" || n == "bitwise_not") {
    return op.inputs.size() == 1 && (n == "logical_not" || !is_float(out));
  }
  if (n == "pow_tensor_scalar") {
    return op.inputs.size() == 1 && out != kBool && attr_if<Scalar>(op, 0) != nullptr;
  }
  if (arithmetic_ops().contains(n) || compare_ops().contains(n) || logical_ops().contains(n)) {
    if (op.inputs.size() != 2) return false;
    if (n == "add" || n == "sub") return attr_if<Scalar>(op, 0) != nullptr;
    if (n == "div" && has_attr(op, 0)) {
      // Integer floor/trunc division raises on a zero divisor in eager code: not generated.
      const auto* mode = attr_if<std::string>(op, 0);
      return mode != nullptr && (*mode == "floor" || *mode == "trunc") &&
             is_float(common_dtype(t, op, 1));
    }
    if (n == "pow") return common_dtype(t, op, 0) != kBool;
    return true;
  }
  if (n == "gelu_backward") {
    return op.inputs.size() == 2 && is_float(out) && attr_if<std::string>(op, 0) != nullptr;
  }
  if (n == "where") return op.inputs.size() == 3 && in_dtype(0) == kBool;
  if (n == "clamp") return op.inputs.size() == 1 && out != kBool;
  if (n == "lerp") {
    return is_float(out) &&
           (op.inputs.size() == 3 || (op.inputs.size() == 2 && attr_if<Scalar>(op, 0) != nullptr));
  }
  if (n == "to_copy") {
    const auto* device = attr_if<Device>(op, 1);
    return op.inputs.size() == 1 && device != nullptr &&
           *device == t.value(op.inputs[0]).spec.device;
  }
  return false;
}

namespace {

// The region trace.ops[begin, end) as torch.compile's kernels compute it
// (Trace::emulate_precision_casts off): each bf16 or f16 value the region computes is kept in
// float, and rounded to its dtype only where it is stored. A copy of the trace in which each such
// member produces f32 (its dtype attributes f32 too); a member whose value is read after the
// region produces a new f32 value, followed by a to_copy to the value's dtype that keeps its id
// (the kernel's outputs are unchanged), and the members after it read the f32 one. amax and amin
// of a value that stays bf16 or f16 stay as they are (they round nothing), and so does a to_copy
// read after the region (it is the store's rounding). nullopt where nothing
// changes; `end` moves past the to_copy ops added, and `fast` gets the values now in float.
std::optional<Trace> upcast_region(const Trace& trace, size_t begin, size_t& end,
                                   absl::flat_hash_set<int>& fast) {
  static const OpDef& to_copy = Registry::get().op("to_copy");
  const auto half = [](ScalarType d) { return d == kBFloat16 || d == kHalf; };
  const absl::flat_hash_set<int> read_outside = values_read_outside(trace, begin, end);
  Trace out = trace;
  out.ops.resize(begin);
  absl::flat_hash_map<int, int> f32_of;  // a value read outside -> its f32 version
  bool changed = false;
  for (size_t i = begin; i < end; ++i) {
    BoundOp op = trace.ops[i];
    for (int& v : op.inputs) {
      if (auto it = f32_of.find(v); it != f32_of.end()) v = it->second;
    }
    const int v = op.outputs.size() == 1 ? op.outputs[0] : -1;
    const bool pick = op.name() == "amax" || op.name() == "amin";
    if (v < 0 || !half(out.value(v).spec.dtype) ||
        (pick && half(out.value(op.inputs[0]).spec.dtype)) ||
        (op.op == &to_copy && read_outside.contains(v))) {  // already the store's rounding
      out.ops.push_back(std::move(op));
      continue;
    }
    changed = true;
    const ScalarType dtype = out.value(v).spec.dtype;
    for (Attr& a : op.attrs) {
      if (const auto* d = std::get_if<ScalarType>(&a); d != nullptr && half(*d)) a = kFloat;
    }
    if (!read_outside.contains(v)) {
      out.values[static_cast<size_t>(v)].spec.dtype = kFloat;
      fast.insert(v);
      out.ops.push_back(std::move(op));
      continue;
    }
    TensorSpec spec = out.value(v).spec;
    spec.dtype = kFloat;
    const int f = out.add_value(spec, ValueRole::kOp);
    f32_of[v] = f;
    fast.insert(f);
    op.outputs[0] = f;
    BoundOp cast;
    cast.op = &to_copy;
    cast.inputs = {f};
    cast.attrs = {dtype, spec.device};
    cast.outputs = {v};
    cast.executor = op.executor;
    cast.region = op.region;
    out.ops.push_back(std::move(op));
    out.ops.push_back(std::move(cast));
  }
  if (!changed) return std::nullopt;
  const size_t added = out.ops.size() - end;
  out.ops.insert(out.ops.end(), trace.ops.begin() + static_cast<std::ptrdiff_t>(end),
                 trace.ops.end());
  end += added;
  return out;
}

}  // namespace

std::optional<FusedKernel> generate_fused_kernel(const Trace& trace, size_t begin, size_t end,
                                                 std::string* why, int64_t shared_limit,
                                                 const RowPlanOptions& rows) {
  KILN_CHECK(rows.accesses_per_thread >= 1 && rows.block_threads >= 32 &&
                 rows.block_threads <= 1024 && rows.block_threads % 32 == 0,
             "[fused_cuda] RowPlanOptions: accesses_per_thread must be positive and block_threads "
             "a multiple of 32 in [32, 1024], got ",
             rows.accesses_per_thread, " and ", rows.block_threads);
  std::optional<Trace> upcast;
  absl::flat_hash_set<int> fast;
  if (!trace.emulate_precision_casts) upcast = upcast_region(trace, begin, end, fast);
  std::optional<FusedKernel> k =
      Generator(upcast ? *upcast : trace, begin, end, shared_limit, rows, std::move(fast)).run(why);
  if (k && k->slots > kMaxSlots) {
    if (why != nullptr) *why = "more than 4 KiB of kernel parameters";
    return std::nullopt;
  }
  return k;
}

}  // namespace internal

std::optional<std::string> fused_cuda_source(const Trace& trace, size_t begin, size_t end,
                                             std::string* why) {
  std::optional<internal::FusedKernel> k = internal::generate_fused_kernel(trace, begin, end, why);
  if (!k) return std::nullopt;
  return std::move(k->source);
}

}  // namespace kiln::compiler
