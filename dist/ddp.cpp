#include "dist/ddp.h"

#include <algorithm>
#include <map>
#include <unordered_set>
#include <utility>

#include "autograd/autograd_meta.h"
#include "autograd/grad_mode.h"
#include "autograd/hooks.h"
#include "autograd/node.h"
#include "compiler/tracer.h"
#include "dist/collective_ops.h"
#include "kernels/cuda.h"
#include "kernels/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"

namespace kiln::dist::internal {
namespace {

// A fingerprint of the parameter list (count, shapes, dtypes), equal on ranks holding the same
// model.
int64_t signature(const std::vector<Tensor>& params) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    h ^= v;
    h *= 1099511628211ull;
  };
  mix(params.size());
  for (const auto& p : params) {
    mix(static_cast<uint64_t>(p.dtype()));
    mix(static_cast<uint64_t>(p.dim()));
    for (int64_t s : p.sizes()) mix(static_cast<uint64_t>(s));
  }
  return static_cast<int64_t>(h >> 1);
}

// Whether `a` is `view` (the same tensor, or the same memory seen the same way).
bool aliases(const Tensor& a, const Tensor& view) {
  if (a.is_same(view)) return true;
  // By storage and offset, not data pointers: a traced step's tensors are proxies (no memory).
  return a.dtype() == view.dtype() && a.impl()->storage().get() == view.impl()->storage().get() &&
         a.storage_offset() == view.storage_offset() && a.sizes() == view.sizes() &&
         a.strides() == view.strides();
}

}  // namespace

Reducer::Reducer(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
                 const DDPOptions& options)
    : module_(std::move(module)), pg_(std::move(pg)), options_(options) {
  KILN_CHECK(module_ != nullptr, "[DistributedDataParallel] the module is null");
  KILN_CHECK(pg_ != nullptr, "[DistributedDataParallel] the process group is null");
  KILN_CHECK(options_.bucket_cap_mb > 0,
             "[DistributedDataParallel] bucket_cap_mb must be > 0, got ", options_.bucket_cap_mb);
  KILN_CHECK(options_.tail_buckets >= 0,
             "[DistributedDataParallel] tail_buckets must be >= 0, got ", options_.tail_buckets);
  for (auto& item : module_->named_parameters()) {
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    names_.push_back(item.key());
  }
  KILN_CHECK(!params_.empty(),
             "[DistributedDataParallel] the module has no parameters that require grad");
  const Device device = params_[0].device();
  for (size_t i = 0; i < params_.size(); ++i) {
    KILN_CHECK(params_[i].device() == device, "[DistributedDataParallel] parameter '", names_[i],
               "' is on ", params_[i].device(), " but '", names_[0], "' is on ", device,
               " (one device per rank)");
  }

  NoGradGuard no_grad;
  // Every rank must hold the same parameter list.
  const int64_t sig = signature(params_);
  Tensor lo = full({1}, sig, kInt64).to(device);
  Tensor hi = lo.clone();
  pg_->all_reduce(lo, ReduceOp::kMin)->wait();
  pg_->all_reduce(hi, ReduceOp::kMax)->wait();
  KILN_CHECK(lo.item<int64_t>() == sig && hi.item<int64_t>() == sig,
             "[DistributedDataParallel] the ranks hold different models: rank ", pg_->rank(),
             " has ", params_.size(),
             " parameters whose shapes or dtypes differ from another "
             "rank's (build the same model on every rank)");
  // Rank 0's parameters and buffers everywhere.
  std::vector<std::shared_ptr<Work>> works;
  for (auto& p : params_) works.push_back(pg_->broadcast(p, 0));
  for (auto b : module_->buffers()) works.push_back(pg_->broadcast(b, 0));
  for (auto& w : works) w->wait();

  // Buckets in reverse registration order until the first backward shows the real order.
  std::vector<size_t> order(params_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = order.size() - 1 - k;
  build_buckets(order);
  ready_.assign(params_.size(), false);

  for (size_t i = 0; i < params_.size(); ++i) {
    hook_handles_.push_back(autograd::register_post_accumulate_grad_hook(
        params_[i], [this, i](const Tensor&) { on_grad_ready(i); }));
  }
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  // One open bucket per (dtype, device); a parameter that would take it past the cap opens the
  // next one (a parameter larger than the cap is alone in its bucket).
  const auto cap = static_cast<int64_t>(options_.bucket_cap_mb * 1024 * 1024);
  std::map<std::pair<int, std::string>, size_t> open;  // (dtype, device) -> bucket index
  std::vector<int64_t> bytes;
  buckets_.clear();
  bucket_of_.assign(params_.size(), 0);
  for (size_t k : order) {
    const Tensor& p = params_[k];
    const auto key = std::make_pair(static_cast<int>(p.dtype()), p.device().str());
    const auto nbytes = static_cast<int64_t>(p.nbytes());
    auto it = open.find(key);
    if (it == open.end() || (bytes[it->second] > 0 && bytes[it->second] + nbytes > cap)) {
      buckets_.emplace_back();
      bytes.push_back(0);
      it = open.insert_or_assign(key, buckets_.size() - 1).first;
    }
    Bucket& b = buckets_[it->second];
    b.params.push_back(k);
    bytes[it->second] += nbytes;
    bucket_of_[k] = it->second;
  }
  views_.assign(params_.size(), Tensor());
  for (Bucket& b : buckets_) {
    b.pending = b.params.size();
    // Each slot starts on a 64-byte boundary: the views handed out as grad() stay aligned for
    // the vectorised optimizer and foreach kernels.
    const int64_t align =
        std::max<int64_t>(1, 64 / static_cast<int64_t>(params_[b.params[0]].element_size()));
    int64_t numel = 0;
    for (size_t i : b.params) {
      b.offsets.push_back(numel);
      numel += (params_[i].numel() + align - 1) / align * align;
    }
    if (solo(b)) continue;
    b.flat = zeros({numel}, params_[b.params[0]].options());
    for (size_t j = 0; j < b.params.size(); ++j) {
      const Tensor& p = params_[b.params[j]];
      views_[b.params[j]] = b.flat.narrow(0, b.offsets[j], p.numel()).view(p.sizes());
    }
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < hook_handles_.size(); ++i) {
    autograd::remove_post_accumulate_grad_hook(params_[i], hook_handles_[i]);
  }
  for (Bucket& b : buckets_) {
    if (b.work == nullptr) continue;
    try {
      b.work->wait();
    } catch (...) {
    }
  }
}

std::vector<std::vector<size_t>> Reducer::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const Bucket& b : buckets_) out.push_back(b.params);
  return out;
}

std::string Reducer::names_of_unready() const {
  std::string s;
  int listed = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (ready_[i]) continue;
    if (listed++ == 10) {
      s += ", ...";
      break;
    }
    s += (s.empty() ? "'" : ", '") + names_[i] + "'";
  }
  return s;
}

void Reducer::on_grad_ready(size_t index) {
  if (!require_sync_) return;  // no_sync(): accumulate locally (into the views, if grad is one)
  std::lock_guard<std::mutex> lock(mu_);
  mark_ready(index);
}

void Reducer::mark_ready(size_t index) {
  KILN_CHECK(!ready_[index], "[DistributedDataParallel] parameter '", names_[index],
             searched_unused_ && !used_[index]
                 ? "' was not reached from the forward's outputs but got a gradient (was it used "
                   "outside the model's forward?)"
                 : "' got a gradient twice in one synchronised backward (a second backward "
                   "through the same forward? run all but the last micro-batch under no_sync())");
  ready_[index] = true;
  ++num_ready_;
  if (!rebuilt_) ready_order_.push_back(index);
  Bucket& b = buckets_[bucket_of_[index]];
  {
    NoGradGuard no_grad;
    Tensor& param = params_[index];
    const Tensor& grad = param.grad();  // undefined: unused in this pass (and before it)
    if (solo(b)) {
      // All-reduced in place: grad() itself, contiguous and in the parameter's dtype.
      if (!grad.defined()) {
        b.flat = zeros(param.sizes(), param.options());  // grad() if another rank used it
      } else {
        if (!grad.is_contiguous() || grad.dtype() != param.dtype()) {
          param.mutable_grad() = grad.to(param.dtype()).contiguous();
        }
        b.flat = param.grad();
      }
    } else {
      Tensor& view = views_[index];
      if (!grad.defined()) {
        view.zero_();
      } else if (!aliases(grad, view)) {
        view.copy_(grad);
        if (options_.gradient_as_bucket_view) param.mutable_grad() = view;
      }
    }
  }
  if (--b.pending > 0) return;
  // Launch the full buckets in bucket order: the same sequence of all-reduces on every rank.
  if (next_to_launch_ == 0 && buckets_[0].pending == 0 && options_.comm_sm_carveout > 0 &&
      carveout_before_ < 0 && params_[index].is_cuda() && !compiler::is_tracing()) {
    carveout_before_ = cuda::matmul_sm_carveout();
    cuda::set_matmul_sm_carveout(options_.comm_sm_carveout);
  }
  while (next_to_launch_ < buckets_.size() && buckets_[next_to_launch_].pending == 0) {
    // An op of the registry: a compiled step records it here, amid the backward it overlaps.
    // The buckets before the last tail_buckets run beside the backward's remaining compute
    // (NCCL: through the copy engines, leaving the SMs to it); the last ones hold up the step,
    // and take the fastest path.
    const bool beside_compute =
        next_to_launch_ + static_cast<size_t>(options_.tail_buckets) < buckets_.size();
    Bucket& next = buckets_[next_to_launch_++];
    next.work = all_reduce_op(pg_, next.flat, ReduceOp::kAvg, beside_compute);
  }
  if (next_to_launch_ == buckets_.size()) finalize();
}

void Reducer::prepare_for_backward(const std::optional<std::vector<Tensor>>& outputs) {
  if (!require_sync_ || !GradMode::is_enabled()) return;
  KILN_CHECK(!compiler::is_tracing(),
             "[DistributedDataParallel] find_unused_parameters cannot be compiled: which "
             "parameters a pass used is agreed on from values at run time; compile without it");
  KILN_CHECK(outputs.has_value(),
             "[DistributedDataParallel] find_unused_parameters needs forward to return a Tensor, "
             "or a std::vector or std::tuple of Tensors");
  // The leaves the outputs depend on: a walk over the graph from their grad_fns.
  std::unordered_set<const TensorImpl*> reached;
  std::unordered_set<const autograd::Node*> seen;
  std::vector<std::shared_ptr<autograd::Node>> stack;
  for (const Tensor& t : *outputs) {
    if (!t.defined() || !t.requires_grad()) continue;
    if (t.grad_fn() != nullptr) {
      stack.push_back(t.grad_fn());
    } else {
      reached.insert(t.impl());  // a parameter returned as is
    }
  }
  while (!stack.empty()) {
    std::shared_ptr<autograd::Node> node = std::move(stack.back());
    stack.pop_back();
    if (!seen.insert(node.get()).second) continue;
    if (auto* acc = dynamic_cast<autograd::AccumulateGrad*>(node.get())) {
      reached.insert(acc->variable().get());
      continue;
    }
    for (const auto& e : node->next_edges()) {
      if (e.function != nullptr) stack.push_back(e.function);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  searched_unused_ = true;
  used_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (reached.contains(params_[i].impl())) {
      used_[i] = 1;
    } else {
      mark_ready(i);
    }
  }
}

void Reducer::finalize() {
  NoGradGuard no_grad;
  // With find_unused_parameters: which parameters some rank used (those no rank used keep their
  // grad as it is).
  std::vector<int32_t> used_anywhere(params_.size(), 1);
  if (searched_unused_) {
    Tensor used = tensor(used_, kInt32).to(params_[0].device());
    pg_->all_reduce(used, ReduceOp::kMax)->wait();
    used_anywhere = used.to_vector<int32_t>();
  }
  for (Bucket& b : buckets_) {
    b.work->wait();
    b.work = nullptr;
    for (size_t i : b.params) {
      if (!used_anywhere[i]) continue;
      Tensor& grad = params_[i].mutable_grad();
      if (solo(b)) {
        if (!grad.defined()) grad = b.flat;  // unused here, used by another rank
      } else if (options_.gradient_as_bucket_view) {
        if (!grad.defined()) grad = views_[i];  // the others are the views: averaged in place
      } else if (grad.defined()) {
        grad.copy_(views_[i]);
      } else {
        grad = views_[i].clone();
      }
    }
    if (solo(b)) b.flat = Tensor();  // the bucket does not keep the gradient alive
  }
  // A traced pass keeps its buckets: the rebuild agrees on the order through a broadcast read on
  // the host and makes new buckets, which a trace cannot record (on a GPU its tensors are
  // proxies). Its order is kept, and the next forward rebuilds from it outside the trace
  // (prepare_for_forward): a compiled step traced twice (an optimizer's state is made by its
  // first call) records the rebuilt buckets. Without that, a compiled step launched its buckets
  // in reverse registration order, and a tied table, registered first but whose LM-head gradient
  // is ready first, was all-reduced last, after the backward (llama-3.2-1b under DDP: 525 MB,
  // 2.4 ms on the step's tail; benchmarks/RESULTS.md, session 25).
  if (!rebuilt_ && compiler::is_tracing()) {
    traced_order_ = ready_order_;
  } else if (!rebuilt_) {
    rebuild_buckets(ready_order_);
  }
  reset_pass();
  reduced_ = true;
  for (auto& add : after_reduction_) add();  // gathered_embedding's rows, on the reduced tables
  after_reduction_.clear();
}

namespace {

// The backward of gathered_embedding's lookup: hands the rows' gradient to the reducer.
class GatheredEmbeddingBackward final : public autograd::Node {
 public:
  GatheredEmbeddingBackward(Reducer* reducer, size_t index, Tensor idx)
      : reducer_(reducer), index_(index), idx_(std::move(idx)) {}
  autograd::variable_list apply(autograd::variable_list&& grads) override {
    if (!grads.empty() && grads[0].defined()) {
      reducer_->gathered_embedding_backward(index_, idx_, grads[0]);
    }
    return {};
  }
  std::string name() const override { return "GatheredEmbeddingBackward"; }
  void release_variables() override { idx_ = Tensor(); }

 private:
  Reducer* reducer_;
  size_t index_;
  Tensor idx_;
};

}  // namespace

Tensor Reducer::gathered_embedding(const Tensor& table, const Tensor& idx) {
  size_t index = params_.size();
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].impl() == table.impl()) index = i;
  }
  KILN_CHECK(index < params_.size(),
             "[DistributedDataParallel] gathered_embedding: the table of "
             "shape ",
             shape_str(table.sizes()), " is not a parameter of the module");
  KILN_CHECK(table.dim() == 2,
             "[DistributedDataParallel] gathered_embedding: the table must be "
             "2-d, got shape ",
             shape_str(table.sizes()));
  if (!GradMode::is_enabled() || !table.requires_grad()) return embedding(table, idx);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = embedding(table, idx);
  }
  auto node = std::make_shared<GatheredEmbeddingBackward>(this, index, idx);
  node->output_metas().push_back(
      autograd::InputMeta{out.impl()->sizes(), out.dtype(), out.device()});
  autograd::internal::set_history(out, node, 0);
  return out;
}

void Reducer::gathered_embedding_backward(size_t index, const Tensor& idx, const Tensor& grad) {
  NoGradGuard no_grad;
  const Tensor& param = params_[index];
  Tensor rows = grad.reshape({-1, param.size(1)}).to(param.dtype()).contiguous();
  Tensor ids = idx.reshape({-1}).contiguous();
  if (!require_sync_) {  // no_sync(): accumulated locally, as the dense gradient would be
    std::lock_guard<std::mutex> lock(mu_);
    Tensor& g = params_[index].mutable_grad();
    if (!g.defined()) g = zeros_like(param);
    cuda::internal::TrustedIndicesScope trusted;  // checked by the forward's lookup
    g.index_add_(0, ids, rows);
    return;
  }
  const int64_t world = pg_->size();
  Tensor all_ids = empty({world * ids.numel()}, ids.options());
  Tensor all_rows = empty({world * rows.size(0), rows.size(1)}, rows.options());
  // Ops of the registry (dist/collective_ops.h), so that a compiled step records the gathers
  // and the rows' addition after the table's all-reduce, as eager code runs them: the table's
  // dense part (the LM head's gradient) is all-reduced early in the backward, beside compute,
  // instead of the whole table after the lookup's backward at its end (llama-3.2-1b: 525 MB
  // all-reduced on the step's tail).
  all_gather_op(pg_, all_ids, ids)->wait();
  all_gather_op(pg_, all_rows, rows)->wait();
  auto add = [this, index, all_ids, all_rows, world] {
    Tensor& g = params_[index].mutable_grad();
    cuda::internal::TrustedIndicesScope trusted;  // checked by each rank's forward lookup
    g.index_add_(0, all_ids, all_rows, 1.0 / static_cast<double>(world));
  };
  std::lock_guard<std::mutex> lock(mu_);
  if (reduced_) {
    add();  // after finalize(), whose waits order the current stream after the all-reduces
  } else {
    after_reduction_.push_back(std::move(add));
  }
}

void Reducer::reset_pass() {
  for (Bucket& b : buckets_) {
    b.work = nullptr;
    b.pending = b.params.size();
    if (solo(b)) b.flat = Tensor();
  }
  searched_unused_ = false;
  ready_.assign(params_.size(), false);
  ready_order_.clear();
  num_ready_ = 0;
  next_to_launch_ = 0;
  if (carveout_before_ >= 0) {
    cuda::set_matmul_sm_carveout(carveout_before_);
    carveout_before_ = -1;
  }
}

void Reducer::rebuild_buckets(std::vector<size_t> order) {
  rebuilt_ = true;
  KILN_CHECK(order.size() == params_.size(),
             "[DistributedDataParallel] internal: the ready order has ", order.size(), " of ",
             params_.size(), " parameters");
  // Rank 0's order on every rank: the ranks may have seen different orders (branches, unused
  // parameters), and must launch the same buckets.
  if (pg_->size() > 1) {
    std::vector<int64_t> wide(order.begin(), order.end());
    Tensor t = tensor(wide, kInt64).to(params_[0].device());
    pg_->broadcast(t, 0)->wait();
    const std::vector<int64_t> got = t.to_vector<int64_t>();
    order.assign(got.begin(), got.end());
  }
  std::vector<size_t> current;
  for (const Bucket& b : buckets_) current.insert(current.end(), b.params.begin(), b.params.end());
  if (order == current) return;
  // Gradients that are views into the old buckets (which the old views keep alive) move into
  // the new ones.
  const std::vector<Tensor> old_views = std::move(views_);
  build_buckets(order);
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& grad = params_[i].grad();
    if (!grad.defined() || !old_views[i].defined() || !aliases(grad, old_views[i])) continue;
    if (views_[i].defined()) {
      views_[i].copy_(grad);
      params_[i].mutable_grad() = views_[i];
    } else {
      params_[i].mutable_grad() = grad.clone();
    }
  }
}

void Reducer::prepare_for_forward() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    reduced_ = false;
    after_reduction_.clear();  // rows of a pass whose reduction failed: dropped with it
    if (num_ready_ > 0) {
      const std::string missing = names_of_unready();
      const size_t got = num_ready_;
      // Start the next iteration clean, whatever the caller does with the error.
      for (Bucket& b : buckets_) {
        if (b.work != nullptr) {
          try {
            b.work->wait();
          } catch (...) {
          }
        }
      }
      reset_pass();
      KILN_FAIL("[DistributedDataParallel] the last backward produced gradients for only ", got,
                " of ", params_.size(),
                " parameters, so the gradients were not averaged over "
                "the ranks; no gradient reached ",
                missing,
                " (every parameter that requires grad must take part in the loss of every "
                "synchronised backward, or set DDPOptions::find_unused_parameters)");
    }
  }
  if (!rebuilt_ && !traced_order_.empty()) {
    // The order a traced pass saw (finalize()): its buckets are made now, outside the trace, as
    // real tensors that this pass's trace captures.
    compiler::NotTracing not_tracing;
    NoGradGuard no_grad;
    rebuild_buckets(std::exchange(traced_order_, {}));
  }
  if (options_.broadcast_buffers && pg_->size() > 1) {
    NoGradGuard no_grad;
    std::vector<std::shared_ptr<Work>> works;
    for (auto b : module_->buffers()) works.push_back(broadcast_op(pg_, b, 0));
    for (auto& w : works) w->wait();
  }
}

}  // namespace kiln::dist::internal
