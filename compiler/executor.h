// Executors: what runs a trace's ops. An executor has a name, a checker that claims bound ops,
// and a lowering that turns a claimed op into a step of the compiled program. Executors are
// tried in priority order (CompileOptions::executors); "eager" (the op's registered kernels
// through the dispatcher, below the Trace key) is always there as the fallback.
//
// A user can register an executor that claims ops by name, as Thunder's pluggable executors:
//
//   auto mine = kiln::compiler::make_op_executor("my_relu", {
//       {"relu", [](kiln::OpCall& call) {                 // fills call.outputs
//          call.outputs = {kiln::clamp_min(call.input(0), 0.0)};
//        }}});
//   kiln::compiler::register_executor(mine);
//   auto f = kiln::compile(fn, kiln::CompileOptions().executors({"my_relu", "eager"}));
//
// A lowered op reads its inputs from the program's value slots and writes its outputs there.
// Steps run with grad mode off: a compiled program's gradient comes from its own backward ops.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "compiler/trace.h"

namespace kiln::compiler {

// The tensors of one run of a program, indexed by value id, and the run's random base.
struct Frame {
  std::vector<Tensor> slots;
  // Outputs placed in the run's arenas by plan_memory (compiler/memory_plan.h), by value id;
  // empty when nothing is placed. An executor that writes into given outputs uses them.
  std::vector<Tensor> placed;
  uint64_t rng_seed = 0;
  uint64_t rng_base = 0;
};
using Step = std::function<void(Frame&)>;

class Executor {
 public:
  virtual ~Executor() = default;
  virtual const std::string& name() const = 0;
  // Whether this executor runs `op` (of `trace`).
  virtual bool claims(const Trace& trace, const BoundOp& op) const = 0;
  // The step that runs `op`; called only for ops this executor claimed.
  virtual Step lower(const Trace& trace, const BoundOp& op) const = 0;

  // Fusion (compiler/fuse.h). Whether `op` may join a region this executor runs whole: the fuse
  // pass groups such ops into regions (contiguous blocks of the trace), and lower_region turns
  // the region trace.ops[begin, end) into one step. Executors without fusion keep the defaults.
  virtual bool fuses(const Trace& trace, const BoundOp& op) const;
  virtual Step lower_region(const Trace& trace, size_t begin, size_t end) const;

  // Matmul epilogues (compiler/fuse.h, attach_epilogues). Whether this executor runs `matmul`
  // (an mm or addmm) together with `consumer`, the op that reads its output (`product`: the
  // mm's output or a view of it), as one region: the product and the elementwise op after it in one
  // library call. With keeps_product, the product (or a view between) is also read outside the
  // region, which must then write it too. Default: no.
  virtual bool fuses_epilogue(const Trace& trace, const BoundOp& matmul, int product,
                              const BoundOp& consumer, bool keeps_product) const;
};

// Registers an executor under its name (replacing one of the same name, "eager" excepted).
void register_executor(std::shared_ptr<const Executor> executor);
// The executor named `name`; fails naming the registered ones when there is none.
std::shared_ptr<const Executor> find_executor(std::string_view name);
std::vector<std::string> executor_names();

// An executor for ops named in `impls`: each function receives the call (inputs and attributes
// set, outputs empty) and fills call.outputs with tensors of the meta rule's shapes and dtypes.
using OpImpl = std::function<void(OpCall& call)>;
std::shared_ptr<const Executor> make_op_executor(std::string name,
                                                 std::vector<std::pair<std::string, OpImpl>> impls);

// The OpCall a bound op makes in this frame: inputs from the slots, the attributes, and for
// random ops the Philox seed and offset of this run.
OpCall bind_call(const BoundOp& op, const Frame& frame);
// Stores a finished call's outputs into the frame's slots.
void store_outputs(const BoundOp& op, OpCall& call, Frame& frame);

// Sets this thread's autocast state to the one an op was traced under, and back afterwards
// (when they differ: the common case, all off, costs two tests).
class AutocastScope {
 public:
  explicit AutocastScope(const BoundOp::Autocast& want);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  static void set(const BoundOp::Autocast& s);
  BoundOp::Autocast saved_;
  bool changed_ = false;
};

// The built-in CPU fusion executor, "fused_cpu" (compiler/fused_cpu.cpp; docs/compiler.md).
std::shared_ptr<const Executor> make_fused_cpu_executor();
// The built-in CUDA fusion executor, "fused_cuda": a generated NVRTC kernel per pointwise region
// of CUDA values (compiler/fused_cuda.h; docs/compiler.md). Fuses nothing without a usable GPU.
std::shared_ptr<const Executor> make_fused_cuda_executor();

// A matmul-epilogue executor (compiler/matmul_epilogue.cpp) named `name` for values on the given
// device types: an mm whose output only an add or sub reads (a residual of the product's shape,
// or a bias row) runs as one addmm, the GEMM library's C matrix or bias epilogue (cuBLASLt on
// CUDA). The built-in one, "matmul_epilogue", takes CUDA only: its result rounds once where
// eager's rounds twice (the product, then the sum), which is within eager's own bf16 error but
// not bit-equal, and compiled CPU programs keep eager's bits. A CPU instance is for programs that
// accept that contract (and for tests).
std::shared_ptr<const Executor> make_matmul_epilogue_executor(std::string name,
                                                              std::vector<DeviceType> devices);

}  // namespace kiln::compiler
