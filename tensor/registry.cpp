#include "tensor/registry.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "autograd/grad_mode.h"
#include "tensor/ops/decomposition_kernel.h"
#include "tensor/ops/elementwise_meta.h"
#include "tensor/profiler.h"

namespace kiln {

struct Registry::Impl {
  std::mutex mu;
  absl::flat_hash_map<std::string, std::unique_ptr<OpDef>> ops;
};

Registry& Registry::get() {
  static Registry r;
  return r;
}

Registry::Impl& Registry::impl() const {
  static Impl i;
  return i;
}

OpDef& Registry::entry(std::string_view name) {
  Impl& i = impl();
  std::lock_guard<std::mutex> lock(i.mu);
  auto& slot = i.ops[std::string(name)];
  if (!slot) {
    slot = std::make_unique<OpDef>();
    slot->name = std::string(name);
  }
  return *slot;
}

const OpDef& Registry::op(std::string_view name) {
  const OpDef& def = entry(name);
  KILN_CHECK(def.meta != nullptr, "[", name, "] no such op is defined in the registry");
  return def;
}

std::vector<std::string> Registry::names() const {
  Impl& i = impl();
  std::lock_guard<std::mutex> lock(i.mu);
  std::vector<std::string> out;
  for (const auto& [name, def] : i.ops) {
    if (def->meta != nullptr) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void Registry::set_kernel_order(std::string_view op, DeviceType device,
                                const std::vector<std::string>& names) {
  OpDef& def = entry(op);
  KILN_CHECK(def.meta != nullptr, "[set_kernel_order] no op named '", op, "' is defined");
  KernelList& list = def.kernels[static_cast<int>(device)];
  KernelList ordered;
  for (const std::string& n : names) {
    auto it =
        std::find_if(list.begin(), list.end(), [&](const KernelDef& k) { return k.name == n; });
    KILN_CHECK(it != list.end(), "[set_kernel_order] ", op, " has no ", device_type_name(device),
               " kernel named '", n, "'");
    ordered.push_back(*it);
    list.erase(it);
  }
  for (KernelDef& k : list) ordered.push_back(std::move(k));
  std::lock_guard<std::mutex> lock(impl().mu);
  list = std::move(ordered);
}

const KernelDef* OpDef::select_kernel(DeviceType device, const OpCall& call) const {
  for (const KernelDef& k : kernels[static_cast<int>(device)]) {
    if (k.accepts(call)) return &k;
  }
  return nullptr;
}

const KernelDef* OpDef::find_kernel(DeviceType device, std::string_view kernel_name) const {
  for (const KernelDef& k : kernels[static_cast<int>(device)]) {
    if (k.name == kernel_name) return &k;
  }
  return nullptr;
}

KernelFn OpDef::first_kernel(DeviceType device) const {
  const KernelList& list = kernels[static_cast<int>(device)];
  return list.empty() ? nullptr : list.front().fn;
}

OpRegistrar::OpRegistrar(std::string_view name, OpKind kind, MetaFn meta, OpFlags flags) {
  OpDef& d = Registry::get().entry(name);
  d.kind = kind;
  d.meta = meta;
  d.allow_cpu_scalars = flags.allow_cpu_scalars;
  d.cross_device = flags.cross_device;
  d.mutated = flags.mutated;
  d.random = flags.random;
}
OpRegistrar::OpRegistrar(std::string_view name, DeviceType device, KernelFn kernel)
    : OpRegistrar(name, device, "", kernel, nullptr, 0) {}
OpRegistrar::OpRegistrar(std::string_view name, DeviceType device, std::string_view kernel_name,
                         KernelFn kernel, SupportFn supports, int priority) {
  KernelList& list = Registry::get().entry(name).kernels[static_cast<int>(device)];
  for (const KernelDef& k : list) {
    KILN_CHECK(k.name != kernel_name, "[", name, "] two ", device_type_name(device),
               " kernels are registered as '", kernel_name, "'");
  }
  // Stable insertion by priority: equal priorities keep registration order.
  auto pos = std::find_if(list.begin(), list.end(),
                          [&](const KernelDef& k) { return k.priority > priority; });
  list.insert(pos, KernelDef{std::string(kernel_name), kernel, supports, priority});
}
OpRegistrar::OpRegistrar(std::string_view name, BackwardFn backward, uint32_t saved_inputs,
                         bool saved_outputs) {
  OpDef& d = Registry::get().entry(name);
  d.backward = backward;
  d.saved_inputs = saved_inputs;
  d.saved_outputs = saved_outputs;
}
OpRegistrar::OpRegistrar(std::string_view name, BackwardFn backward, SaveFn save_inputs,
                         bool saved_outputs)
    : OpRegistrar(name, backward, ~0u, saved_outputs) {
  Registry::get().entry(name).save_inputs_fn = save_inputs;
}
OpRegistrar::OpRegistrar(std::string_view name, DecompositionFn decomposition) {
  Registry::get().entry(name).decomposition = decomposition;
}

const std::string& OpCall::name() const {
  static const std::string unknown = "op";
  return op != nullptr ? op->name : unknown;
}

// --- Dispatch ---------------------------------------------------------------------------------

namespace {

constexpr int kNumKeys = static_cast<int>(DispatchKey::kCount);
thread_local bool t_proxy_mode = false;
constexpr int kAutogradKey = static_cast<int>(DispatchKey::Autograd);
std::array<std::atomic<const DispatchHandler*>, kNumKeys> g_handlers{};

// For an op with a decomposition, above autograd: chooses the kernel that will run the call, or,
// when no kernel of the device supports it, runs the decomposition in its place (its ops go
// through the whole chain, so autograd records them and the op's own backward rule is not
// needed). Returns true when the decomposition ran. Meta tensors (tracing) keep the op whole.
bool decompose_unsupported(OpCall& call) {
  const OpDef& op = *call.op;
  const Device device = common_device(call);
  if (device.is_meta() || t_proxy_mode) return false;
  (void)op.meta(call);  // the checks come first: support rules may assume a valid call
  call.kernel = op.select_kernel(device.type(), call);
  if (call.kernel != nullptr) return false;
  call.outputs = op.decomposition(call);
  return true;
}

void dispatch_from(OpCall& call, int key) {
  for (int k = key; k < kNumKeys; ++k) {
    if (k == kAutogradKey && call.op->decomposition != nullptr && call.kernel == nullptr &&
        decompose_unsupported(call)) {
      return;
    }
    const DispatchHandler* h = g_handlers[k].load(std::memory_order_acquire);
    if (h != nullptr && h->active(call)) {
      h->handle(call);
      return;
    }
  }
  run_backend(call);
}

Tensor allocate(const TensorSpec& spec, bool proxy) {
  const size_t nbytes = nbytes_of(spec.sizes, element_size(spec.dtype), "allocate");
  if (!spec.strides.empty() && numel_of(spec.sizes) > 0) {  // every offset inside the allocation
    int64_t last = 0;
    bool ok = spec.strides.size() == spec.sizes.size();
    for (size_t d = 0; ok && d < spec.sizes.size(); ++d) {
      ok = spec.strides[d] >= 0;
      last += spec.sizes[d] > 0 ? (spec.sizes[d] - 1) * spec.strides[d] : 0;
    }
    KILN_CHECK(ok && last < numel_of(spec.sizes), "[allocate] strides ", shape_str(spec.strides),
               " are not a dense layout of sizes ", shape_str(spec.sizes));
  }
  return Tensor(std::make_shared<TensorImpl>(
      proxy ? proxy_storage(nbytes, spec.device) : allocate_storage(nbytes, spec.device),
      spec.sizes, spec.strides.empty() ? contiguous_strides(spec.sizes) : spec.strides, 0,
      spec.dtype));
}

// An in-place op's outputs: the inputs it writes (OpDef::mutated), by default input 0.
void set_inplace_outputs(OpCall& call) {
  call.outputs.clear();
  if (call.op->mutated != nullptr) {
    call.op->mutated(call, call.outputs);
  } else {
    call.outputs.push_back(call.inputs[0]);
  }
}

// run_backend in proxy mode: outputs carry shapes, dtypes and devices, and no kernel runs.
void run_on_proxies(OpCall& call, const SpecList& specs) {
  const OpDef& op = *call.op;
  switch (op.kind) {
    case OpKind::kFunctional:
      call.outputs.clear();
      for (const TensorSpec& s : specs) call.outputs.push_back(allocate(s, /*proxy=*/true));
      return;
    case OpKind::kInplace:
      set_inplace_outputs(call);
      for (const Tensor& t : call.outputs) t.impl()->bump_version();
      return;
    case OpKind::kView:
      op.first_kernel(kCPU)(call);
      return;
    case OpKind::kDynamic:
      KILN_FAIL("[", op.name, "] the shape of its output depends on the values of its inputs, ",
                "which are not known while kiln::compile traces the function: call ", op.name,
                " outside the compiled function and pass its result in as an argument");
  }
}

}  // namespace

ProxyModeGuard::ProxyModeGuard() : previous_(t_proxy_mode) { t_proxy_mode = true; }
ProxyModeGuard::~ProxyModeGuard() { t_proxy_mode = previous_; }
bool in_proxy_mode() { return t_proxy_mode; }

void set_dispatch_handler(DispatchKey key, const DispatchHandler* handler) {
  g_handlers[static_cast<int>(key)].store(handler, std::memory_order_release);
}

void dispatch(OpCall& call) { dispatch_from(call, 0); }

void dispatch_after(OpCall& call, DispatchKey key) {
  dispatch_from(call, static_cast<int>(key) + 1);
}

Device common_device(const OpCall& call) {
  if (call.op->cross_device && !call.inputs.empty()) return call.inputs[0].device();
  const Tensor* first = nullptr;
  for (const Tensor& t : call.inputs) {
    if (!t.defined()) continue;
    if (call.op->allow_cpu_scalars && t.is_cpu() && t.dim() == 0) continue;
    if (first == nullptr) {
      first = &t;
    } else {
      KILN_CHECK(t.device() == first->device(), "[", call.name(),
                 "] expected all tensors on the same device, got ", first->device().str(), " and ",
                 t.device().str());
    }
  }
  if (first != nullptr) return first->device();
  for (const Tensor& t : call.inputs) {
    if (t.defined()) return t.device();
  }
  for (const Attr& a : call.attrs) {
    if (const Device* d = std::get_if<Device>(&a)) return *d;
  }
  return Device(kCPU);
}

void run_backend(OpCall& call) {
  const OpDef& op = *call.op;
  for (const Tensor& t : call.inputs) {
    KILN_CHECK(t.defined() || op.kind == OpKind::kFunctional, "[", op.name,
               "] got an undefined tensor");
  }
  const Device device = common_device(call);
  const SpecList specs = op.meta(call);
  if (t_proxy_mode) {
    run_on_proxies(call, specs);
    return;
  }
  const KernelDef* chosen = call.kernel;
  if (op.kind == OpKind::kView) {
    chosen = nullptr;  // views are device-agnostic: the CPU entry builds them
  } else if (chosen == nullptr && !device.is_meta()) {
    chosen = op.select_kernel(device.type(), call);
    if (chosen == nullptr && op.decomposition != nullptr) {
      call.outputs = op.decomposition(call);
      return;
    }
    KILN_CHECK(chosen != nullptr || op.kernels[static_cast<int>(device.type())].empty(), "[",
               op.name, "] no ", device_type_name(device.type()), " kernel supports this call");
  }
  KernelFn kernel = chosen != nullptr ? chosen->fn : nullptr;
  switch (op.kind) {
    case OpKind::kFunctional:
      call.outputs.clear();
      for (const TensorSpec& s : specs) call.outputs.push_back(allocate(s, /*proxy=*/false));
      if (device.is_meta()) return;  // proxies carry no data
      break;
    case OpKind::kInplace:
      set_inplace_outputs(call);
      if (device.is_meta()) return;
      break;
    case OpKind::kView:
      kernel = op.first_kernel(kCPU);
      break;
    case OpKind::kDynamic:
      KILN_CHECK(!device.is_meta(), "[", op.name,
                 "] the output shape depends on the data, so it cannot run on meta tensors");
      break;
  }
  KILN_CHECK(kernel != nullptr, "[", op.name, "] is not implemented for device ", device.str());
  if (profiler::internal::active() && op.kind != OpKind::kView && !device.is_meta()) {
    profiler::internal::run_timed(kernel, chosen, call, device);
  } else {
    kernel(call);
  }
  if (op.kind == OpKind::kInplace) {
    for (const Tensor& t : call.outputs) t.impl()->bump_version();
  }
}

TensorVec call_op(const OpDef& op, TensorVec inputs, absl::InlinedVector<Attr, 4> attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  dispatch(call);
  return std::move(call.outputs);
}

TensorVec call_op_with_kernel(const OpDef& op, std::string_view kernel, TensorVec inputs,
                              absl::InlinedVector<Attr, 4> attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  const Device device = common_device(call);
  call.kernel = op.find_kernel(device.type(), kernel);
  KILN_CHECK(call.kernel != nullptr, "[", op.name, "] has no ", device_type_name(device.type()),
             " kernel named '", kernel, "'");
  (void)op.meta(call);
  KILN_CHECK(call.kernel->accepts(call), "[", op.name, "] the ", device_type_name(device.type()),
             " kernel '", kernel, "' does not support this call");
  dispatch(call);
  return std::move(call.outputs);
}

void run_into(const OpDef& op, TensorVec inputs, TensorVec outputs,
              absl::InlinedVector<Attr, 4> attrs) {
  KILN_CHECK(op.kind == OpKind::kFunctional, "[", op.name,
             "] run_into takes functional ops only (this op makes no fresh outputs)");
  KILN_CHECK(!t_proxy_mode, "[", op.name, "] run_into cannot run while tracing on proxies");
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  // An undefined input is an absent optional one: the meta rule says where one may be.
  const Device device = common_device(call);
  const SpecList specs = op.meta(call);
  KILN_CHECK(outputs.size() == specs.size(), "[", op.name, "] run_into got ", outputs.size(),
             " outputs for an op with ", specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor& out = outputs[i];
    KILN_CHECK(specs[i].strides.empty() || specs[i].strides == contiguous_strides(specs[i].sizes),
               "[", op.name, "] run_into takes ops whose outputs are contiguous; output ", i,
               " has strides ", shape_str(specs[i].strides));
    KILN_CHECK(out.defined() && out.sizes() == specs[i].sizes && out.dtype() == specs[i].dtype &&
                   out.device() == specs[i].device && out.is_contiguous(),
               "[", op.name, "] run_into's output ", i, " must be a contiguous ",
               dtype_name(specs[i].dtype), " tensor of shape ", shape_str(specs[i].sizes), " on ",
               specs[i].device.str(), ", got ",
               out.defined()
                   ? std::string(dtype_name(out.dtype())) + " " + shape_str(out.sizes()) +
                         (out.is_contiguous() ? "" : " strided") + " on " + out.device().str()
                   : std::string("an undefined tensor"));
  }
  // An output overlapping an input would be read after the kernel began writing it.
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t k = 0; k < call.inputs.size(); ++k) {
      KILN_CHECK(!internal::memory_overlaps(outputs[i], call.inputs[k]), "[", op.name,
                 "] run_into's output ", i, " overlaps input ", k, " in memory");
    }
  }
  const KernelDef* chosen = op.select_kernel(device.type(), call);
  KILN_CHECK(chosen != nullptr, "[", op.name, "] run_into: no ", device_type_name(device.type()),
             " kernel supports this call");
  call.outputs = std::move(outputs);
  if (device.is_meta()) return;
  if (profiler::internal::active()) {
    profiler::internal::run_timed(chosen->fn, chosen, call, device);
  } else {
    chosen->fn(call);
  }
}

TensorVec call_decomposition(const OpDef& op, TensorVec inputs,
                             absl::InlinedVector<Attr, 4> attrs) {
  KILN_CHECK(op.decomposition != nullptr, "[", op.name, "] has no decomposition");
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  (void)common_device(call);
  (void)op.meta(call);
  return op.decomposition(call);
}

void decomposition_kernel(OpCall& call) {
  KILN_CHECK(call.op->decomposition != nullptr, "[", call.op->name, "] has no decomposition");
  NoGradGuard no_grad;  // the kernel's steps, not the caller's graph
  const TensorVec r = call.op->decomposition(call);
  for (size_t i = 0; i < call.outputs.size(); ++i) call.outputs[i].copy_(r[i]);
}

Tensor call_op1(const OpDef& op, TensorVec inputs, absl::InlinedVector<Attr, 4> attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  dispatch(call);
  return std::move(call.outputs[0]);
}

}  // namespace kiln
