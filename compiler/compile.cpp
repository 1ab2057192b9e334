#include "compiler/compile.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "autograd/autograd_meta.h"
#include "autograd/grad_mode.h"
#include "compiler/autocast_pass.h"
#include "compiler/cuda_graph.h"
#include "compiler/functionalize.h"
#include "compiler/fuse.h"
#include "compiler/fused_cuda.h"
#include "compiler/graph_trial.h"
#include "compiler/memory_plan.h"
#include "compiler/partition.h"
#include "compiler/passes.h"
#include "compiler/program.h"
#include "compiler/symbolic.h"
#include "compiler/trace_files.h"
#include "compiler/tracer.h"
#include "kernels/cuda.h"
#include "kernels/cuda/runtime.h"
#include "tensor/autocast_state.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"
#include "tensor/profiler.h"

namespace kiln {

namespace compiler {
namespace {

// The signature of a call: a hashable key, and the same facts readable for recompile reasons.
struct Signature {
  std::vector<int64_t> key;
  // Labels and values: ("argument 0", "f32[4, 8] cpu strides [8, 1]"), ("grad mode", "on").
  std::vector<std::pair<std::string, std::string>> parts;
};

std::string tensor_part(const Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = spec_str(spec_of(t));
  if (!t.is_contiguous()) s += " strides " + shape_str(t.strides());
  if (t.requires_grad()) s += " requires_grad";
  return s;
}

// The key always; the readable parts only when `readable` (a miss): a hit builds no strings.
Signature signature(const FlatArgs& args, bool readable) {
  Signature s;
  auto add_tensor = [&](const Tensor& t) {
    s.key.push_back(t.defined());
    if (!t.defined()) return;
    s.key.push_back(static_cast<int64_t>(t.dtype()));
    s.key.push_back(static_cast<int64_t>(t.device().type()));
    s.key.push_back(t.device().index());
    s.key.push_back(t.requires_grad());
    s.key.push_back(t.dim());
    for (int64_t d = 0; d < t.dim(); ++d) {
      s.key.push_back(t.size(d));
      s.key.push_back(t.stride(d));
    }
  };
  for (size_t i = 0; i < args.tensors.size(); ++i) {
    add_tensor(args.tensors[i]);
    if (readable)
      s.parts.emplace_back("argument " + std::to_string(i), tensor_part(args.tensors[i]));
  }
  for (size_t i = 0; i < args.scalars.size(); ++i) {
    int64_t bits;
    static_assert(sizeof(bits) == sizeof(double));
    std::memcpy(&bits, &args.scalars[i], sizeof(bits));
    s.key.push_back(bits);
    if (!readable) continue;
    std::ostringstream os;
    os << args.scalars[i];
    s.parts.emplace_back("scalar argument " + std::to_string(i), os.str());
  }
  const bool grad = GradMode::is_enabled();
  s.key.push_back(grad);
  if (readable) s.parts.emplace_back("grad mode", grad ? "on" : "off");
  // Kernel choices (and so the decompose pass) depend on it (tensor/deterministic.h).
  const bool deterministic = are_deterministic_algorithms_enabled();
  s.key.push_back(deterministic);
  if (readable) s.parts.emplace_back("deterministic algorithms", deterministic ? "on" : "off");
  for (DeviceType d : {kCPU, kCUDA}) {
    const bool on = is_autocast_enabled(d);
    s.key.push_back(on);
    s.key.push_back(on ? static_cast<int64_t>(autocast_dtype(d)) : -1);
    if (readable) {
      s.parts.emplace_back("autocast " + std::string(device_type_name(d)),
                           on ? std::string(dtype_name(autocast_dtype(d))) : "off");
    }
  }
  return s;
}

// What a cached program checks about each captured tensor.
struct ExternalGuard {
  Shape sizes, strides;
  int64_t offset;
  ScalarType dtype;
  Device device;
  bool requires_grad;
  bool has_grad;
  bool check_grad = true;  // whether has_grad is part of the guard
};

ExternalGuard guard_of(const Tensor& t) {
  const TensorImpl* i = t.impl();
  return {i->sizes(),  i->strides(),      i->storage_offset(), i->dtype(),
          i->device(), t.requires_grad(), t.grad().defined()};
}

bool operator==(const ExternalGuard& a, const ExternalGuard& b) {
  return a.sizes == b.sizes && a.strides == b.strides && a.offset == b.offset &&
         a.dtype == b.dtype && a.device == b.device && a.requires_grad == b.requires_grad &&
         (!a.check_grad || a.has_grad == b.has_grad);
}

std::string guard_str(const ExternalGuard& g) {
  return spec_str({g.sizes, g.dtype, g.device, {}}) + (g.requires_grad ? " requires_grad" : "") +
         (g.has_grad ? " with a grad" : " without a grad");
}

// The grad_fn of a compiled function's outputs: runs the compiled backward.
class CompiledBackward final : public autograd::Node {
 public:
  CompiledBackward(std::shared_ptr<const BackwardPlan> plan, std::vector<Tensor> saved,
                   RngState rng)
      : plan_(std::move(plan)), saved_(std::move(saved)), rng_(rng) {}

  autograd::variable_list apply(autograd::variable_list&& grads) override {
    KILN_CHECK(!released_,
               "[backward] trying to backward through a compiled function a second "
               "time: its saved tensors were freed; pass retain_graph=true to the first call");
    std::vector<Tensor> args = saved_;
    for (size_t k = 0; k < plan_->grad_specs.size(); ++k) {
      const TensorSpec& s = plan_->grad_specs[k];
      Tensor g = k < grads.size() ? grads[k] : Tensor();
      if (!g.defined()) g = zeros(s.sizes, TensorOptions(s.dtype).device(s.device));
      args.push_back(g.is_contiguous() ? g : g.contiguous());
    }
    // A recomputation in the backward (kiln::checkpoint) draws what its forward drew.
    return plan_->program->run(args, &rng_);
  }
  std::string name() const override { return "CompiledFunctionBackward"; }
  void release_variables() override {
    released_ = !saved_.empty();
    saved_.clear();
  }

 private:
  std::shared_ptr<const BackwardPlan> plan_;
  std::vector<Tensor> saved_;
  RngState rng_;  // the forward run's random base
  bool released_ = false;
};

struct Entry {
  std::vector<ExternalGuard> guards;  // taken before the traced call, in Trace::externals order
  std::shared_ptr<const Program> program;
  std::shared_ptr<const BackwardPlan> backward;  // joint programs only
  // CUDA graphs of the program (compiler/cuda_graph.h): made at its first cached run; off when
  // refused, failed or turned off, with the reason.
  std::shared_ptr<GraphedProgram> graphed;
  bool graph_off = false;
  std::string graph_off_reason;
  // The device whose graph memory the next op-by-op run trims, or -1: what the last graph
  // replay handed out (gradients) holds graph memory until that run replaces it.
  int trim_after_run = -1;
  // A program with all-reduces: how it runs is measured (compiler/graph_trial.h); null otherwise.
  std::shared_ptr<GraphTrial> trial;

  // Empty when the captured tensors still match; else why not.
  std::string mismatch() const {
    const std::vector<Tensor>& ext = program->externals();
    for (size_t i = 0; i < guards.size(); ++i) {  // constants a pass added need no guard
      const ExternalGuard now = guard_of(ext[i]);
      if (!(guards[i] == now)) {
        return "captured tensor " + program->trace().value(program->trace().externals[i]).name +
               ": " + guard_str(guards[i]) + " -> " + guard_str(now);
      }
    }
    return "";
  }
};

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

// Runs an entry's program; for a joint program, gives the differentiable outputs a
// CompiledBackward grad_fn whose edges lead to the arguments and captured tensors.
std::vector<Tensor> run_entry(const Entry& e, const std::vector<Tensor>& args) {
  RngState rng;
  std::vector<Tensor> outputs = e.program->run(args, nullptr, &rng);
  if (!e.backward) return outputs;
  const BackwardPlan& plan = *e.backward;
  const size_t kept = plan.user_outputs + plan.escaped;  // returned; the caller drops escaped
  std::vector<Tensor> saved(outputs.begin() + static_cast<std::ptrdiff_t>(kept), outputs.end());
  outputs.resize(kept);
  if (!GradMode::is_enabled()) return outputs;
  // A saved value may be a returned output itself (relu's result): the node keeps its own handle
  // on the data, without the autograd history that set_history gives the output below, or output
  // and node would hold each other and outlive every user handle (a forward whose backward never
  // runs would keep its saved activations for good).
  for (Tensor& t : saved) {
    if (t.defined()) t = t.detach();
  }
  auto node = std::make_shared<CompiledBackward>(e.backward, std::move(saved), rng);
  bool any = false;
  for (int t : plan.targets) {
    const Tensor& target =
        t >= 0 ? args[static_cast<size_t>(t)] : e.program->externals()[static_cast<size_t>(-1 - t)];
    node->mutable_next_edges().push_back(autograd::internal::gradient_edge(target));
    any |= node->next_edges().back().is_valid();
  }
  if (!any) return outputs;
  // An output that is a leaf requiring grad among the arguments or captured tensors (the callable
  // returned its input, or a parameter) stays that leaf, as eager code returns it: given the node
  // as its grad_fn, it would stop being a leaf, and node and tensor would hold each other.
  // Gradients reach it directly; the node gets zeros for that output (its meta is still the
  // node's, in output order). Such a leaf cannot have been written in place with grad (tracing
  // refuses that, as eager code does); any other returned argument takes the node's history.
  auto passed_through = [&](const Tensor& out) {
    if (!out.defined() || !out.requires_grad() || out.grad_fn() != nullptr) return false;
    for (const Tensor& a : args) {
      if (a.defined() && a.impl() == out.impl()) return true;
    }
    for (const Tensor& x : e.program->externals()) {
      if (x.defined() && x.impl() == out.impl()) return true;
    }
    return false;
  };
  for (size_t i = 0; i < plan.user_outputs; ++i) {
    const int k = plan.grad_outputs[i];
    if (k < 0) continue;
    const TensorSpec& s = plan.grad_specs[static_cast<size_t>(k)];
    node->output_metas().push_back({s.sizes, s.dtype, s.device});
    if (!passed_through(outputs[i])) {
      autograd::internal::set_history(outputs[i], node, static_cast<uint32_t>(k));
    }
  }
  return outputs;
}

}  // namespace

struct CompiledCore::Impl {
  CompileOptions options;
  std::vector<std::shared_ptr<const Executor>> executors;
  absl::flat_hash_map<std::vector<int64_t>, std::vector<Entry>> cache;
  CompileStats stats;
  std::vector<Trace> traces;
  std::vector<std::pair<std::string, std::string>> last_parts;
  std::vector<Shape> last_sizes;  // the tensor arguments' sizes at the last compilation
  int compilations = 0;           // counted against recompile_limit
  bool dynamic_only = false;      // the last reason was only a dynamic dimension's size
  // For a dynamic-only miss: the marked dimensions that changed, all from size `from` to `to`
  // (empty when they changed to different sizes).
  std::vector<std::pair<int, int64_t>> changed_dims;
  int64_t changed_from = 0, changed_to = 0;
  Compilation last;  // the last compilation that was cached
  std::optional<SharedProgram> shared;
  std::vector<ExternalGuard> shared_guards;  // the guards of the compilation it was fitted to
  std::string trace_dir;
  bool graph_warned = false;  // the one warning that a GPU program runs without CUDA graphs

  // A program that runs without graphs from now on, and why (warned once per callable).
  void graph_off(Entry& e, std::string why, bool gpu_program) {
    e.graph_off = true;
    if (e.graphed) {
      // A dropped graph's memory stays reserved for graphs until trimmed (llama-3.2-1b's DDP
      // step: 12 GiB more at its peak), and what its last replay handed out (llama-3.2-1b's
      // gradients, 2.2 GiB) until the next run has replaced it: trimmed now and after that run.
      // Only graph memory: the pool keeps what the runs op by op take again (trimmed, the next
      // run grows it anew: 60-85 ms on llama-3.2-1b's and llama-160m's 4-GPU DDP ranks).
      const int device = e.graphed->device();
      e.graphed.reset();
      cuda::internal::trim_graph_memory(device);
      e.trim_after_run = device;
    }
    e.graph_off_reason = std::move(why);
    stats.cuda_graph = "off";
    stats.graph_reason = e.graph_off_reason;
    if (gpu_program && !graph_warned && options.cuda_graphs()) {
      graph_warned = true;
      std::fprintf(stderr, "kiln::compile: '%s' runs without CUDA graphs: %s\n",
                   options.name().c_str(), e.graph_off_reason.c_str());
    }
  }

  // A program just compiled (and run once: its warm-up): whether its next run captures graphs.
  void graph_new_entry(Entry& e) {
    stats.graph_static_bytes = 0;
    stats.graph_kept_bytes = 0;
    if (!options.cuda_graphs()) {
      graph_off(e, "turned off (CompileOptions::cuda_graphs(false))", false);
      return;
    }
    // Which CPU scalars are constants depends on what holds them: decided at the first hit,
    // once this call's copies are gone (run_cached).
    std::string why = cuda_graph_refusal(*e.program, e.backward != nullptr);
    if (!why.empty() && why.rfind("no step", 0) != 0) {
      const bool gpu = why.rfind("a CPU program", 0) != 0;
      graph_off(e, std::move(why), gpu);
      return;
    }
    stats.cuda_graph = "warm-up";
    stats.graph_reason = "captured at the program's next run";
    e.trial = GraphTrial::of(*e.program);
    if (e.trial) {
      stats.cuda_graph = "measuring";
      stats.graph_reason = GraphTrial::measuring_reason();
    }
  }

  // A successful run through a program's graphs, in the stats.
  void count_graph_run(const GraphedProgram::Run& r) {
    if (r.captured) {
      ++stats.graph_captures;
      if (!r.recaptured.empty()) stats.graph_recapture_reasons.push_back(r.recaptured);
    } else {
      ++stats.graph_replays;
    }
  }

  // A run of a program whose way of running is being measured (GraphTrial): op by op, or
  // through its graphs (the first run captures them). A rank whose capture failed goes on op by
  // op, with the collectives of the others' graphs.
  std::vector<Tensor> run_trial(Entry& e, const std::vector<Tensor>& args) {
    GraphTrial& g = *e.trial;
    g.before_run();
    if (g.phase() == GraphTrial::Phase::kGraphs && g.failure().empty() && !e.graphed) {
      std::string why = cuda_graph_refusal(*e.program, e.backward != nullptr);
      if (why.empty()) {
        e.graphed = std::make_shared<GraphedProgram>(e.program);
      } else {
        g.capture_failed(std::move(why));
      }
    }
    std::vector<Tensor> outputs;
    if (!e.graphed) {
      outputs = run_entry(e, args);
    } else {
      GraphedProgram::Run r;
      outputs = e.graphed->run(args, r);
      if (!r.failure.empty()) {
        g.capture_failed(r.failure);
        e.graphed.reset();
      } else {
        count_graph_run(r);
      }
    }
    g.after_run();
    if (g.phase() != GraphTrial::Phase::kDecided) return outputs;
    if (g.graphs_kept()) {
      stats.cuda_graph = "replaying";
      stats.graph_reason = g.measurement();
    } else {
      graph_off(e, g.off_reason(), g.failed());
    }
    return outputs;
  }

  // Runs a cached program: through its CUDA graphs where it has them.
  std::vector<Tensor> run_cached(Entry& e, const std::vector<Tensor>& args) {
    if (e.graph_off) {
      stats.cuda_graph = "off";
      stats.graph_reason = e.graph_off_reason;
      std::vector<Tensor> outputs = run_entry(e, args);
      if (e.trim_after_run >= 0) {
        cuda::internal::trim_graph_memory(e.trim_after_run);
        e.trim_after_run = -1;
      }
      return outputs;
    }
    // The profiler times ops one by one: a graph would hide them.
    if (profiler::internal::active()) return run_entry(e, args);
    if (e.trial && e.trial->phase() != GraphTrial::Phase::kDecided) {
      stats.cuda_graph = "measuring";
      return run_trial(e, args);
    }
    if (!e.graphed) {
      std::string why = cuda_graph_refusal(*e.program, e.backward != nullptr);
      if (!why.empty()) {
        graph_off(e, std::move(why), true);
        return run_entry(e, args);
      }
      e.graphed = std::make_shared<GraphedProgram>(e.program);
    }
    GraphedProgram::Run r;
    std::vector<Tensor> outputs = e.graphed->run(args, r);
    if (!r.failure.empty()) {
      graph_off(e, r.failure, true);
      return outputs;
    }
    count_graph_run(r);
    stats.cuda_graph = "replaying";
    const int graphs = e.graphed->graphs();
    stats.graph_reason = std::to_string(graphs) + (graphs == 1 ? " graph, " : " graphs, ") +
                         std::to_string(e.graphed->host_steps()) + " host steps" +
                         (e.trial ? "; " + e.trial->measurement() : "");
    stats.graph_static_bytes = e.graphed->static_bytes();
    stats.graph_kept_bytes = e.graphed->kept_bytes();
    return outputs;
  }

  void write_stage(const Trace& t) {
    if (std::as_const(options).debug()) std::fprintf(stderr, "%s\n", t.str().c_str());
    if (trace_dir.empty()) return;
    write_trace_listing(
        trace_dir,
        options.name() + "." + std::to_string(stats.misses) + "." + std::to_string(traces.size()),
        t);
  }

  // Whether the arguments differ from the last compilation's only in dimensions marked dynamic.
  bool only_dynamic_changed(const FlatArgs& args) const {
    if (options.dynamic_dims().empty() || args.tensors.size() != last_sizes.size()) return false;
    bool changed = false;
    for (size_t i = 0; i < args.tensors.size(); ++i) {
      const Tensor& t = args.tensors[i];
      const Shape now = t.defined() ? Shape(t.sizes().begin(), t.sizes().end()) : Shape{};
      if (now.size() != last_sizes[i].size()) return false;
      for (size_t d = 0; d < now.size(); ++d) {
        if (now[d] == last_sizes[i][d]) continue;
        const auto& dyn = options.dynamic_dims();
        if (std::find(dyn.begin(), dyn.end(),
                      std::pair<int, int64_t>(static_cast<int>(i), static_cast<int64_t>(d))) ==
            dyn.end()) {
          return false;
        }
        changed = true;
      }
    }
    return changed;
  }

  // The marked dimensions the call changed from the last compilation, if all went from one size
  // to one other size (sets changed_dims, changed_from, changed_to).
  void find_changed_dims(const FlatArgs& args) {
    changed_dims.clear();
    for (const auto& [a, d] : options.dynamic_dims()) {
      const size_t i = static_cast<size_t>(a);
      if (i >= args.tensors.size() || !args.tensors[i].defined() || d >= args.tensors[i].dim() ||
          d >= static_cast<int64_t>(last_sizes[i].size())) {
        continue;
      }
      const int64_t from = last_sizes[i][static_cast<size_t>(d)];
      const int64_t to = args.tensors[i].size(d);
      if (from == to) continue;
      if (!changed_dims.empty() && (from != changed_from || to != changed_to)) {
        changed_dims.clear();
        return;
      }
      changed_dims.emplace_back(a, d);
      changed_from = from;
      changed_to = to;
    }
  }

  // Builds the shared program from the last compilation and `now` (a compilation for a call
  // that changed only the dimensions in changed_dims). Returns why they cannot share, or "".
  std::string share(const Signature& sig, const Entry& now) {
    if (changed_dims.empty())
      return "several dimensions marked dynamic changed, to different sizes";
    if (!last.program) return "";
    SharedProgram sp;
    const std::string why = compiler::share(changed_dims, last, changed_from,
                                            {sig.key, now.program, now.backward}, changed_to, sp);
    if (!why.empty()) return why;
    shared = std::move(sp);
    shared_guards = now.guards;
    return "";
  }

  // The shared program instantiated for the call, or nullopt with `why` set when it does not
  // serve this call.
  std::optional<Entry> instantiate_shared(const FlatArgs& args, const Signature& sig,
                                          std::string& why) {
    const auto& skipped = options.skipped_passes();
    const bool plan = std::find(skipped.begin(), skipped.end(), "plan_memory") == skipped.end();
    Compilation c;
    why = compiler::instantiate_shared(*shared, args.tensors, sig.key, executors, plan, c);
    if (!why.empty()) return std::nullopt;
    Entry e{shared_guards, std::move(c.program), std::move(c.plan)};
    why = e.mismatch();
    if (!why.empty()) return std::nullopt;
    return e;
  }

  // Why this call compiles again: the first part of the signature that changed.
  std::string reason(const Signature& sig, const std::string& guard_mismatch,
                     const std::string& dynamic_note) {
    if (!guard_mismatch.empty()) return guard_mismatch;
    if (dynamic_only) {
      for (size_t i = 0; i < sig.parts.size() && i < last_parts.size(); ++i) {
        if (sig.parts[i] != last_parts[i]) {
          return sig.parts[i].first + ": " + last_parts[i].second + " -> " + sig.parts[i].second +
                 " (a dimension marked dynamic: " + dynamic_note + ")";
        }
      }
    }
    for (size_t i = 0; i < sig.parts.size() && i < last_parts.size(); ++i) {
      if (sig.parts[i] != last_parts[i]) {
        return sig.parts[i].first + ": " + last_parts[i].second + " -> " + sig.parts[i].second;
      }
    }
    if (sig.parts.size() != last_parts.size()) {
      return "the number of arguments changed (" + std::to_string(last_parts.size()) + " -> " +
             std::to_string(sig.parts.size()) + " signature parts)";
    }
    return "the previous call created state that outlives it (traced again now that it exists)";
  }
};

CompiledCore::CompiledCore(CompileOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->options = std::move(options);
  for (const std::string& n : impl_->options.executors()) {
    impl_->executors.push_back(find_executor(n));
  }
  impl_->trace_dir = impl_->options.trace_dir();
  if (impl_->trace_dir.empty()) {
    if (const char* dir = std::getenv("KILN_TRACE_DIR")) impl_->trace_dir = dir;
  }
}

CompiledCore::~CompiledCore() = default;

const CompileStats& CompiledCore::stats() const { return impl_->stats; }
const std::vector<Trace>& CompiledCore::traces() const { return impl_->traces; }

std::vector<Tensor> CompiledCore::call(
    const FlatArgs& args,
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& body) {
  Impl& m = *impl_;
  ++m.stats.calls;
  if (m.stats.fell_back_to_eager) return body(args.tensors);
  Signature sig = signature(args, /*readable=*/false);
  std::string mismatch;
  auto it = m.cache.find(sig.key);
  if (it != m.cache.end()) {
    for (Entry& e : it->second) {
      std::string why = e.mismatch();
      if (why.empty()) {
        ++m.stats.hits;
        return m.run_cached(e, args.tensors);
      }
      mismatch = std::move(why);
    }
  }
  // A miss: trace, transform, lower.
  sig = signature(args, /*readable=*/true);
  m.dynamic_only = mismatch.empty() && m.only_dynamic_changed(args);
  std::string dynamic_note;
  if (m.dynamic_only) {
    m.find_changed_dims(args);
    if (m.shared) {
      const auto t0 = std::chrono::steady_clock::now();
      std::optional<Entry> e = m.instantiate_shared(args, sig, dynamic_note);
      if (e) {
        ++m.stats.dynamic_instances;
        m.stats.instantiate_ms = ms_since(t0);
        std::vector<Tensor> outputs = run_entry(*e, args.tensors);
        m.cache[sig.key].push_back(std::move(*e));
        m.graph_new_entry(m.cache[sig.key].back());
        return outputs;
      }
      dynamic_note = "the shared program does not serve this size, so it is compiled on its own: " +
                     dynamic_note;
    } else {
      dynamic_note = "compiled once more, to fit one program to every size";
    }
  }
  if (m.stats.misses > 0) {
    m.stats.recompile_reasons.push_back(m.reason(sig, mismatch, dynamic_note));
  }
  if (!m.dynamic_only && m.compilations >= m.options.recompile_limit()) {
    m.stats.fell_back_to_eager = true;
    std::fprintf(stderr,
                 "kiln::compile: '%s' was compiled %d times (recompile_limit); running it eagerly "
                 "from now on. Last reason: %s\n",
                 m.options.name().c_str(), m.compilations,
                 m.stats.recompile_reasons.back().c_str());
    return body(args.tensors);
  }
  if (!m.dynamic_only) ++m.compilations;
  ++m.stats.misses;
  m.last_parts = sig.parts;
  m.last_sizes.clear();
  for (const Tensor& t : args.tensors) {
    m.last_sizes.push_back(t.defined() ? Shape(t.sizes().begin(), t.sizes().end()) : Shape{});
  }
  m.traces.clear();
  m.stats.stage_ms.clear();
  m.stats.saved_bytes = 0;
  m.stats.recomputed_ops = 0;

  auto start = std::chrono::steady_clock::now();
  TraceResult traced = trace_callable(body, args.tensors, m.options.name(), /*joint=*/true);
  m.stats.stage_ms.emplace_back("trace", ms_since(start));
  // The captured tensors are as they were before the call again (the tracer restored them).
  std::vector<ExternalGuard> guards;
  for (size_t i = 0; i < traced.externals.size(); ++i) {
    guards.push_back(guard_of(traced.externals[i]));
    guards.back().check_grad = i < traced.grad_guarded.size() && traced.grad_guarded[i];
  }
  Trace trace = std::move(traced.trace);
  const size_t user_outputs = trace.outputs.size();
  for (const auto& [weak, value] : traced.escaped) trace.outputs.push_back(value);
  m.traces.push_back(trace);
  m.write_stage(trace);
  std::shared_ptr<BackwardPlan> plan;
  Trace backward_trace;
  if (traced.backward_begin >= 0) {
    plan = std::make_shared<BackwardPlan>();
    const auto t0 = std::chrono::steady_clock::now();
    Partition part = partition_joint(trace, joint_boundary(traced), m.options.partition());
    m.stats.stage_ms.emplace_back("partition", ms_since(t0));
    m.stats.saved_bytes = part.saved_bytes;
    m.stats.recomputed_ops = part.recomputed_ops;
    plan->user_outputs = user_outputs;
    plan->escaped = traced.escaped.size();
    int k = 0;
    for (int v : traced.grad_outputs) {
      plan->grad_outputs.push_back(v >= 0 ? k++ : -1);
      if (v >= 0) plan->grad_specs.push_back(trace.value(v).spec);
    }
    for (int v : traced.grad_targets) {
      const auto arg = std::find(trace.arguments.begin(), trace.arguments.end(), v);
      if (arg != trace.arguments.end()) {
        plan->targets.push_back(static_cast<int>(arg - trace.arguments.begin()));
      } else {
        const auto ext = std::find(trace.externals.begin(), trace.externals.end(), v);
        plan->targets.push_back(-1 - static_cast<int>(ext - trace.externals.begin()));
      }
    }
    trace = std::move(part.forward);
    backward_trace = std::move(part.backward);
    m.traces.push_back(trace);
    m.write_stage(trace);
    m.traces.push_back(backward_trace);
    m.write_stage(backward_trace);
  }
  auto transform = [&](Trace& t, std::vector<Tensor>& externals) {
    t.emulate_precision_casts = m.options.emulate_precision_casts();
    const auto& skipped = m.options.skipped_passes();
    auto skip = [&](const std::string& name) {
      return std::find(skipped.begin(), skipped.end(), name) != skipped.end();
    };
    auto record = [&](const std::string& name, std::chrono::steady_clock::time_point t0) {
      m.stats.stage_ms.emplace_back(name, ms_since(t0));
      m.traces.push_back(t);
      m.write_stage(t);
    };
    if (!skip("autocast")) {  // first: decompose's support checks read the cast inputs
      const auto t0 = std::chrono::steady_clock::now();
      t = autocast(t);
      record("autocast", t0);
    }
    if (!skip("decompose")) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto& forced = m.options.decomposed_ops();
      t = decompose(t, externals, [&](const Trace& now, const BoundOp& op) {
        if (std::find(forced.begin(), forced.end(), op.name()) != forced.end()) return true;
        for (const auto& e : m.executors) {
          if (e->name() != "eager" && e->claims(now, op)) return false;  // claimed whole
        }
        return !device_kernel_supports(now, op);
      });
      record("decompose", t0);
    }
    for (auto [name, pass] :
         {std::pair{"functionalize", &functionalize}, std::pair{"simplify", &simplify},
          std::pair{"dce", &dce}, std::pair{"cse", &cse},
          std::pair{"fuse_norm_residual", &fuse_norm_residual},
          std::pair{"fold_index_add", &fold_index_add},
          std::pair{"fuse_qkv_rotary", &fuse_qkv_rotary},
          std::pair{"fold_copy_into_mm", &fold_copy_into_mm}}) {
      if (skip(name)) continue;
      const auto t0 = std::chrono::steady_clock::now();
      t = pass(t);
      record(name, t0);
    }
    if (!skip("fuse")) {
      // Each executor that fuses, in priority order, groups the ops it runs together: matmul
      // epilogues first, so that an add an executor runs with its product is not also taken
      // into an elementwise region.
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& e : m.executors) t = attach_epilogues(t, *e);
      for (const auto& e : m.executors) t = fuse(t, *e);
      record("fuse", t0);
    }
    const auto t0 = std::chrono::steady_clock::now();
    t = assign_executors(t, m.executors);
    record("executors", t0);
    if (!skip("plan_memory")) {
      const auto t1 = std::chrono::steady_clock::now();
      t = plan_memory(t);
      record("plan_memory", t1);
    }
    KILN_CHECK(t.emulate_precision_casts == m.options.emulate_precision_casts(),
               "[compile] internal: a pass dropped the trace's emulate_precision_casts");
  };
  std::vector<Tensor> externals = std::move(traced.externals);
  std::vector<Tensor> backward_externals = externals;
  transform(trace, externals);
  if (plan) transform(backward_trace, backward_externals);
  const auto t0 = std::chrono::steady_clock::now();
  if (plan) {
    plan->program = std::make_shared<const Program>(std::move(backward_trace),
                                                    std::move(backward_externals), m.executors);
  }
  auto program =
      std::make_shared<const Program>(std::move(trace), std::move(externals), m.executors);
  m.stats.stage_ms.emplace_back("lower", ms_since(t0));
  m.stats.planned_peak_bytes = program->planned_peak_bytes();
  m.stats.arena_bytes = 0;
  for (const compiler::Arena& a : program->trace().arenas) m.stats.arena_bytes += a.bytes;
  if (plan) {
    int64_t backward = 0;
    for (const compiler::Arena& a : plan->program->trace().arenas) backward += a.bytes;
    m.stats.arena_bytes = std::max(m.stats.arena_bytes, backward);
  }
  if (plan) {
    m.stats.planned_peak_bytes =
        std::max(m.stats.planned_peak_bytes, plan->program->planned_peak_bytes());
  }
  Entry entry{std::move(guards), std::move(program), std::move(plan)};
  std::vector<Tensor> outputs = run_entry(entry, args.tensors);
  if (!traced.escaped.empty()) {
    // The callable kept proxies in its own state: give them their values, and do not cache a
    // program that would create that state again.
    for (size_t i = 0; i < traced.escaped.size(); ++i) {
      if (auto impl = traced.escaped[i].first.lock()) {
        const Tensor& real = outputs[user_outputs + i];
        if (real.defined()) impl->set_data(*real.impl());
      }
    }
    outputs.resize(user_outputs);
    return outputs;
  }
  if (m.dynamic_only && !m.shared) {
    const std::string why = m.share(sig, entry);
    if (!why.empty() && !m.stats.recompile_reasons.empty()) {
      m.stats.recompile_reasons.back() += "; the sizes cannot share one program: " + why;
    }
  }
  m.last = {sig.key, entry.program, entry.backward};
  m.cache[sig.key].push_back(std::move(entry));
  m.graph_new_entry(m.cache[sig.key].back());
  return outputs;
}

}  // namespace compiler
}  // namespace kiln
