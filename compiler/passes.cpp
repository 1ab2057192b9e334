#include "compiler/passes.h"

#include <utility>
#include <variant>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "autograd/grad_mode.h"
#include "compiler/pass_util.h"
#include "compiler/tracer.h"

namespace kiln::compiler {

void rename(std::vector<int>& ids, const std::vector<int>& to) {
  for (int& v : ids) {
    if (v >= 0) v = to[static_cast<size_t>(v)];
  }
}

// A functional op's identity for cse: the op, its inputs and its attributes printed.
static std::string op_key(const BoundOp& op) {
  std::string key = op.name();
  for (int v : op.inputs) key += "," + std::to_string(v);
  key += ";";
  for (const Attr& a : op.attrs) {
    key += std::to_string(a.index()) + ":" + attr_str(a) + ",";
  }
  return key;
}

// The start of a pass that rewrites the ops one by one: `trace` without its ops, as stage
// `stage`, and `to`, the identity renaming of its values.
Trace without_ops(const Trace& trace, const char* stage, std::vector<int>& to) {
  Trace out = trace;
  out.stage = stage;
  out.ops.clear();
  to.resize(trace.values.size());
  for (size_t v = 0; v < to.size(); ++v) to[v] = static_cast<int>(v);
  return out;
}

// The end of such a pass: the returned values and grad effects renamed.
void rename_results(Trace& out, const std::vector<int>& to) {
  rename(out.outputs, to);
  for (GradEffect& e : out.grad_effects) {
    if (e.value >= 0) e.value = to[static_cast<size_t>(e.value)];
  }
}

static std::vector<Tensor> input_proxies(const Trace& trace, const BoundOp& op) {
  std::vector<Tensor> in;
  in.reserve(op.inputs.size());
  for (int v : op.inputs) in.push_back(v >= 0 ? proxy_of(trace.value(v).spec) : Tensor());
  return in;
}

std::vector<TensorSpec> derive_specs(const Trace& trace, const BoundOp& op) {
  KILN_CHECK(op.op->kind != OpKind::kDynamic, "[compile] the output shape of ", op.name(),
             " depends on data, so its outputs cannot be derived again for new input specs");
  OpCall call;
  call.op = op.op;
  for (const Tensor& t : input_proxies(trace, op)) call.inputs.push_back(t);
  call.attrs = op.attrs;
  NoGradGuard no_grad;
  ProxyModeGuard proxies;
  run_backend(call);
  std::vector<TensorSpec> specs;
  specs.reserve(call.outputs.size());
  for (const Tensor& t : call.outputs) specs.push_back(spec_of(t));
  return specs;
}

bool device_kernel_supports(const Trace& trace, const BoundOp& op) {
  OpCall call;
  call.op = op.op;
  for (const Tensor& t : input_proxies(trace, op)) call.inputs.push_back(t);
  call.attrs = op.attrs;
  const Device device = common_device(call);
  (void)op.op->meta(call);  // support rules may assume a call the meta rule accepted
  return op.op->select_kernel(device.type(), call) != nullptr;
}

Trace decompose(const Trace& trace, std::vector<Tensor>& externals,
                const std::function<bool(const Trace& trace, const BoundOp& op)>& expand) {
  std::vector<int> to;
  Trace out = without_ops(trace, "decompose", to);
  for (const BoundOp& original : trace.ops) {
    BoundOp op = original;
    rename(op.inputs, to);
    if (op.op->decomposition == nullptr || op.rng_offset >= 0 || !expand(out, op)) {
      out.ops.push_back(std::move(op));
      continue;
    }
    NoGradGuard no_grad;
    const OpDef& def = *op.op;
    const auto attrs = op.attrs;
    TraceResult sub = trace_callable(
        [&def, &attrs](const std::vector<Tensor>& in) {
          const TensorVec outs = call_decomposition(def, TensorVec(in.begin(), in.end()), attrs);
          return std::vector<Tensor>(outs.begin(), outs.end());
        },
        input_proxies(out, op), op.name() + "_decomposition");
    if (sub.trace.rng_blocks > 0 || !sub.escaped.empty()) {  // keep random draws in order
      out.ops.push_back(std::move(op));
      continue;
    }
    // Splice: the sub-trace's arguments are the op's inputs; its captured constants become new
    // externals; its ops' results new values; its outputs replace the op's outputs.
    std::vector<int> map(sub.trace.values.size(), -1);
    for (size_t i = 0; i < sub.trace.arguments.size(); ++i) {
      if (sub.trace.arguments[i] >= 0)
        map[static_cast<size_t>(sub.trace.arguments[i])] = op.inputs[i];
    }
    for (size_t j = 0; j < sub.trace.externals.size(); ++j) {
      const int id =
          out.add_value(sub.trace.value(sub.trace.externals[j]).spec, ValueRole::kExternal);
      out.externals.push_back(id);
      externals.push_back(sub.externals[j]);
      map[static_cast<size_t>(sub.trace.externals[j])] = id;
    }
    for (const BoundOp& sop : sub.trace.ops) {
      BoundOp copy = sop;
      copy.autocast = op.autocast;  // eager code runs a decomposition under the op's autocast
      for (int& v : copy.inputs) {
        if (v >= 0) v = map[static_cast<size_t>(v)];
      }
      for (int& v : copy.outputs) {
        if (v < 0) continue;
        const int id = out.add_value(sub.trace.value(v).spec, ValueRole::kOp);
        map[static_cast<size_t>(v)] = id;
        v = id;
      }
      out.ops.push_back(std::move(copy));
    }
    for (size_t k = 0; k < op.outputs.size() && k < sub.trace.outputs.size(); ++k) {
      const int sv = sub.trace.outputs[k];
      if (op.outputs[k] >= 0 && sv >= 0)
        to[static_cast<size_t>(op.outputs[k])] = map[static_cast<size_t>(sv)];
    }
  }
  rename_results(out, to);
  return out;
}

Trace dce(const Trace& trace) {
  std::vector<bool> live(trace.values.size(), false);
  auto mark = [&](int v) {
    if (v >= 0) live[static_cast<size_t>(v)] = true;
  };
  for (int v : trace.outputs) mark(v);
  for (const GradEffect& e : trace.grad_effects) mark(e.value);
  std::vector<bool> keep(trace.ops.size(), false);
  for (size_t i = trace.ops.size(); i-- > 0;) {
    const BoundOp& op = trace.ops[i];
    bool needed = op.op->kind == OpKind::kInplace;
    for (int v : op.outputs) needed |= v >= 0 && live[static_cast<size_t>(v)];
    if (!needed) continue;
    keep[i] = true;
    for (int v : op.inputs) mark(v);
  }
  Trace out = trace;
  out.stage = "dce";
  out.ops.clear();
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    if (keep[i]) out.ops.push_back(trace.ops[i]);
  }
  return out;
}

// The inputs an in-place op writes: input 0, or those its OpDef::mutated names (the multi-tensor
// optimizer updates write their parameters and moments, not the gradients they read). Every input
// where the call cannot be decoded.
static std::vector<int> mutated_inputs(const Trace& trace, const BoundOp& op) {
  if (op.op->mutated == nullptr) {
    return op.inputs.empty() ? std::vector<int>{} : std::vector<int>{op.inputs[0]};
  }
  OpCall call;
  call.op = op.op;
  for (const Tensor& t : input_proxies(trace, op)) call.inputs.push_back(t);
  call.attrs = op.attrs;
  TensorVec mutated;
  try {
    NoGradGuard no_grad;
    ProxyModeGuard proxies;
    op.op->mutated(call, mutated);
  } catch (const Error&) {
    return op.inputs;
  }
  std::vector<int> out;
  for (const Tensor& m : mutated) {
    size_t i = 0;
    while (i < call.inputs.size() && !(m.defined() && call.inputs[i].is_same(m))) ++i;
    if (i == call.inputs.size()) return op.inputs;  // not an input as it is: stay conservative
    out.push_back(op.inputs[i]);
  }
  return out;
}

// Extends `marked` through the views that alias its values: a view's inputs are marked when one
// of its outputs is (in reverse order, so that chains of views are followed).
static void mark_view_bases(const Trace& trace, std::vector<bool>& marked) {
  for (size_t i = trace.ops.size(); i-- > 0;) {
    const BoundOp& op = trace.ops[i];
    if (op.op->kind != OpKind::kView) continue;
    bool aliased = false;
    for (int v : op.outputs) aliased |= v >= 0 && marked[static_cast<size_t>(v)];
    if (!aliased) continue;
    for (int v : op.inputs) {
      if (v >= 0) marked[static_cast<size_t>(v)] = true;
    }
  }
}

// Values some in-place op writes, and through views the values they alias.
std::vector<bool> written_values(const Trace& trace) {
  std::vector<bool> written(trace.values.size(), false);
  for (const BoundOp& op : trace.ops) {
    if (op.op->kind != OpKind::kInplace) continue;
    for (int v : mutated_inputs(trace, op)) {
      if (v >= 0) written[static_cast<size_t>(v)] = true;
    }
  }
  mark_view_bases(trace, written);
  return written;
}

// Values the program hands out, as gradients (grad effects) or returned, and through views the
// values they alias. Two of them stay two tensors, as in eager code: a pass never makes one stand
// for another (code after the step may change one in place: a gradient's accumulation or clip).
std::vector<bool> handed_out_values(const Trace& trace) {
  std::vector<bool> out(trace.values.size(), false);
  for (const GradEffect& e : trace.grad_effects) {
    if (e.value >= 0) out[static_cast<size_t>(e.value)] = true;
  }
  for (int v : trace.outputs) {
    if (v >= 0) out[static_cast<size_t>(v)] = true;
  }
  mark_view_bases(trace, out);
  return out;
}

Dataflow dataflow(const Trace& trace) {
  Dataflow d{std::vector<int>(trace.values.size(), -1), std::vector<int>(trace.values.size(), 0)};
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    for (int v : trace.ops[i].inputs) {
      if (v >= 0) ++d.uses[static_cast<size_t>(v)];
    }
    for (int v : trace.ops[i].outputs) {
      if (v >= 0) d.producer[static_cast<size_t>(v)] = static_cast<int>(i);
    }
  }
  return d;
}

// Whether two specs have one layout: sizes, dtype, device, and strides (none recorded meaning
// contiguous).
bool same_layout(const TensorSpec& a, const TensorSpec& b) {
  auto strides = [](const TensorSpec& t) {
    return t.strides.empty() ? contiguous_strides(t.sizes) : t.strides;
  };
  return a.sizes == b.sizes && strides(a) == strides(b) && a.dtype == b.dtype &&
         a.device == b.device;
}

// Whether v's memory is read by nothing but v's one reader: v made by a functional op, or from
// such a tensor through views and in-place ops (whose result is the input they write: compiled
// DDP's all-reduce and its wait), each value read only by the next, none handed out, and none
// written but by the in-place ops of the chain. (Each value read once, by the next op of the
// chain, is written only through that op: an in-place op of the chain, or a view of it that such
// an op writes.)
bool read_once(const Trace& trace, const Dataflow& flow, const std::vector<bool>& written,
               const std::vector<bool>& handed_out, int v) {
  bool written_by_chain = false;  // an in-place op of the chain writes v's memory
  for (;;) {
    const auto i = static_cast<size_t>(v);
    if (flow.uses[i] != 1 || handed_out[i] || (written[i] && !written_by_chain) ||
        flow.producer[i] < 0) {
      return false;
    }
    const BoundOp& made = trace.ops[static_cast<size_t>(flow.producer[i])];
    if (made.op->kind == OpKind::kFunctional) return true;
    const bool in_place = made.op->kind == OpKind::kInplace;
    if ((!in_place && made.op->kind != OpKind::kView) || made.inputs.empty() ||
        made.outputs.size() != 1 || made.inputs[0] < 0) {
      return false;
    }
    // An in-place op's result is the input it writes (input 0 unless its rule names another).
    int base = made.inputs[0];
    if (in_place) {
      const std::vector<int> mutated = mutated_inputs(trace, made);
      base = mutated.empty() ? -1 : mutated[0];
    }
    if (base < 0) return false;
    written_by_chain = written_by_chain || in_place;
    v = base;
  }
}

std::vector<int> last_inplace_before(const Trace& trace) {
  std::vector<int> last(trace.ops.size() + 1, -1);
  for (size_t i = 0; i < trace.ops.size(); ++i) {
    last[i + 1] = trace.ops[i].op->kind == OpKind::kInplace ? static_cast<int>(i) : last[i];
  }
  return last;
}

Trace simplify(const Trace& trace) {
  // Kept up to date through the renames: a factor that stands for its product is written where
  // the product was, and read where it was.
  std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  std::vector<int> uses = dataflow(trace).uses;
  std::vector<const BoundOp*> producer(trace.values.size(), nullptr);
  for (const BoundOp& op : trace.ops) {
    for (int v : op.outputs) {
      if (v >= 0) producer[static_cast<size_t>(v)] = &op;
    }
  }
  // A 0-d value fill_ set to one on a fresh empty([]) that nothing else writes.
  auto constant_one = [&](int v) {
    const BoundOp* fill = producer[static_cast<size_t>(v)];
    if (fill == nullptr || fill->name() != "fill_" || fill->inputs.size() != 1 ||
        fill->attrs.size() != 1 || !trace.value(v).spec.sizes.empty() ||
        written[static_cast<size_t>(v)]) {
      return false;
    }
    const auto* s = std::get_if<Scalar>(&fill->attrs[0]);
    const int base = fill->inputs[0];
    const BoundOp* made = base >= 0 ? producer[static_cast<size_t>(base)] : nullptr;
    return s != nullptr && !s->is_boolean() && s->to<double>() == 1.0 && made != nullptr &&
           made->name() == "empty" && made->inputs.empty();
  };
  std::vector<int> to;
  Trace out = without_ops(trace, "simplify", to);
  for (const BoundOp& original : trace.ops) {
    BoundOp op = original;
    rename(op.inputs, to);
    if (op.name() == "mul" && op.inputs.size() == 2 && op.outputs.size() == 1 &&
        op.outputs[0] >= 0 && op.inputs[0] >= 0 && op.inputs[1] >= 0 && !op.autocast.any()) {
      const int product = op.outputs[0];
      for (int k = 0; k < 2; ++k) {
        const int x = op.inputs[static_cast<size_t>(k)];
        if (!constant_one(op.inputs[static_cast<size_t>(1 - k)])) continue;
        const TensorSpec& xs = trace.value(x).spec;
        const TensorSpec& ps = trace.value(product).spec;
        const BoundOp* made = producer[static_cast<size_t>(x)];
        // A product written in place later (compiled DDP's in-place all-reduce of a tied
        // table's gradient: a 525 MB multiplication a llama-3.2-1b step) may be its factor
        // when nothing else reads the factor, which has the product's layout and is not
        // handed out: the writes then change a value no one else sees.
        const bool sole_reader = uses[static_cast<size_t>(x)] == 1 && xs.strides == ps.strides &&
                                 !handed_out[static_cast<size_t>(x)];
        if (xs.sizes != ps.sizes || xs.dtype != ps.dtype || xs.device != ps.device ||
            written[static_cast<size_t>(x)] ||
            (written[static_cast<size_t>(product)] && !sole_reader) ||
            (handed_out[static_cast<size_t>(x)] && handed_out[static_cast<size_t>(product)]) ||
            made == nullptr || made->op->kind != OpKind::kFunctional) {
          continue;
        }
        to[static_cast<size_t>(product)] = x;
        uses[static_cast<size_t>(x)] += uses[static_cast<size_t>(product)] - 1;
        if (written[static_cast<size_t>(product)]) written[static_cast<size_t>(x)] = true;
        break;
      }
      if (to[static_cast<size_t>(product)] != product) continue;
    }
    out.ops.push_back(std::move(op));
  }
  rename_results(out, to);
  return out;
}

Trace cse(const Trace& trace) {
  // An op producing a value some in-place op writes, or one the program hands out (a gradient,
  // a result), is never merged with another, since the two would no longer be two tensors.
  const std::vector<bool> written = written_values(trace);
  const std::vector<bool> handed_out = handed_out_values(trace);
  std::vector<int> to;
  Trace out = without_ops(trace, "cse", to);
  absl::flat_hash_map<std::string, size_t> seen;  // key -> index into out.ops
  for (const BoundOp& original : trace.ops) {
    BoundOp op = original;
    rename(op.inputs, to);
    if (op.op->kind == OpKind::kInplace) {
      seen.clear();
      out.ops.push_back(std::move(op));
      continue;
    }
    bool writable = false;
    for (int v : op.outputs) {
      writable |= v >= 0 && (written[static_cast<size_t>(v)] || handed_out[static_cast<size_t>(v)]);
    }
    if (op.op->kind == OpKind::kFunctional && !op.op->random && !writable) {
      const std::string key = op_key(op);
      if (auto it = seen.find(key); it != seen.end()) {
        const BoundOp& first = out.ops[it->second];
        for (size_t i = 0; i < op.outputs.size(); ++i) {
          if (op.outputs[i] >= 0) to[static_cast<size_t>(op.outputs[i])] = first.outputs[i];
        }
        continue;
      }
      seen.emplace(key, out.ops.size());
    }
    out.ops.push_back(std::move(op));
  }
  rename_results(out, to);
  return out;
}

Trace assign_executors(const Trace& trace,
                       const std::vector<std::shared_ptr<const Executor>>& executors) {
  Trace out = trace;
  out.stage = "executors";
  for (BoundOp& op : out.ops) {
    if (op.region >= 0) continue;  // the fuse pass gave the region to its executor
    op.executor.clear();
    for (const auto& e : executors) {
      if (e->claims(out, op)) {
        op.executor = e->name();
        break;
      }
    }
    KILN_CHECK(!op.executor.empty(), "[compile] no executor claims ", op.name(),
               "; keep 'eager' last in CompileOptions::executors");
  }
  return out;
}

}  // namespace kiln::compiler
