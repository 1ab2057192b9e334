// kiln::compile: records a callable's op stream once as a trace, transforms it and runs the
// result on every later call with the same input signature (docs/compiler.md).
//
//   auto step = kiln::compile([&](const kiln::Tensor& x, const kiln::Tensor& y) {
//     opt.zero_grad();
//     kiln::Tensor loss = kiln::nn::functional::cross_entropy(model(x), y);
//     loss.backward();
//     opt.step();
//     return loss;
//   });
//   for (...) kiln::Tensor loss = step(x, y);      // traced on the first call, replayed after
//   std::cout << step.traces().back().str();     // the program that ran
//
//   auto fwd = kiln::compile(model);               // a module: its forward
//
// The callable takes tensors, std::vector<Tensor> and arithmetic scalars (a scalar's value is
// part of the signature: a new value compiles again) and returns a Tensor, a std::vector<Tensor>,
// a std::tuple of tensors or nothing. Parameters, buffers and other tensors it captures enter the
// program by identity.
//
// The signature a program is cached under: each tensor argument's shape, strides, dtype, device
// and requires_grad, the scalar arguments, grad mode and the autocast state; a cached program
// also checks that each captured tensor still has the shape, dtype, device and requires_grad it
// was traced with, and whether it had a gradient. Anything else the callable decides in C++
// (an if on a member variable, a value read from a file) is frozen at trace time: values that
// change from call to call must be tensors or scalar arguments.
//
// On CUDA a cached program's GPU steps run as CUDA graphs from its second run on
// (CompileOptions::cuda_graphs, compiler/cuda_graph.h); stats() says whether, or why not.
//
// Pitfalls: reading a tensor's values inside the callable (item(), printing, data_ptr(), ops such
// as nonzero whose output shape depends on data) is an error while tracing: return the tensor and
// read it outside. A callable that creates state on its first call (an optimizer's buffers) runs
// that first call as traced, and is traced again on the second call. A compiled callable keeps
// its cache unsynchronised: call it from one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "compiler/partition.h"
#include "compiler/trace.h"

namespace kiln {

class CompileOptions {
 public:
  // Executors in priority order (compiler/executor.h); "eager" is appended when missing. The
  // default, {"matmul_epilogue", "fused_cuda", "fused_cpu", "eager"}, runs an mm and the residual
  // add or bias after it as one addmm on CUDA (matmul_epilogue), pointwise regions of CUDA ops as
  // generated kernels (fused_cuda), fusion regions of CPU ops with fused_cpu, and everything else
  // with the ops' own kernels.
  CompileOptions& executors(std::vector<std::string> names);
  // Skips a pass by name: "autocast", "decompose", "functionalize", "simplify", "dce", "cse",
  // "fuse_norm_residual", "fold_index_add", "fuse_qkv_rotary", "fold_copy_into_mm", "fuse",
  // "plan_memory" (the order they run in).
  CompileOptions& skip_pass(std::string name);
  // Ops the decompose pass always expands into their decompositions (besides those no executor
  // claims whole and no kernel supports), e.g. {"rms_norm"} to see its primitives.
  CompileOptions& decompose(std::vector<std::string> op_names);
  // Marks dimension `dim` of tensor argument `argument` (counting tensors in the flattened
  // argument list) as dynamic, e.g. the sequence length. The first two sizes compile; from the
  // two programs one is fitted that every further size shares without tracing or passes, its
  // shapes derived again by the meta rules (compiler/symbolic.h). Where the programs cannot be
  // shared, or the meta rules reject a size, that size compiles on its own and the recompile
  // reason says why; compilations for a dynamic dimension do not count against recompile_limit.
  CompileOptions& dynamic(int argument, int64_t dim);
  // Prints every stage's trace to stderr when compiling.
  CompileOptions& debug(bool on = true);
  // Writes every stage's trace to `dir`/<name>.<n>.<stage>.txt (also set by KILN_TRACE_DIR).
  CompileOptions& trace_dir(std::string dir);
  // After this many compilations of one callable, it warns once and runs eagerly.
  CompileOptions& recompile_limit(int limit);
  // The name the traces print for the callable.
  CompileOptions& name(std::string name);
  // What a compiled backward saves (compiler/partition.h): kMinCut (the default) saves a minimum
  // cut of the forward's values and recomputes cheap ones in the backward; kSaveAll saves every
  // forward value the backward reads.
  CompileOptions& remat(compiler::RematPolicy policy);
  // The most bytes the forward may save for the backward: kMinCut recomputes more (reductions,
  // then every op but matmuls, attention, random and in-place ops) until the cut fits, and
  // compiling fails naming the least it can save when nothing fits.
  CompileOptions& activation_budget(int64_t bytes);
  // CUDA graphs (compiler/cuda_graph.h; on by default): a cached program's GPU steps are
  // captured on its second run and replayed with one cudaGraphLaunch per graph after that. A
  // program that cannot be captured (on the CPU, with collectives, ...) runs op by op, and
  // stats().graph_reason says why.
  CompileOptions& cuda_graphs(bool on);
  // Whether the generated CUDA kernels (fused_cuda) round each bf16 or f16 value a fusion region
  // computes to its dtype, as eager code does (on by default: compiled results are eager's bit
  // for bit). Off, a region keeps those values in float and rounds only what it writes to
  // memory, as torch.compile's generated kernels do (its emulate_precision_casts, off there by
  // default): fewer instructions per element, results within the dtype's rounding of eager's.
  // Hand kernels, library calls and CPU regions are unaffected.
  CompileOptions& emulate_precision_casts(bool on);

  const std::vector<std::string>& executors() const { return executors_; }
  const std::vector<std::string>& skipped_passes() const { return skipped_; }
  const std::vector<std::string>& decomposed_ops() const { return decomposed_; }
  const std::vector<std::pair<int, int64_t>>& dynamic_dims() const { return dynamic_; }
  bool debug() const { return debug_; }
  const std::string& trace_dir() const { return trace_dir_; }
  int recompile_limit() const { return recompile_limit_; }
  const std::string& name() const { return name_; }
  const compiler::PartitionOptions& partition() const { return partition_; }
  bool cuda_graphs() const { return cuda_graphs_; }
  bool emulate_precision_casts() const { return emulate_precision_casts_; }

 private:
  std::vector<std::string> executors_{"matmul_epilogue", "fused_cuda", "fused_cpu", "eager"};
  std::vector<std::string> skipped_;
  std::vector<std::string> decomposed_;
  std::vector<std::pair<int, int64_t>> dynamic_;
  bool debug_ = false;
  std::string trace_dir_;
  int recompile_limit_ = 8;
  std::string name_ = "fn";
  compiler::PartitionOptions partition_;
  bool cuda_graphs_ = true;
  bool emulate_precision_casts_ = true;
};

namespace compiler {

// What a compiled callable did so far.
struct CompileStats {
  int64_t calls = 0;
  int64_t hits = 0;    // calls that ran a cached program
  int64_t misses = 0;  // calls that traced and compiled
  // Calls that gave a new size of a dynamic dimension to the shared program (no trace, no
  // passes: CompileOptions::dynamic), and the last such instantiation's time in milliseconds.
  int64_t dynamic_instances = 0;
  double instantiate_ms = 0;
  bool fell_back_to_eager = false;
  // Why each compilation after the first happened ("argument 0: shape [4, 8] -> [4, 16]").
  std::vector<std::string> recompile_reasons;
  // The last compilation's time per stage, in milliseconds ("trace", "dce", ...).
  std::vector<std::pair<std::string, double>> stage_ms;
  // The last compiled program's planned peak of intermediate memory (Program::
  // planned_peak_bytes; for a forward/backward pair, the larger of the two).
  int64_t planned_peak_bytes = 0;
  // The last compiled program's arenas (plan_memory) added up, in bytes; for a forward/backward
  // pair, the larger program's.
  int64_t arena_bytes = 0;
  // For a compiled function with a backward: the bytes of the values the forward saves for it,
  // and the forward ops the backward recomputes instead of saving (CompileOptions::remat).
  int64_t saved_bytes = 0;
  int recomputed_ops = 0;
  // CUDA graphs (CompileOptions::cuda_graphs) of the last program that ran: `cuda_graph` is
  // "replaying" (its GPU steps run as graphs), "warm-up" (captured on its next run),
  // "measuring" (a program with all-reduces times its runs op by op and as graphs, then keeps the
  // faster: docs/compiler.md, "Collectives") or "off"; `graph_reason` says why it is off ("CPU
  // program ...", "capturing ... failed: ...", "op by op measured faster: ...") or, when
  // replaying, how the program is split ("1 graph, 0 host steps"). Captures (the first, and
  // those after a new program or a captured tensor's memory moved: graph_recapture_reasons) and
  // replays are counted over all programs; graph_static_bytes are the last captured program's
  // static input buffers, graph_kept_bytes its values that outlive a graph in the graph's memory
  // (a training step's gradients, kept until the graph's next launch).
  std::string cuda_graph = "off";
  std::string graph_reason;
  int64_t graph_captures = 0;
  int64_t graph_replays = 0;
  std::vector<std::string> graph_recapture_reasons;
  int64_t graph_static_bytes = 0;
  int64_t graph_kept_bytes = 0;
};

// The arguments of one call, flattened: the tensors, and everything else of the signature.
struct FlatArgs {
  std::vector<Tensor> tensors;
  std::vector<double> scalars;
};

// The type-erased part of a compiled callable: cache, guards, tracing and passes.
class CompiledCore {
 public:
  explicit CompiledCore(CompileOptions options);
  ~CompiledCore();
  // Runs the cached program for `args` (compiling it first on a miss); `body` runs the
  // callable on the given tensors (proxies while tracing, real ones when falling back).
  std::vector<Tensor> call(
      const FlatArgs& args,
      const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& body);
  const CompileStats& stats() const;
  // Every stage of the last compilation, traced first.
  const std::vector<Trace>& traces() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Flattening of arguments and results (see compile.h's banner for what is accepted).
template <typename T>
void flatten_arg(FlatArgs& flat, const T& arg) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, Tensor>) {
    flat.tensors.push_back(arg);
  } else if constexpr (std::is_same_v<D, std::vector<Tensor>>) {
    flat.scalars.push_back(static_cast<double>(arg.size()));
    flat.tensors.insert(flat.tensors.end(), arg.begin(), arg.end());
  } else if constexpr (std::is_arithmetic_v<D>) {
    flat.scalars.push_back(static_cast<double>(arg));
  } else {
    static_assert(sizeof(D) == 0,
                  "kiln::compile: arguments must be tensors, std::vector<Tensor> "
                  "or arithmetic scalars");
  }
}

// The argument the callable receives: proxies (or the real tensors) in place of the tensors.
template <typename T>
decltype(auto) rebuild_arg(const T& arg, const std::vector<Tensor>& tensors, size_t& next) {
  using D = std::decay_t<T>;
  if constexpr (std::is_same_v<D, Tensor>) {
    return Tensor(tensors[next++]);
  } else if constexpr (std::is_same_v<D, std::vector<Tensor>>) {
    std::vector<Tensor> v(tensors.begin() + static_cast<std::ptrdiff_t>(next),
                          tensors.begin() + static_cast<std::ptrdiff_t>(next + arg.size()));
    next += arg.size();
    return v;
  } else {
    return D(arg);
  }
}

template <typename R>
std::vector<Tensor> flatten_result(R&& r) {
  using D = std::decay_t<R>;
  if constexpr (std::is_same_v<D, Tensor>) {
    return {std::forward<R>(r)};
  } else if constexpr (std::is_same_v<D, std::vector<Tensor>>) {
    return std::forward<R>(r);
  } else {
    return std::apply([](auto&&... t) { return std::vector<Tensor>{Tensor(t)...}; },
                      std::forward<R>(r));
  }
}

template <typename R>
R unflatten_result(std::vector<Tensor>&& outs) {
  if constexpr (std::is_void_v<R>) {
    return;
  } else if constexpr (std::is_same_v<R, Tensor>) {
    return std::move(outs.at(0));
  } else if constexpr (std::is_same_v<R, std::vector<Tensor>>) {
    return std::move(outs);
  } else {
    return [&]<size_t... I>(std::index_sequence<I...>) { return R{std::move(outs.at(I))...}; }
    (std::make_index_sequence<std::tuple_size_v<R>>{});
  }
}

// A module holder (Linear, Sequential, models::GPT): compile(module) compiles its forward.
template <typename M>
concept ModuleHolderLike = requires(M m) {
  typename M::ContainedType;
  m.get();
};

}  // namespace compiler

// The compiled callable kiln::compile returns.
template <typename F>
class CompiledFunction {
 public:
  CompiledFunction(F fn, CompileOptions options)
      : fn_(std::make_shared<F>(std::move(fn))),
        core_(std::make_shared<compiler::CompiledCore>(std::move(options))) {}

  template <typename... Args>
  auto operator()(const Args&... args) {
    using R = std::decay_t<std::invoke_result_t<F&, const Args&...>>;
    compiler::FlatArgs flat;
    (compiler::flatten_arg(flat, args), ...);
    auto body = [&](const std::vector<Tensor>& tensors) -> std::vector<Tensor> {
      size_t next = 0;
      // Braced initialisation evaluates the arguments left to right.
      auto rebuilt =
          std::tuple<std::decay_t<decltype(compiler::rebuild_arg(args, tensors, next))>...>{
              compiler::rebuild_arg(args, tensors, next)...};
      if constexpr (std::is_void_v<R>) {
        std::apply(*fn_, rebuilt);
        return {};
      } else {
        return compiler::flatten_result(std::apply(*fn_, rebuilt));
      }
    };
    return compiler::unflatten_result<R>(core_->call(flat, body));
  }

  const compiler::CompileStats& stats() const { return core_->stats(); }
  const std::vector<compiler::Trace>& traces() const { return core_->traces(); }

 private:
  std::shared_ptr<F> fn_;
  std::shared_ptr<compiler::CompiledCore> core_;
};

template <typename F>
requires(!compiler::ModuleHolderLike<F>) CompiledFunction<F> compile(F fn,
                                                                     CompileOptions options = {}) {
  return CompiledFunction<F>(std::move(fn), std::move(options));
}

// compile(module): a callable running the module's forward.
template <compiler::ModuleHolderLike M>
auto compile(M module, CompileOptions options = {}) {
  auto fwd = [module](const auto&... args) mutable { return module->forward(args...); };
  return CompiledFunction<decltype(fwd)>(std::move(fwd), std::move(options));
}

}  // namespace kiln
