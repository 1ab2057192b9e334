// The compiler's pattern rewrites (compiler/passes.h): fuse_norm_residual, fold_index_add,
// fuse_qkv_rotary and fold_copy_into_mm. Each finds one op that can take another's work (a
// residual add into a norm's backward, a gradient copy into a product) and rewrites the trace
// where the dataflow allows it (compiler/pass_util.h); the general passes are in passes.cpp.
#include <utility>
#include <variant>

#include "compiler/pass_util.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"

namespace kiln::compiler {

Trace fuse_norm_residual(const Trace& trace) {
  const std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  const auto [producer, uses] = dataflow(trace);
  const std::vector<int> last_inplace_before = compiler::last_inplace_before(trace);
  auto same_spec = [](const TensorSpec& a, const TensorSpec& b) {
    return a.sizes == b.sizes && a.strides == b.strides && a.dtype == b.dtype &&
           a.device == b.device;
  };
  std::vector<int> residual_of(trace.ops.size(), -1);  // norm op -> the residual it takes
  std::vector<bool> drop(trace.ops.size(), false);     // the adds it takes over
  std::vector<int> to;
  Trace out = without_ops(trace, "fuse_norm_residual", to);
  for (size_t j = 0; j < trace.ops.size(); ++j) {
    const BoundOp& add = trace.ops[j];
    if (add.name() != "add" || add.inputs.size() != 2 || add.outputs.size() != 1 ||
        add.outputs[0] < 0 || add.attrs.size() != 1 || add.autocast.any()) {
      continue;
    }
    const auto* alpha = std::get_if<Scalar>(&add.attrs[0]);
    if (alpha == nullptr || alpha->is_boolean() || alpha->to<double>() != 1.0) continue;
    for (int k = 0; k < 2; ++k) {
      const int dx = add.inputs[static_cast<size_t>(k)];
      const int r = add.inputs[static_cast<size_t>(1 - k)];
      if (dx < 0 || r < 0) continue;
      const int p = producer[static_cast<size_t>(dx)];
      if (p < 0) continue;
      // dx read once (by this add) is neither read twice, nor written in place, nor viewed.
      const BoundOp& norm = trace.ops[static_cast<size_t>(p)];
      if (norm.name() != "rms_norm_backward" || norm.outputs[0] != dx || norm.inputs.size() != 4 ||
          norm.autocast.any() || uses[static_cast<size_t>(dx)] != 1 ||
          handed_out[static_cast<size_t>(dx)] || written[static_cast<size_t>(r)] ||
          producer[static_cast<size_t>(r)] >= p || last_inplace_before[j] > p) {
        continue;
      }
      const TensorSpec& ds = trace.value(dx).spec;
      if (!same_spec(ds, trace.value(r).spec) || !same_spec(ds, trace.value(add.outputs[0]).spec)) {
        continue;
      }
      // On the CPU compiled code keeps eager's bits: there only where the one rounding of the
      // sum equals eager's two (f32 and f64 compute in their own dtype).
      if (!ds.device.is_cuda() && ds.dtype != kFloat && ds.dtype != kDouble) continue;
      residual_of[static_cast<size_t>(p)] = r;
      drop[j] = true;
      to[static_cast<size_t>(add.outputs[0])] = dx;
      break;
    }
  }
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (drop[i]) continue;
    BoundOp op = trace.ops[i];
    rename(op.inputs, to);
    // The residual may be an add this pass drops (the previous block's sum): its new name.
    if (residual_of[i] >= 0) op.inputs.push_back(to[static_cast<size_t>(residual_of[i])]);
    out.ops.push_back(std::move(op));
  }
  rename_results(out, to);
  return out;
}

Trace fold_index_add(const Trace& trace) {
  const std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  const Dataflow flow = dataflow(trace);
  const auto& [producer, uses] = flow;
  auto scalar_is = [](const Attr& a, double want) {
    const auto* s = std::get_if<Scalar>(&a);
    return s != nullptr && !s->is_boolean() && s->to<double>() == want;
  };
  // The op that makes v alone (its only output read once, by the op we come from, never handed
  // out), or nullptr.
  auto sole = [&](int v, const char* name) -> const BoundOp* {
    if (v < 0 || uses[static_cast<size_t>(v)] != 1 || handed_out[static_cast<size_t>(v)]) {
      return nullptr;
    }
    const int p = producer[static_cast<size_t>(v)];
    if (p < 0) return nullptr;
    const BoundOp& op = trace.ops[static_cast<size_t>(p)];
    if (op.name() != name || op.outputs.size() != 1 || op.outputs[0] != v || op.autocast.any()) {
      return nullptr;
    }
    return &op;
  };
  static const OpDef& index_add_ = KILN_OP(index_add_);
  std::vector<bool> in_place(trace.ops.size(), false);
  std::vector<int> base_of(trace.ops.size(), -1);    // index_add op -> the g it now adds into
  std::vector<int> result_of(trace.ops.size(), -1);  // index_add op -> the add's result it makes
  std::vector<bool> drop(trace.ops.size(), false);
  std::vector<int> unused;  // no value is renamed: the index_add makes the add's result itself
  Trace out = without_ops(trace, "fold_index_add", unused);
  for (size_t j = 0; j < trace.ops.size(); ++j) {
    const BoundOp& add = trace.ops[j];
    if (add.name() != "add" || add.inputs.size() != 2 || add.outputs.size() != 1 ||
        add.outputs[0] < 0 || add.attrs.size() != 1 || !scalar_is(add.attrs[0], 1.0) ||
        add.autocast.any()) {
      continue;
    }
    for (int k = 0; k < 2; ++k) {
      const int x = add.inputs[static_cast<size_t>(k)];
      const int g = add.inputs[static_cast<size_t>(1 - k)];
      const BoundOp* ia = sole(x, "index_add");
      if (ia == nullptr || g < 0 || ia->inputs.size() != 3 || written[static_cast<size_t>(x)] ||
          written[static_cast<size_t>(g)]) {
        continue;
      }
      const int p = producer[static_cast<size_t>(x)];
      if (producer[static_cast<size_t>(g)] >= p) continue;
      const BoundOp* fill = sole(ia->inputs[0], "fill_");
      if (fill == nullptr || fill->inputs.size() != 1 || fill->attrs.size() != 1 ||
          !scalar_is(fill->attrs[0], 0.0)) {
        continue;
      }
      const BoundOp* empty = sole(fill->inputs[0], "empty");
      if (empty == nullptr) continue;
      const TensorSpec& sum = trace.value(add.outputs[0]).spec;
      const TensorSpec& gs = trace.value(g).spec;
      if (!sum.device.is_cuda() || gs.sizes != sum.sizes || gs.dtype != sum.dtype ||
          gs.device != sum.device) {
        continue;
      }
      // The index_add on g makes the add's result: its layout must be the add's (g may be a
      // transposed view, the head's gradient).
      BoundOp folded = *ia;
      folded.inputs[0] = g;
      std::vector<TensorSpec> specs;
      try {
        specs = derive_specs(trace, folded);
      } catch (const Error&) {
        continue;
      }
      if (specs.size() != 1 || !same_layout(specs[0], sum)) continue;
      // g's memory read by nothing but the add: the rows go into g itself.
      in_place[static_cast<size_t>(p)] =
          read_once(trace, flow, written, handed_out, g) && same_layout(gs, sum);
      base_of[static_cast<size_t>(p)] = g;
      result_of[static_cast<size_t>(p)] = add.outputs[0];
      drop[j] = true;
      drop[static_cast<size_t>(producer[static_cast<size_t>(ia->inputs[0])])] = true;
      drop[static_cast<size_t>(producer[static_cast<size_t>(fill->inputs[0])])] = true;
      break;
    }
  }
  // Any other index_add whose table's memory nothing else reads adds its rows into it in place:
  // under DDP, the lookup's rows gathered from every rank into the table's all-reduced gradient.
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    const BoundOp& op = trace.ops[i];
    if (drop[i] || base_of[i] >= 0 || op.name() != "index_add" || op.inputs.size() != 3 ||
        op.outputs.size() != 1 || op.outputs[0] < 0 || op.inputs[0] < 0 || op.autocast.any()) {
      continue;
    }
    in_place[i] = read_once(trace, flow, written, handed_out, op.inputs[0]) &&
                  same_layout(trace.value(op.inputs[0]).spec, trace.value(op.outputs[0]).spec);
  }
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (drop[i]) continue;
    BoundOp op = trace.ops[i];
    if (base_of[i] >= 0) {
      op.inputs[0] = base_of[i];
      op.outputs[0] = result_of[i];
    }
    if (in_place[i]) op.op = &index_add_;
    out.ops.push_back(std::move(op));
  }
  return out;
}

Trace fuse_qkv_rotary(const Trace& trace) {
  const std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  const Dataflow flow = dataflow(trace);
  const auto& [producer, uses] = flow;
  auto at = [](const std::vector<int>& v, int i) { return v[static_cast<size_t>(i)]; };
  const std::vector<int> last_inplace_before = compiler::last_inplace_before(trace);
  // The value a chain of shape-preserving views (view, expand, alias to the same sizes), each
  // read only by the next and none handed out or written, starts from; the ops are collected.
  auto through_identity_views = [&](int v, std::vector<int>& ops) {
    for (;;) {
      const int p = at(producer, v);
      if (p < 0) return v;
      const BoundOp& op = trace.ops[static_cast<size_t>(p)];
      const std::string& n = op.name();
      if (op.op->kind != OpKind::kView || (n != "view" && n != "expand" && n != "alias") ||
          op.inputs.size() != 1 || op.inputs[0] < 0 ||
          trace.value(op.inputs[0]).spec.sizes != trace.value(v).spec.sizes) {
        return v;
      }
      const int in = op.inputs[0];
      if (at(uses, in) != 1 || handed_out[static_cast<size_t>(in)] ||
          written[static_cast<size_t>(in)]) {
        return v;
      }
      ops.push_back(p);
      v = in;
    }
  };
  static const OpDef& rotary_qkv = KILN_OP(rotary_qkv_);
  static const OpDef& fused_backward = KILN_OP(flash_attention_backward_qkv);
  static const OpDef& view_op = KILN_OP(view);
  static const OpDef& slice_op = KILN_OP(slice);
  static const OpDef& permute_op = KILN_OP(permute);
  // The merge `m` of flash_attention_backward `bwd`'s results as one op, in the merge's place:
  // the backward's inputs and attributes, then the merge's tables and transpose.
  auto merged = [&](const BoundOp& m, const BoundOp& bwd) {
    BoundOp fused = m;
    fused.op = &fused_backward;
    fused.inputs.assign(bwd.inputs.begin(), bwd.inputs.end());
    fused.inputs.push_back(m.inputs[3]);
    fused.inputs.push_back(m.inputs[4]);
    fused.attrs.assign(bwd.attrs.begin(), bwd.attrs.end());
    fused.attrs.push_back(m.attrs[0]);
    return fused;
  };
  std::vector<bool> drop(trace.ops.size(), false);
  std::vector<bool> split_in_place(trace.ops.size(), false);
  std::vector<int> backward_of(trace.ops.size(), -1);  // merge op -> the backward it takes in
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    const BoundOp& op = trace.ops[i];
    if (op.autocast.any()) continue;
    if (op.name() == "split_qkv_rotary" && op.inputs.size() == 3 && op.inputs[0] >= 0 &&
        op.attrs.size() == 3 && read_once(trace, flow, written, handed_out, op.inputs[0])) {
      BoundOp in_place = op;
      in_place.op = &rotary_qkv;
      split_in_place[i] = device_kernel_supports(trace, in_place);
      continue;
    }
    if (op.name() != "merge_qkv_rotary" || op.inputs.size() != 5 || op.outputs.size() != 1 ||
        op.outputs[0] < 0 || op.attrs.size() != 1) {
      continue;
    }
    // dq, dk, dv: the three results of one flash_attention_backward, each read by this merge
    // alone (through identity views), with no in-place op in between.
    std::vector<int> views;
    int b = -1;
    bool ok = true;
    for (size_t k = 0; k < 3 && ok; ++k) {
      const int v = op.inputs[k];
      if (v < 0 || at(uses, v) != 1 || handed_out[static_cast<size_t>(v)] ||
          written[static_cast<size_t>(v)]) {
        ok = false;
        break;
      }
      const int start = through_identity_views(v, views);
      const int p = at(producer, start);
      ok = p >= 0 && (b < 0 || p == b) && at(uses, start) == 1 &&
           !handed_out[static_cast<size_t>(start)] && !written[static_cast<size_t>(start)] &&
           trace.ops[static_cast<size_t>(p)].outputs.size() == 3 &&
           trace.ops[static_cast<size_t>(p)].outputs[k] == start;
      b = p;
    }
    if (!ok) continue;
    const BoundOp& bwd = trace.ops[static_cast<size_t>(b)];
    if (bwd.name() != "flash_attention_backward" || bwd.inputs.size() != 7 ||
        bwd.attrs.size() != 4 || bwd.autocast.any() || last_inplace_before[i] > b) {
      continue;
    }
    const BoundOp fused = merged(op, bwd);
    try {
      const std::vector<TensorSpec> specs = derive_specs(trace, fused);
      const TensorSpec& want = trace.value(op.outputs[0]).spec;
      if (specs.size() != 1 || specs[0].sizes != want.sizes || specs[0].dtype != want.dtype ||
          specs[0].device != want.device || !device_kernel_supports(trace, fused)) {
        continue;
      }
    } catch (const Error&) {
      continue;
    }
    backward_of[i] = b;
    drop[static_cast<size_t>(b)] = true;
    for (int v : views) drop[static_cast<size_t>(v)] = true;
  }
  std::vector<int> unused;
  Trace out = without_ops(trace, "fuse_qkv_rotary", unused);
  auto unchanged = [&] {
    Trace same = trace;
    same.stage = out.stage;
    return same;
  };
  std::vector<bool> respec(trace.values.size(), false);  // values whose layout changed
  auto add_op = [&](const OpDef& def, std::vector<int> inputs, absl::InlinedVector<Attr, 4> attrs,
                    int result) {
    BoundOp v;
    v.op = &def;
    v.inputs = std::move(inputs);
    v.attrs = std::move(attrs);
    const std::vector<TensorSpec> specs = derive_specs(out, v);
    if (result < 0) {
      result = out.add_value(specs[0], ValueRole::kOp);
      respec.push_back(false);
    } else {
      out.values[static_cast<size_t>(result)].spec = specs[0];
      respec[static_cast<size_t>(result)] = true;
    }
    v.outputs = {result};
    out.ops.push_back(std::move(v));
    return result;
  };
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (drop[i]) continue;
    const BoundOp& op = trace.ops[i];
    if (backward_of[i] >= 0) {
      out.ops.push_back(merged(op, trace.ops[static_cast<size_t>(backward_of[i])]));
      continue;
    }
    if (!split_in_place[i]) {
      out.ops.push_back(op);
      continue;
    }
    // qkv rotated in place, then q, k and v as internal::qkv_heads's views of it:
    // view [..., T, heads, D], slice of the heads, heads before T.
    BoundOp in_place = op;
    in_place.op = &rotary_qkv;
    const TensorSpec& qkv = trace.value(op.inputs[0]).spec;
    in_place.outputs = {out.add_value(qkv, ValueRole::kOp)};
    respec.push_back(false);
    const int rotated = in_place.outputs[0];
    out.ops.push_back(std::move(in_place));
    const int64_t h = std::get<int64_t>(op.attrs[1]), g = std::get<int64_t>(op.attrs[2]);
    const int64_t n = h + 2 * g, d = qkv.sizes.back() / n, rank = std::ssize(qkv.sizes) + 1;
    Shape heads(qkv.sizes.begin(), qkv.sizes.end() - 1);
    heads.insert(heads.end(), {n, d});
    const int u = add_op(view_op, {rotated}, {heads}, -1);
    Shape perm(static_cast<size_t>(rank));
    for (int64_t k = 0; k < rank; ++k) perm[static_cast<size_t>(k)] = k;
    std::swap(perm[static_cast<size_t>(rank - 3)], perm[static_cast<size_t>(rank - 2)]);
    const int64_t first[3] = {0, h, h + g}, count[3] = {h, g, g};
    for (size_t k = 0; k < 3; ++k) {
      const int s =
          add_op(slice_op, {u}, {rank - 2, first[k], first[k] + count[k], int64_t{1}}, -1);
      add_op(permute_op, {s}, {perm}, op.outputs[k]);
    }
  }
  // What reads the heads was traced on split_qkv_rotary's layout: the specs of later ops whose
  // inputs changed layout are derived again. Views follow; any other op must keep its outputs'
  // specs and no changed value may be handed out, else the pass leaves the trace as it was.
  for (BoundOp& op : out.ops) {
    bool changed = false;
    for (int v : op.inputs) changed |= v >= 0 && respec[static_cast<size_t>(v)];
    if (!changed) continue;
    std::vector<TensorSpec> specs;
    try {
      specs = derive_specs(out, op);
    } catch (const Error&) {
      return unchanged();
    }
    for (size_t k = 0; k < op.outputs.size() && k < specs.size(); ++k) {
      const int v = op.outputs[k];
      if (v < 0) continue;
      ValueInfo& info = out.values[static_cast<size_t>(v)];
      if (same_layout(info.spec, specs[k])) continue;
      if (op.op->kind != OpKind::kView) return unchanged();
      info.spec = specs[k];
      respec[static_cast<size_t>(v)] = true;
    }
  }
  for (size_t v = 0; v < trace.values.size(); ++v) {
    if (respec[v] && handed_out[v]) return unchanged();
  }
  return out;
}

Trace fold_copy_into_mm(const Trace& trace) {
  const std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  const Dataflow flow = dataflow(trace);
  const auto& [producer, uses] = flow;
  const std::vector<int> last_inplace_before = compiler::last_inplace_before(trace);
  static const OpDef& mm_into = KILN_OP(mm_into_);
  std::vector<bool> drop(trace.ops.size(), false);
  std::vector<int> product_of(trace.ops.size(), -1);  // a folded copy -> its mm
  for (size_t j = 0; j < trace.ops.size(); ++j) {
    const BoundOp& copy = trace.ops[j];
    if (copy.name() != "copy_" || copy.inputs.size() != 2 || copy.outputs.size() != 1 ||
        copy.autocast.any()) {
      continue;
    }
    const int dst = copy.inputs[0], x = copy.inputs[1];
    if (dst < 0 || x < 0 || !read_once(trace, flow, written, handed_out, x)) continue;
    // The views between the product and the copy (read_once: each read only by the next); only
    // views that keep the storage offset, so that the same layout is the same memory.
    std::vector<int> views;
    int y = x;
    bool offset_kept = true;
    for (;;) {
      const BoundOp& view = trace.ops[static_cast<size_t>(producer[static_cast<size_t>(y)])];
      if (view.op->kind != OpKind::kView) break;
      const std::string& n = view.name();
      offset_kept = offset_kept && (n == "permute" || n == "view" || n == "alias" ||
                                    n == "transpose" || n == "squeeze" || n == "unsqueeze");
      views.push_back(producer[static_cast<size_t>(y)]);
      y = view.inputs[0];
    }
    if (!offset_kept) continue;
    const int p = producer[static_cast<size_t>(y)];
    const BoundOp& mm = trace.ops[static_cast<size_t>(p)];
    if (mm.name() != "mm" || mm.inputs.size() != 2 || mm.inputs[0] < 0 || mm.inputs[1] < 0 ||
        mm.outputs.size() != 1 || mm.autocast.any()) {
      continue;
    }
    // The copy reads the product as the product lies; dst is a plain contiguous copy of it; the
    // operands are as they were at the product (no in-place op between).
    const TensorSpec& ys = trace.value(y).spec;
    const TensorSpec& ds = trace.value(dst).spec;
    const TensorSpec dense{ys.sizes, ys.dtype, ys.device};
    if (!same_layout(trace.value(x).spec, ys) || !same_layout(ds, dense) ||
        !same_layout(ys, dense) || last_inplace_before[j] > p) {
      continue;
    }
    drop[static_cast<size_t>(p)] = true;
    for (int v : views) drop[static_cast<size_t>(v)] = true;
    product_of[j] = p;
  }
  std::vector<int> unused;  // no value is renamed: mm_into_ makes the copy's result
  Trace out = without_ops(trace, "fold_copy_into_mm", unused);
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (drop[i]) continue;
    BoundOp op = trace.ops[i];
    if (product_of[i] >= 0) {
      const BoundOp& mm = trace.ops[static_cast<size_t>(product_of[i])];
      op.op = &mm_into;
      op.inputs = {op.inputs[0], mm.inputs[0], mm.inputs[1]};
      op.attrs.clear();
    }
    out.ops.push_back(std::move(op));
  }
  return out;
}

}  // namespace kiln::compiler
