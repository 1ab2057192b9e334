#include "compiler/autocast_pass.h"

#include <functional>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "autograd/grad_mode.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "nn/autocast.h"

namespace kiln::compiler {
namespace {

// The autocast state an op runs under: (on, dtype) for its device type.
using StateOf = std::function<std::pair<bool, ScalarType>(const BoundOp& op, DeviceType type)>;

bool same_spec(const TensorSpec& a, const TensorSpec& b) {
  return a.sizes == b.sizes && a.dtype == b.dtype && a.device == b.device && a.strides == b.strides;
}

// The device type a call runs on, as the policy reads it: its first defined input's.
std::optional<DeviceType> call_type(const Trace& trace, const BoundOp& op) {
  for (int v : op.inputs) {
    if (v >= 0) return trace.value(v).spec.device.type();
  }
  return std::nullopt;
}

// A cast Tensor::to would make: to_copy(v; dtype, device).
bool is_plain_cast(const Trace& trace, const BoundOp& op) {
  static const OpDef& to_copy = Registry::get().op("to_copy");
  return op.op == &to_copy && op.inputs.size() == 1 && op.inputs[0] >= 0 &&
         op.outputs.size() == 1 && op.outputs[0] >= 0 && op.attrs.size() == 2 &&
         std::holds_alternative<ScalarType>(op.attrs[0]) &&
         std::holds_alternative<Device>(op.attrs[1]) &&
         std::get<Device>(op.attrs[1]) == trace.value(op.inputs[0]).spec.device;
}

// `recorded`: the trace's specs are those eager code gave under the ops' recorded states, so a
// re-derived spec must equal the recorded one (checked); else specs downstream of a cast change.
Trace apply_policy(const Trace& trace, const StateOf& state_of, bool recorded) {
  static const OpDef& to_copy = Registry::get().op("to_copy");
  Trace out = trace;
  out.stage = "autocast";
  out.ops.clear();
  out.ops.reserve(trace.ops.size());
  std::vector<bool> changed(trace.values.size(), false);  // the value's spec was re-derived
  // (value, dtype) -> the value holding its cast, until the next in-place op.
  absl::flat_hash_map<std::pair<int, ScalarType>, int> casts;
  for (const BoundOp& original : trace.ops) {
    BoundOp op = original;
    op.autocast = {};
    if (op.op->kind == OpKind::kInplace) casts.clear();
    const std::optional<DeviceType> type = call_type(out, op);
    const auto [on, dtype] =
        type ? state_of(original, *type) : std::pair<bool, ScalarType>{false, kBFloat16};
    bool cast_any = false;
    if (on) {
      std::vector<internal::AutocastInput> inputs;
      for (int v : op.inputs) {
        if (v < 0) {
          inputs.emplace_back();
          continue;
        }
        const TensorSpec& s = out.value(v).spec;
        inputs.push_back({true, s.dtype, s.device.type()});
      }
      const auto want = internal::autocast_input_casts(*op.op, inputs, op.attrs, dtype);
      for (size_t i = 0; i < want.size(); ++i) {
        if (!want[i]) continue;
        const int v = op.inputs[i];
        auto [it, fresh] = casts.try_emplace({v, *want[i]}, -1);
        if (fresh) {
          BoundOp cast;
          cast.op = &to_copy;
          cast.inputs = {v};
          cast.attrs = {*want[i], out.value(v).spec.device};
          const TensorSpec spec = derive_specs(out, cast)[0];
          it->second = out.add_value(spec, ValueRole::kOp);
          changed.push_back(false);
          cast.outputs = {it->second};
          out.ops.push_back(std::move(cast));
        }
        op.inputs[i] = it->second;
        cast_any = true;
      }
    }
    bool rederive = cast_any;
    for (int v : op.inputs) rederive |= v >= 0 && changed[static_cast<size_t>(v)];
    if (rederive) {
      const std::vector<TensorSpec> specs = derive_specs(out, op);
      for (size_t k = 0; k < op.outputs.size() && k < specs.size(); ++k) {
        const int v = op.outputs[k];
        if (v < 0) continue;
        ValueInfo& info = out.values[static_cast<size_t>(v)];
        KILN_CHECK(!recorded || same_spec(info.spec, specs[k]), "[autocast] ", info.name, " = ",
                   op.name(), "(...) gives ", spec_str(specs[k]),
                   " on its cast inputs, but the trace recorded ", spec_str(info.spec));
        changed[static_cast<size_t>(v)] = !same_spec(info.spec, specs[k]);
        info.spec = specs[k];
      }
    }
    // An op no kernel supports with these inputs runs its decomposition at run time, whose ops
    // eager code autocasts: it keeps the state so that the eager executor replays that.
    if (on && op.op->decomposition != nullptr && !device_kernel_supports(out, op)) {
      op.autocast = original.autocast;
      if (!recorded) {
        (*type == kCPU ? op.autocast.cpu : op.autocast.cuda) = true;
        (*type == kCPU ? op.autocast.cpu_dtype : op.autocast.cuda_dtype) = dtype;
      }
    }
    if (is_plain_cast(out, op)) {
      casts.try_emplace({op.inputs[0], std::get<ScalarType>(op.attrs[0])}, op.outputs[0]);
    }
    out.ops.push_back(std::move(op));
  }
  return out;
}

}  // namespace

Trace autocast(const Trace& trace) {
  return apply_policy(
      trace,
      [](const BoundOp& op, DeviceType type) {
        const BoundOp::Autocast& a = op.autocast;
        return type == kCPU    ? std::pair{a.cpu, a.cpu_dtype}
               : type == kCUDA ? std::pair{a.cuda, a.cuda_dtype}
                               : std::pair{false, kBFloat16};
      },
      /*recorded=*/true);
}

Trace autocast(const Trace& trace, DeviceType device, ScalarType dtype) {
  KILN_CHECK(dtype == kBFloat16 || dtype == kHalf,
             "[autocast] the autocast dtype must be bfloat16 or float16, got ", dtype_name(dtype));
  return apply_policy(
      trace,
      [device, dtype](const BoundOp&, DeviceType type) {
        return std::pair{type == device, dtype};
      },
      /*recorded=*/false);
}

}  // namespace kiln::compiler
