#include "compiler/cuda_graph.h"

#include <algorithm>
#include <cstdint>
#include <utility>

#include "autograd/grad_mode.h"
#include "kernels/cuda.h"
#include "kernels/cuda/runtime.h"
#include "tensor/storage.h"
#include "tensor/tensor_impl.h"

namespace kiln::compiler {
namespace {

// How the steps of a program divide into graphs and host steps, and which values cross them.
struct Analysis {
  int device = -1;           // the GPU of the program's CUDA values (-1: none)
  std::vector<int> root;     // per value: the value whose storage it shares (views, in-place ops)
  std::vector<int> segment;  // per value: the segment of the step that makes it (-1: argument
                             // or captured tensor)
  struct Segment {
    size_t begin = 0, end = 0;  // op indices [begin, end)
    bool graph = false;
    std::vector<int> inputs;   // graph: arguments and host-made values it reads
    std::vector<int> escapes;  // graph: values it makes that are read after it
  };
  std::vector<Segment> segments;
  // Captured 0-d CPU tensors that only the program holds (the scalars of `x * 2.0`, wrapped by
  // the ops): constants, which a CUDA kernel reads on the host at launch, so a graph may keep
  // their values (checked at each replay). Index into Trace::externals.
  std::vector<size_t> constants;
  // Copies of mutable CPU scalars to the program's GPU (the lr an optimizer copies to the GPU at
  // every step): a 0-d CPU captured tensor that no op writes and only same-dtype to_copy ops to
  // the GPU read. Each copy's op is skipped: at the start of every run its output is written from
  // the CPU tensor into a static device buffer that the graphs read (by address) and the op's
  // readers take, so the value set on the host before the call reaches the replayed graph.
  struct LaunchInput {
    size_t op;        // the to_copy op
    int value;        // its output
    size_t external;  // its input, an index into Trace::externals
  };
  std::vector<LaunchInput> launch_inputs;
  int host_steps = 0;
  std::string refusal;  // "" when it can be captured
};

bool on_device(const Trace& t, int v, int device) {
  if (v < 0) return true;
  const Device d = t.value(v).spec.device;
  return d.is_cuda() && d.index() == device;
}

std::string name_of(const Trace& t, int v) { return t.value(v).name; }

// Per op: whether it is the dist_wait_ of a dist_all_reduce_ (the wait's tensor is the
// all-reduce's output, or an in-place op's or a view's of it).
std::vector<bool> all_reduce_waits(const Trace& t) {
  std::vector<int> producer(t.values.size(), -1);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    for (int v : t.ops[i].outputs) {
      if (v >= 0) producer[static_cast<size_t>(v)] = static_cast<int>(i);
    }
  }
  std::vector<bool> waits(t.ops.size(), false);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const BoundOp& op = t.ops[i];
    if (op.name() != "dist_wait_" || op.inputs.empty()) continue;
    int v = op.inputs[0];
    while (v >= 0 && producer[static_cast<size_t>(v)] >= 0) {
      const BoundOp& p = t.ops[static_cast<size_t>(producer[static_cast<size_t>(v)])];
      if (p.name() == "dist_all_reduce_") {
        waits[i] = true;
        break;
      }
      const bool shares = p.op->kind == OpKind::kView ||
                          (p.op->kind == OpKind::kInplace && p.op->mutated == nullptr);
      if (!shares || p.inputs.empty() || p.name().rfind("dist_", 0) == 0) break;
      v = p.inputs[0];
    }
  }
  return waits;
}

Analysis analyse(const Program& program, bool has_backward) {
  const Trace& t = program.trace();
  Analysis a;
  for (const ValueInfo& v : t.values) {
    if (v.spec.device.is_cuda()) {
      a.device = v.spec.device.index();
      break;
    }
  }
  if (a.device < 0) {
    a.refusal = "a CPU program (no tensor of it is on a GPU)";
    return a;
  }
  if (has_backward) {
    a.refusal =
        "a compiled function with a backward (autograd runs its second program); only programs "
        "without one, such as a whole training step, are captured";
    return a;
  }
  for (const Arena& arena : t.arenas) {
    if (arena.device.is_cuda()) {
      a.refusal = "plan_memory placed values in a GPU arena, allocated per run";
      return a;
    }
  }
  for (const BoundOp& op : t.ops) {
    // DDP's collectives (its buckets' all-reduces, the gathered rows' all-gathers, their waits)
    // are captured with the rest: NCCL records its kernels into the graph on the group's stream,
    // which joins the capture through the events of the op and its wait (the copy-engine
    // all-reduce declines a capturing stream, PeerAllReduce::takes). FSDP's programs stay op by
    // op: captured whole (their gathers and reduce-scatters in the graph) they ran no faster on
    // two H200s (benchmarks/RESULTS.md, session 42).
    if (op.name().rfind("dist_reduce_scatter", 0) == 0) {
      a.refusal =
          "it has collectives of kiln::dist (" + op.name() + "): FSDP's programs run op by op";
      return a;
    }
  }
  // Captured CPU scalars nothing else holds cannot change between runs; others (an optimizer's
  // learning rate) can, so a step reading them runs on the host, unless it only copies one to
  // the GPU (a launch input, below).
  std::vector<bool> constant(t.values.size(), false);
  for (size_t i = 0; i < t.externals.size(); ++i) {
    const Tensor& e = program.externals()[i];
    if (e.defined() && e.is_cpu() && e.dim() == 0 && e.use_count() == 1 &&
        e.impl()->storage().use_count() == 1) {
      constant[static_cast<size_t>(t.externals[i])] = true;
      a.constants.push_back(i);
    }
  }
  // Launch inputs: the copies of the other CPU scalars, when nothing else reads them.
  {
    std::vector<int> external_of(t.values.size(), -1);
    for (size_t i = 0; i < t.externals.size(); ++i) {
      external_of[static_cast<size_t>(t.externals[i])] = static_cast<int>(i);
    }
    std::vector<bool> other_reader(t.values.size(), false);
    std::vector<Analysis::LaunchInput> copies;
    for (size_t i = 0; i < t.ops.size(); ++i) {
      const BoundOp& op = t.ops[i];
      const int in = op.inputs.size() == 1 ? op.inputs[0] : -1;
      const bool copy = in >= 0 && op.name() == "to_copy" && op.outputs.size() == 1 &&
                        op.outputs[0] >= 0 && op.region < 0 && program.has_step(i) &&
                        on_device(t, op.outputs[0], a.device) &&
                        t.value(op.outputs[0]).spec.dtype == t.value(in).spec.dtype;
      for (int v : op.inputs) {
        if (v >= 0 && !(copy && v == in)) other_reader[static_cast<size_t>(v)] = true;
      }
      if (!copy || external_of[static_cast<size_t>(in)] < 0 || constant[static_cast<size_t>(in)]) {
        continue;
      }
      const Tensor& e =
          program.externals()[static_cast<size_t>(external_of[static_cast<size_t>(in)])];
      if (e.defined() && e.is_cpu() && e.dim() == 0) {
        copies.push_back(
            {i, op.outputs[0], static_cast<size_t>(external_of[static_cast<size_t>(in)])});
      }
    }
    // A returned copy (or a .grad) would be the buffer itself, overwritten by the next run.
    std::vector<bool> kept(t.values.size(), false);
    for (int v : t.outputs) {
      if (v >= 0) kept[static_cast<size_t>(v)] = true;
    }
    for (const GradEffect& e : t.grad_effects) {
      if (e.value >= 0) kept[static_cast<size_t>(e.value)] = true;
    }
    for (const Analysis::LaunchInput& c : copies) {
      if (!other_reader[static_cast<size_t>(t.externals[c.external])] &&
          !kept[static_cast<size_t>(c.value)]) {
        a.launch_inputs.push_back(c);
      }
    }
  }
  // Where each op's step runs, and whether every tensor of that step is on the GPU (a launch
  // input's copy counts as a GPU step: it is not run). The wait of an all-reduce runs on the host
  // between graphs: a graph's all-reduce starts after its launch (dist/collective_ops.cpp).
  const std::vector<int> at = step_positions(t);
  std::vector<bool> gpu_step(t.ops.size(), true);
  std::vector<bool> launch_op(t.ops.size(), false);
  for (const Analysis::LaunchInput& c : a.launch_inputs) launch_op[c.op] = true;
  const std::vector<bool> reduce_wait = all_reduce_waits(t);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (launch_op[i]) continue;
    if (reduce_wait[i]) {
      gpu_step[static_cast<size_t>(at[i])] = false;
      continue;
    }
    bool ok = true;
    for (int v : t.ops[i].inputs) {
      ok = ok && (on_device(t, v, a.device) || constant[static_cast<size_t>(v)]);
    }
    for (int v : t.ops[i].outputs) ok = ok && on_device(t, v, a.device);
    if (!ok) gpu_step[static_cast<size_t>(at[i])] = false;
  }
  // A launch input's copy is not run: it takes the kind of the next step (else of the one
  // before), so that it never makes a segment of its own.
  {
    std::vector<int> next_kind(t.ops.size(), -1);
    int kind = -1;  // 1: a graph step, 0: a host step, -1: none
    for (size_t i = t.ops.size(); i-- > 0;) {
      if (!program.has_step(i)) continue;
      if (launch_op[i]) {
        next_kind[i] = kind;
      } else {
        kind = gpu_step[i] ? 1 : 0;
      }
    }
    kind = -1;
    for (size_t i = 0; i < t.ops.size(); ++i) {
      if (!program.has_step(i)) continue;
      if (launch_op[i]) {
        gpu_step[i] = (next_kind[i] >= 0 ? next_kind[i] : kind) == 1;
      } else {
        kind = gpu_step[i] ? 1 : 0;
      }
    }
  }
  // Segments: maximal runs of steps of one kind; an op index without a step joins the segment
  // of its step (a region's earlier ops).
  for (size_t i = 0; i < t.ops.size(); ++i) {
    if (!program.has_step(i)) continue;
    const bool graph = gpu_step[i];
    if (!graph && !launch_op[i]) ++a.host_steps;
    if (a.segments.empty() || a.segments.back().graph != graph) {
      const size_t begin = a.segments.empty() ? 0 : a.segments.back().end;
      a.segments.push_back({begin, i + 1, graph, {}, {}});
    } else {
      a.segments.back().end = i + 1;
    }
  }
  if (!a.segments.empty()) a.segments.back().end = t.ops.size();
  const bool any_graph = std::any_of(a.segments.begin(), a.segments.end(),
                                     [](const Analysis::Segment& s) { return s.graph; });
  if (!any_graph) {
    a.refusal = "no step has all its tensors on cuda:" + std::to_string(a.device);
    return a;
  }
  // Which segment makes each value, and the storage each one shares.
  a.root.resize(t.values.size());
  a.segment.assign(t.values.size(), -1);
  for (size_t v = 0; v < t.values.size(); ++v) a.root[v] = static_cast<int>(v);
  std::vector<int> op_segment(t.ops.size(), -1);
  for (size_t s = 0; s < a.segments.size(); ++s) {
    for (size_t i = a.segments[s].begin; i < a.segments[s].end; ++i) {
      op_segment[i] = static_cast<int>(s);
    }
  }
  std::vector<bool> waited(t.values.size(), false);  // the output of an all-reduce's wait
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const BoundOp& op = t.ops[i];
    for (size_t k = 0; k < op.outputs.size(); ++k) {
      const int v = op.outputs[k];
      if (v < 0) continue;
      // A launch input's value is written before the run, as a captured tensor is there.
      a.segment[static_cast<size_t>(v)] = launch_op[i] ? -1 : op_segment[i];
      const OpKind kind = op.op->kind;
      // A view shares its input's storage, a single in-place op its written input's; a
      // multi-tensor in-place op (op->mutated) is taken as making its own.
      const bool single_inplace = kind == OpKind::kInplace && op.op->mutated == nullptr;
      if ((kind == OpKind::kView || (single_inplace && k == 0)) && !op.inputs.empty() &&
          op.inputs[0] >= 0) {
        a.root[static_cast<size_t>(v)] = a.root[static_cast<size_t>(op.inputs[0])];
      }
      // A wait's output is the all-reduced tensor where it lives (a graph's memory, read by the
      // next graph at its address), not a value of the host step to copy into a static buffer.
      if (reduce_wait[i] && k == 0) {
        a.segment[static_cast<size_t>(v)] =
            a.segment[static_cast<size_t>(a.root[static_cast<size_t>(v)])];
        waited[static_cast<size_t>(v)] = true;
      }
    }
  }
  auto made_by_host = [&](int v) {
    const int s = a.segment[static_cast<size_t>(v)];
    return s >= 0 && !a.segments[static_cast<size_t>(s)].graph;
  };
  // In-place writes in a graph to a copy that the graph reads instead of the original would be
  // lost to the original's other readers.
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const BoundOp& op = t.ops[i];
    if (op.op->kind != OpKind::kInplace || !a.segments[static_cast<size_t>(op_segment[i])].graph) {
      continue;
    }
    const size_t written = op.op->mutated == nullptr ? 1 : op.inputs.size();
    for (size_t k = 0; k < written && k < op.inputs.size(); ++k) {
      if (op.inputs[k] < 0) continue;
      const int r = a.root[static_cast<size_t>(op.inputs[k])];
      if (t.roles[static_cast<size_t>(r)] == ValueRole::kArgument || made_by_host(r)) {
        a.refusal = op.name() + " writes " + name_of(t, op.inputs[k]) + " in place, which " +
                    (made_by_host(r) ? "a host step made" : "is an argument") +
                    ": a graph reads a copy of it";
        return a;
      }
    }
  }
  // Values that outlive the segment that makes them: read by a later one, returned, or assigned
  // to a grad. A returned value that is a view of an argument would be a view of the copy.
  std::vector<int> last_reader(t.values.size(), -1);
  for (size_t i = 0; i < t.ops.size(); ++i) {
    for (int v : t.ops[i].inputs) {
      if (v < 0) continue;
      last_reader[static_cast<size_t>(v)] = op_segment[i];
      const Analysis::Segment& s = a.segments[static_cast<size_t>(op_segment[i])];
      if (!s.graph) continue;
      const bool outside =
          t.roles[static_cast<size_t>(v)] == ValueRole::kArgument || made_by_host(v);
      auto& in = a.segments[static_cast<size_t>(op_segment[i])].inputs;
      if (outside && std::find(in.begin(), in.end(), v) == in.end()) in.push_back(v);
    }
  }
  std::vector<bool> kept(t.values.size(), false);
  for (int v : t.outputs) {
    if (v >= 0) kept[static_cast<size_t>(v)] = true;
  }
  for (const GradEffect& e : t.grad_effects) {
    if (e.value >= 0) kept[static_cast<size_t>(e.value)] = true;
  }
  for (size_t v = 0; v < t.values.size(); ++v) {
    const int s = a.segment[v];
    if (s < 0 || !a.segments[static_cast<size_t>(s)].graph) continue;
    if (!kept[v] && last_reader[v] <= s) continue;
    // Made by the wait on the host: the frame gets it from the wait's step, after the graph.
    if (waited[v]) continue;
    const int r = a.root[v];
    if (kept[v] && t.roles[static_cast<size_t>(r)] == ValueRole::kArgument) {
      a.refusal = "it returns " + name_of(t, static_cast<int>(v)) + ", a view of the argument " +
                  name_of(t, r) + " (a graph reads a copy of it)";
      return a;
    }
    a.segments[static_cast<size_t>(s)].escapes.push_back(static_cast<int>(v));
  }
  return a;
}

// A buffer of `spec`'s sizes and strides, outside any graph (kiln's pool). With `like`, its data
// starts at the same offset from a 256-byte boundary as like's: kernels choose their variant by
// alignment (fused_cuda's vector entry, cuBLASLt's algorithms), and the graph then runs what a
// run on `like` would have run.
Tensor static_buffer(const TensorSpec& spec, const Tensor& like = Tensor()) {
  const Shape strides = spec.strides.empty() ? contiguous_strides(spec.sizes) : spec.strides;
  const size_t item = element_size(spec.dtype);
  size_t misalign = 0;
  if (like.defined() && like.numel() > 0) {
    misalign = reinterpret_cast<uintptr_t>(like.data_ptr()) % 256;
    if (misalign % item != 0) misalign = 0;
  }
  int64_t extent = 1;
  bool empty = false;
  for (size_t d = 0; d < spec.sizes.size(); ++d) {
    if (spec.sizes[d] == 0) empty = true;
    extent += (spec.sizes[d] - 1) * std::max<int64_t>(strides[d], 0);
  }
  const size_t bytes = empty ? 0 : static_cast<size_t>(extent) * item + misalign;
  return Tensor(std::make_shared<TensorImpl>(allocate_storage(bytes, spec.device), spec.sizes,
                                             strides, static_cast<int64_t>(misalign / item),
                                             spec.dtype));
}

// The bytes of a 0-d CPU tensor.
std::string bytes_of(const Tensor& t) {
  return std::string(static_cast<const char*>(t.data_ptr()), element_size(t.dtype()));
}

}  // namespace

std::string cuda_graph_refusal(const Program& program, bool has_backward) {
  return analyse(program, has_backward).refusal;
}

struct GraphedProgram::Plan {
  Analysis analysis;
  struct Captured {
    std::shared_ptr<cuda::internal::CapturedGraph> graph;
    std::vector<std::pair<int, Tensor>> inputs;   // value, the static buffer the graph reads
    std::vector<std::pair<int, Tensor>> escapes;  // value, the tensor later steps read
  };
  std::vector<Captured> captured;  // per segment (empty for host segments); empty: not captured
  std::vector<const void*> external_ptrs;   // the captured tensors' data at capture
  std::vector<std::string> constant_bytes;  // Analysis::constants' values at capture
  std::vector<bool> copied_out;             // per value: returned from a graph's memory
  int64_t static_bytes = 0;                 // the inputs' static buffers
  int64_t kept_bytes = 0;                   // the values that outlive a graph, in its memory
  std::vector<Tensor> launch_buffers;       // per Analysis::launch_inputs: where its value is
  // Random ops: the device word the graphs' random kernels read each replay's Philox base from
  // (written before every launch), and the generator's seed at capture.
  Tensor rng_word;
  cuda::internal::GraphRng rng;
  uint64_t rng_seed = 0;
};

GraphedProgram::GraphedProgram(std::shared_ptr<const Program> program)
    : program_(std::move(program)), plan_(std::make_unique<Plan>()) {
  plan_->analysis = analyse(*program_, false);
  KILN_CHECK(plan_->analysis.refusal.empty(),
             "[cuda_graph] the program cannot be captured: ", plan_->analysis.refusal);
}

GraphedProgram::~GraphedProgram() = default;

int GraphedProgram::graphs() const {
  int n = 0;
  for (const auto& c : plan_->captured) n += c.graph != nullptr;
  return n;
}

int GraphedProgram::device() const { return plan_->analysis.device; }

int GraphedProgram::host_steps() const { return plan_->analysis.host_steps; }

int64_t GraphedProgram::static_bytes() const { return plan_->static_bytes; }

int64_t GraphedProgram::kept_bytes() const { return plan_->kept_bytes; }

std::vector<Tensor> GraphedProgram::run(const std::vector<Tensor>& arguments, Run& r) {
  const Program& p = *program_;
  const Trace& t = p.trace();
  Plan& plan = *plan_;
  const Analysis& a = plan.analysis;
  r = Run{};
  if (cuda::launch_sync()) {
    r.failure = "the synchronous debug mode (KILN_CUDA_SYNC, cuda::set_launch_sync) is on";
    return p.run(arguments);
  }
  Frame frame = p.begin_run(arguments);  // reserves the run's Philox blocks
  const bool random = t.rng_blocks > 0;
  // The graphs' random kernels were captured with the generator's seed of then.
  if (!plan.captured.empty() && random && frame.rng_seed != plan.rng_seed) {
    r.recaptured = "the random generator's seed changed (manual_seed)";
    plan.captured.clear();
  }
  // A captured tensor whose memory moved (replaced storage) is read at its old address by the
  // graphs: capture them again.
  if (!plan.captured.empty()) {
    for (size_t i = 0; i < p.externals().size(); ++i) {
      const Tensor& e = p.externals()[i];
      const void* now = e.defined() ? e.data_ptr() : nullptr;
      if (now != plan.external_ptrs[i]) {
        r.recaptured = "the memory of captured tensor " + name_of(t, t.externals[i]) + " moved";
        plan.captured.clear();
        break;
      }
    }
  }
  if (!plan.captured.empty()) {
    for (size_t k = 0; k < a.constants.size(); ++k) {
      if (bytes_of(p.externals()[a.constants[k]]) != plan.constant_bytes[k]) {
        r.recaptured =
            "the value of the CPU scalar " + name_of(t, t.externals[a.constants[k]]) + " changed";
        plan.captured.clear();
        break;
      }
    }
  }
  NoGradGuard no_grad;
  // Each launch reads this run's Philox base from the word (stream-ordered before the graph).
  auto launch = [&](cuda::internal::CapturedGraph& graph) {
    if (random) {
      cuda::internal::write_device_word(a.device, static_cast<uint64_t*>(plan.rng_word.data_ptr()),
                                        frame.rng_base);
    }
    graph.launch();
  };
  // The launch inputs: this run's values of the CPU scalars, written (stream-ordered before the
  // run's launches) into the buffers the graphs read, which their readers take.
  auto write_launch_inputs = [&] {
    for (size_t k = 0; k < a.launch_inputs.size(); ++k) {
      const Analysis::LaunchInput& li = a.launch_inputs[k];
      plan.launch_buffers[k].copy_(p.externals()[li.external]);
      frame.slots[static_cast<size_t>(li.value)] = plan.launch_buffers[k];
    }
  };
  // Program::run_steps over ops [begin, end) but the launch inputs' copies (their values are in
  // their buffers already).
  auto run_range = [&](size_t begin, size_t end) {
    size_t from = begin;
    for (const Analysis::LaunchInput& li : a.launch_inputs) {
      if (li.op < begin || li.op >= end) continue;
      p.run_steps(frame, from, li.op);
      for (int v : p.dropped_after(li.op)) frame.slots[static_cast<size_t>(v)] = Tensor();
      from = li.op + 1;
    }
    p.run_steps(frame, from, end);
  };
  if (!plan.captured.empty()) {
    write_launch_inputs();
    for (size_t s = 0; s < a.segments.size(); ++s) {
      const Analysis::Segment& seg = a.segments[s];
      if (!seg.graph) {
        run_range(seg.begin, seg.end);
        continue;
      }
      Plan::Captured& c = plan.captured[s];
      for (auto& [v, buffer] : c.inputs) buffer.copy_(frame.slots[static_cast<size_t>(v)]);
      launch(*c.graph);
      for (const auto& [v, tensor] : c.escapes) frame.slots[static_cast<size_t>(v)] = tensor;
      for (size_t i = seg.begin; i < seg.end; ++i) {
        for (int v : p.dropped_after(i)) frame.slots[static_cast<size_t>(v)] = Tensor();
      }
    }
  } else {
    // Capture, segment by segment, launching each graph as it is made; a failed capture leaves
    // the frame as it was before the segment, which then runs op by op, as does the rest.
    r.captured = true;
    plan.captured.assign(a.segments.size(), {});
    plan.copied_out.assign(t.values.size(), false);
    plan.static_bytes = 0;
    plan.kept_bytes = 0;
    plan.external_ptrs.clear();
    for (const Tensor& e : p.externals()) {
      plan.external_ptrs.push_back(e.defined() ? e.data_ptr() : nullptr);
    }
    plan.constant_bytes.clear();
    for (size_t k : a.constants) plan.constant_bytes.push_back(bytes_of(p.externals()[k]));
    if (random) {
      plan.rng_word = static_buffer({Shape{}, kInt64, Device(kCUDA, a.device), {}});
      plan.rng = {static_cast<const uint64_t*>(plan.rng_word.data_ptr()), frame.rng_base};
      plan.rng_seed = frame.rng_seed;
    }
    plan.launch_buffers.clear();
    for (const Analysis::LaunchInput& li : a.launch_inputs) {
      plan.launch_buffers.push_back(static_buffer(t.value(li.value).spec));
      plan.static_bytes +=
          static_cast<int64_t>(plan.launch_buffers.back().impl()->storage()->nbytes());
    }
    write_launch_inputs();
    // The warm-up's intermediates are cached in kiln's pool; graph memory is apart from it.
    cuda::empty_cache(a.device);
    bool failed = false;
    for (size_t s = 0; s < a.segments.size(); ++s) {
      const Analysis::Segment& seg = a.segments[s];
      if (!seg.graph || failed) {
        run_range(seg.begin, seg.end);
        continue;
      }
      Plan::Captured& c = plan.captured[s];
      const std::vector<Tensor> before = frame.slots;
      for (int v : seg.inputs) {
        Tensor buffer = static_buffer(t.value(v).spec, frame.slots[static_cast<size_t>(v)]);
        buffer.copy_(frame.slots[static_cast<size_t>(v)]);
        plan.static_bytes += static_cast<int64_t>(buffer.impl()->storage()->nbytes());
        frame.slots[static_cast<size_t>(v)] = buffer;
        c.inputs.emplace_back(v, std::move(buffer));
      }
      // Values that outlive the graph (read by a later step, returned, or a gradient) stay in
      // its memory, at the same address on every replay, until its next launch; returned ones
      // are copied out after each run (below).
      std::vector<int> kept;
      for (int v : seg.escapes) {
        const int root = a.root[static_cast<size_t>(v)];
        if (a.segment[static_cast<size_t>(root)] != static_cast<int>(s)) continue;
        kept.push_back(v);
        plan.copied_out[static_cast<size_t>(v)] = true;
      }
      try {
        c.graph = cuda::internal::capture_graph(a.device, [&] {
          const cuda::internal::GraphRngScope rng(random ? &plan.rng : nullptr);
          run_range(seg.begin, seg.end);
          std::vector<Storage> storages;
          for (int v : kept) {
            const Tensor& slot = frame.slots[static_cast<size_t>(v)];
            if (!slot.defined()) continue;
            const Storage& st = slot.impl()->storage();
            if (std::find(storages.begin(), storages.end(), st) != storages.end()) continue;
            storages.push_back(st);
            plan.kept_bytes += static_cast<int64_t>(st->nbytes());
          }
          return storages;
        });
      } catch (const Error& e) {
        // Nothing of the segment ran: run it op by op from the frame as it was.
        frame.slots = before;
        plan.captured.clear();
        r.failure = "capturing the steps of ops " + std::to_string(seg.begin) + "-" +
                    std::to_string(seg.end - 1) + " (" + t.ops[seg.begin].name() + " ... " +
                    t.ops[seg.end - 1].name() + ") failed: " + e.what();
        failed = true;
        run_range(seg.begin, seg.end);
        continue;
      }
      for (int v : seg.escapes) c.escapes.emplace_back(v, frame.slots[static_cast<size_t>(v)]);
      // Later steps read the arguments and host values themselves, as a replay leaves them.
      for (const auto& [v, buffer] : c.inputs) {
        Tensor& slot = frame.slots[static_cast<size_t>(v)];
        if (slot.defined() && slot.impl() == buffer.impl()) slot = before[static_cast<size_t>(v)];
      }
      launch(*c.graph);
    }
  }
  std::vector<Tensor> outputs = p.end_run(frame);
  // Returned values of a graph's memory: copied out, so the next replay does not overwrite what
  // the caller holds.
  if (!plan.captured.empty()) {
    for (size_t i = 0; i < t.outputs.size(); ++i) {
      const int v = t.outputs[i];
      if (v >= 0 && plan.copied_out[static_cast<size_t>(v)] && outputs[i].defined()) {
        outputs[i] = outputs[i].clone();
      }
    }
  }
  return outputs;
}

}  // namespace kiln::compiler
