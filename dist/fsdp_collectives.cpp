// FSDPModule's collectives (dist/fsdp.h): the all-gather of a unit's packed shard into its full
// parameters (views of one gathered buffer), resharding (the buffer's memory released between the
// forward and the gather in backward), the backward's gathers and the reduce-scatter of the full
// gradients into the shards' grad(), and clip_grad_norm_'s all-reduce. The units, the sharding
// and the forward: dist/fsdp.cpp.
#include <cmath>
#include <new>

#include "autograd/grad_mode.h"
#include "compiler/tracer.h"
#include "dist/collective_ops.h"
#include "dist/fsdp.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::dist {
namespace {

// Puts `memory` (null: none) under `s` in place: the StorageImpl, which the views autograd saved
// hold, keeps its identity and its version counter (their saved versions stay valid), and frees
// the memory it had. This is PyTorch's storage resize_ to 0 and back; kiln's StorageImpl has no
// resize, so the object is rebuilt where it is (same type, no const members: the pointers to it
// stay valid) over the other storage's memory, which its deleter keeps alive.
void replace_memory(StorageImpl& s, Storage memory) {
  const uint64_t version = s.version();
  const Device device = s.device();
  void* data = memory != nullptr ? memory->data() : nullptr;
  const size_t nbytes = memory != nullptr ? memory->nbytes() : 0;
  StorageImpl::Deleter keep;
  if (memory != nullptr) keep = [memory](void*) {};  // the memory goes with the capture
  s.~StorageImpl();
  new (&s) StorageImpl(data, nbytes, device, std::move(keep));
  while (s.version() < version) s.bump_version();
}

// Points the module's parameter at `data` (its shard, or its view of the gathered buffer). While
// kiln::compile traces, the parameter is a captured tensor whose data is a proxy: the tracer then
// finds its value by the new data (compiler/tracer.h, trace_forget_handle).
void point_at(Tensor& param, const Tensor& data) {
  param.impl()->set_data(*data.impl());
  compiler::trace_forget_handle(param);
}

// A buffer of the gathers and reductions. While kiln::compile traces, a value of the program (the
// `empty` op, recorded), which its executor frees after its last reader; empty() itself stays a
// real allocation even then (the tracer would capture it as a constant of the program, held for
// as long as the program lives).
Tensor buffer(int64_t numel, const TensorOptions& options) {
  if (!compiler::is_tracing()) return empty({numel}, options);
  static const OpDef& op = KILN_OP(empty);
  return call_op1(op, {}, {Shape{numel}, options.dtype(), options.device()});
}

// Writes (or adds, when accumulating) the flattened gradient `g` of `numel` elements into `dst`,
// the [world, shard] columns of a parameter in the reduce-scatter's input: row r gets elements
// [r * shard, (r + 1) * shard), the padding past numel zeros (written once, when not
// accumulating). One strided copy, converting the dtype, instead of flatten + pad + copy.
void pack_gradient(Tensor dst, const Tensor& g, int64_t numel, bool accumulate) {
  const int64_t world = dst.size(0), shard = dst.size(1);
  Tensor flat = g.reshape({-1});
  if (accumulate && flat.dtype() != dst.dtype()) flat = flat.to(dst.dtype());
  auto put = [accumulate](Tensor to, const Tensor& from) {
    if (accumulate) {
      to.add_(from);
    } else {
      to.copy_(from);
    }
  };
  const int64_t rows = numel / shard, rem = numel % shard;
  if (rows > 0) put(dst.narrow(0, 0, rows), flat.narrow(0, 0, rows * shard).view({rows, shard}));
  if (rem > 0) put(dst[rows].narrow(0, 0, rem), flat.narrow(0, rows * shard, rem));
  if (accumulate) return;
  if (rem > 0) dst[rows].narrow(0, rem, shard - rem).zero_();
  const int64_t used = rows + (rem > 0 ? 1 : 0);
  if (used < world) dst.narrow(0, used, world - used).zero_();
}

}  // namespace

// --- Gathering ----------------------------------------------------------------------------------

ScalarType FSDPModule::compute_dtype() const {
  return options_.mp_policy.param_dtype.value_or(dtype_);
}

ScalarType FSDPModule::reduce_dtype() const {
  return options_.mp_policy.reduce_dtype.value_or(compute_dtype());
}

const Tensor& FSDPModule::packed_shard() {
  // A shard replaced behind the unit's back (set_data on a parameter) is copied in and the
  // parameter pointed back at its place.
  for (Param& p : params_) {
    Tensor& held = unsharded_ ? p.sharded : p.param;
    const TensorImpl& t = *held.impl();
    if (t.storage() == packed_shard_.impl()->storage() &&
        t.storage_offset() == packed_shard_.storage_offset() + p.offset && t.numel() == p.shard &&
        held.is_contiguous() && held.dim() == 1)
      continue;
    NoGradGuard no_grad;
    Tensor slot = packed_shard_.narrow(0, p.offset, p.shard);
    slot.copy_(held.detach().reshape({-1}));
    if (unsharded_) {
      p.sharded = slot;
    } else {
      point_at(p.param, slot);
    }
  }
  return packed_shard_;
}

void FSDPModule::launch_gather() {
  if (unsharded_ || gather_work_ != nullptr || params_.empty()) return;
  NoGradGuard no_grad;
  // No copy in: the packed shard is the input (mixed precision converts it once).
  Tensor input = packed_shard();
  if (input.dtype() != compute_dtype()) input = input.to(compute_dtype());
  const int world = pg_->size();
  if (world > 1) {
    // Each parameter's slices gathered straight into its place in the unit's buffer, the
    // gathers launched as one group: nothing to copy out afterwards (that copy moved the whole
    // unit through memory twice a step, forward and backward). An op: a compiled step records
    // the gather here (dist/collective_ops.h).
    gather_buffer_ = buffer(full_numel_, input.options());
    std::vector<GatherPart> parts;
    for (const Param& p : params_) parts.push_back({p.offset, p.shard, p.full_offset});
    gather_work_ = all_gather_coalesced_op(pg_, gather_buffer_, input, parts);
  } else {
    // One rank: its packed shard is the parameters themselves.
    gather_buffer_ = buffer(packed_, input.options());
    gather_work_ = all_gather_op(pg_, gather_buffer_, input);
  }
  gather_input_ = input;
}

void FSDPModule::finish_gather() {
  if (unsharded_ || params_.empty()) return;
  if (gather_work_ == nullptr) launch_gather();
  NoGradGuard no_grad;
  gather_work_->wait();
  gather_work_ = nullptr;
  const int world = pg_->size();
  // The gather put every parameter in its place (launch_gather): no copy out.
  Tensor full = gather_buffer_;
  gather_buffer_ = Tensor();
  gather_input_ = Tensor();
  if (full_released_ && compiler::is_tracing()) {
    // Traced: the gather in backward is a new value of the program, and the views the forward
    // saved (on the old buffer, a proxy) read it from here on; the forward's buffer dies after the
    // forward's last read of it, by the program's liveness (docs/distributed.md, "Compiled FSDP").
    compiler::trace_redirect_storage(full_storage_, full);
    full_storage_ = full.impl()->storage();
    full_released_ = false;
  } else if (full_released_) {
    // The gather in backward: the memory goes back under the buffer the forward's views hold.
    replace_memory(*full_storage_, full.impl()->storage());
    full = Tensor(std::make_shared<TensorImpl>(full_storage_, Shape{full.numel()}, Shape{1}, 0,
                                               full.dtype()));
    full_released_ = false;
  } else {
    full_storage_ = full.impl()->storage();
  }
  for (Param& p : params_) {
    Tensor view = full.narrow(0, world > 1 ? p.full_offset : p.offset, p.numel).view(p.shape);
    p.sharded = p.param.detach();
    p.sharded_grad = p.param.grad();
    p.param.mutable_grad() = Tensor();
    point_at(p.param, view);
    if (p.version_known) {
      // The graph saved the parameter at the version the forward's gather had; a buffer gathered
      // anew (not refilled) starts lower, so this only evens out the counter.
      while (p.param._version() < p.full_version) p.param.impl()->bump_version();
      KILN_CHECK(p.param._version() == p.full_version, "[fully_shard] ", describe(),
                 ": the gathered '", p.name, "' is at version ", p.param._version(),
                 ", the forward saw version ", p.full_version);
    }
  }
  unsharded_ = true;
}

void FSDPModule::unshard() { finish_gather(); }

void FSDPModule::refresh_full() {
  if (!unsharded_) return;
  reshard();
  for (Param& p : params_) p.version_known = false;
  finish_gather();
}

void FSDPModule::reshard() { reshard_keeping(false); }

void FSDPModule::reshard_keeping(bool for_backward) {
  if (gather_work_ != nullptr) finish_gather();  // a prefetch in flight: let it land first
  if (unsharded_) {
    for (Param& p : params_) {
      point_at(p.param, p.sharded);
      p.param.mutable_grad() = p.sharded_grad;
      p.sharded = Tensor();
      p.sharded_grad = Tensor();
    }
    unsharded_ = false;
    if (for_backward && full_storage_ != nullptr) {
      // Traced, the buffer is a proxy: nothing to free (the program frees its value), and the
      // gather in backward redirects the views the forward saved to its own (finish_gather).
      if (!compiler::is_tracing()) replace_memory(*full_storage_, nullptr);
      full_released_ = true;
      return;
    }
  }
  if (!for_backward) {
    full_storage_ = nullptr;  // freed once the views autograd saved are gone
    full_released_ = false;
  }
}

// --- Backward -----------------------------------------------------------------------------------

void FSDPModule::pre_backward(uint64_t run) {
  // The graph of an earlier run(): its units' gathered buffers may have no memory any more, and
  // its nodes would read it (an error here instead).
  FSDPModule& r = root();
  KILN_CHECK(run == r.forward_runs_, "[FSDPModule::run] a backward through the outputs of an ",
             "earlier run() of ", r.describe(), ": a later run() has started since (one backward ",
             "per run(), before the next run())");
  if (!backward_pending_ || reduce_work_ != nullptr) return;
  finish_gather();
  // Prefetch: units finish backward in backward_order_, so the first one still pending and not
  // gathered is the next that backward reaches; its all-gather runs while this unit computes.
  for (FSDPModule* u : root().backward_order_) {
    if (u == this || !u->backward_pending_ || u->unsharded_) continue;
    u->launch_gather();  // no-op when its gather is in flight already
    break;
  }
}

void FSDPModule::on_grad_ready(size_t i) {
  Param& p = params_[i];
  KILN_CHECK(backward_pending_ && p.expected, "[fully_shard] parameter '", p.name, "' of ",
             describe(), " got a gradient outside a backward of the outputs of the root's run() ",
             "(call the model through run(), and run one backward per run())");
  KILN_CHECK(!p.ready, "[fully_shard] parameter '", p.name, "' of ", describe(),
             " got a gradient twice in one backward");
  p.ready = true;
  if (++ready_count_ == expected_count_) launch_reduce();
}

void FSDPModule::launch_reduce() {
  NoGradGuard no_grad;
  const int world = pg_->size();
  FSDPModule& r = root();
  // The previous unit's reduce-scatter has had this unit's backward to run: wait for it and let
  // go of its input before this unit's is made. Otherwise every unit's packed full gradient (the
  // collective keeps its input until the wait) would stay until the end of the backward: the
  // whole model's gradients in full. NCCL: the wait orders the compute stream after the
  // collective, so the input's memory is reused only once the collective has read it.
  if (r.last_reduce_ != nullptr && r.last_reduce_ != this) r.last_reduce_->finish_reduce();
  const bool accumulate = grad_acc_.defined();
  if (requires_gradient_sync_ && !accumulate && world > 1) {
    launch_reduce_direct();
  } else {
    // Row r of the packed gradient holds the slices rank r keeps, laid out as the packed shard.
    // Without gradient sync it stays, and the next backwards add into it.
    Tensor packed =
        accumulate
            ? grad_acc_
            : buffer(world * packed_,
                     TensorOptions().dtype(reduce_dtype()).device(params_[0].param.device()));
    const Tensor rows = packed.view({world, packed_});
    for (const Param& p : params_) {
      const Tensor& g = p.param.grad();
      Tensor dst = rows.narrow(1, p.offset, p.shard);
      if (g.defined()) {
        pack_gradient(dst, g, p.numel, accumulate);
      } else if (!accumulate) {
        dst.zero_();
      }
    }
    if (requires_gradient_sync_) {
      grad_acc_ = Tensor();
      reduce_output_ = buffer(packed_, packed.options());
      reduce_input_ = packed;
      reduce_work_ = reduce_scatter_op(pg_, reduce_output_, packed, ReduceOp::kAvg);
      r.last_reduce_ = this;
    } else {
      grad_acc_ = packed;
    }
  }
  for (Param& p : params_) {
    p.param.mutable_grad() = Tensor();
    p.expected = p.ready = false;
  }
  backward_pending_ = false;
  reshard();  // the full parameters and gradients go now; the shards' grads come at the end
  if (--r.units_to_reduce_ == 0) r.finish_backward();
}

void FSDPModule::launch_reduce_direct() {
  const int world = pg_->size();
  const ScalarType dtype = reduce_dtype();
  reduce_output_ = buffer(packed_, TensorOptions().dtype(dtype).device(params_[0].param.device()));
  std::vector<Tensor> inputs;
  std::vector<int64_t> offsets;
  for (const Param& p : params_) {
    // The full gradient is the reduce-scatter's input as it is where it has the shape of one:
    // world * shard elements, contiguous, in the reduce dtype, and alone in its memory (kept
    // until the collective has read it, so it must not hold a larger buffer alive). Otherwise it
    // is padded or converted into an input of its own.
    const Tensor& g = p.param.grad();
    Tensor in;
    if (g.defined() && g.dtype() == dtype && g.is_contiguous() && p.numel == world * p.shard &&
        g.impl()->storage()->nbytes() == g.nbytes()) {
      in = g.view({-1});
    } else {
      in = buffer(world * p.shard, reduce_output_.options());
      if (g.defined()) {
        pack_gradient(in.view({world, p.shard}), g, p.numel, /*accumulate=*/false);
      } else {
        in.zero_();
      }
    }
    inputs.push_back(in);
    offsets.push_back(p.offset);
  }
  grad_acc_ = Tensor();
  // An op: a compiled step records the reduce-scatter here (dist/collective_ops.h).
  reduce_work_ = reduce_scatter_coalesced_op(pg_, reduce_output_, inputs, offsets, ReduceOp::kAvg);
  reduce_inputs_ = std::move(inputs);
  root().last_reduce_ = this;
}

void FSDPModule::finish_reduce() {
  if (reduce_work_ == nullptr) return;
  NoGradGuard no_grad;
  reduce_work_->wait();
  reduce_work_ = nullptr;
  reduce_input_ = Tensor();
  reduce_inputs_.clear();
}

void FSDPModule::finish_backward() {
  NoGradGuard no_grad;
  last_reduce_ = nullptr;
  for (FSDPModule* u : subtree()) {
    u->finish_reduce();
    if (!u->reduce_output_.defined()) continue;
    for (Param& p : u->params_) {
      Tensor g = u->reduce_output_.narrow(0, p.offset, p.shard);
      if (g.dtype() != u->dtype_) g = g.to(u->dtype_);
      if (p.param.grad().defined()) {
        Tensor acc = p.param.grad();
        acc.add_(g);
      } else {
        p.param.mutable_grad() = g;  // a view: the shards' gradients share the reduction's output
      }
    }
    u->reduce_output_ = Tensor();
    u->reduce_input_ = Tensor();
    u->reduce_inputs_.clear();
  }
  backward_order_.clear();
}

double FSDPModule::clip_grad_norm_(double max_norm) {
  KILN_CHECK(is_root(), "[FSDPModule::clip_grad_norm_] ", describe(), " was adopted by the ",
             "fully_shard call on ", root().module().name(), ": call it on that root");
  NoGradGuard no_grad;
  // The padding of the shards holds zero gradients, so the shards' squares sum to the model's.
  Tensor sum;
  std::vector<Tensor> grads;
  for (FSDPModule* u : subtree()) {
    for (const Param& p : u->params_) {
      const Tensor& g = u->unsharded_ ? p.sharded_grad : p.param.grad();
      if (!g.defined()) continue;
      grads.push_back(g);
      Tensor sq = g.to(kDouble).square().sum();
      sum = sum.defined() ? sum + sq : sq;
    }
  }
  const Device device = params_.empty() ? Device(kCPU) : params_[0].param.device();
  Tensor total = sum.defined() ? sum.reshape({1}).to(device)
                               : zeros({1}, TensorOptions().dtype(kDouble).device(device));
  pg_->all_reduce(total, ReduceOp::kSum)->wait();
  const double norm = std::sqrt(total.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1) {
    for (Tensor g : grads) g.mul_(coef);
  }
  return norm;
}

}  // namespace kiln::dist
