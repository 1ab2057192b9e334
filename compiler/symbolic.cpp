#include "compiler/symbolic.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "compiler/memory_plan.h"
#include "compiler/passes.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::compiler {
namespace {

// Whether attribute `i` of `op` is one of a random op's Philox seed and offset, which every run
// re-bases (executor.cpp) rather than reading: the offset always, the seed when it is the
// generator's at entry.
bool rebased(const BoundOp& op, size_t i) {
  if (op.rng_offset < 0) return false;
  const size_t n = op.attrs.size();
  return i + 1 == n || (i + 2 == n && op.rng_seed_from_entry);
}

// Calls f(op index, attribute index, element index (-1: a scalar int), value) for every integer
// of the trace's attributes that may move with the size, in a fixed order.
template <typename F>
void for_each_size_attr(const Trace& t, F&& f) {
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const BoundOp& op = t.ops[i];
    for (size_t a = 0; a < op.attrs.size(); ++a) {
      if (rebased(op, a)) continue;
      if (const auto* x = std::get_if<int64_t>(&op.attrs[a])) {
        f(i, a, -1, *x);
      } else if (const auto* shape = std::get_if<Shape>(&op.attrs[a])) {
        for (size_t k = 0; k < shape->size(); ++k) f(i, a, static_cast<int>(k), (*shape)[k]);
      }
    }
  }
}

std::string op_where(const Trace& t, size_t i) {
  const BoundOp& op = t.ops[i];
  std::string out = op.outputs.empty() || op.outputs[0] < 0 ? "_" : t.value(op.outputs[0]).name;
  return out + " = " + op.name() + "(...) (op " + std::to_string(i) + ")";
}

// Why `a` and `b` differ in something other than sizes and integer attributes, or "".
std::string structure_difference(const Trace& a, const Trace& b) {
  if (a.values.size() != b.values.size() || a.ops.size() != b.ops.size()) {
    return "the programs differ in length (" + std::to_string(a.ops.size()) + " and " +
           std::to_string(b.ops.size()) + " ops)";
  }
  if (a.arguments != b.arguments) return "the programs' arguments differ";
  if (a.externals != b.externals) {
    return "the programs capture different tensors (" + std::to_string(a.externals.size()) +
           " and " + std::to_string(b.externals.size()) + ")";
  }
  if (a.outputs != b.outputs) return "the programs' outputs differ";
  if (a.roles != b.roles) return "the programs' values differ";

  if (a.grad_effects.size() != b.grad_effects.size()) return "the programs' grad effects differ";
  for (size_t i = 0; i < a.grad_effects.size(); ++i) {
    if (a.grad_effects[i].external != b.grad_effects[i].external ||
        a.grad_effects[i].value != b.grad_effects[i].value) {
      return "the programs' grad effects differ";
    }
  }
  for (size_t v = 0; v < a.values.size(); ++v) {
    const ValueInfo& x = a.values[v];
    const ValueInfo& y = b.values[v];
    if (x.spec.dtype != y.spec.dtype || x.spec.device != y.spec.device ||
        x.requires_grad != y.requires_grad) {
      return "value " + y.name + " is " + spec_str(x.spec) + " at one size and " +
             spec_str(y.spec) + " at the other";
    }
    if (a.roles[v] == ValueRole::kExternal && x.spec.sizes != y.spec.sizes) {
      return "the captured tensor " + y.name + " has a size-dependent shape (" + spec_str(x.spec) +
             " and " + spec_str(y.spec) + ")";
    }
  }
  for (size_t i = 0; i < a.ops.size(); ++i) {
    const BoundOp& x = a.ops[i];
    const BoundOp& y = b.ops[i];
    if (x.op != y.op || x.inputs != y.inputs || x.outputs != y.outputs ||
        x.executor != y.executor || x.region != y.region || x.attrs.size() != y.attrs.size()) {
      return "the programs differ at " + op_where(b, i) + " (" + x.name() + " at the other size)";
    }
    if (y.autocast.any()) {
      return op_where(b, i) + " keeps an autocast state (see compiler/autocast_pass.h)";
    }
    if ((x.rng_offset >= 0) != (y.rng_offset >= 0) ||
        x.rng_seed_from_entry != y.rng_seed_from_entry) {
      return op_where(b, i) + " draws random numbers differently at the two sizes";
    }
    for (size_t k = 0; k < x.attrs.size(); ++k) {
      if (rebased(y, k)) continue;
      const Attr& p = x.attrs[k];
      const Attr& q = y.attrs[k];
      if (p.index() != q.index())
        return "attribute " + std::to_string(k) + " of " + op_where(b, i) + " changes type";
      if (std::holds_alternative<int64_t>(q)) continue;
      if (const auto* s = std::get_if<Shape>(&q)) {
        if (std::get<Shape>(p).size() != s->size()) {
          return "attribute " + std::to_string(k) + " of " + op_where(b, i) +
                 " changes length: " + attr_str(p) + " and " + attr_str(q);
        }
        continue;
      }
      if (attr_str(p) != attr_str(q)) {
        return "attribute " + std::to_string(k) + " of " + op_where(b, i) + " is " + attr_str(p) +
               " at one size and " + attr_str(q) +
               " at the other (only integer attributes may follow the size)";
      }
    }
  }
  return "";
}

int64_t numel_of_output(const Trace& t, const BoundOp& op) {
  return op.outputs.empty() || op.outputs[0] < 0 ? 0 : numel_of(t.value(op.outputs[0]).spec.sizes);
}

int64_t blocks_of(int64_t numel, int64_t per) { return (numel + per - 1) / per; }

// How the random ops' Philox offsets follow the size (SizeFit::random_ops), or why they do not.
std::string fit_random(const Trace& a, const Trace& b, SizeFit& fit) {
  std::vector<size_t> ops;
  bool same = a.rng_blocks == b.rng_blocks;
  for (size_t i = 0; i < b.ops.size(); ++i) {
    if (b.ops[i].rng_offset < 0) continue;
    ops.push_back(i);
    same &= a.ops[i].rng_offset == b.ops[i].rng_offset;
  }
  if (same) return "";  // draws that do not depend on the size
  const std::string not_shared =
      "random ops whose draws depend on the size are shared only when each draws ceil(numel / "
      "k) Philox blocks one after the other: ";
  if (b.rng_blocks == 0) {
    return not_shared + "this program replays the draws of another (a recomputed forward)";
  }
  auto by_offset = [](const Trace& t, std::vector<size_t> order) {
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t p, size_t q) { return t.ops[p].rng_offset < t.ops[q].rng_offset; });
    return order;
  };
  const std::vector<size_t> order = by_offset(b, ops);
  if (by_offset(a, ops) != order) return not_shared + "the ops draw in another order";
  if (a.ops[order[0]].rng_offset != b.ops[order[0]].rng_offset)
    return not_shared + "the first draw's offset changes";
  fit.first_offset = b.ops[order[0]].rng_offset;
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    auto blocks = [&](const Trace& t) {
      const int64_t next = k + 1 < order.size() ? t.ops[order[k + 1]].rng_offset
                                                : static_cast<int64_t>(t.rng_blocks);
      return next - t.ops[i].rng_offset;
    };
    const int64_t na = numel_of_output(a, a.ops[i]), nb = numel_of_output(b, b.ops[i]);
    int64_t per = 0;
    for (int64_t k2 : {1, 2, 4, 8}) {
      if (blocks_of(na, k2) != blocks(a) || blocks_of(nb, k2) != blocks(b)) continue;
      if (per != 0) return not_shared + op_where(b, i) + " fits several block sizes";
      per = k2;
    }
    if (per == 0) {
      return not_shared + op_where(b, i) + " draws " + std::to_string(blocks(a)) + " and " +
             std::to_string(blocks(b)) + " blocks for " + std::to_string(na) + " and " +
             std::to_string(nb) + " elements";
    }
    fit.random_ops.emplace_back(i, per);
  }
  return "";
}

}  // namespace

std::string fit_sizes(const Trace& a, int64_t sa, const Trace& b, int64_t sb, SizeFit& fit) {
  KILN_CHECK(sa != sb, "[compile] fit_sizes needs two different sizes, got ", sa, " twice");
  std::string why = structure_difference(a, b);
  if (!why.empty()) return why;
  std::vector<int64_t> xa;
  for_each_size_attr(a, [&](size_t, size_t, int, int64_t x) { xa.push_back(x); });
  SizeFit out;
  out.at = sb;
  size_t n = 0;
  for_each_size_attr(b, [&](size_t i, size_t k, int e, int64_t y) {
    const int64_t x = xa[n++];
    if (!why.empty()) return;
    if ((y - x) % (sb - sa) != 0) {
      why = "attribute " + std::to_string(k) + (e >= 0 ? "[" + std::to_string(e) + "]" : "") +
            " of " + op_where(b, i) + " is " + std::to_string(x) + " at size " +
            std::to_string(sa) + " and " + std::to_string(y) + " at size " + std::to_string(sb) +
            ": not an integer multiple of the size plus a constant";
      return;
    }
    out.slopes.push_back((y - x) / (sb - sa));
  });
  if (!why.empty()) return why;
  why = fit_random(a, b, out);
  if (!why.empty()) return why;
  fit = std::move(out);
  return "";
}

std::string instantiate(const Trace& b, const SizeFit& fit, int64_t s,
                        const std::vector<TensorSpec>& argument_specs, Trace& out) {
  KILN_CHECK(argument_specs.size() == b.arguments.size(),
             "[compile] instantiate: ", argument_specs.size(), " argument specs for a program of ",
             b.arguments.size(), " arguments");
  Trace t = b;
  t.arenas.clear();
  for (ValueInfo& v : t.values) {
    v.arena = -1;
    v.arena_offset = 0;
  }
  for (size_t i = 0; i < b.arguments.size(); ++i) {
    if (b.arguments[i] < 0) continue;
    TensorSpec& spec = t.values[static_cast<size_t>(b.arguments[i])].spec;
    if (argument_specs[i].dtype != spec.dtype || argument_specs[i].device != spec.device) {
      return "argument " + std::to_string(i) + " is " + spec_str(argument_specs[i]) +
             ", the program takes " + spec_str(spec);
    }
    spec = argument_specs[i];
  }
  // The fitted attributes, written in visiting order.
  std::vector<int64_t> values;
  values.reserve(fit.slopes.size());
  size_t n = 0;
  for_each_size_attr(b, [&](size_t, size_t, int, int64_t x) {
    values.push_back(x + fit.slopes[n++] * (s - fit.at));
  });
  KILN_CHECK(n == fit.slopes.size(), "[compile] instantiate: the fit does not match the trace");
  n = 0;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    BoundOp& op = t.ops[i];
    for (size_t a = 0; a < op.attrs.size(); ++a) {
      if (rebased(op, a)) continue;
      if (auto* x = std::get_if<int64_t>(&op.attrs[a])) {
        *x = values[n++];
      } else if (auto* shape = std::get_if<Shape>(&op.attrs[a])) {
        for (int64_t& d : *shape) d = values[n++];
      }
    }
    std::vector<TensorSpec> specs;
    try {
      specs = derive_specs(t, op);
    } catch (const Error& e) {
      return op_where(t, i) + " rejects the size " + std::to_string(s) + ": " + e.what();
    }
    if (specs.size() < op.outputs.size()) {
      return op_where(t, i) + " gives " + std::to_string(specs.size()) + " outputs at size " +
             std::to_string(s) + ", " + std::to_string(op.outputs.size()) + " when traced";
    }
    for (size_t k = 0; k < op.outputs.size(); ++k) {
      const int v = op.outputs[k];
      if (v < 0) continue;
      TensorSpec& spec = t.values[static_cast<size_t>(v)].spec;
      if (specs[k].dtype != spec.dtype || specs[k].device != spec.device) {
        return op_where(t, i) + " gives " + spec_str(specs[k]) + " at size " + std::to_string(s) +
               ", " + spec_str(spec) + " when traced";
      }
      spec = specs[k];
    }
  }
  if (!fit.random_ops.empty()) {  // the offsets eager code would reserve at this size
    int64_t offset = fit.first_offset;
    for (const auto& [i, per] : fit.random_ops) {
      t.ops[i].rng_offset = offset;
      offset += blocks_of(numel_of_output(t, t.ops[i]), per);
    }
    t.rng_blocks = static_cast<uint64_t>(offset);
  }
  t.stage = b.stage;
  out = std::move(t);
  return "";
}

namespace {

// The backward program's argument specs as the forward program's outputs give them: the saved
// values, then the output gradients (contiguous, as CompiledBackward passes them). Empty when
// a saved value is undefined.
std::vector<TensorSpec> backward_argument_specs(const Trace& forward, const BackwardPlan& plan) {
  const size_t kept = plan.user_outputs + plan.escaped;
  std::vector<TensorSpec> specs;
  for (size_t j = kept; j < forward.outputs.size(); ++j) {
    if (forward.outputs[j] < 0) return {};
    specs.push_back(forward.value(forward.outputs[j]).spec);
  }
  for (size_t k = 0; k < plan.grad_specs.size(); ++k) {
    TensorSpec g = plan.grad_specs[k];
    g.strides = {};
    for (size_t i = 0; i < plan.grad_outputs.size(); ++i) {
      if (plan.grad_outputs[i] == static_cast<int>(k) && forward.outputs[i] >= 0)
        g.sizes = forward.value(forward.outputs[i]).spec.sizes;
    }
    specs.push_back(std::move(g));
  }
  return specs;
}

// Why the traced backward's arguments are not those backward_argument_specs derives, or "".
std::string backward_arguments_differ(const Trace& forward, const BackwardPlan& plan) {
  const Trace& backward = plan.program->trace();
  const std::vector<TensorSpec> derived = backward_argument_specs(forward, plan);
  if (derived.size() != backward.arguments.size())
    return "the backward's arguments are not the forward's saved values and output gradients";
  for (size_t i = 0; i < derived.size(); ++i) {
    const int v = backward.arguments[i];
    if (v < 0) continue;
    const TensorSpec& s = backward.value(v).spec;
    if (s.sizes != derived[i].sizes || s.dtype != derived[i].dtype ||
        s.device != derived[i].device) {
      return "the backward's argument " + backward.value(v).name + " is " + spec_str(s) +
             " where the forward gives " + spec_str(derived[i]);
    }
  }
  return "";
}

// Why an executor no longer takes an op of an instantiated trace, or "".
std::string unclaimed(const Trace& t,
                      const std::vector<std::shared_ptr<const Executor>>& executors) {
  for (const BoundOp& op : t.ops) {
    if (op.executor == "eager") continue;
    for (const auto& e : executors) {
      if (e->name() != op.executor) continue;
      if (op.region >= 0 ? !e->fuses(t, op) : !e->claims(t, op))
        return "the executor " + e->name() + " does not take " + op.name() + " at this size";
    }
  }
  return "";
}

std::string fit_externals(const Program& a, int64_t sa, const Program& b, int64_t sb,
                          ExternalFit& fit) {
  const std::vector<Tensor>& ea = a.externals();
  const std::vector<Tensor>& eb = b.externals();
  if (ea.size() != eb.size()) return "the programs capture different tensors";
  for (size_t i = 0; i < ea.size(); ++i) {
    const Tensor& x = ea[i];
    const Tensor& y = eb[i];
    if (x.impl() == y.impl()) continue;
    const std::string name = b.trace().value(b.trace().externals[i]).name;
    if (!x.defined() || !y.defined() || x.dtype() != y.dtype() || x.device() != y.device() ||
        x.sizes() != y.sizes()) {
      return "the captured tensor " + name + " differs between the sizes";
    }
    if (equal(x, y)) continue;  // a constant made again, with the same value
    if (x.dim() == 0) {
      const double vx = x.item<double>(), vy = y.item<double>();
      const double slope = (vy - vx) / static_cast<double>(sb - sa);
      if (vx == std::floor(vx) && vy == std::floor(vy) && slope == std::floor(slope) &&
          std::abs(vx) < 0x1p52 && std::abs(vy) < 0x1p52) {
        fit.slopes.emplace_back(i, static_cast<int64_t>(slope));
        continue;
      }
    }
    return "the captured constant " + name +
           " has a value that is not an integer multiple of the size plus a constant (" +
           (x.dim() == 0 ? std::to_string(x.item<double>()) + " and " +
                               std::to_string(y.item<double>()) + ")"
                         : "a tensor)");
  }
  return "";
}

// `b`'s captured tensors for size `s`: the fitted 0-d constants made anew.
std::vector<Tensor> instantiate_externals(const Program& b, int64_t sb, const ExternalFit& fit,
                                          int64_t s) {
  std::vector<Tensor> out = b.externals();
  for (const auto& [i, slope] : fit.slopes) {
    const Tensor& old = out[i];
    const double value = old.item<double>() + static_cast<double>(slope * (s - sb));
    out[i] = full({}, value, TensorOptions(old.dtype()).device(old.device()));
  }
  return out;
}

}  // namespace

std::string share(const std::vector<std::pair<int, int64_t>>& dims, const Compilation& a,
                  int64_t sa, const Compilation& b, int64_t sb, SharedProgram& out) {
  if (a.key.size() != b.key.size()) return "the signature changed its length";
  SharedProgram sp;
  sp.dims = dims;
  sp.key = b.key;
  for (size_t j = 0; j < b.key.size(); ++j) {
    const int64_t diff = b.key[j] - a.key[j];
    if (diff % (sb - sa) != 0)
      return "the arguments' sizes or strides are not affine in the dynamic size";
    sp.key_slopes.push_back(diff / (sb - sa));
  }
  std::string why = fit_sizes(a.program->trace(), sa, b.program->trace(), sb, sp.forward_fit);
  if (!why.empty()) return why;
  why = fit_externals(*a.program, sa, *b.program, sb, sp.forward_externals);
  if (!why.empty()) return why;
  if (b.plan || a.plan) {
    if (!b.plan || !a.plan) return "one of the programs has a compiled backward and the other not";
    const BackwardPlan& pa = *a.plan;
    const BackwardPlan& pb = *b.plan;
    if (pa.user_outputs != pb.user_outputs || pa.escaped != pb.escaped ||
        pa.grad_outputs != pb.grad_outputs || pa.targets != pb.targets ||
        pa.grad_specs.size() != pb.grad_specs.size()) {
      return "the compiled backwards differ in their outputs or gradients";
    }
    why = fit_sizes(pa.program->trace(), sa, pb.program->trace(), sb, sp.backward_fit);
    if (why.empty()) {
      why = fit_externals(*pa.program, sa, *pb.program, sb, sp.backward_externals);
    }
    if (why.empty()) why = backward_arguments_differ(a.program->trace(), pa);
    if (why.empty()) why = backward_arguments_differ(b.program->trace(), pb);
    if (!why.empty()) return "backward: " + why;
  }
  sp.forward = b.program;
  sp.plan = b.plan;
  out = std::move(sp);
  return "";
}

std::string instantiate_shared(const SharedProgram& shared, const std::vector<Tensor>& args,
                               const std::vector<int64_t>& key,
                               const std::vector<std::shared_ptr<const Executor>>& executors,
                               bool plan_arenas, Compilation& out) {
  const SharedProgram& sp = shared;
  const auto [a0, d0] = sp.dims[0];
  const size_t i0 = static_cast<size_t>(a0);
  const bool has = i0 < args.size() && args[i0].defined() && d0 < args[i0].dim();
  const int64_t s = has ? args[i0].size(d0) : -1;
  const int64_t at = sp.forward_fit.at;
  bool fits = s >= 0 && key.size() == sp.key.size();
  for (size_t j = 0; fits && j < key.size(); ++j)
    fits = key[j] == sp.key[j] + sp.key_slopes[j] * (s - at);
  if (!fits)
    return "the call changes more than the size of the dimensions the shared program follows";
  std::vector<TensorSpec> specs;
  for (const Tensor& t : args)
    specs.push_back(t.defined() ? spec_of(t) : TensorSpec{{}, kFloat, Device(kCPU)});
  Trace forward;
  std::string why = instantiate(sp.forward->trace(), sp.forward_fit, s, specs, forward);
  if (why.empty()) why = unclaimed(forward, executors);
  if (!why.empty()) return why;
  std::shared_ptr<BackwardPlan> plan;
  if (sp.plan) {
    plan = std::make_shared<BackwardPlan>(*sp.plan);
    const std::vector<TensorSpec> bspecs = backward_argument_specs(forward, *plan);
    for (size_t k = 0; k < plan->grad_specs.size(); ++k) {
      plan->grad_specs[k].sizes = bspecs[bspecs.size() - plan->grad_specs.size() + k].sizes;
    }
    Trace backward;
    why = instantiate(sp.plan->program->trace(), sp.backward_fit, s, bspecs, backward);
    if (why.empty()) why = unclaimed(backward, executors);
    if (!why.empty()) return "backward: " + why;
    if (plan_arenas) backward = plan_memory(backward);
    plan->program = std::make_shared<const Program>(
        std::move(backward), instantiate_externals(*sp.plan->program, at, sp.backward_externals, s),
        executors);
  }
  if (plan_arenas) forward = plan_memory(forward);
  out = {key,
         std::make_shared<const Program>(
             std::move(forward), instantiate_externals(*sp.forward, at, sp.forward_externals, s),
             executors),
         std::move(plan)};
  return "";
}

}  // namespace kiln::compiler
