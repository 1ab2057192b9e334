// The compiler's IR: a Trace is a straight-line program of bound ops over values, recorded from
// the dispatcher's op stream (compiler/tracer.h) and rewritten by passes (compiler/passes.h),
// each of which returns a new Trace. It prints as one line per op:
//
//   # traced: 6 ops
//   def fn(a0: f32[4, 8] cpu, a1: i64[4] cpu; p0: f32[8, 8] cpu requires_grad)
//     t2 = mm(a0, p0)                                   # f32[4, 8] cpu
//     t3 = relu(t2)                                     # f32[4, 8] cpu
//     t4 = cross_entropy_fused(t3, a1, _; -100, 'mean', 0.0)   # f32[] cpu
//     return t4
//
// Values: a0.. are the callable's tensor arguments, p0.. the tensors it captured (parameters,
// buffers, optimizer state: "externals", entered by identity), t.. what ops produce. After
// executor assignment each line also names the executor (`[eager]`); a fusion region prints as
// a block of its members. Attributes follow the inputs after ';' in the op's attribute order
// (tensor/ops/ documents each op's layout); `_` is an absent optional input.
//
// In-place ops (OpKind::kInplace) stay in the trace in program order: their outputs are new
// values naming the written tensor's new contents, and a pass must not move an op across an
// in-place op that writes one of its inputs (passes.h says what each pass assumes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/registry.h"

namespace kiln::compiler {

// One tensor of a trace: its spec (the real device, not the proxy's meta device).
struct ValueInfo {
  TensorSpec spec;
  bool requires_grad = false;
  std::string name;
  // Set by plan_memory (compiler/memory_plan.h): the arena holding the value (-1: its op
  // allocates it) and its byte offset there.
  int arena = -1;
  int64_t arena_offset = 0;
};

// One arena of a planned program: a single allocation per run on `device`.
struct Arena {
  Device device = Device(kCPU);
  int64_t bytes = 0;
};

enum class ValueRole : uint8_t {
  kArgument,  // a tensor argument of the compiled callable
  kExternal,  // a tensor the callable captured (parameter, buffer, optimizer state)
  kOp,        // produced by an op of the trace
};

struct BoundOp {
  const OpDef* op = nullptr;
  std::vector<int> inputs;  // value ids; -1: an absent optional input
  absl::InlinedVector<Attr, 4> attrs;
  std::vector<int> outputs;  // value ids
  // Random ops: the offset of the op's Philox blocks from the program's base offset, and
  // whether its seed is the generator's at entry (else the recorded seed is kept).
  int64_t rng_offset = -1;
  bool rng_seed_from_entry = true;
  // The autocast state the op was called under (replayed with it): per device type, whether
  // autocast was on and its dtype. Default: off everywhere.
  struct Autocast {
    bool cpu = false, cuda = false;
    ScalarType cpu_dtype = kBFloat16, cuda_dtype = kBFloat16;
    bool any() const { return cpu || cuda; }
    bool operator==(const Autocast&) const = default;
  } autocast;
  // Recorded under cuda::internal::TrustedIndicesScope (kernels/cuda/runtime.h), and replayed
  // under it: an index_add whose caller vouches for the indices does not wait for the device
  // to check them (DDP's gathered rows, embedding's backward).
  bool trusted_indices = false;
  std::string executor;  // set by executor assignment
  int region = -1;       // the fusion region this op belongs to (-1: none)

  const std::string& name() const { return op->name; }
};

// After the program runs, `external`'s .grad is set to `value` (-1: to undefined), as a training
// step's backward() and zero_grad() leave it.
struct GradEffect {
  int external = 0;  // index into Trace::externals
  int value = -1;
};

class Trace {
 public:
  std::string stage = "traced";  // the pass that produced it
  std::string fn_name = "fn";
  std::vector<ValueInfo> values;
  std::vector<ValueRole> roles;
  std::vector<int> arguments;  // value ids of the tensor arguments, in order
  std::vector<int> externals;  // value ids of the captured tensors, in order of first use
  std::vector<BoundOp> ops;
  std::vector<int> outputs;  // value ids (-1: an undefined output)
  std::vector<GradEffect> grad_effects;
  uint64_t rng_blocks = 0;  // Philox blocks the program reserves per run
  // Off: generated kernels keep a fusion region's bf16 and f16 values in float and round only
  // what they store (CompileOptions::emulate_precision_casts).
  bool emulate_precision_casts = true;
  std::vector<std::string> region_names;
  std::vector<Arena> arenas;  // set by plan_memory

  // Adds a value and returns its id.
  int add_value(TensorSpec spec, ValueRole role, bool requires_grad = false);
  const ValueInfo& value(int id) const { return values[static_cast<size_t>(id)]; }

  // The listing described at the top of this file.
  std::string str() const;
};

// Where each op's work runs, by op index: a fusion region (a contiguous block of ops with the
// same BoundOp::region, compiler/fuse.h) runs as one step at its last op; other ops at their own.
std::vector<int> step_positions(const Trace& trace);

// A tensor's sizes, dtype, device and strides.
TensorSpec spec_of(const Tensor& t);
// "f32[4, 8] cpu": a value's spec as the listing prints it.
std::string spec_str(const TensorSpec& spec);
std::string attr_str(const Attr& attr);

}  // namespace kiln::compiler
