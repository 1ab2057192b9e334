// kiln::dist::DistributedDataParallel: data-parallel training over a ProcessGroup, as PyTorch's
// DistributedDataParallel. Every rank holds the whole model and a different part of the batch;
// gradients are averaged over the ranks during backward, so that after loss.backward() every
// rank has the gradient of the global batch and the optimizers stay in step.
//
//   auto pg = kiln::dist::init_process_group("gloo");
//   Net net(...);                                   // any module holder (KILN_MODULE)
//   kiln::dist::DistributedDataParallel ddp(net, pg);   // broadcasts rank 0's parameters
//   kiln::optim::SGD opt(ddp->parameters(), 0.1);
//   for (...) {
//     opt.zero_grad();
//     auto loss = loss_fn(ddp(x_of_this_rank), y_of_this_rank);
//     loss.backward();                              // buckets all-reduced as they fill
//     opt.step();
//   }
//
// How: the parameters are grouped into buckets of about bucket_cap_mb, per dtype and device, at
// first in reverse registration order (roughly the order backward produces their gradients),
// then, after the first synchronised backward, in the order their gradients became ready there
// (rank 0's order, broadcast, so that every rank launches the same buckets in the same order). A
// hook on each parameter (autograd/hooks.h) puts its gradient into its bucket once it is
// accumulated; a full bucket is all-reduced (ReduceOp::kAvg) asynchronously while backward goes
// on, buckets being launched in bucket order. With gradient_as_bucket_view (the default) grad()
// is a view into its bucket's buffer, so autograd accumulates into the bucket and the averaged
// gradient needs no copy back; a parameter alone in its bucket (one larger than bucket_cap_mb) is
// all-reduced in its own grad(), without any copy.
//
// Gradient accumulation: inside `auto guard = ddp.no_sync();` backward only accumulates locally;
// the first backward after the guard is gone all-reduces the accumulated gradients.
//
// Pitfalls:
// - Every parameter that requires grad must get a gradient in every synchronised backward,
//   unless find_unused_parameters is set; a backward that leaves some out is reported by the
//   next forward through ddp, naming the parameters.
// - Call the model through ddp (ddp(x) or ddp.forward(x)), not the module directly: the forward
//   checks the previous reduction and broadcasts the buffers (broadcast_buffers). A forward that
//   is not forward() (a model's loss method) goes through ddp.run([&] { ... }).
// - The loss should be a mean over the rank's batch (as with PyTorch's DDP): the average of the
//   ranks' gradients is then the gradient of the global batch's mean loss.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dist/process_group.h"
#include "nn/module.h"

namespace kiln::dist {

struct DDPOptions {
  // Bucket size in MiB (PyTorch's default 25). Smaller buckets start communicating earlier.
  double bucket_cap_mb = 25;
  // Broadcast rank 0's buffers (BatchNorm statistics, ...) before every forward.
  bool broadcast_buffers = true;
  // Parameters may be left out of the loss: every forward (with grad mode on, outside no_sync)
  // walks the autograd graph from its outputs and counts the parameters it does not reach as
  // ready with a zero gradient. A parameter no rank used keeps its grad() as it was (undefined
  // after zero_grad()), as in PyTorch. Costs a graph walk per forward and a small all-reduce per
  // backward. forward must return a Tensor, or a std::vector or std::tuple of Tensors.
  bool find_unused_parameters = false;
  // Gradients live in the buckets (PyTorch's option of the same name, on by default here): after
  // a parameter's gradient has been put in its bucket, its grad() is a view into the bucket's
  // buffer, shaped like the parameter, and stays so: later backward passes (no_sync()
  // accumulation included) add into the bucket in place, and the all-reduce averages grad() with
  // no copy back. A gradient that arrives as a new tensor (after zero_grad(), whose default sets
  // grads to undefined) is copied in once and grad() pointed back at the view. A parameter alone
  // in its bucket keeps its own grad() tensor, all-reduced in place. Saves the copy out of every
  // bucket and the buckets' memory for the large parameters. Pitfall: grad() tensors of a bucket
  // share one buffer; rebinding grad() to another tensor is fine (it is copied in next time).
  // Off: gradients are copied into the buckets and the averages copied back (kiln's former path).
  bool gradient_as_bucket_view = true;
  // SMs the matrix products leave to the all-reduces while these may run, from the first
  // bucket's launch to the end of the backward (kiln::cuda::set_matmul_sm_carveout; CUDA only,
  // not in a compiled step). 0: the products plan for every SM.
  int comm_sm_carveout = 0;
  // The last `tail_buckets` buckets of a backward are all-reduced the way that is fastest on its
  // own (ProcessGroup::all_reduce: NCCL's kernels), the others beside the backward's compute
  // (all_reduce_beside_compute: the copy engines between the GPUs of one host). The last buckets
  // become ready when little or nothing of the backward is left for them to overlap, so their
  // time adds to the step's. With one, llama-160m's slowest rank on 4 GPUs waited 250 us after
  // its backward, and 650 us in steps where its last two buckets' transfers slowed each other;
  // with two, 300 us in every step, but the step was no faster on 2 or 4 GPUs, where the ranks'
  // speeds differ by more (2.5-4.7%; benchmarks/RESULTS.md, session 32). 0: every bucket beside the
  // compute.
  int tail_buckets = 1;
};

namespace internal {

// The gradient bucketing and reduction of DistributedDataParallel (module-type independent).
class Reducer {
 public:
  Reducer(std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
          const DDPOptions& options);
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Before each forward: fails if the last synchronised backward left parameters without a
  // gradient, and broadcasts the buffers.
  void prepare_for_forward();
  // After a forward, with find_unused_parameters: marks the parameters that `outputs` do not
  // depend on as ready. `outputs` is nullopt when forward returned something else.
  void prepare_for_backward(const std::optional<std::vector<Tensor>>& outputs);
  bool find_unused_parameters() const { return options_.find_unused_parameters; }
  void set_require_sync(bool sync) { require_sync_ = sync; }
  bool require_sync() const { return require_sync_; }
  // Bucket layout, for tests and logs: the parameter indices (registration order) per bucket,
  // in launch order.
  std::vector<std::vector<size_t>> bucket_indices() const;
  // Whether the buckets follow the observed ready order yet (after the first synchronised
  // backward).
  bool buckets_rebuilt() const { return rebuilt_; }
  // DistributedDataParallel::gathered_embedding.
  Tensor gathered_embedding(const Tensor& table, const Tensor& idx);
  // Its backward: `grad` of the lookup of `idx` in parameter `index`.
  void gathered_embedding_backward(size_t index, const Tensor& idx, const Tensor& grad);

 private:
  struct Bucket {
    std::vector<size_t> params;    // indices into params_
    std::vector<int64_t> offsets;  // element offsets in flat
    // The buffer that is all-reduced. For a bucket of one parameter under
    // gradient_as_bucket_view: undefined between passes, the parameter's grad() during one.
    Tensor flat;
    size_t pending = 0;  // parameters whose gradient has not arrived this pass
    std::shared_ptr<Work> work;
  };
  bool solo(const Bucket& b) const {
    return options_.gradient_as_bucket_view && b.params.size() == 1;
  }
  // Lays the buckets out with the parameters in `order` (indices into params_).
  void build_buckets(const std::vector<size_t>& order);
  // After the first synchronised backward: buckets in rank 0's observed ready order.
  void rebuild_buckets(std::vector<size_t> order);
  void on_grad_ready(size_t index);
  // Puts the parameter's gradient (zeros when undefined) into its bucket; launches full buckets.
  void mark_ready(size_t index);
  void finalize();
  void reset_pass();
  std::string names_of_unready() const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> pg_;
  DDPOptions options_;
  std::vector<Tensor> params_;
  std::vector<std::string> names_;
  std::vector<unsigned> hook_handles_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_;
  std::vector<Tensor> views_;  // each parameter's slot in its bucket's flat (undefined: solo)
  std::vector<bool> ready_;
  std::vector<int32_t> used_;        // find_unused_parameters: this pass's use, per parameter
  std::vector<size_t> ready_order_;  // until the rebuild: the order of this pass's mark_ready
  // A traced pass's ready order, for the rebuild before the next forward (finalize()).
  std::vector<size_t> traced_order_;
  bool rebuilt_ = false;
  bool searched_unused_ = false;
  size_t next_to_launch_ = 0;
  size_t num_ready_ = 0;
  int carveout_before_ = -1;  // matmul_sm_carveout() before this pass set comm_sm_carveout
  bool require_sync_ = true;
  // gathered_embedding: whether this pass's buckets are reduced (finalize() ran), and the row
  // additions waiting for it.
  bool reduced_ = false;
  std::vector<std::function<void()>> after_reduction_;
  std::mutex mu_;
};

}  // namespace internal

// The `ddp.no_sync()` guard: restores synchronisation when it goes out of scope.
class NoSyncGuard {
 public:
  explicit NoSyncGuard(internal::Reducer* reducer)
      : reducer_(reducer), previous_(reducer->require_sync()) {
    reducer_->set_require_sync(false);
  }
  ~NoSyncGuard() {
    if (reducer_ != nullptr) reducer_->set_require_sync(previous_);
  }
  NoSyncGuard(NoSyncGuard&& o) noexcept : reducer_(o.reducer_), previous_(o.previous_) {
    o.reducer_ = nullptr;
  }
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;

 private:
  internal::Reducer* reducer_;
  bool previous_;
};

namespace internal {
// The tensors a forward returned, for find_unused_parameters.
inline std::optional<std::vector<Tensor>> output_tensors(const Tensor& t) {
  return std::vector<Tensor>{t};
}
inline std::optional<std::vector<Tensor>> output_tensors(const std::vector<Tensor>& v) { return v; }
template <typename... Ts>
std::optional<std::vector<Tensor>> output_tensors(const std::tuple<Ts...>& t) {
  std::vector<Tensor> out;
  bool ok = true;
  std::apply(
      [&](const auto&... e) {
        (
            [&] {
              auto part = output_tensors(e);
              if (!part) {
                ok = false;
                return;
              }
              out.insert(out.end(), part->begin(), part->end());
            }(),
            ...);
      },
      t);
  if (!ok) return std::nullopt;
  return out;
}
template <typename T>
std::optional<std::vector<Tensor>> output_tensors(const T&) {
  return std::nullopt;
}
}  // namespace internal

template <typename ModuleHolder>
class DistributedDataParallel {
 public:
  // Broadcasts rank 0's parameters and buffers to every rank (and checks that all ranks hold
  // the same parameter shapes), then registers the gradient hooks.
  DistributedDataParallel(ModuleHolder module, std::shared_ptr<ProcessGroup> pg,
                          DDPOptions options = {})
      : module_(std::move(module)),
        reducer_(std::make_unique<internal::Reducer>(module_.ptr(), std::move(pg), options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    reducer_->prepare_for_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    if (reducer_->find_unused_parameters()) {
      reducer_->prepare_for_backward(internal::output_tensors(out));
    }
    return out;
  }
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }
  // Runs `f`, a forward through the module other than forward() (a loss method, several
  // calls), as forward() does: the buffers broadcast first, the outputs (a Tensor, or a
  // std::vector or std::tuple of Tensors) walked for unused parameters when that option is on.
  //   auto loss = ddp.run([&] { return ddp->loss(x, y); });
  template <typename F>
  auto run(F&& f) {
    reducer_->prepare_for_forward();
    auto out = f();
    if (reducer_->find_unused_parameters()) {
      reducer_->prepare_for_backward(internal::output_tensors(out));
    }
    return out;
  }

  // Backward passes while the guard lives accumulate gradients locally only.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(reducer_.get()); }

  // kiln::embedding(table, idx) for a parameter `table` that also has a dense use (an LM head
  // tied to the token embedding): the gradient rows of this lookup are all-gathered over the
  // ranks (the token ids and one row per token) and added to the table's averaged gradient once
  // the buckets are reduced, instead of being part of the table's all-reduce. The table is then
  // all-reduced as soon as its dense use's gradient is in, early in the backward, rather than
  // after the lookup's, which comes last: on llama-3.2-1b that moves a 525 MB all-reduce out of
  // the step's tail for an all-gather of 32 MB a rank (benchmarks/RESULTS.md, session 18).
  // The sum is the same as the all-reduce's, in another order. Pitfall: a table used only here
  // gets no gradient through autograd, which DDP reports at the next forward; while tracing
  // (kiln::compile) this is kiln::embedding.
  Tensor gathered_embedding(const Tensor& table, const Tensor& idx) {
    return reducer_->gathered_embedding(table, idx);
  }

  ModuleHolder& module() { return module_; }
  auto* operator->() const { return module_.get(); }
  const internal::Reducer& reducer() const { return *reducer_; }

 private:
  ModuleHolder module_;
  std::unique_ptr<internal::Reducer> reducer_;
};

}  // namespace kiln::dist
