// Autocast: the guard (setting tensor/autocast_state.h) and the dispatch handler at
// DispatchKey::Autocast.
#include "nn/autocast.h"

#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "tensor/error.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

enum class Policy : uint8_t { kLower, kFloat32, kPromote };

// The ops of each policy (see autocast.h for why each list holds what it holds).
constexpr std::string_view kLowerOps[] = {"mm", "bmm", "addmm", "linear_cross_entropy"};
constexpr std::string_view kFloat32Ops[] = {
    "softmax", "log_softmax", "rms_norm",  "layer_norm",       "sum", "mean", "prod",  "var",
    "std",     "norm",        "logsumexp", "cumsum",           "exp", "log",  "log1p", "expm1",
    "rsqrt",   "reciprocal",  "pow",       "pow_tensor_scalar"};
constexpr std::string_view kPromoteOps[] = {
    "cat",     "where",       "lerp",      "atan2",           "maximum",
    "minimum", "scatter_add", "index_add", "lstm_cell_fused", "gru_cell_fused"};

// Calls f(op name, policy) for every op of the table.
template <typename F>
void for_each_policy(F&& f) {
  for (std::string_view op : kLowerOps) f(op, Policy::kLower);
  for (std::string_view op : kFloat32Ops) f(op, Policy::kFloat32);
  for (std::string_view op : kPromoteOps) f(op, Policy::kPromote);
}

// The table keyed by op entry, built when the first guard enables autocast: every name must be a
// defined op, so that a misspelled or removed one fails there instead of being skipped.
const absl::flat_hash_map<const OpDef*, Policy>& policies() {
  static const auto* table = [] {
    auto* t = new absl::flat_hash_map<const OpDef*, Policy>();
    for_each_policy([&](std::string_view op, Policy p) {
      const OpDef* def = nullptr;
      try {
        def = &Registry::get().op(op);
      } catch (const Error& e) {
        KILN_FAIL("[autocast] the policy table names an op the registry lacks: ", e.what());
      }
      (*t)[def] = p;
    });
    return t;
  }();
  return *table;
}

bool eligible_float(const internal::AutocastInput& t) {
  return t.defined && is_floating_point(t.dtype) && t.dtype != kDouble;
}

// Whether the op has a policy for this call: a functional op of the table without an explicit
// dtype attribute (in-place ops and views run as they are; an explicit dtype wins).
bool has_policy(const OpDef& op, const absl::InlinedVector<Attr, 4>& attrs) {
  if (op.kind != OpKind::kFunctional || !policies().contains(&op)) return false;
  for (const Attr& a : attrs) {
    if (std::holds_alternative<ScalarType>(a)) return false;
  }
  return true;
}

// The device type the call runs on: that of its first defined input.
bool call_device(const OpCall& call, DeviceType* type) {
  for (const Tensor& t : call.inputs) {
    if (t.defined()) {
      *type = t.device().type();
      return true;
    }
  }
  return false;
}

bool autocast_active(const OpCall& call) {
  if (!internal::any_autocast_enabled()) return false;
  if (call.op->kind != OpKind::kFunctional) return false;
  DeviceType type;
  if (!call_device(call, &type) || !is_autocast_enabled(type)) return false;
  return has_policy(*call.op, call.attrs);
}

void autocast_handle(OpCall& call) {
  DeviceType type = kCPU;
  call_device(call, &type);
  std::vector<internal::AutocastInput> inputs;
  inputs.reserve(call.inputs.size());
  for (const Tensor& t : call.inputs) {
    inputs.push_back(t.defined() ? internal::AutocastInput{true, t.dtype(), t.device().type()}
                                 : internal::AutocastInput{});
  }
  const auto casts =
      internal::autocast_input_casts(*call.op, inputs, call.attrs, autocast_dtype(type));
  for (size_t i = 0; i < casts.size(); ++i) {
    if (casts[i]) call.inputs[i] = call.inputs[i].to(*casts[i]);
  }
  dispatch_after(call, DispatchKey::Autocast);
}

const DispatchHandler kAutocastHandler{autocast_active, autocast_handle};

struct Install {
  Install() { set_dispatch_handler(DispatchKey::Autocast, &kAutocastHandler); }
} install;

}  // namespace

namespace internal {
std::vector<std::string_view> autocast_policy_ops() {
  std::vector<std::string_view> names;
  for_each_policy([&](std::string_view op, Policy) { names.push_back(op); });
  return names;
}
size_t resolved_autocast_policies() { return policies().size(); }

std::vector<std::optional<ScalarType>> autocast_input_casts(
    const OpDef& op, const std::vector<AutocastInput>& inputs,
    const absl::InlinedVector<Attr, 4>& attrs, ScalarType dtype) {
  std::vector<std::optional<ScalarType>> casts;
  if (!has_policy(op, attrs)) return casts;
  DeviceType type = kCPU;
  for (const AutocastInput& t : inputs) {
    if (t.defined) {
      type = t.device;
      break;
    }
  }
  const Policy policy = policies().at(&op);
  ScalarType target = dtype;
  if (policy == Policy::kPromote) {
    bool any = false;
    for (const AutocastInput& t : inputs) {
      if (!t.defined || !is_floating_point(t.dtype)) continue;
      target = any ? promote_types(target, t.dtype) : t.dtype;
      any = true;
    }
    if (!any) return casts;
  }
  casts.resize(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const AutocastInput& t = inputs[i];
    if (!eligible_float(t)) continue;
    // CPU 0-d tensors joining GPU inputs stay where they are (they are read as scalars).
    if (t.device != type) continue;
    switch (policy) {
      case Policy::kLower:
      case Policy::kPromote:
        if (t.dtype != target) casts[i] = target;
        break;
      case Policy::kFloat32:
        if (is_reduced_float(t.dtype)) casts[i] = kFloat;
        break;
    }
  }
  return casts;
}
}  // namespace internal

AutocastGuard::AutocastGuard(DeviceType device, ScalarType dtype, bool enabled) : device_(device) {
  KILN_CHECK(device == kCPU || device == kCUDA,
             "[autocast] expected the cpu or cuda device type, got ", device_type_name(device));
  KILN_CHECK(!enabled || dtype == kBFloat16 || dtype == kHalf,
             "[autocast] the autocast dtype must be bfloat16 or float16, got ", dtype_name(dtype));
  if (enabled) (void)policies();  // a bad table fails here, before the first op runs
  prev_enabled_ = is_autocast_enabled(device);
  prev_dtype_ = autocast_dtype(device);
  internal::set_autocast_state(device, enabled, enabled ? dtype : prev_dtype_);
}

AutocastGuard::~AutocastGuard() {
  internal::set_autocast_state(device_, prev_enabled_, prev_dtype_);
}

}  // namespace kiln
