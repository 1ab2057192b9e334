// Dynamic dimensions: one compiled trace serving every size of a dimension marked dynamic
// (CompileOptions::dynamic), instead of a compilation per size.
//
// kiln's sizes are plain integers (Tensor::size returns int64_t, as libtorch's does), so the
// tracer cannot record a size as a symbol the way torch.compile's SymInt does: a callable that
// computes `x.size(1) * 4` hands the op the product. What is symbolic is recovered from two
// compilations instead. When a call differs from the last compiled one only in dimensions
// marked dynamic (size s1, now s2), the callable is compiled again and the two programs are
// compared:
//
//   - Their structure must be the same: ops, inputs, outputs, executors, regions, dtypes,
//     devices, random draws (fit_sizes says what differs otherwise).
//   - Every integer attribute (a reshape's sizes, a slice's end, ...) must be an affine
//     function of the size with an integer slope: x(s) = x(s2) + k (s - s2).
//
// A third size s then instantiates the template without tracing or running the passes: the
// arguments take their new specs, each integer attribute its fitted value, and every op's
// output specs are derived again by its meta rule (and view kernels, on proxies) from the new
// input specs, in order. So value shapes and strides are never guessed: they are what the meta
// rules compute on the new sizes. An attribute that is not affine in the size (a reshape to
// [T * T]) is caught by the meta rule it breaks (reshape checks the element count); a meta rule
// that rejects the new sizes makes that size compile on its own, and the recompile reason says
// which op refused.
//
// Pitfalls:
//   - A size-dependent attribute that is affine at the two compiled sizes but not elsewhere,
//     and that no meta rule checks, would be instantiated wrongly (min(T, 512) with T = 1024
//     and 2048 reads as the constant 512; a later op's meta rule usually rejects the result).
//   - Random ops whose number of Philox blocks depends on the size (dropout over the dynamic
//     dimension) are shared when each op's blocks are ceil(numel / k) of its output at both
//     sizes for one k in {1, 2, 4, 8}, and the ops' offsets follow one another without gaps:
//     their offsets are then derived again per size, as eager code would reserve them. A
//     backward that replays its forward's draws (recomputed dropout) is not shared.
//   - Ops that kept an autocast state (compiler/autocast_pass.h's pitfall) are not shared.
//
// CompiledCore (compile.cpp) keeps the cache and decides when to fit; share() fits two
// compilations into a SharedProgram and instantiate_shared() makes it for a third size:
//
//   SharedProgram sp;
//   if (share(dims, compiled_at_8, 8, compiled_at_16, 16, sp).empty()) {
//     Compilation at_12;
//     const std::string why = instantiate_shared(sp, args, key, executors, true, at_12);
//   }
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "compiler/executor.h"
#include "compiler/program.h"
#include "compiler/trace.h"

namespace kiln::compiler {

// How each integer attribute of a trace moves with the dynamic size, in the order
// for_each_size_attr visits them: x(s) = x(at) + slope * (s - at).
struct SizeFit {
  int64_t at = 0;  // the size the template trace was compiled for
  std::vector<int64_t> slopes;
  // When random ops draw size-dependent numbers of Philox blocks: each one (op index, in the
  // order of its offset), with the elements one block serves (ceil(numel / per) blocks for an
  // output of numel elements), from `first_offset` on.
  std::vector<std::pair<size_t, int64_t>> random_ops;
  int64_t first_offset = 0;
};

// Compares `a` (compiled for size `sa`) with `b` (for size `sb != sa`): returns why they
// cannot share one trace, or "" and sets `fit` (relative to b).
std::string fit_sizes(const Trace& a, int64_t sa, const Trace& b, int64_t sb, SizeFit& fit);

// `b` instantiated for size `s`: `argument_specs` (one per Trace::arguments entry) replace the
// argument values' specs, attributes take their fitted values and every op's output specs are
// derived again, in order. Returns why the size cannot use the template (a meta rule's error,
// an output whose dtype or device changed), or "" and sets `out`. Arenas are cleared: run
// plan_memory again.
std::string instantiate(const Trace& b, const SizeFit& fit, int64_t s,
                        const std::vector<TensorSpec>& argument_specs, Trace& out);

// ---- One program for every size: what CompiledCore (compile.cpp) builds from two compilations
// and instantiates per size. compile.cpp decides when (the cache); these say whether and how.

// The backward half of a joint trace, and how its gradients map to the call's tensors.
struct BackwardPlan {
  std::shared_ptr<const Program> program;  // arguments: saved values, then output gradients
  size_t user_outputs = 0;                 // the forward program's outputs of the callable
  // Then values the callable kept in its own state (a first call creating it), then the saved
  // values.
  size_t escaped = 0;
  std::vector<int> grad_outputs;       // per user output: its gradient's position, or -1
  std::vector<TensorSpec> grad_specs;  // per differentiable output
  // Per gradient the backward returns: the argument index (>= 0) or -1 - external index.
  std::vector<int> targets;
};

// One compilation for one size: a side of a fit, or a size the shared program instantiated.
struct Compilation {
  std::vector<int64_t> key;  // the call's signature key (argument sizes and strides among it)
  std::shared_ptr<const Program> program;
  std::shared_ptr<const BackwardPlan> plan;  // joint programs only
};

// How the captured tensors of two compilations for sizes sa and sb relate: the same tensor, an
// equal constant, or a 0-d constant the trace made whose value follows the size (the divisor of
// a mean's backward), fitted like an integer attribute: value(s) = value(sb) + slope (s - sb).
struct ExternalFit {
  std::vector<std::pair<size_t, int64_t>> slopes;  // (index into the externals, slope)
};

// One compiled trace serving the sizes of the dynamic dimensions.
struct SharedProgram {
  std::vector<std::pair<int, int64_t>> dims;  // the marked dimensions that follow the size
  std::vector<int64_t> key, key_slopes;       // the signature key at forward_fit.at; its slopes
  SizeFit forward_fit, backward_fit;
  ExternalFit forward_externals, backward_externals;
  std::shared_ptr<const Program> forward;
  std::shared_ptr<const BackwardPlan> plan;
};

// Fits `a` (compiled for size `sa`) to `b` (compiled for a call that changed only `dims`, each
// from `sa` to `sb`): forward, backward, captured constants and the signature key. Returns why
// they cannot share one program, or "" and sets `out` (relative to b).
std::string share(const std::vector<std::pair<int, int64_t>>& dims, const Compilation& a,
                  int64_t sa, const Compilation& b, int64_t sb, SharedProgram& out);

// `shared` instantiated for a call with tensor arguments `args` and signature key `key`: the
// traces instantiated, each op still taken by its executor of `executors` at the new size, and
// the memory planned again when `plan_arenas` (plan_memory is not skipped). Returns why it does
// not serve the call, or "" and sets `out`. The captured tensors' guards are the caller's.
std::string instantiate_shared(const SharedProgram& shared, const std::vector<Tensor>& args,
                               const std::vector<int64_t>& key,
                               const std::vector<std::shared_ptr<const Executor>>& executors,
                               bool plan_arenas, Compilation& out);

}  // namespace kiln::compiler
