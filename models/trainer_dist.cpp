// Data parallelism of `kiln pretrain` and `kiln bench` (PretrainOptions::dist,
// models/trainer_internal.h): DDP or FSDP over the ranks of `kiln run`.
#include <cmath>

#include "autograd/grad_mode.h"
#include "dist/collective_ops.h"
#include "dist/dist.h"
#include "dist/fsdp.h"
#include "kernels/cuda.h"
#include "models/gpt_hooks.h"
#include "models/trainer_internal.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"

namespace kiln::models::internal {

struct DataParallel::Impl {
  std::string mode;
  Device device{kCPU};
  std::shared_ptr<dist::ProcessGroup> pg;
  std::optional<dist::DistributedDataParallel<GPT>> ddp;
  std::shared_ptr<dist::FSDPModule> fsdp;
  StateLayout layout;         // FSDP: the optimizer's parameters' full shapes, and their slices
  std::optional<GPT> hooked;  // FSDP: the model whose block hook gathers the blocks
  std::optional<GPT> embedding_hooked;  // DDP: the tied model whose lookup gathers its rows

  ~Impl() {
    if (hooked) set_block_hook(**hooked, {});
    if (embedding_hooked) set_embedding_hook(**embedding_hooked, {});
  }
};

void DataParallel::check_mode(const std::string& mode, bool compiled, const char* who) {
  (void)compiled;  // every mode compiles: the collectives are ops (dist/collective_ops.h)
  KILN_CHECK(mode == "ddp" || mode == "zero2" || mode == "zero3" || mode == "fsdp", "[", who,
             "] dist must be ddp, zero2, zero3 or fsdp (= zero3), got '", mode, "'");
}

DataParallel::DataParallel(const std::string& mode, bool cuda, const char* who,
                           bool peer_all_reduce)
    : impl_(std::make_unique<Impl>()) {
  check_mode(mode, /*compiled=*/false, who);
  impl_->mode = mode == "fsdp" ? "zero3" : mode;
  const dist::RendezvousInfo info = dist::rendezvous_info_from_env();
  if (cuda) {
    KILN_CHECK(info.local_rank < cuda::device_count(), "[", who, "] rank ", info.rank,
               " has LOCAL_RANK ", info.local_rank, " but this node has ", cuda::device_count(),
               " GPUs: start at most that many ranks per node (kiln run --nproc-per-node)");
    cuda::set_device(info.local_rank);
    impl_->device = Device(kCUDA, info.local_rank);
  }
  dist::InitOptions init;
  init.peer_all_reduce = peer_all_reduce;
  impl_->pg = dist::init_process_group(cuda ? "nccl" : "gloo", init);
}

DataParallel::~DataParallel() = default;

Device DataParallel::device() const { return impl_->device; }
int DataParallel::rank() const { return impl_->pg->rank(); }
int DataParallel::world() const { return impl_->pg->size(); }
bool DataParallel::sharded() const { return impl_->mode != "ddp"; }
const std::string& DataParallel::mode() const { return impl_->mode; }

void DataParallel::wrap(GPT& model, const optim::Optimizer& opt, int comm_sm_carveout,
                        std::optional<double> bucket_cap_mb, std::optional<int> tail_buckets) {
  if (!sharded()) {
    // GPT's buffers (the RoPE tables) are computed from the config, the same on every rank.
    dist::DDPOptions o;
    o.broadcast_buffers = false;
    o.comm_sm_carveout = comm_sm_carveout;
    if (bucket_cap_mb) o.bucket_cap_mb = *bucket_cap_mb;
    if (tail_buckets) o.tail_buckets = *tail_buckets;
    impl_->ddp.emplace(model, impl_->pg, o);
    if (model->config().tie_embeddings) {
      // The table's all-reduce starts with the LM head's gradient, early in the backward; the
      // lookup's rows are all-gathered at its end (dist/ddp.h, gathered_embedding).
      auto* ddp = &*impl_->ddp;
      set_embedding_hook(*model, [ddp](const Tensor& table, const Tensor& idx) {
        return ddp->gathered_embedding(table, idx);
      });
      impl_->embedding_hooked = model;
    }
    return;
  }
  // The optimizer's parameters in its order, with their full shapes, before they become shards.
  const int64_t world = this->world();
  std::vector<int64_t> numels;
  for (const Tensor& p : opt.parameters()) {
    impl_->layout.full_shapes.emplace_back(p.sizes().begin(), p.sizes().end());
    numels.push_back(p.numel());
  }
  const int64_t rank = this->rank();
  impl_->layout.to_shard = [numels, world, rank](size_t index, const Tensor& full) {
    // FSDP's layout: the flattened tensor padded to world * shard elements, rank r holding
    // elements [r * shard, (r + 1) * shard).
    const int64_t numel = numels.at(index);
    const int64_t shard = (numel + world - 1) / world;
    Tensor flat = full.reshape({-1});
    if (world * shard > numel) flat = cat({flat, zeros({world * shard - numel}, flat.options())});
    return flat.narrow(0, rank * shard, shard).clone();
  };
  dist::FSDPOptions fo;
  fo.reshard_after_forward = impl_->mode == "zero3";
  std::vector<std::shared_ptr<dist::FSDPModule>> blocks;
  for (const auto& block : *model->h) blocks.push_back(dist::fully_shard(block, impl_->pg, fo));
  impl_->fsdp = dist::fully_shard(model, impl_->pg, fo);
  // Each block gathered as the forward reaches it, the next one's gather in flight meanwhile.
  impl_->fsdp->set_gather_per_unit(true);
  set_block_hook(*model, [blocks](int64_t layer, bool before) {
    dist::FSDPModule& unit = *blocks.at(static_cast<size_t>(layer));
    if (before) {
      unit.before_forward();
    } else {
      unit.after_forward();
    }
  });
  impl_->hooked = model;
}

Tensor DataParallel::forward_backward(const std::function<Tensor()>& loss, bool sync) {
  if (impl_->ddp) {
    std::optional<dist::NoSyncGuard> no_sync;
    if (!sync) no_sync.emplace(impl_->ddp->no_sync());
    Tensor l = impl_->ddp->run(loss);
    l.backward();
    return l.detach();
  }
  KILN_CHECK(impl_->fsdp != nullptr, "[pretrain] DataParallel::wrap was not called");
  impl_->fsdp->set_requires_gradient_sync(sync);  // one reduce-scatter per step, after the last
  Tensor l = impl_->fsdp->run(loss);
  l.backward();
  return l.detach();
}

Tensor DataParallel::forward(const std::function<Tensor()>& f) {
  if (impl_->ddp) return impl_->ddp->run(f);
  KILN_CHECK(impl_->fsdp != nullptr, "[pretrain] DataParallel::wrap was not called");
  return impl_->fsdp->run(f);
}

Tensor DataParallel::clip_grad_norm(const std::vector<Tensor>& params, double max_norm,
                                    Tensor* coef) {
  // DDP: the global gradients. FSDP: shards, whose squares sum over the ranks to the model's;
  // the coefficient is then the same on every rank, and scales each rank's shards.
  if (!sharded()) return internal::clip_grad_norm(params, max_norm, {}, coef);
  return internal::clip_grad_norm(
      params, max_norm,
      // An op, so that a compiled step records it (dist/collective_ops.h).
      [this](Tensor& squares) {
        dist::all_reduce_op(impl_->pg, squares, dist::ReduceOp::kSum)->wait();
      },
      coef);
}

std::vector<double> DataParallel::sum(const std::vector<double>& values) {
  if (values.empty()) return {};
  Tensor t = tensor(values, TensorOptions().dtype(kFloat64)).to(impl_->device);
  impl_->pg->all_reduce(t, dist::ReduceOp::kSum)->wait();
  t = t.to(kCPU).contiguous();
  const double* d = t.data_ptr<double>();
  return std::vector<double>(d, d + values.size());
}

double DataParallel::max(double value) {
  Tensor t = full({1}, value, TensorOptions().dtype(kFloat64).device(impl_->device));
  impl_->pg->all_reduce(t, dist::ReduceOp::kMax)->wait();
  return t.item<double>();
}

void DataParallel::barrier() { impl_->pg->barrier()->wait(); }

TensorMap DataParallel::full_model_state(GPT& model) {
  if (impl_->fsdp) return impl_->fsdp->full_state_dict(/*rank0_only=*/true);
  TensorMap out;
  for (const auto& [name, t] : model->state_dict()) out.emplace(name, t);
  return out;
}

TensorMap DataParallel::full_optimizer_state(const optim::Optimizer& opt,
                                             SafetensorsMetadata* metadata) {
  TensorMap state = opt.state_dict(metadata);
  if (!impl_->fsdp) return state;
  // Every buffer is shaped like its parameter's shard: gathered and cut to the full shape, in
  // host memory (every rank holds it until the save: rank 0 writes it). The map's order is the
  // same on every rank (the same parameters took the same steps).
  const int64_t world = this->world();
  NoGradGuard no_grad;
  for (auto& [name, t] : state) {
    const auto index = static_cast<size_t>(std::stoll(name.substr(6)));
    const Shape& shape = impl_->layout.full_shapes.at(index);
    int64_t numel = 1;
    for (int64_t s : shape) numel *= s;
    Tensor gathered = empty({world * t.numel()}, t.options());
    Tensor shard = t.contiguous();
    impl_->pg->all_gather_into_tensor(gathered, shard)->wait();
    // To host memory one buffer at a time, so that the device never holds the full state.
    t = gathered.narrow(0, 0, numel)
            .reshape(IntArrayRef(shape))
            .to(Device(kCPU), /*non_blocking=*/false, /*copy=*/true);
  }
  return state;
}

const StateLayout* DataParallel::state_layout() const {
  return impl_->fsdp ? &impl_->layout : nullptr;
}

}  // namespace kiln::models::internal
