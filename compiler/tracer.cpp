#include "compiler/tracer.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "autograd/autograd_meta.h"
#include "autograd/engine.h"
#include "autograd/grad_mode.h"
#include "kernels/cuda/runtime.h"
#include "tensor/autocast_state.h"
#include "tensor/borrowed.h"
#include "tensor/random.h"
#include "tensor/traced_factories.h"

namespace kiln::compiler {
namespace {

// A captured tensor turned into a proxy for the duration of the trace.
struct Converted {
  Tensor tensor;                                        // the user's tensor (now a proxy)
  std::shared_ptr<TensorImpl> real;                     // its real data, restored at the end
  std::shared_ptr<autograd::AutogradMeta> meta;         // its autograd state, restored at the end
  std::shared_ptr<autograd::AutogradMeta> traced_meta;  // the state used while tracing
  Tensor grad_at_entry;
  // For a tensor over borrowed memory (from_blob): its values when captured, which the
  // program reads instead (the memory may be gone when the program runs).
  Tensor snapshot;
  int external = -1;          // index into Trace::externals
  bool grad_written = false;  // the callable wrote its grad through mutable_grad (zero_grad)
};

// A known value on a proxy storage, to resolve aliases made outside the registry (detach()).
struct Placed {
  int value;
  Shape sizes, strides;
  int64_t offset;
  ScalarType dtype;
};

class Tracer {
 public:
  Trace trace;
  std::vector<Converted> converted;
  std::vector<bool> grad_guarded;  // per external, set by restore()
  int depth = 0;                   // > 0 while a recorded call runs below the Trace key
  int paused = 0;                  // > 0 while the tracer's own calls run (nothing is recorded)
  RngState rng_at_entry;

  // The value of `t`, converting a real tensor into an external on first sight.
  int resolve(const Tensor& t) {
    const TensorImpl* impl = t.impl();
    if (!redirects_.empty()) {
      if (auto it = redirects_.find(impl->storage().get()); it != redirects_.end())
        return resolve_redirected(t, it->second.second);
    }
    if (auto it = by_impl_.find(impl); it != by_impl_.end() && !it->second.first.expired()) {
      return it->second.second;
    }
    const StorageImpl* storage = impl->storage().get();
    if (storage->is_proxy()) {
      if (auto it = by_storage_.find(storage); it != by_storage_.end()) {
        for (auto p_it = it->second.rbegin(); p_it != it->second.rend(); ++p_it) {  // latest first
          const Placed& p = *p_it;
          if (p.sizes == impl->sizes() && p.strides == impl->strides() &&
              p.offset == impl->storage_offset() && p.dtype == impl->dtype()) {
            const int id = p.value;  // remember() may grow the vector p is in
            remember(t, id);
            return id;
          }
        }
      }
      KILN_FAIL("[compile] a tensor of shape ", shape_str(t.sizes()),
                " aliases a traced value but was made outside the op registry (a view built "
                "from raw strides?); make it with a view op such as view, slice or as_strided");
    }
    return capture(t);
  }

  // Registers an op's output (a proxy) as a new value.
  int add_output(const Tensor& t) {
    const int id = trace.add_value(spec_of(t), ValueRole::kOp, t.requires_grad());
    remember(t, id);
    return id;
  }

  int add_argument(const Tensor& proxy) {
    const int id = trace.add_value(spec_of(proxy), ValueRole::kArgument, proxy.requires_grad());
    trace.arguments.push_back(id);
    remember(proxy, id);
    return id;
  }

  // The value a tensor handle names (undefined: -1).
  int lookup(const Tensor& t) {
    if (!t.defined()) return -1;
    return resolve(t);
  }

  // A grad about to be written through mutable_grad: captures its tensor (a real one) first.
  void note_grad_write(const Tensor& t) {
    if (!t.impl()->storage()->is_proxy()) (void)resolve(t);
    for (Converted& c : converted) {
      if (c.tensor.impl() == t.impl()) c.grad_written = true;
    }
  }

  // Whether the callable changed a captured tensor's grad so far.
  bool grads_changed() const {
    for (const Converted& c : converted) {
      const Tensor& g = c.traced_meta->grad;
      if (g.defined() != c.grad_at_entry.defined() ||
          (g.defined() && g.impl() != c.grad_at_entry.impl())) {
        return true;
      }
    }
    return false;
  }

  // Joint mode: traces the backward of `outputs` (see trace_callable).
  void trace_backward(const std::vector<Tensor>& outputs, const std::vector<Tensor>& arguments,
                      TraceResult& result) {
    std::vector<Tensor> diff_outputs, grad_proxies, targets;
    for (const Tensor& out : outputs) {
      if (!out.defined() || !out.requires_grad() || !is_floating_point(out.dtype())) {
        result.grad_outputs.push_back(-1);
        continue;
      }
      Tensor g = proxy_of({out.impl()->sizes(), out.dtype(), out.device()});  // contiguous
      const int id = trace.add_value(spec_of(g), ValueRole::kArgument);
      trace.values[static_cast<size_t>(id)].name = "g" + std::to_string(id);
      remember(g, id);
      result.grad_outputs.push_back(id);
      diff_outputs.push_back(out);
      grad_proxies.push_back(std::move(g));
    }
    for (const Tensor& a : arguments) {
      if (a.defined() && a.requires_grad()) targets.push_back(a);
    }
    for (const Converted& c : converted) {
      if (c.tensor.requires_grad()) targets.push_back(c.tensor);
    }
    if (diff_outputs.empty() || targets.empty()) {
      result.grad_outputs.clear();
      return;
    }
    for (const Tensor& t : targets) result.grad_targets.push_back(lookup(t));
    result.backward_begin = static_cast<int>(trace.ops.size());
    const std::vector<Tensor> grads = autograd::grad(diff_outputs, targets, grad_proxies,
                                                     /*retain_graph=*/false,
                                                     /*create_graph=*/false,
                                                     /*allow_unused=*/true);
    ++paused;  // reading the results records nothing
    for (const Tensor& g : grads) result.grads.push_back(lookup(g));
    --paused;
  }

  // Gives every captured tensor its real data and autograd state back; records grad effects.
  void restore(std::vector<Tensor>& externals) {
    // By index: resolving a grad the callable assigned may capture one more tensor.
    for (size_t i = 0; i < converted.size(); ++i) {
      const Tensor grad = converted[i].traced_meta->grad;
      const Tensor& entry = converted[i].grad_at_entry;
      const bool same = grad.defined() && entry.defined() && grad.impl() == entry.impl();
      // A grad the callable cleared is cleared by the program whatever the entry state was.
      const bool cleared = !grad.defined() && converted[i].grad_written;
      if (!same && (grad.defined() || entry.defined() || cleared)) {
        const int value = grad.defined() ? resolve(grad) : -1;
        trace.grad_effects.push_back({converted[i].external, value});
      }
    }
    // Whether the program depends on the grad the tensor had at entry: it read that grad (the
    // grad tensor itself was captured), or it left a grad behind without first writing it
    // (backward without zero_grad: eager code would have accumulated into an existing one).
    grad_guarded.assign(trace.externals.size(), false);
    for (const Converted& c : converted) {
      bool depends = c.grad_at_entry.defined() && by_impl_.contains(c.grad_at_entry.impl());
      for (const GradEffect& e : trace.grad_effects) {
        depends |= e.external == c.external && !c.grad_written;
      }
      grad_guarded[static_cast<size_t>(c.external)] = depends;
    }
    for (Converted& c : converted) {
      c.tensor.impl()->set_data(*c.real);
      c.tensor.impl()->set_autograd_meta(std::move(c.meta));
      c.traced_meta.reset();
    }
    externals.clear();
    externals.resize(trace.externals.size());
    for (Converted& c : converted) {
      externals[static_cast<size_t>(c.external)] = c.snapshot.defined() ? c.snapshot : c.tensor;
    }
    converted.clear();
    redirects_.clear();  // the targets are proxies: they must not outlive the trace from here
  }

  // trace_forget_handle / trace_redirect_storage (see tracer.h).
  void forget(const Tensor& t) { by_impl_.erase(t.impl()); }
  void redirect(const Storage& from, const Tensor& to) {
    KILN_CHECK(to.impl()->storage()->is_proxy() && to.storage_offset() == 0,
               "[compile] trace_redirect_storage: the target must be a traced value from offset 0");
    redirects_[from.get()] = {from, to};
  }

  // Proxies made while tracing that are still alive after everything the tracer held is gone
  // (captured tensors, real again, are not among them), each with its latest value.
  std::vector<std::pair<std::weak_ptr<TensorImpl>, int>> escaped() {
    std::vector<std::pair<std::weak_ptr<TensorImpl>, int>> out;
    for (auto& [impl, entry] : by_impl_) {
      const std::shared_ptr<TensorImpl> alive = entry.first.lock();
      if (alive && alive->storage()->is_proxy()) out.emplace_back(alive, entry.second);
    }
    return out;
  }

 private:
  void remember(const Tensor& t, int id) {
    const TensorImpl* impl = t.impl();
    by_impl_[impl] = {t.impl_ptr(), id};
    by_storage_[impl->storage().get()].push_back(
        {id, impl->sizes(), impl->strides(), impl->storage_offset(), impl->dtype()});
  }

  // A tensor on a redirected storage: the as_strided view of the target at its place, recorded
  // once per tensor handle (recording even where the tracer pauses: the view is a read of it).
  int resolve_redirected(const Tensor& t, const Tensor& to) {
    const TensorImpl* impl = t.impl();
    if (auto it = redirected_.find(impl); it != redirected_.end() && !it->second.first.expired())
      return it->second.second;
    const int saved_paused = paused, saved_depth = depth;
    paused = depth = 0;
    Tensor view;
    {
      NoGradGuard no_grad;
      view = to.as_strided(impl->sizes(), impl->strides(), impl->storage_offset());
    }
    paused = saved_paused;
    depth = saved_depth;
    const int id = lookup(view);
    redirected_[impl] = {t.impl_ptr(), id};
    return id;
  }

  // Turns the real tensor `t` into a proxy external (see tracer.h).
  int capture(const Tensor& t) {
    TensorImpl* impl = t.impl();
    const StorageImpl* real_storage = impl->storage().get();
    Storage& proxy = proxy_of_[real_storage];
    if (!proxy) proxy = proxy_storage(real_storage->nbytes(), real_storage->device());
    Converted c;
    c.tensor = t;
    if (internal::is_borrowed(real_storage)) {
      ++paused;  // the copy is not part of the trace
      NoGradGuard no_grad;
      c.snapshot = t.detach().clone();
      --paused;
    }
    c.real = std::make_shared<TensorImpl>(impl->storage(), impl->sizes(), impl->strides(),
                                          impl->storage_offset(), impl->dtype());
    c.meta = impl->autograd_meta();
    c.traced_meta = std::make_shared<autograd::AutogradMeta>();
    if (c.meta) {
      c.grad_at_entry = c.meta->grad;
      // The leaf's hooks run while tracing as in eager code: what they do (DDP's bucket copies
      // and all-reduces, dist/collective_ops.h) is recorded.
      c.traced_meta->leaf_hooks = c.meta->leaf_hooks;
      c.traced_meta->post_accumulate_hooks = c.meta->post_accumulate_hooks;
    }
    c.traced_meta->grad = c.grad_at_entry;
    impl->set_data(
        TensorImpl(proxy, impl->sizes(), impl->strides(), impl->storage_offset(), impl->dtype()));
    impl->set_autograd_meta(c.traced_meta);
    const int id = trace.add_value(spec_of(t), ValueRole::kExternal, t.requires_grad());
    c.external = static_cast<int>(trace.externals.size());
    trace.externals.push_back(id);
    converted.push_back(std::move(c));
    remember(t, id);
    return id;
  }

  absl::flat_hash_map<const TensorImpl*, std::pair<std::weak_ptr<TensorImpl>, int>> by_impl_;
  absl::flat_hash_map<const StorageImpl*, std::vector<Placed>> by_storage_;
  absl::flat_hash_map<const StorageImpl*, Storage> proxy_of_;
  // Redirected storages (held: a dead one's address could be taken by a new proxy storage) and
  // their targets.
  absl::flat_hash_map<const StorageImpl*, std::pair<Storage, Tensor>> redirects_;
  absl::flat_hash_map<const TensorImpl*, std::pair<std::weak_ptr<TensorImpl>, int>> redirected_;
};

thread_local Tracer* t_tracer = nullptr;

// Calls the callable makes are recorded; so are the functional calls made inside a recorded call
// (autocast's casts, the copy autograd keeps of an in-place op's input): replaying the outer op
// repeats the casts, so those go unused and dce drops them, but autograd's copy runs only while
// recording a graph, and its value is what the traced backward reads.
bool trace_active(const OpCall& call) {
  return t_tracer != nullptr && t_tracer->paused == 0 &&
         (t_tracer->depth == 0 || call.op->kind == OpKind::kFunctional);
}

void trace_handle(OpCall& call) {
  Tracer& tr = *t_tracer;
  const OpDef& op = *call.op;
  // As in eager code: an op whose device has no kernel supporting the call runs its
  // decomposition, whose ops are recorded instead (and give the gradient).
  if (tr.depth == 0 && op.decomposition != nullptr && call.kernel == nullptr) {
    const Device device = common_device(call);
    (void)op.meta(call);
    if (!device.is_meta() && op.select_kernel(device.type(), call) == nullptr) {
      call.outputs = op.decomposition(call);
      return;
    }
  }
  BoundOp bound;
  bound.op = &op;
  bound.inputs.reserve(call.inputs.size());
  for (const Tensor& t : call.inputs) bound.inputs.push_back(t.defined() ? tr.resolve(t) : -1);
  bound.attrs = call.attrs;
  bound.trusted_indices = cuda::internal::indices_trusted;
  if (internal::any_autocast_enabled()) {
    bound.autocast.cpu = is_autocast_enabled(kCPU);
    bound.autocast.cuda = is_autocast_enabled(kCUDA);
    bound.autocast.cpu_dtype = autocast_dtype(kCPU);
    bound.autocast.cuda_dtype = autocast_dtype(kCUDA);
  }
  if (op.random && call.attrs.size() >= 2) {
    const auto* seed = std::get_if<int64_t>(&call.attrs[call.attrs.size() - 2]);
    const auto* offset = std::get_if<int64_t>(&call.attrs.back());
    KILN_CHECK(seed != nullptr && offset != nullptr, "[compile] the random op ", op.name,
               " does not end its attributes with its Philox seed and offset");
    bound.rng_offset = *offset - static_cast<int64_t>(tr.rng_at_entry.offset);
    bound.rng_seed_from_entry = static_cast<uint64_t>(*seed) == tr.rng_at_entry.seed;
  }
  {
    ++tr.depth;
    struct Leave {
      Tracer& tr;
      ~Leave() { --tr.depth; }
    } leave{tr};
    ProxyModeGuard proxies;
    dispatch_after(call, DispatchKey::Trace);
  }
  for (const Tensor& out : call.outputs)
    bound.outputs.push_back(out.defined() ? tr.add_output(out) : -1);
  tr.trace.ops.push_back(std::move(bound));
}

const DispatchHandler kTraceHandler{&trace_active, &trace_handle};

// A grad about to be written (zero_grad) belongs to a tensor the trace must capture first.
void on_grad_write(const Tensor& t) {
  if (t_tracer == nullptr || t_tracer->depth != 0 || t_tracer->paused != 0 || !t.defined()) return;
  t_tracer->note_grad_write(t);
}

}  // namespace

bool is_tracing() { return t_tracer != nullptr; }

NotTracing::NotTracing() : saved_(t_tracer) { t_tracer = nullptr; }
NotTracing::~NotTracing() { t_tracer = static_cast<Tracer*>(saved_); }

void trace_capture_now(const Tensor& t) {
  if (t_tracer == nullptr || !t.defined() || t.impl()->storage()->is_proxy()) return;
  ++t_tracer->paused;  // capturing records no op
  struct Resume {
    ~Resume() { --t_tracer->paused; }
  } resume;
  (void)t_tracer->resolve(t);
}

void trace_forget_handle(const Tensor& t) {
  if (t_tracer != nullptr && t.defined()) t_tracer->forget(t);
}

void trace_redirect_storage(const Storage& from, const Tensor& to) {
  if (t_tracer != nullptr && from != nullptr) t_tracer->redirect(from, to);
}

Tensor proxy_of(const TensorSpec& spec, bool requires_grad) {
  const Shape strides = spec.strides.empty() ? contiguous_strides(spec.sizes) : spec.strides;
  int64_t extent = numel_of(spec.sizes) > 0 ? 1 : 0;
  for (size_t d = 0; d < spec.sizes.size() && extent > 0; ++d) {
    extent += (spec.sizes[d] - 1) * strides[d];
  }
  Tensor p(std::make_shared<TensorImpl>(
      proxy_storage(static_cast<size_t>(extent) * element_size(spec.dtype), spec.device),
      spec.sizes, strides, 0, spec.dtype));
  if (requires_grad) p.requires_grad_(true);
  return p;
}

TraceResult trace_callable(const TraceBody& body, const std::vector<Tensor>& arguments,
                           const std::string& fn_name, bool joint) {
  KILN_CHECK(t_tracer == nullptr,
             "[compile] a compiled function was called while another one "
             "is being traced; compile the outer function only");
  Tracer tr;
  tr.trace.fn_name = fn_name;
  tr.rng_at_entry = get_rng_state();
  TraceResult result;
  {
    std::vector<Tensor> proxies;
    proxies.reserve(arguments.size());
    for (const Tensor& a : arguments) {
      if (!a.defined()) {
        proxies.emplace_back();
        tr.trace.arguments.push_back(-1);
        continue;
      }
      proxies.push_back(proxy_of(spec_of(a), a.requires_grad()));
      tr.add_argument(proxies.back());
    }
    set_dispatch_handler(DispatchKey::Trace, &kTraceHandler);
    autograd::internal::set_grad_write_hook(&on_grad_write);
    t_tracer = &tr;
    struct Stop {
      Tracer& tr;
      std::vector<Tensor>& externals;
      ~Stop() {
        t_tracer = nullptr;
        set_rng_state(tr.rng_at_entry);
        if (!tr.converted.empty()) tr.restore(externals);
      }
    } stop{tr, result.externals};
    const RngState before = get_rng_state();
    std::vector<Tensor> outputs;
    {
      internal::TracedFactoriesScope factories;  // empty() and zeros() record an op
      outputs = body(proxies);
    }
    tr.trace.rng_blocks = get_rng_state().offset - before.offset;
    ++tr.paused;  // no more recording: what follows only reads the handles
    for (const Tensor& out : outputs) tr.trace.outputs.push_back(tr.lookup(out));
    if (joint && GradMode::is_enabled() && !tr.grads_changed()) {
      --tr.paused;
      tr.trace_backward(outputs, proxies, result);
      ++tr.paused;
    }
    outputs.clear();
    proxies.clear();
    tr.restore(result.externals);
  }
  result.grad_guarded = std::move(tr.grad_guarded);
  result.escaped = tr.escaped();
  result.trace = std::move(tr.trace);
  return result;
}

}  // namespace kiln::compiler
