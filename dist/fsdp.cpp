// fully_shard and FSDPModule's units (dist/fsdp.h): which unit owns which parameters, the
// sharding of a unit's parameters into its packed shard, and the forward (gathering each unit and
// preparing the backward: the hooks that gather a unit before the nodes that read it). The
// gathers, reshards and gradient reduce-scatters: dist/fsdp_collectives.cpp; state dicts and
// sharded checkpoints: dist/fsdp_state.cpp.
#include "dist/fsdp.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>

#include "autograd/grad_mode.h"
#include "autograd/hooks.h"
#include "autograd/node.h"
#include "compiler/tracer.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::dist {

struct FSDPModule::Private {};

namespace {

// Units not yet adopted by an ancestor's fully_shard, and which unit owns each parameter (so that
// a module shared between two units is caught).
struct Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<FSDPModule>> unadopted;
  std::unordered_map<const nn::Module*, std::weak_ptr<FSDPModule>> by_module;
  std::unordered_map<const TensorImpl*, std::weak_ptr<FSDPModule>> by_param;
};
Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: units may outlive static destruction
  return *r;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Each parameter's region of a unit's gathered buffer starts at a multiple of this many bytes,
// as a tensor of its own would (vectorised kernels and GEMMs like aligned operands).
constexpr int64_t kFullAlignBytes = 256;

// The names of the nodes of view ops (TBackward0, ViewBackward0, ...): their outputs alias their
// input's storage.
const std::unordered_set<std::string>& view_node_names() {
  static const auto* names = [] {
    auto* out = new std::unordered_set<std::string>;
    for (const std::string& op : kiln::Registry::get().names()) {
      if (kiln::Registry::get().entry(op).kind == OpKind::kView)
        out->insert(autograd::backward_node_name(op));
    }
    return out;
  }();
  return *names;
}

// A fingerprint of the parameter list (names, shapes, dtypes), equal on ranks holding the same
// model.
int64_t signature(const OrderedDict<std::string, Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  mix(params.size());
  for (const auto& item : params) {
    for (char c : item.key()) mix(static_cast<unsigned char>(c));
    mix(static_cast<uint64_t>(item.value().dtype()));
    for (int64_t s : item.value().sizes()) mix(static_cast<uint64_t>(s));
  }
  return static_cast<int64_t>(h >> 1);
}

}  // namespace

// --- fully_shard --------------------------------------------------------------------------------

std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module,
                                        std::shared_ptr<ProcessGroup> pg,
                                        const FSDPOptions& options) {
  KILN_CHECK(module != nullptr, "[fully_shard] the module is null");
  KILN_CHECK(pg != nullptr, "[fully_shard] the process group is null");
  for (auto dt : {options.mp_policy.param_dtype, options.mp_policy.reduce_dtype}) {
    KILN_CHECK(!dt || is_floating_point(*dt), "[fully_shard] mixed precision dtypes must be ",
               "floating, got ", dtype_name(*dt));
  }
  Registry& reg = registry();
  // The lock is not held while the unit is made: its constructor runs collectives, and the ranks
  // may be threads of one process (benchmarks/dist_bench.cpp).
  std::unique_lock<std::mutex> lock(reg.mu);
  if (auto it = reg.by_module.find(module.get());
      it != reg.by_module.end() && !it->second.expired()) {
    KILN_FAIL("[fully_shard] ", module->name(),
              " is already sharded: fully_shard was called on it ",
              "before (call it once per module)");
  }
  // The units of descendants that no one adopted yet become this unit's children.
  std::unordered_set<const nn::Module*> below;
  for (const auto& m : module->modules(/*include_self=*/false)) below.insert(m.get());
  std::vector<std::shared_ptr<FSDPModule>> children;
  for (auto it = reg.unadopted.begin(); it != reg.unadopted.end(); ++it) {
    if (below.contains(&(*it)->module())) {
      KILN_CHECK((*it)->process_group() == pg, "[fully_shard] ", module->name(), " and its ",
                 "descendant ", (*it)->module().name(), " were sharded over different process ",
                 "groups (use one group for a model)");
      children.push_back(*it);
    }
  }
  lock.unlock();
  // The children are adopted only once the unit exists: a failed call leaves them as they were.
  auto unit =
      std::make_shared<FSDPModule>(FSDPModule::Private{}, module, std::move(pg), options, children);
  lock.lock();
  for (const auto& c : children) {
    c->parent_ = unit.get();
    std::erase(reg.unadopted, c);
  }
  // Errors name each unit by its path under the root ("transformer.h.3").
  std::unordered_map<const nn::Module*, FSDPModule*> unit_of;
  for (FSDPModule* u : unit->subtree()) unit_of[&u->module()] = u;
  for (const auto& item : module->named_modules("", /*include_self=*/false)) {
    if (auto it = unit_of.find(item.value().get()); it != unit_of.end())
      it->second->path_ = item.key();
  }
  reg.unadopted.push_back(unit);
  reg.by_module[module.get()] = unit;
  for (const std::string& name : unit->parameter_names()) {
    reg.by_param[module->named_parameters()[name].impl()] = unit;
  }
  return unit;
}

FSDPModule::FSDPModule(const Private&, std::shared_ptr<nn::Module> module,
                       std::shared_ptr<ProcessGroup> pg, const FSDPOptions& options,
                       std::vector<std::shared_ptr<FSDPModule>> children)
    : module_(std::move(module)),
      pg_(std::move(pg)),
      options_(options),
      children_(std::move(children)) {
  // The parameters below that a child unit owns.
  std::unordered_set<const TensorImpl*> owned_below;
  for (FSDPModule* u : subtree()) {
    if (u == this) continue;
    for (const Param& p : u->params_) owned_below.insert(p.param.impl());
  }
  const auto named = module_->named_parameters();
  std::unique_lock<std::mutex> lock(registry().mu);
  for (const auto& item : named) {
    const Tensor& t = item.value();
    if (!t.requires_grad() || owned_below.contains(t.impl())) continue;
    auto it = registry().by_param.find(t.impl());
    if (it != registry().by_param.end()) {
      if (auto other = it->second.lock()) {
        KILN_FAIL("[fully_shard] parameter '", item.key(), "' of ", module_->name(),
                  " is already sharded by the fully_shard call on ", other->module().name(),
                  ", which is not a descendant of ", module_->name(), " (a module shared by two ",
                  "units: call fully_shard on a module that contains every use of it)");
      }
    }
    Param p;
    p.name = item.key();
    p.param = t;
    p.shape = Shape(t.sizes().begin(), t.sizes().end());
    p.numel = t.numel();
    params_.push_back(std::move(p));
  }
  lock.unlock();
  const int world = pg_->size(), rank = pg_->rank();
  if (!params_.empty()) {
    dtype_ = params_[0].param.dtype();
    const Device device = params_[0].param.device();
    for (const Param& p : params_) {
      KILN_CHECK(p.param.dtype() == dtype_ && is_floating_point(dtype_), "[fully_shard] ",
                 module_->name(), ": parameter '", p.name, "' is ", dtype_name(p.param.dtype()),
                 " but '", params_[0].name, "' is ", dtype_name(dtype_),
                 " (one floating dtype per unit: shard the parts of other dtypes separately)");
      KILN_CHECK(p.param.device() == device, "[fully_shard] ", module_->name(), ": parameter '",
                 p.name, "' is on ", p.param.device().str(), " but '", params_[0].name, "' is on ",
                 device.str(), " (one device per rank)");
    }
  }
  NoGradGuard no_grad;
  // Every rank must hold the same parameters; rank 0's values are taken (as DDP does), so that
  // ranks that initialised differently still hold slices of one model.
  const int64_t sig = signature(named);
  const Device device = named.is_empty() ? Device(kCPU) : named.begin()->value().device();
  Tensor lo = full({1}, sig, kInt64).to(device), hi = lo.clone();
  pg_->all_reduce(lo, ReduceOp::kMin)->wait();
  pg_->all_reduce(hi, ReduceOp::kMax)->wait();
  KILN_CHECK(lo.item<int64_t>() == sig && hi.item<int64_t>() == sig, "[fully_shard] ",
             module_->name(), ": the ranks hold different models (rank ", rank, " has ",
             named.size(), " parameters whose names, shapes or dtypes differ from another ",
             "rank's; build the same model on every rank)");
  std::vector<std::shared_ptr<Work>> works;
  for (Param& p : params_) works.push_back(pg_->broadcast(p.param, 0));
  for (auto& w : works) w->wait();

  // The shards live packed, each parameter's a view of the packed shard: the all-gather reads it
  // as it is. The gathered buffer holds each parameter padded (world * shard elements) at an
  // aligned offset.
  const int64_t align =
      std::max<int64_t>(1, kFullAlignBytes / static_cast<int64_t>(element_size(compute_dtype())));
  for (Param& p : params_) {
    p.shard = ceil_div(p.numel, world);
    p.offset = packed_;
    packed_ += p.shard;
    p.full_offset = full_numel_;
    full_numel_ += ceil_div(world * p.shard, align) * align;
  }
  if (!params_.empty()) packed_shard_ = zeros({packed_}, params_[0].param.options());
  for (size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    // This rank's slice of the flattened parameter, padded with zeros past its end.
    Tensor shard = packed_shard_.narrow(0, p.offset, p.shard);
    const int64_t begin = std::min<int64_t>(rank * p.shard, p.numel);
    const int64_t len = std::min<int64_t>(p.shard, p.numel - begin);
    if (len > 0)
      shard.narrow(0, 0, len).copy_(p.param.detach().reshape({-1}).narrow(0, begin, len));
    Tensor grad_shard;
    if (p.param.grad().defined()) {
      grad_shard = zeros({p.shard}, p.param.grad().options());
      if (len > 0)
        grad_shard.narrow(0, 0, len).copy_(p.param.grad().reshape({-1}).narrow(0, begin, len));
    }
    p.param.impl()->set_data(*shard.impl());
    p.param.mutable_grad() = grad_shard;
    p.hook = autograd::register_post_accumulate_grad_hook(
        p.param, [this, i](const Tensor&) { on_grad_ready(i); });
  }
}

FSDPModule::~FSDPModule() {
  for (Param& p : params_) autograd::remove_post_accumulate_grad_hook(p.param, p.hook);
  for (auto* w : {&gather_work_, &reduce_work_}) {
    if (*w == nullptr) continue;
    try {
      (*w)->wait();
    } catch (...) {
    }
  }
}

std::vector<std::string> FSDPModule::parameter_names() const {
  std::vector<std::string> out;
  for (const Param& p : params_) out.push_back(p.name);
  return out;
}

int64_t FSDPModule::unsharded_numel() const {
  int64_t n = 0;
  for (const Param& p : params_) n += p.numel;
  return n;
}

int64_t FSDPModule::sharded_numel() const { return packed_; }

std::string FSDPModule::describe() const {
  if (path_.empty()) return "the unit on " + module_->name();
  return "the unit on '" + path_ + "' (" + module_->name() + ")";
}

std::vector<FSDPModule*> FSDPModule::subtree() {
  std::vector<FSDPModule*> out;
  std::vector<FSDPModule*> stack{this};
  while (!stack.empty()) {  // depth first, children in adoption order
    FSDPModule* u = stack.back();
    stack.pop_back();
    out.push_back(u);
    for (auto it = u->children_.rbegin(); it != u->children_.rend(); ++it)
      stack.push_back(it->get());
  }
  return out;
}

FSDPModule& FSDPModule::root() {
  FSDPModule* u = this;
  while (u->parent_ != nullptr) u = u->parent_;
  return *u;
}

void FSDPModule::set_requires_gradient_sync(bool sync, bool recurse) {
  for (FSDPModule* u : recurse ? subtree() : std::vector<FSDPModule*>{this})
    u->requires_gradient_sync_ = sync;
}

// --- Forward ------------------------------------------------------------------------------------

void FSDPModule::check_previous_backward() {
  std::string missing;
  std::string unit;
  for (FSDPModule* u : subtree()) {
    if (!u->backward_pending_) continue;
    if (unit.empty()) {
      unit = u->describe();
      for (const Param& p : u->params_) {
        if (p.expected && !p.ready) missing += (missing.empty() ? "'" : ", '") + p.name + "'";
      }
    }
  }
  if (unit.empty()) return;
  abort_forward();
  KILN_FAIL("[FSDPModule::run] the last backward did not finish: ", unit, " got no gradient for ",
            missing, ", so its gradients were not reduce-scattered (run one backward through the ",
            "outputs of every run(), reaching every parameter that requires grad)");
}

void FSDPModule::pre_forward() {
  KILN_CHECK(is_root(), "[FSDPModule::run] ", describe(),
             " was adopted by the fully_shard call on ", root().module().name(),
             ": call run() on that root");
  check_previous_backward();
  const auto units = subtree();
  if (compiler::is_tracing()) {
    // A compiled step: the shards become externals of the program (by identity) before the
    // parameters are pointed at the gathered values, so that tracing ends with them as they are.
    for (FSDPModule* u : units) {
      compiler::trace_capture_now(u->packed_shard_);
      for (Param& p : u->params_) compiler::trace_capture_now(p.param);
    }
  }
  for (FSDPModule* u : units) {
    for (Param& p : u->params_) p.version_known = false;
    u->forward_gathered_ = false;
    u->versions_seen_ = false;
  }
  if (gather_per_unit_) {
    // The root's own parameters now; the units as the model reaches them (before_forward).
    finish_gather();
    forward_gathered_ = true;
    forward_order_.assign(units.begin() + 1, units.end());
    if (!forward_order_.empty()) forward_order_.front()->launch_gather();
    return;
  }
  for (FSDPModule* u : units) {
    u->launch_gather();  // every all-gather in flight before waiting for the first
  }
  for (FSDPModule* u : units) u->finish_gather();
}

void FSDPModule::set_gather_per_unit(bool on) {
  KILN_CHECK(is_root(), "[FSDPModule::set_gather_per_unit] ", describe(),
             " was adopted by the fully_shard call on ", root().module().name(),
             ": call it on that root");
  gather_per_unit_ = on;
}

void FSDPModule::before_forward() {
  FSDPModule& r = root();
  if (!r.gather_per_unit_) return;  // run() gathered every unit
  finish_gather();                  // launches it first when no prefetch did
  forward_gathered_ = true;
  const auto it = std::find(r.forward_order_.begin(), r.forward_order_.end(), this);
  if (it != r.forward_order_.end() && it + 1 != r.forward_order_.end())
    (*(it + 1))->launch_gather();
}

void FSDPModule::after_forward() {
  if (!root().gather_per_unit_ || this == &root()) return;
  // The versions the forward saw, which the gather in backward restores (resharding now moves
  // the counters on before post_forward could read them).
  for (Param& p : params_) p.full_version = p.param._version();
  versions_seen_ = true;
  if (options_.reshard_after_forward) reshard_keeping(GradMode::is_enabled());
}

void FSDPModule::abort_forward() {
  ++forward_runs_;  // the graph of the aborted run() cannot be run backward
  for (FSDPModule* u : subtree()) {
    for (Param& p : u->params_) {
      p.expected = p.ready = false;
    }
    u->backward_pending_ = false;
    u->expected_count_ = u->ready_count_ = 0;
    if (u->reduce_work_ != nullptr) {
      try {
        u->reduce_work_->wait();
      } catch (...) {
      }
      u->reduce_work_ = nullptr;
    }
    u->reduce_input_ = u->reduce_output_ = Tensor();
    u->reduce_inputs_.clear();
    u->reshard();
  }
  units_to_reduce_ = 0;
  last_reduce_ = nullptr;
  backward_order_.clear();
}

void FSDPModule::post_forward(const std::optional<std::vector<Tensor>>& outputs) {
  const auto units = subtree();
  if (gather_per_unit_) {
    for (FSDPModule* u : units) {
      if (u->forward_gathered_ || u->params_.empty()) continue;
      abort_forward();
      KILN_FAIL("[FSDPModule::run] gather_per_unit is on but the forward never called ",
                u->describe(),
                "'s before_forward(): call before_forward() / after_forward() "
                "around each unit's forward, or set_gather_per_unit(false)");
    }
  }
  bool needs_backward = false;
  if (GradMode::is_enabled()) {
    KILN_CHECK(outputs.has_value(), "[FSDPModule::run] the callable must return a Tensor, or a ",
               "std::vector or std::tuple of Tensors, for the backward to be prepared");
    for (const Tensor& t : *outputs) needs_backward |= t.defined() && t.requires_grad();
  }
  if (!needs_backward) {
    for (FSDPModule* u : units) u->reshard();
    return;
  }
  // Which unit parameter each leaf accumulator stands for.
  std::unordered_map<const TensorImpl*, std::pair<FSDPModule*, size_t>> owner;
  for (FSDPModule* u : units) {
    for (size_t i = 0; i < u->params_.size(); ++i) owner[u->params_[i].param.impl()] = {u, i};
  }
  ++forward_runs_;  // the hooks of an earlier run()'s graph refuse to gather for this one
  // Walk the graph. A unit's parameters (their AccumulateGrad nodes), and views of them alone
  // (linear's weight.t()), are the unit's: what their outputs hold may be a view of the gathered
  // buffer, which resharding empties. Every node that takes one of them as an input (and may
  // have saved it) gets a hook gathering the unit before it runs.
  std::unordered_map<const autograd::Node*, FSDPModule*> unit_of;
  std::vector<std::shared_ptr<autograd::Node>> nodes;
  std::unordered_set<const autograd::Node*> seen;
  std::vector<std::shared_ptr<autograd::Node>> stack;
  for (const Tensor& t : *outputs) {
    if (t.defined() && t.grad_fn() != nullptr) stack.push_back(t.grad_fn());
  }
  while (!stack.empty()) {
    std::shared_ptr<autograd::Node> node = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(node.get()).second) continue;
    if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(node.get())) {
      if (auto it = owner.find(acc->variable().get()); it != owner.end()) {
        auto [u, i] = it->second;
        u->params_[i].expected = true;
        unit_of[node.get()] = u;
      }
      continue;
    }
    for (const auto& e : node->next_edges()) {
      if (e.function != nullptr) stack.push_back(e.function);
    }
    nodes.push_back(std::move(node));
  }
  const auto& views = view_node_names();
  for (bool grew = true; grew;) {  // as many rounds as the longest chain of views
    grew = false;
    for (const auto& node : nodes) {
      if (unit_of.contains(node.get()) || node->next_edges().empty()) continue;
      const autograd::Edge& in = node->next_edge(0);
      if (in.function == nullptr) continue;
      auto it = unit_of.find(in.function.get());
      if (it == unit_of.end() || !views.contains(node->name())) continue;
      unit_of[node.get()] = it->second;
      grew = true;
    }
  }
  for (const auto& node : nodes) {
    std::vector<std::weak_ptr<FSDPModule>> readers;
    std::unordered_set<FSDPModule*> added;
    for (const auto& e : node->next_edges()) {
      if (e.function == nullptr) continue;
      auto it = unit_of.find(e.function.get());
      if (it != unit_of.end() && added.insert(it->second).second)
        readers.push_back(it->second->weak_from_this());
    }
    if (readers.empty()) continue;
    auto hook = [readers, run = forward_runs_](const Tensor&) {
      for (const auto& w : readers) {
        if (auto u = w.lock()) u->pre_backward(run);
      }
      return Tensor();
    };
    const size_t outs = std::max<size_t>(1, node->output_metas().size());
    for (size_t k = 0; k < outs; ++k) node->add_pre_hook(static_cast<uint32_t>(k), hook);
  }
  units_to_reduce_ = 0;
  last_reduce_ = nullptr;
  backward_order_.clear();
  for (auto it = units.rbegin(); it != units.rend(); ++it) {
    FSDPModule* u = *it;
    if (u->params_.empty()) continue;
    u->expected_count_ = 0;
    u->ready_count_ = 0;
    for (Param& p : u->params_) {
      u->expected_count_ += p.expected ? 1 : 0;
      p.ready = false;
      if (!u->versions_seen_) p.full_version = p.param._version();
      p.version_known = true;
    }
    if (u->expected_count_ == 0) {
      abort_forward();
      KILN_FAIL("[FSDPModule::run] no parameter of ", u->describe(), " is reachable from the ",
                "outputs, so its gradients would never be reduce-scattered (every unit must take ",
                "part in the loss; shard unused parts separately, or run them outside run())");
    }
    u->backward_pending_ = true;
    ++units_to_reduce_;
    backward_order_.push_back(u);
  }
  for (FSDPModule* u : units) {
    if (u != this && u->options_.reshard_after_forward) u->reshard_keeping(true);
  }
}

}  // namespace kiln::dist
