// kiln::dist::fully_shard: fully sharded data parallelism (ZeRO-3), after PyTorch's FSDP2. Every
// parameter is flattened and split evenly over the ranks (the last shard padded with zeros); each
// rank keeps only its shard, so the optimizer built over the module's parameters keeps its state
// for that shard only. The full parameters exist only while they are needed: gathered for the
// forward, freed after it, gathered again (the next unit's gather prefetched) for the backward,
// and the full gradients are reduce-scattered (averaged over the ranks) into the shards' grad().
//
//   auto pg = kiln::dist::init_process_group("gloo");
//   kiln::models::GPT model(cfg);                               // same seed on every rank
//   for (auto& block : *model->h) kiln::dist::fully_shard(block, pg);   // one unit per block
//   auto fsdp = kiln::dist::fully_shard(model, pg);             // the root: the rest
//   kiln::optim::AdamW opt(model->parameters(), 1e-3);          // the shards
//   for (...) {
//     opt.zero_grad();
//     auto loss = fsdp->run([&] { return model->loss(x_of_this_rank, y_of_this_rank); });
//     loss.backward();                                          // shards' grads averaged
//     opt.step();                                               // each rank updates its shard
//   }
//   auto full = fsdp->full_state_dict();                        // on rank 0: full tensors
//   if (pg->rank() == 0) kiln::save_safetensors(full, "model.safetensors");
//
// Units: each fully_shard call makes a unit of the module's parameters that no earlier call (on
// a descendant) took; the call on an ancestor adopts the descendants' units, and the top one is
// the root. One all-gather and one reduce-scatter per unit and step (its shards are packed into
// one buffer), as FSDP2's parameter groups.
//
// Forward: kiln's modules have no forward hooks (forward is a plain member function), so by
// default the root's run() gathers every unit (all the all-gathers in flight at once), runs the
// callable, then frees the full parameters of the units that reshard after forward. A model that
// calls before_forward() / after_forward() around each unit (GPT through models/gpt_hooks.h; see
// set_gather_per_unit) gets FSDP2's per-unit gathers instead, each overlapping the previous
// unit's compute. The shards are what stays between steps, and backward holds at most the units
// it is working on.
// Backward: run() finds, in the graph of its outputs, the nodes that read each unit's
// parameters; a hook on those nodes gathers the unit when backward reaches it and starts the
// gather of the unit that comes next in backward. Once every parameter of a unit has its full
// gradient (post-accumulate-grad hooks, autograd/hooks.h) the unit reduce-scatters them
// (ReduceOp::kAvg) and frees its full parameters and gradients; its launch first waits for the
// previous unit's reduce-scatter and lets go of that one's input (FSDP2 does the same), so one
// packed full gradient is in flight at a time; the last unit waits for the rest and writes the
// averaged shard gradients into grad().
//
// Memory: a unit's gathered parameters are views of one buffer. Resharding after forward frees
// that buffer's memory but keeps the buffer itself, which the views that autograd saved (linear
// saves weight.t()) still hold; the gather in backward puts the memory back under them, before
// any node that saved such a view runs (PyTorch's FSDP resizes the storage to 0 and back).
// Nothing full outlives the backward.
//
// Compiled (kiln::compile of a step that calls run(), backward() and the optimizer): the gathers
// and reduce-scatters are ops (dist/collective_ops.h), recorded where eager code starts them. While
// tracing, the parameters are captured (their shards, by identity) and pointed at proxies of the
// program's gathered values; resharding frees nothing, and the gather in backward is a new value
// that the views the forward saved are redirected to (compiler/tracer.h,
// trace_redirect_storage), so the program frees the forward's gathered buffer after its last
// read. docs/distributed.md, "Compiled FSDP".
//
// Gradient accumulation: set_requires_gradient_sync(false) (FSDP2's; DDP's no_sync) makes
// backward keep each unit's full gradients, summed over the micro-batches, instead of
// reduce-scattering them; the next backward with sync on reduce-scatters the sum once.
//
// At rest each parameter is a 1-d tensor of ceil(numel / world) elements (its shard), with the
// same identity as before (members and optimizers keep working); full_state_dict() gives the
// full tensors under the module's names, load_full_state_dict() takes them back, and
// save_sharded_checkpoint() / load_sharded_checkpoint() write one file per rank, loadable at
// another world size.
//
// Pitfalls:
// - Call the model through the root's run() (or unshard() it first): outside, the parameters are
//   1-d shards and the model's ops fail on their shapes.
// - The loss should be a mean over the rank's batch, as with DDP: the average of the ranks'
//   gradients is then the gradient of the global batch.
// - Every parameter of a unit that requires grad must be reachable from run()'s outputs
//   (otherwise the unit's reduce-scatter would never start); a unit with none is refused.
//   Parameters that do not require grad are left whole (not sharded).
// - One backward per run(); the next run() fails if a backward did not reach every unit.
// - Between a unit's forward and its backward its gathered buffer has no memory (when it
//   reshards after forward): a view of a parameter kept outside autograd (through detach())
//   and read in backward before the unit is gathered again would read freed memory.
// - Keep the root's handle while the model is used: the units live in it, and without them the
//   parameters stay 1-d shards.
// - Build the same model on every rank: fully_shard checks that the parameter lists match, then
//   takes rank 0's values (a broadcast, as DDP does), so the ranks may initialise differently.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dist/ddp.h"
#include "dist/process_group.h"
#include "nn/module.h"

namespace kiln::dist {

// FSDP2's MixedPrecisionPolicy: shards (and the optimizer) stay in the parameters' dtype.
struct MixedPrecisionPolicy {
  // The dtype the parameters are gathered in, for forward and backward (e.g. kBFloat16).
  std::optional<ScalarType> param_dtype;
  // The dtype of the gradients' reduce-scatter (default: param_dtype, else the parameters').
  std::optional<ScalarType> reduce_dtype;
};

struct FSDPOptions {
  // Free the gathered parameters after the forward and gather them again in backward (ZeRO-3);
  // false keeps them from the forward to the end of backward (fewer collectives, more memory).
  // The root's own parameters are kept until backward either way, as FSDP2 does.
  bool reshard_after_forward = true;
  MixedPrecisionPolicy mp_policy;
};

class FSDPModule;

// Shards `module`'s parameters over `pg` (see the banner). Fails when the module is already
// sharded, or when one of its parameters belongs to a unit that is not a descendant (a module
// shared between two units).
std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module,
                                        std::shared_ptr<ProcessGroup> pg,
                                        const FSDPOptions& options = {});
template <nn::ModuleHolderType H>
std::shared_ptr<FSDPModule> fully_shard(const H& holder, std::shared_ptr<ProcessGroup> pg,
                                        const FSDPOptions& options = {}) {
  return fully_shard(std::static_pointer_cast<nn::Module>(holder.ptr()), std::move(pg), options);
}

class FSDPModule : public std::enable_shared_from_this<FSDPModule> {
 public:
  ~FSDPModule();
  FSDPModule(const FSDPModule&) = delete;
  FSDPModule& operator=(const FSDPModule&) = delete;

  // Runs `f` (a forward of the module: a callable returning a Tensor, or a std::vector or
  // std::tuple of Tensors) with every unit of this root gathered; prepares the backward of its
  // outputs and reshards. Root only.
  template <typename F>
  auto run(F&& f) {
    pre_forward();
    try {
      auto out = f();
      post_forward(internal::output_tensors(out));
      return out;
    } catch (...) {
      abort_forward();
      throw;
    }
  }

  // Forward unit by unit: FSDP2's forward pre- and post-hooks, for a model that calls these around
  // each unit's forward (kiln's GPT does, through models/gpt_hooks.h; its modules have no forward
  // hooks). After set_gather_per_unit(true) on the root, run() gathers only the root's own
  // parameters and starts the all-gather of the first unit; a unit's before_forward() waits for
  // its gather and starts the next unit's (forward order: the root's units in pre-order), so that
  // the gathers overlap the blocks' compute; after_forward() frees the unit's full parameters when
  // it reshards after forward. A unit whose before_forward() did not run in a run() is an error
  // at the end of that forward.
  void set_gather_per_unit(bool on);
  void before_forward();
  void after_forward();

  // Gathers (blocking) or frees this unit's full parameters by hand.
  void unshard();
  void reshard();
  bool is_unsharded() const { return unsharded_; }

  // FSDP2's set_requires_gradient_sync (DDP's no_sync), for gradient accumulation: while off,
  // a backward leaves each unit's full gradients on this rank, summed over the micro-batches (in
  // the reduce dtype, laid out as the reduce-scatter's input), and the shards' grad() untouched;
  // the first backward with it on adds its own and reduce-scatters the sum, one collective per
  // unit and step instead of one per micro-batch. The sum costs a full copy of each unit's
  // gradients between micro-batches (what DDP's no_sync keeps as well). Applies to this unit and,
  // with recurse, to every unit below it.
  //
  //   for (int k = 0; k < micro; ++k) {
  //     fsdp->set_requires_gradient_sync(k == micro - 1);
  //     fsdp->run([&] { return model->loss(x[k], y[k]) / micro; }).backward();
  //   }
  void set_requires_gradient_sync(bool sync, bool recurse = true);
  bool requires_gradient_sync() const { return requires_gradient_sync_; }

  nn::Module& module() const { return *module_; }
  const std::shared_ptr<ProcessGroup>& process_group() const { return pg_; }
  const FSDPOptions& options() const { return options_; }
  // The units this one adopted (direct children), and whether this is a root.
  const std::vector<std::shared_ptr<FSDPModule>>& children() const { return children_; }
  bool is_root() const { return parent_ == nullptr; }
  // This unit's parameters' names (relative to its module), full element counts, and the
  // elements this rank holds (padding included).
  std::vector<std::string> parameter_names() const;
  int64_t unsharded_numel() const;
  int64_t sharded_numel() const;

  // torch's clip_grad_norm_ over the sharded gradients of this root's units (norm 2): the norm
  // of the full gradients, as nn::utils::clip_grad_norm_ would compute it on the whole model;
  // when it exceeds max_norm every shard's grad() is scaled by max_norm / (norm + 1e-6).
  // Collective: every rank must call. Returns the norm before clipping.
  double clip_grad_norm_(double max_norm);

  // State dicts, over this unit and every unit below it, keyed as module().state_dict()
  // (buffers included). Collective: every rank must call. full_state_dict gives full tensors in
  // the shards' dtype on rank 0 (every rank when !rank0_only); load_full_state_dict takes the
  // same on every rank (missing, unexpected or misshapen keys are an error listing them).
  std::map<std::string, Tensor> full_state_dict(bool rank0_only = true);
  void load_full_state_dict(const std::map<std::string, Tensor>& state_dict);
  // This rank's shards (1-d, padded), keyed by name; loading checks that the shards were made
  // for this world size.
  std::map<std::string, Tensor> sharded_state_dict() const;
  void load_sharded_state_dict(const std::map<std::string, Tensor>& state_dict);
  // Each rank writes <dir>/shard-<rank>-of-<world>.safetensors atomically (its shards without
  // padding, and the full shapes); loading reads the files of whatever world size wrote them
  // and takes this rank's slice. Collective (a barrier ends the save).
  void save_sharded_checkpoint(const std::string& dir) const;
  void load_sharded_checkpoint(const std::string& dir);

  // For fully_shard.
  friend std::shared_ptr<FSDPModule> fully_shard(const std::shared_ptr<nn::Module>& module,
                                                 std::shared_ptr<ProcessGroup> pg,
                                                 const FSDPOptions& options);
  struct Private;
  FSDPModule(const Private&, std::shared_ptr<nn::Module> module, std::shared_ptr<ProcessGroup> pg,
             const FSDPOptions& options, std::vector<std::shared_ptr<FSDPModule>> children);

 private:
  struct Param {
    std::string name;           // relative to module_
    Tensor param;               // the module's tensor (its data swapped between shard and full)
    Shape shape;                // the full shape
    int64_t numel = 0;          // full elements
    int64_t shard = 0;          // elements per rank (ceil(numel / world))
    int64_t offset = 0;         // in the unit's packed shard
    int64_t full_offset = 0;    // in the unit's gathered buffer (world * shard elements there)
    Tensor sharded;             // the shard's data while the parameter holds the full one
    Tensor sharded_grad;        // the shard's gradient while the parameter holds the full one
    uint64_t full_version = 0;  // the full data's version counter when the forward saw it
    bool version_known = false;
    unsigned hook = 0;
    bool expected = false;  // reached from the last run()'s outputs
    bool ready = false;     // its full gradient has arrived in this backward
  };

  void pre_forward();
  void post_forward(const std::optional<std::vector<Tensor>>& outputs);
  void abort_forward();
  // This unit and every unit below, in pre-order (the forward order of a model whose children
  // run in registration order).
  std::vector<FSDPModule*> subtree();
  FSDPModule& root();
  // Starts the all-gather of the packed shards (no-op if unsharded or already started): each
  // parameter's gather lands in its place in the unit's buffer (one coalesced collective, an op
  // that a compiled step records; at one rank the packed shard is the parameters themselves).
  void launch_gather();
  // Waits for it and points the parameters at the full tensors.
  void finish_gather();
  // The parameters back to their shards. for_backward (after a forward whose backward comes):
  // the gathered buffer keeps its identity for the views autograd saved, without its memory, so
  // that the gather in backward refills it; otherwise it is let go.
  void reshard_keeping(bool for_backward);
  // The packed shard, every parameter's shard a view of it (re-packed first where something
  // pointed a parameter elsewhere).
  const Tensor& packed_shard();
  ScalarType compute_dtype() const;
  ScalarType reduce_dtype() const;
  // After a load changed the shards under a gathered unit: gathers the full parameters again.
  void refresh_full();
  // The hook of the graph of the root's run() number `run`.
  void pre_backward(uint64_t run);
  void on_grad_ready(size_t i);
  void launch_reduce();
  // launch_reduce's collective in eager code with gradient sync, over more than one rank: each
  // parameter's full gradient reduce-scattered as it is (padded into an input of its own where
  // its size does not divide, or converted to the reduce dtype) into its slot of the packed
  // shard gradient, the reductions as one coalesced launch: no packed full gradient.
  void launch_reduce_direct();
  // Waits for this unit's reduce-scatter and lets go of its input (the full gradients, packed);
  // the output (the shards' gradients) stays for finish_backward.
  void finish_reduce();
  void finish_backward();
  void check_previous_backward();
  // The unit's full parameters in `dtype`, gathered without touching the module (state dicts).
  std::vector<Tensor> gather_full(ScalarType dtype);
  std::string describe() const;

  std::shared_ptr<nn::Module> module_;
  std::shared_ptr<ProcessGroup> pg_;
  FSDPOptions options_;
  std::vector<std::shared_ptr<FSDPModule>> children_;
  FSDPModule* parent_ = nullptr;
  std::string path_;  // the module's path under its root, once adopted
  std::vector<Param> params_;
  ScalarType dtype_ = kFloat;  // the shards'
  int64_t packed_ = 0;         // elements of the packed shard (sum of shard sizes)
  Tensor packed_shard_;        // the shards, packed: the all-gather's input
  int64_t full_numel_ = 0;     // elements of the gathered buffer (aligned per parameter)
  // The gathered buffer the full parameters are views of; released: without memory between
  // the forward and the gather in backward.
  Storage full_storage_;
  bool full_released_ = false;
  bool unsharded_ = false;
  bool requires_gradient_sync_ = true;
  Tensor grad_acc_;  // without gradient sync: the full gradients' sum, as the reduce's input
  bool gather_per_unit_ = false;            // root: units gathered by before_forward()
  bool forward_gathered_ = false;           // before_forward() ran in this forward
  bool versions_seen_ = false;              // after_forward() recorded full_version
  std::vector<FSDPModule*> forward_order_;  // root, per-unit mode: the units after the root
  std::shared_ptr<Work> gather_work_;
  Tensor gather_input_, gather_buffer_;  // kept alive while the all-gather runs
  // Backward bookkeeping.
  bool backward_pending_ = false;
  size_t expected_count_ = 0;
  size_t ready_count_ = 0;
  std::shared_ptr<Work> reduce_work_;
  Tensor reduce_input_, reduce_output_;
  std::vector<Tensor> reduce_inputs_;  // launch_reduce_direct's inputs, kept until the wait
  // Root only: the units of this root whose reduction has not been launched yet in this
  // backward, and the order in which backward is expected to reach them.
  size_t units_to_reduce_ = 0;
  // Root only: the unit whose reduce-scatter was launched last in this backward; the next unit's
  // launch waits for it first (FSDP2's reduce_scatter_state), so that one packed full gradient is
  // in flight at a time instead of one per unit until the end of the backward.
  FSDPModule* last_reduce_ = nullptr;
  uint64_t forward_runs_ = 0;  // root: run()s prepared for a backward, and aborted ones
  std::vector<FSDPModule*> backward_order_;
};

}  // namespace kiln::dist
