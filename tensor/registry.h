// The op registry and dispatcher: every op is defined once, here, and every consumer (eager
// kernels per device, autograd, autocast, the compiler's tracer) plugs into its entry.
//
// An OpDef answers the four questions the compiler asks of every op:
//   - what does it produce: the meta rule, from input shapes/dtypes/devices and attributes the
//     output specs (shape, dtype, device), with all argument checking. Defined in tensor/ops/.
//   - which kernel can run this call: per device type, a list of kernels in preference order,
//     each with a support rule ("can this kernel run this call?"). Registered from kernels/cpu/
//     and kernels/cuda/. A device may hold several kernels for one op (a hand kernel and a
//     library call); the first whose rule accepts the call runs.
//   - what is it made of: for fused ops, a decomposition into other ops, registered beside the
//     meta rule. When no kernel of the device supports a call, the op runs its decomposition
//     (before autograd, so the gradient comes from the decomposition's ops).
//   - how does it differentiate: a backward rule, written in kiln ops (registered from
//     autograd/).
//
// A call runs through the dispatch chain: each DispatchKey (Trace, Autocast, Autograd) may
// have a handler installed by its layer; a handler sees the call and either handles it or
// passes it on with `next`. The last step, run_backend(), checks devices, runs meta, allocates
// outputs and calls the chosen kernel of the inputs' device. Modes hook in without touching any
// op.
//
//   KILN_DEFINE_OP(rms_norm, OpKind::kFunctional, rms_norm_meta);          // tensor/ops/norm.cpp
//   KILN_REGISTER_DECOMPOSITION(rms_norm, rms_norm_decomposition);         // tensor/ops/norm.cpp
//   KILN_REGISTER_KERNEL(rms_norm, kCPU, rms_norm_cpu);                    // kernels/cpu/norm.cpp
//   KILN_REGISTER_KERNEL_IF(rms_norm, kCUDA, "fused", rms_norm_cuda, rms_norm_cuda_supports);
//   KILN_REGISTER_BACKWARD(rms_norm, rms_norm_backward_rule);              // autograd/
//
// Adding an op: see docs/adding_an_op.md.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "tensor/tensor.h"

namespace kiln {

// An attribute of an op call: everything that is not an input tensor.
using Attr = std::variant<std::monostate, bool, int64_t, double, Scalar, Shape, ScalarType,
                          std::string, Device>;

struct TensorSpec {
  Shape sizes;
  ScalarType dtype;
  Device device;
  // The output's strides, dense over `sizes` (dense_strides_like); empty: contiguous.
  Shape strides = {};
};
using SpecList = absl::InlinedVector<TensorSpec, 2>;
using TensorVec = absl::InlinedVector<Tensor, 4>;

struct OpDef;
struct KernelDef;

// One invocation of an op: its inputs, attributes and (once run) outputs. Kernels read inputs
// and attributes and write into the preallocated outputs.
struct OpCall {
  const OpDef* op = nullptr;
  TensorVec inputs;
  absl::InlinedVector<Attr, 4> attrs;
  TensorVec outputs;
  // The kernel that runs the call: chosen by the dispatcher (the first of the device's kernels
  // whose support rule accepts the call), or named by call_op_with_kernel.
  const KernelDef* kernel = nullptr;

  const Tensor& input(size_t i) const { return inputs[i]; }
  template <typename T>
  const T& attr(size_t i) const;
  // An optional attribute: std::monostate means "not given".
  bool has_attr(size_t i) const {
    return i < attrs.size() && !std::holds_alternative<std::monostate>(attrs[i]);
  }
  const std::string& name() const;
};

enum class OpKind : uint8_t {
  kFunctional,  // outputs are fresh tensors allocated from the meta rule
  kInplace,     // output 0 is input 0, written in place (its version is bumped)
  kView,        // outputs alias input 0's storage; the kernel (device-agnostic) makes them
  kDynamic,     // output shapes depend on data: the kernel allocates the outputs
};

using MetaFn = SpecList (*)(const OpCall& call);
using KernelFn = void (*)(OpCall& call);
// A kernel's support rule: whether it can run this call (which the meta rule has accepted). It
// reads shapes, dtypes, strides, attributes and device properties, never tensor data, and is
// cheap: it runs on every call of the op.
using SupportFn = bool (*)(const OpCall& call);
// The inputs an in-place op writes (default: input 0), in the order of the call's outputs.
using MutatedFn = void (*)(const OpCall& call, TensorVec& mutated);

// One kernel of an op on one device type.
struct KernelDef {
  std::string name;  // unique per op and device ("flash_hopper"); "" for the only one
  KernelFn fn = nullptr;
  SupportFn supports = nullptr;  // nullptr: every call the meta rule accepts
  int priority = 0;              // lower is tried first (registration order breaks ties)
  bool accepts(const OpCall& call) const { return supports == nullptr || supports(call); }
};
using KernelList = absl::InlinedVector<KernelDef, 1>;

// What a backward rule receives: the forward call (inputs, attributes, outputs; inputs the
// rule does not save arrive as meta tensors carrying only shape, dtype and device) and the
// gradients of the outputs. An output that received no gradient gets zeros when the rule first
// reads its gradient (grad(i), grads()): a rule that never reads it costs no zeros (the
// linear_cross_entropy rule reads only the loss's, not the [vocab, C] zeros of its dweight).
struct BackwardCall {
  const OpCall& forward;
  TensorList grad_outputs;  // undefined where an output received none and grad(i) was not read
  // Whether input i needs a gradient; rules may skip work for the others.
  absl::Span<const bool> needs_input_grad;
  // Writes zeros into grad_outputs[i] (the caller's storage), for an absent gradient's first
  // read; null: every gradient is defined.
  void (*materialize)(void* context, size_t i) = nullptr;
  void* materialize_context = nullptr;
  const Tensor& input(size_t i) const { return forward.inputs[i]; }
  const Tensor& output(size_t i) const { return forward.outputs[i]; }
  const Tensor& grad(size_t i = 0) const {
    if (!grad_outputs[i].defined() && materialize != nullptr) materialize(materialize_context, i);
    return grad_outputs[i];
  }
  // Whether output i received a gradient (false: grad(i) would be zeros the engine made).
  bool has_grad(size_t i) const { return grad_outputs[i].defined() || materialize == nullptr; }
  // Every output's gradient, zeros for the absent ones.
  TensorList grads() const {
    for (size_t i = 0; i < grad_outputs.size(); ++i) (void)grad(i);
    return grad_outputs;
  }
  bool needs_grad(size_t i) const { return i < needs_input_grad.size() && needs_input_grad[i]; }
  template <typename T>
  const T& attr(size_t i) const {
    return forward.attr<T>(i);
  }
};
// Gradients for each input (undefined where not needed or not differentiable), written in
// kiln ops so that they are differentiable themselves (higher-order gradients) and traceable.
using BackwardFn = TensorVec (*)(const BackwardCall& call);
// A fused op written as other ops: what runs when no kernel of the device supports a call, and
// what the compiler's decompose pass substitutes. Returns the op's outputs (same count, shapes
// and dtypes as the meta rule's; for an in-place op, the inputs it wrote).
using DecompositionFn = TensorVec (*)(const OpCall& call);
// Which inputs a call's backward reads (bit i: input i), decided per call when it is recorded:
// rotary_emb reads x only when its tables require grad, so x need not live until backward.
using SaveFn = uint32_t (*)(const OpCall& call);

struct OpDef {
  std::string name;
  OpKind kind = OpKind::kFunctional;
  MetaFn meta = nullptr;
  // Per device type, in preference order (set_kernel_order changes it).
  std::array<KernelList, kNumDeviceTypes> kernels{};
  BackwardFn backward = nullptr;
  // Which forward tensors the backward rule reads (bit i: input i; saved_outputs: all outputs).
  // Autograd keeps only these alive; the rest become meta tensors in the BackwardCall.
  uint32_t saved_inputs = ~0u;
  SaveFn save_inputs_fn = nullptr;  // when set, replaces saved_inputs per call
  bool saved_outputs = true;
  DecompositionFn decomposition = nullptr;
  // Lets a CPU 0-d tensor input join inputs on another device (as PyTorch does for scalars).
  bool allow_cpu_scalars = true;
  // Inputs may live on different devices (copies); the op runs on input 0's device.
  bool cross_device = false;
  // kInplace ops that write several inputs (the multi-tensor optimizer update) name them here.
  MutatedFn mutated = nullptr;
  // A random op: its last two attributes are the Philox seed and base offset it reserved
  // (tensor/ops/random.cpp); the compiler re-bases them on every run of a compiled program.
  bool random = false;

  // The first kernel of `device` that supports the call, or nullptr.
  const KernelDef* select_kernel(DeviceType device, const OpCall& call) const;
  // The kernel of `device` named `name` ("" for an op's unnamed kernel), or nullptr.
  const KernelDef* find_kernel(DeviceType device, std::string_view name) const;
  // The first kernel of `device` regardless of support rules (views, copies), or nullptr.
  KernelFn first_kernel(DeviceType device) const;
};

struct OpFlags {
  bool allow_cpu_scalars = true;
  bool cross_device = false;
  MutatedFn mutated = nullptr;
  bool random = false;
};

class Registry {
 public:
  static Registry& get();
  // The entry for `name`, created empty if absent (so registration order does not matter).
  OpDef& entry(std::string_view name);
  // The entry for `name`; fails unless its meta rule was defined.
  const OpDef& op(std::string_view name);
  std::vector<std::string> names() const;

  // Sets the preference order of `op`'s kernels on `device`: the kernels named come first, in
  // this order; the others follow in their registered order. For the results of measurement
  // (which kernel wins on this GPU); call it before the op runs on other threads. An unknown op
  // or kernel name is an error.
  void set_kernel_order(std::string_view op, DeviceType device,
                        const std::vector<std::string>& names);

 private:
  Registry() = default;
  struct Impl;
  Impl& impl() const;
};

// Static registration helpers used by tensor/ops, kernels/ and autograd/:
//   KILN_DEFINE_OP(add, OpKind::kFunctional, binary_meta);
//   KILN_REGISTER_KERNEL(add, kCPU, add_cpu);
//   KILN_REGISTER_BACKWARD(add, add_backward);
struct OpRegistrar {
  OpRegistrar(std::string_view name, OpKind kind, MetaFn meta, OpFlags flags = {});
  OpRegistrar(std::string_view name, DeviceType device, KernelFn kernel);
  OpRegistrar(std::string_view name, DeviceType device, std::string_view kernel_name,
              KernelFn kernel, SupportFn supports, int priority = 0);
  OpRegistrar(std::string_view name, BackwardFn backward, uint32_t saved_inputs = ~0u,
              bool saved_outputs = true);
  OpRegistrar(std::string_view name, BackwardFn backward, SaveFn save_inputs,
              bool saved_outputs = true);
  OpRegistrar(std::string_view name, DecompositionFn decomposition);
};
#define KILN_REG_CONCAT2(a, b) a##b
#define KILN_REG_CONCAT(a, b) KILN_REG_CONCAT2(a, b)
#define KILN_DEFINE_OP(name, kind, ...) \
  static const ::kiln::OpRegistrar KILN_REG_CONCAT(kiln_def_, __COUNTER__)(#name, kind, __VA_ARGS__)
#define KILN_REGISTER_KERNEL(name, device, fn) \
  static const ::kiln::OpRegistrar KILN_REG_CONCAT(kiln_kernel_, __COUNTER__)(#name, device, fn)
// A kernel that runs only the calls its support rule accepts; kernels of one device are tried
// by priority (lower first), then registration order:
//   KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "flash_hopper", fwd_hopper, hopper_supports);
//   KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "flash_sm80", fwd_sm80, sm80_supports, 1);
#define KILN_REGISTER_KERNEL_IF(name, device, kernel_name, fn, supports, ...)  \
  static const ::kiln::OpRegistrar KILN_REG_CONCAT(kiln_kernel_, __COUNTER__)( \
      #name, device, kernel_name, fn, supports __VA_OPT__(, ) __VA_ARGS__)
//   KILN_REGISTER_BACKWARD(add, add_backward, kSaveNone, false);  // what the rule reads
#define KILN_REGISTER_BACKWARD(name, fn, ...)                               \
  static const ::kiln::OpRegistrar KILN_REG_CONCAT(kiln_bwd_, __COUNTER__)( \
      #name, static_cast<::kiln::BackwardFn>(fn) __VA_OPT__(, ) __VA_ARGS__)
inline constexpr uint32_t kSaveNone = 0;
inline constexpr uint32_t kSaveAll = ~0u;
constexpr uint32_t save_inputs(std::initializer_list<int> which) {
  uint32_t m = 0;
  for (int i : which) m |= 1u << i;
  return m;
}
#define KILN_REGISTER_DECOMPOSITION(name, fn)                                  \
  static const ::kiln::OpRegistrar KILN_REG_CONCAT(kiln_decomp_, __COUNTER__)( \
      #name, static_cast<::kiln::DecompositionFn>(fn))

// --- Dispatch ---------------------------------------------------------------------------------

enum class DispatchKey : uint8_t { Trace, Autocast, Autograd, kCount };

// A handler sees every call while installed and active. It either produces call.outputs
// itself or continues down the chain with dispatch_after(call, its own key).
struct DispatchHandler {
  // Cheap test of whether the handler wants this call (e.g. grad mode on and an input
  // requires grad); an inactive handler costs the call one test.
  bool (*active)(const OpCall& call) = nullptr;
  void (*handle)(OpCall& call) = nullptr;
};
void set_dispatch_handler(DispatchKey key, const DispatchHandler* handler);

// Proxy mode, for kiln::compile's tracer: while a ProxyModeGuard lives on this thread,
// run_backend gives functional ops proxy outputs (no memory: StorageImpl::is_proxy) and runs no
// kernel; in-place ops only bump versions; view ops build their views as usual; ops whose
// output shape depends on data fail, naming the op. Ops with a decomposition stay whole.
class ProxyModeGuard {
 public:
  ProxyModeGuard();
  ~ProxyModeGuard();
  ProxyModeGuard(const ProxyModeGuard&) = delete;
  ProxyModeGuard& operator=(const ProxyModeGuard&) = delete;

 private:
  bool previous_;
};
bool in_proxy_mode();

// Runs `call` through the dispatch chain; on return call.outputs holds the results.
void dispatch(OpCall& call);
// Continues a call below `key` in the chain (what a handler calls to pass it on).
void dispatch_after(OpCall& call, DispatchKey key);
// The last step of the chain: checks, meta, allocation and the device kernel.
void run_backend(OpCall& call);
// The device all inputs run on (the first non-CPU-scalar input's), checking they agree.
Device common_device(const OpCall& call);

// Convenience for op wrappers: builds the call, dispatches it, returns the outputs.
TensorVec call_op(const OpDef& op, TensorVec inputs, absl::InlinedVector<Attr, 4> attrs = {});
Tensor call_op1(const OpDef& op, TensorVec inputs, absl::InlinedVector<Attr, 4> attrs = {});

// For tests and the kernel lab: the call through the dispatch chain (autograd included), run by
// the kernel named `kernel` of the inputs' device, which must exist and support the call.
TensorVec call_op_with_kernel(const OpDef& op, std::string_view kernel, TensorVec inputs,
                              absl::InlinedVector<Attr, 4> attrs = {});
// For kernels built from other ops (linear_cross_entropy's chunks): a functional op's kernel
// run on `inputs` writing into `outputs`, tensors the caller holds, instead of fresh ones (no
// copy of a result into its place). Below the dispatch chain: no autograd, trace or autocast.
// Each output must have the meta rule's sizes, dtype and device and be contiguous (what kernels
// assume of the outputs they are given); an output must not overlap an input. An undefined input
// is an absent optional one, as in call_op.
void run_into(const OpDef& op, TensorVec inputs, TensorVec outputs,
              absl::InlinedVector<Attr, 4> attrs = {});
// For tests and the compiler: the op's decomposition run on the inputs (its ops dispatched as
// any others, so autograd records them), after the meta rule's checks. Fails for an op without
// a decomposition.
TensorVec call_decomposition(const OpDef& op, TensorVec inputs,
                             absl::InlinedVector<Attr, 4> attrs = {});

// Resolves an op once per call site: `static const OpDef& op = KILN_OP(add);`
#define KILN_OP(name) ::kiln::Registry::get().op(#name)

template <typename T>
const T& OpCall::attr(size_t i) const {
  KILN_CHECK(i < attrs.size(), "[", name(), "] missing attribute ", i);
  const T* v = std::get_if<T>(&attrs[i]);
  KILN_CHECK(v != nullptr, "[", name(), "] attribute ", i, " has an unexpected type");
  return *v;
}

}  // namespace kiln
