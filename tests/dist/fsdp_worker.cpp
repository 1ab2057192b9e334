// fsdp_worker SCENARIO: one rank of a multi-process FSDP test (tests/dist/fsdp_test.cpp starts
// the ranks through spawn.h). Each scenario trains or checks a fully_shard model against the same
// model in this process without sharding, and exits 0 when every check held; a failed check
// prints what differed and exits 1.
//
// Tolerances: the models are in float64, where the sharded run and the one-process run differ
// only in the order of the reductions (each rank's mean over its part, then the average over the
// ranks, instead of one mean over the global batch): a few ulps per step, so 1e-9 relative holds
// with a wide margin after a few AdamW steps (AdamW divides by sqrt(v) + eps; with eps 1e-8 a
// rounding error of 1e-16 relative in a gradient moves an update by at most ~1e-8 of lr).
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <unordered_set>

#include "dist/dist.h"
#include "dist/fsdp.h"
#include "fsdp_util.h"
#include "kiln.h"
#include "models/gpt.h"
#include "models/gpt_hooks.h"
#include "worker_util.h"

namespace {

using namespace kiln;
using namespace kiln::dist;
using test::error_of;
using test::expect_close;
using test::expect_global_loss;
using test::short_timeout;
using testing::deep_tiny_llama;
using testing::shard_bytes;
using testing::shard_per_block;

void expect_error(const std::function<void()>& f, const std::string& needle,
                  const std::string& what) {
  const std::string e = error_of(f);
  WCHECK(e.find(needle) != std::string::npos, what, ": expected an error containing '", needle,
         "', got '", e, "'");
  std::cout << "rank error (" << what << "): " << e << "\n";
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// --- A small MLP: three Linear layers, one unit each, and the root holding a scale -------------

struct MlpImpl : nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", nn::Linear(8, 16));
    fc2 = register_module("fc2", nn::Linear(16, 16));
    fc3 = register_module("fc3", nn::Linear(16, 4));
    scale = register_parameter("scale", ones({4}));
  }
  Tensor forward(const Tensor& x) { return fc3(fc2(fc1(x).tanh()).tanh()) * scale; }
  nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  Tensor scale;
};
KILN_MODULE(Mlp);

Mlp make_mlp(uint64_t seed) {
  manual_seed(seed);
  Mlp m;
  m->to(kDouble);
  return m;
}

Tensor mse(const Tensor& out, const Tensor& y) { return (out - y).square().mean(); }

// Compares every full parameter of the sharded model with the reference's.
void expect_same_weights(FSDPModule& fsdp, nn::Module& ref, double tol, const std::string& when) {
  const auto full = fsdp.full_state_dict(/*rank0_only=*/false);
  const auto want = ref.state_dict();
  WCHECK(full.size() == want.size(), when, ": ", full.size(), " entries vs ", want.size());
  for (const auto& [name, t] : want) {
    WCHECK(full.contains(name), when, ": no '", name, "' in the full state dict");
    expect_close(full.at(name), t, tol, when + ": " + name);
  }
}

// Rank r of n's part of a flattened tensor of `numel` elements under FSDP's layout: a shard of
// ceil(numel / n) elements (padding included) whose first `len` are elements [begin, begin + len).
struct RankSlice {
  int64_t shard = 0, begin = 0, len = 0;
};
RankSlice rank_slice(int64_t numel, int r, int n) {
  RankSlice s;
  s.shard = ceil_div(numel, n);
  s.begin = std::min<int64_t>(r * s.shard, numel);
  s.len = std::min<int64_t>(s.shard, numel - s.begin);
  return s;
}

// Every shard gradient of `model` equals this rank's slice of the flattened gradient of `ref`.
void expect_shard_grads(nn::Module& model, nn::Module& ref, int r, int n, double tol,
                        const std::string& when) {
  const auto want = ref.named_parameters();
  for (const auto& item : model.named_parameters()) {
    const Tensor g = want[item.key()].grad().reshape({-1});
    const RankSlice sl = rank_slice(g.numel(), r, n);
    const Tensor& got = item.value().grad();
    WCHECK(got.defined() && got.numel() == sl.shard, when, ": the shard gradient of ", item.key(),
           " has ", got.defined() ? got.numel() : -1, " elements, expected ", sl.shard);
    expect_close(got.narrow(0, 0, sl.len), g.narrow(0, sl.begin, sl.len), tol,
                 when + ": gradient of " + item.key());
  }
}

// fully_shard == one process on the global batch: losses after every step, full weights after
// every step, shard sizes; the first step's shard gradients against slices of the reference's;
// the last step accumulates two micro-batches.
void fsdp_mlp() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 3, global = local * n;
  Mlp ref = make_mlp(100);
  Mlp model = make_mlp(100 + r);  // rank 0's values win
  auto u1 = fully_shard(model->fc1, pg);
  FSDPOptions keep;
  keep.reshard_after_forward = false;  // fc2 stays gathered from forward to backward
  auto u2 = fully_shard(model->fc2, pg, keep);
  auto u3 = fully_shard(model->fc3, pg);
  auto root = fully_shard(model, pg);
  WCHECK(root->is_root() && !u1->is_root() && root->children().size() == 3,
         "the root adopts the three units");
  WCHECK(root->parameter_names() == std::vector<std::string>{"scale"}, "the root keeps 'scale'");
  // Every parameter is a 1-d shard of ceil(numel / world) elements.
  int64_t held = 0, total = 0;
  for (auto* u : {u1.get(), u2.get(), u3.get(), root.get()}) {
    held += u->sharded_numel();
    total += u->unsharded_numel();
  }
  WCHECK(model->fc1->weight.sizes() == Shape({ceil_div(128, n)}), "fc1.weight shard ",
         shape_str(model->fc1->weight.sizes()));
  WCHECK(model->fc3->bias.sizes() == Shape({ceil_div(4, n)}), "fc3.bias shard");
  WCHECK(total == 8 * 16 + 16 + 16 * 16 + 16 + 16 * 4 + 4 + 4, "unsharded numel ", total);
  WCHECK(held * n < total + 7 * n, "held ", held, " elements of ", total, " over ", n, " ranks");
  expect_same_weights(*root, *ref, 0, "initial weights are rank 0's");

  optim::AdamW opt(model->parameters(), optim::AdamWOptions(0.01).weight_decay(0.1));
  optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(0.01).weight_decay(0.1));
  manual_seed(7);  // the same global batches on every rank
  for (int step = 0; step < 5; ++step) {
    const int micro = step == 4 ? 2 : 1;
    opt.zero_grad();
    ref_opt.zero_grad();
    double loss_sum = 0, ref_sum = 0;
    for (int k = 0; k < micro; ++k) {
      Tensor x = randn({global, 8}, kDouble), y = randn({global, 4}, kDouble);
      Tensor mx = x.narrow(0, r * local, local), my = y.narrow(0, r * local, local);
      Tensor loss = root->run([&] { return mse(model(mx), my); });
      WCHECK(!model->fc1->weight.sizes().empty() && model->fc1->weight.dim() == 1,
             "fc1 is resharded after forward");
      WCHECK(model->fc2->weight.dim() == 2, "fc2 (reshard_after_forward=false) stays gathered");
      loss.backward();
      WCHECK(model->fc2->weight.dim() == 1, "fc2 is resharded after backward");
      loss_sum += loss.item<double>();
      Tensor ref_loss = mse(ref(x), y);
      ref_loss.backward();
      ref_sum += ref_loss.item<double>();
    }
    expect_global_loss(*pg, loss_sum, ref_sum, step);
    if (step == 0 || step == 4) {
      // The shard's gradient is this rank's slice of the global gradient.
      const Tensor g = ref->fc1->weight.grad().reshape({-1});
      const RankSlice sl = rank_slice(g.numel(), r, n);
      WCHECK(model->fc1->weight.grad().numel() == sl.shard, "the shard gradient has ", sl.shard,
             " elements");
      expect_close(model->fc1->weight.grad().narrow(0, 0, sl.len), g.narrow(0, sl.begin, sl.len),
                   1e-12, "fc1.weight shard gradient at step " + std::to_string(step));
    }
    if (step == 1) {
      // The norm of the full gradient, from the shards; a max_norm below it scales them.
      const double norm = root->clip_grad_norm_(0.05);
      const double ref_norm = nn::utils::clip_grad_norm_(ref->parameters(), 0.05);
      WCHECK(std::abs(norm - ref_norm) < 1e-12 * ref_norm && ref_norm > 0.05, "gradient norm ",
             norm, " vs one process ", ref_norm);
    }
    opt.step();
    ref_opt.step();
    expect_same_weights(*root, *ref, 1e-9, "after step " + std::to_string(step));
  }
  {
    // Without grad mode (evaluation) run() gathers, runs and reshards every unit, the root's too.
    NoGradGuard no_grad;
    Tensor x = randn({2, 8}, kDouble);
    Tensor out = root->run([&] { return model(x); });
    expect_close(out, ref(x), 1e-9, "an evaluation forward");
    for (const auto& p : model->parameters()) WCHECK(p.dim() == 1, "resharded after evaluation");
  }
  // The shard padding (past the end of a parameter) stays zero through AdamW.
  if (r == n - 1 && 4 % n != 0) {
    const auto b = model->fc3->bias.to_vector<double>();
    WCHECK(b.back() == 0, "padding of fc3.bias is ", b.back());
  }
  std::cout << "rank " << r << ": fsdp mlp == one process\n";
}

// Gradient accumulation without sync (set_requires_gradient_sync(false), FSDP2's no_sync): k
// micro-batches whose backward leaves the full gradients summed on each rank, then one synced
// micro-batch that reduce-scatters the sum, == one process on the whole global batch. fc1 and
// fc3 reshard after forward (ZeRO-3), fc2 does not (ZeRO-2); 2 steps of 3 micro-batches.
void fsdp_no_sync() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 2, global = local * n, micro = 3;
  Mlp ref = make_mlp(200);
  Mlp model = make_mlp(200);
  fully_shard(model->fc1, pg);
  FSDPOptions keep;
  keep.reshard_after_forward = false;
  auto u2 = fully_shard(model->fc2, pg, keep);
  fully_shard(model->fc3, pg);
  auto root = fully_shard(model, pg);
  optim::AdamW opt(model->parameters(), optim::AdamWOptions(0.01).weight_decay(0.1));
  optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(0.01).weight_decay(0.1));
  manual_seed(9);
  for (int step = 0; step < 2; ++step) {
    opt.zero_grad();
    ref_opt.zero_grad();
    Tensor x = randn({micro * global, 8}, kDouble), y = randn({micro * global, 4}, kDouble);
    double loss_sum = 0;
    for (int64_t k = 0; k < micro; ++k) {
      const bool sync = k == micro - 1;
      root->set_requires_gradient_sync(sync);
      WCHECK(u2->requires_gradient_sync() == sync, "the setting reaches the units below the root");
      // Micro-batch k of the global batch; this rank's rows of it.
      Tensor mx = x.narrow(0, k * global + r * local, local);
      Tensor my = y.narrow(0, k * global + r * local, local);
      Tensor loss = root->run([&] { return mse(model(mx), my) / static_cast<double>(micro); });
      loss.backward();
      loss_sum += loss.item<double>();
      for (const auto& p : model->parameters()) {
        WCHECK(p.dim() == 1, "resharded after a backward");
        WCHECK(p.grad().defined() == sync, "step ", step, " micro-batch ", k, ": a shard ",
               "gradient is ", p.grad().defined() ? "defined" : "undefined", " (written only by ",
               "the synced backward)");
      }
    }
    Tensor ref_loss = mse(ref(x), y);
    ref_loss.backward();
    Tensor l = full({1}, loss_sum, kDouble);
    pg->all_reduce(l, ReduceOp::kAvg)->wait();
    WCHECK(std::abs(l.item<double>() - ref_loss.item<double>()) < 1e-12, "step ", step, ": loss ",
           l.item<double>(), " vs one process ", ref_loss.item<double>());
    expect_shard_grads(*model, *ref, r, n, 1e-9, "no_sync step " + std::to_string(step));
    opt.step();
    ref_opt.step();
    expect_same_weights(*root, *ref, 1e-9, "no_sync after step " + std::to_string(step));
  }
  std::cout << "rank " << r << ": fsdp no_sync accumulation == one process\n";
}

// --- The tiny Llama
// -------------------------------------------------------------------------------

models::ModelConfig tiny_llama() { return models::ModelConfig::from_name("tiny-llama"); }

models::GPT make_gpt(uint64_t seed, ScalarType dtype = kDouble) {
  manual_seed(seed);
  return models::GPT(tiny_llama(), TensorOptions().dtype(dtype));
}

// Each block a unit (block 0 keeps its parameters from forward to backward), the root holds the
// embedding, the final norm and the head; AdamW; 3 steps.
// per_unit: each block gathered as the forward reaches it (set_gather_per_unit and GPT's block
// hook), the next one prefetched, none further ahead.
void fsdp_llama_with(bool per_unit) {
  auto pg = init_process_group("gloo", short_timeout(30000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 1, global = local * n, T = 16;
  models::GPT ref = make_gpt(11);
  models::GPT model = make_gpt(11);
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  for (size_t l = 0; l < model->h->size(); ++l) {
    FSDPOptions o;
    o.reshard_after_forward = l != 0;
    blocks.push_back(fully_shard(model->h[l], pg, o));
  }
  auto root = fully_shard(model, pg);
  int64_t hook_calls = 0;
  // Where the hook records block 1's gathered storages (per unit: gathered only in its hook).
  std::vector<std::weak_ptr<StorageImpl>>* record = nullptr;
  if (per_unit) {
    root->set_gather_per_unit(true);
    models::set_block_hook(*model, [&](int64_t layer, bool before) {
      const auto l = static_cast<size_t>(layer);
      if (!before) {
        blocks[l]->after_forward();
        return;
      }
      blocks[l]->before_forward();
      ++hook_calls;
      WCHECK(blocks[l]->is_unsharded(), "block ", l, " is gathered for its forward");
      if (l == 1 && record != nullptr) {
        for (const auto& p : model->h[1]->parameters()) record->push_back(p.impl()->storage());
      }
      for (size_t k = l + 2; k < blocks.size(); ++k) {
        WCHECK(!blocks[k]->is_unsharded(), "block ", k, " is gathered before block ", l, " runs");
      }
    });
  }
  const int64_t total = ref->num_parameters();
  int64_t held = root->sharded_numel(), counted = root->unsharded_numel();
  for (auto& b : blocks) {
    held += b->sharded_numel();
    counted += b->unsharded_numel();
  }
  WCHECK(counted == total, "the units hold ", counted, " of ", total, " parameters");
  // ceil per parameter: at most one element of padding per parameter and rank.
  const int64_t num_params = static_cast<int64_t>(ref->parameters().size());
  WCHECK(held <= total / n + num_params, "rank ", r, " holds ", held, " elements, more than ",
         total, " / ", n, " + ", num_params);
  for (const auto& p : model->parameters()) WCHECK(p.dim() == 1, "a parameter is not sharded");

  optim::AdamW opt(model->parameters(), optim::AdamWOptions(3e-3).weight_decay(0.1));
  optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(3e-3).weight_decay(0.1));
  manual_seed(5);
  for (int step = 0; step < 3; ++step) {
    Tensor idx = randint(0, 320, {global, T}), tgt = randint(0, 320, {global, T});
    opt.zero_grad();
    ref_opt.zero_grad();
    // The storages of block 1's gathered parameters: resharding after forward points the
    // parameters back at their shards, and the end of backward lets go of the rest (what the graph
    // saved of them), so nothing full survives a step.
    std::vector<std::weak_ptr<StorageImpl>> gathered;
    record = &gathered;
    Tensor loss = root->run([&] {
      if (!per_unit) {
        for (const auto& p : model->h[1]->parameters()) gathered.push_back(p.impl()->storage());
      }
      return model->loss(idx.narrow(0, r * local, local), tgt.narrow(0, r * local, local));
    });
    WCHECK(model->h[0]->named_parameters()["attn.qkv.weight"].dim() == 2,
           "block 0 (no reshard after forward) stays gathered");
    WCHECK(model->h[1]->named_parameters()["attn.qkv.weight"].dim() == 1,
           "block 1 is resharded after forward");
    record = nullptr;
    WCHECK(!gathered.empty(), "block 1's gathered storages were recorded");
    // Resharding after forward took block 1's memory: the views the graph saved (linear's
    // weight.t()) still hold its gathered buffer, empty until the gather in backward refills it.
    // Block 0 (no reshard after forward) keeps its own.
    int alive = 0;
    for (const auto& w : gathered) {
      if (auto s = w.lock()) {
        ++alive;
        WCHECK(s->nbytes() == 0, "block 1's gathered buffer holds ", s->nbytes(),
               " bytes after forward");
      }
    }
    WCHECK(alive > 0, "the graph holds no view of block 1's gathered parameters");
    for (const auto& p : model->h[0]->parameters()) {
      WCHECK(p.impl()->storage()->nbytes() >= p.nbytes(), "block 0 lost its gathered memory");
    }
    loss.backward();
    Tensor l = loss.detach().reshape({1}).clone();
    loss = Tensor();  // the graph goes
    for (const auto& w : gathered) WCHECK(w.expired(), "a gathered parameter of block 1 lives on");
    for (const auto& p : model->parameters()) WCHECK(p.dim() == 1, "resharded after backward");
    Tensor ref_loss = ref->loss(idx, tgt);
    ref_loss.backward();
    pg->all_reduce(l, ReduceOp::kAvg)->wait();
    WCHECK(std::abs(l.item<double>() - ref_loss.item<double>()) < 1e-12, "step ", step, ": loss ",
           l.item<double>(), " vs one process ", ref_loss.item<double>());
    expect_shard_grads(*model, *ref, r, n, 1e-10, "step " + std::to_string(step));
    opt.step();
    ref_opt.step();
  }
  WCHECK(hook_calls == (per_unit ? 3 * static_cast<int64_t>(blocks.size()) : 0),
         "the block hook ran ", hook_calls, " times");
  if (per_unit) {
    // A forward that never calls a unit's before_forward() is an error at its end (a forward that
    // runs a block without it fails earlier, on the block's 1-d shards).
    models::set_block_hook(*model, {});
    expect_error([&] { root->run([&] { return model->ln_f->weight.sum(); }); },
                 "gather_per_unit is on but the forward never called",
                 "per-unit gathering without the hook");
    root->set_gather_per_unit(false);
  }
  expect_same_weights(*root, *ref, 1e-9, "tiny llama after 3 steps");
  // The full state dict on rank 0 saves and loads as the model's own.
  const auto full = root->full_state_dict();
  WCHECK((r == 0) == !full.empty(), "the full state dict is on rank 0 only");
  if (r == 0) {
    const std::string path = "/tmp/kiln_fsdp_llama_" + std::to_string(::getpid()) + ".safetensors";
    save_safetensors(full, path);
    models::GPT fresh = make_gpt(99);
    fresh->load_state_dict(load_safetensors(path));
    ::unlink(path.c_str());
    for (const auto& [name, t] : fresh->state_dict()) {
      expect_close(t, full.at(name), 0, "loaded from the full state dict: " + name);
    }
    Tensor idx = randint(0, 320, {2, T});
    expect_close(fresh(idx), ref(idx), 1e-9, "logits of the loaded model");
  }
  std::cout << "rank " << r << ": fsdp tiny llama == one process" << (per_unit ? " (per unit)" : "")
            << "\n";
}

void fsdp_llama() { fsdp_llama_with(false); }
void fsdp_llama_per_unit() { fsdp_llama_with(true); }

// bf16 compute with f32 shards: the forward sees bf16 parameters, the shards, their gradients and
// the optimizer stay f32; losses follow the f32 model within bf16 rounding.
void fsdp_mixed_precision() {
  auto pg = init_process_group("gloo", short_timeout(30000));
  const int r = pg->rank(), n = pg->size();
  const int64_t T = 16;
  models::GPT ref = make_gpt(11, kFloat);
  models::GPT model = make_gpt(11, kFloat);
  FSDPOptions o;
  o.mp_policy.param_dtype = kBFloat16;
  o.mp_policy.reduce_dtype = kFloat;
  for (size_t l = 0; l < model->h->size(); ++l) fully_shard(model->h[l], pg, o);
  auto root = fully_shard(model, pg, o);
  optim::AdamW opt(model->parameters(), optim::AdamWOptions(3e-3));
  optim::AdamW ref_opt(ref->parameters(), optim::AdamWOptions(3e-3));
  manual_seed(5);
  for (int step = 0; step < 3; ++step) {
    Tensor idx = randint(0, 320, {n, T}), tgt = randint(0, 320, {n, T});
    opt.zero_grad();
    ref_opt.zero_grad();
    // The last step in two halves, the first without gradient sync: its bf16 gradients are
    // summed in f32 (the reduce dtype) with the second's.
    const int micro = step == 2 ? 2 : 1;
    Tensor loss;
    for (int k = 0; k < micro; ++k) {
      root->set_requires_gradient_sync(k == micro - 1);
      Tensor part = root->run([&] {
        WCHECK(model->wte->weight.dtype() == kBFloat16, "gathered in ",
               dtype_name(model->wte->weight.dtype()));
        return model->loss(idx.narrow(0, r, 1), tgt.narrow(0, r, 1)) / static_cast<double>(micro);
      });
      part.backward();
      loss = loss.defined() ? loss + part.detach() : part.detach();
    }
    for (const auto& p : model->parameters()) {
      WCHECK(p.dtype() == kFloat && p.grad().dtype() == kFloat, "shards and grads stay f32");
    }
    Tensor ref_loss = ref->loss(idx, tgt);
    ref_loss.backward();
    if (step == 0) {
      // The shards' f32 gradients (bf16 gradients reduce-scattered in f32) against this rank's
      // slices of the f32 model's: within bf16 rounding, as a norm over each parameter (the
      // weights' tolerance below would also pass gradients of zero).
      const auto want = ref->named_parameters();
      for (const auto& item : model->named_parameters()) {
        const Tensor g = want[item.key()].grad().reshape({-1});
        const RankSlice sl = rank_slice(g.numel(), r, n);
        if (sl.len == 0) continue;
        const Tensor w = g.narrow(0, sl.begin, sl.len).to(kDouble);
        const Tensor got = item.value().grad().narrow(0, 0, sl.len).to(kDouble);
        const double rel = (got - w).norm().item<double>() / (w.norm().item<double>() + 1e-12);
        WCHECK(rel < 5e-2, "the shard gradient of ", item.key(), " is off by ", rel,
               " (relative norm) from the f32 model's");
      }
    }
    Tensor l = loss.detach().to(kFloat).reshape({1}).clone();
    pg->all_reduce(l, ReduceOp::kAvg)->wait();
    WCHECK(std::abs(l.item<double>() - ref_loss.item<double>()) < 2e-2 * ref_loss.item<double>(),
           "step ", step, ": bf16 loss ", l.item<double>(), " vs f32 ", ref_loss.item<double>());
    opt.step();
    ref_opt.step();
  }
  // bf16 gradients move AdamW's updates by O(lr) at worst: 3 steps of lr 3e-3.
  expect_same_weights(*root, *ref, 2e-2, "bf16 compute after 3 steps");
  std::cout << "rank " << r << ": fsdp bf16 compute follows f32\n";
}

// A checkpoint written by one world size (FSDP_CKPT_DIR), read by another.
void fsdp_checkpoint_save() {
  auto pg = init_process_group("gloo", short_timeout(30000));
  const char* dir = std::getenv("FSDP_CKPT_DIR");
  WCHECK(dir != nullptr, "FSDP_CKPT_DIR is not set");
  models::GPT model = make_gpt(21);
  for (size_t l = 0; l < model->h->size(); ++l) fully_shard(model->h[l], pg);
  auto root = fully_shard(model, pg);
  root->save_sharded_checkpoint(dir);
  const auto full = root->full_state_dict();
  if (pg->rank() == 0) save_safetensors(full, std::string(dir) + "/full.safetensors");
  pg->barrier()->wait();
}

void fsdp_checkpoint_load() {
  auto pg = init_process_group("gloo", short_timeout(30000));
  const char* dir = std::getenv("FSDP_CKPT_DIR");
  WCHECK(dir != nullptr, "FSDP_CKPT_DIR is not set");
  models::GPT model = make_gpt(22);  // other values: the checkpoint must replace them all
  for (size_t l = 0; l < model->h->size(); ++l) fully_shard(model->h[l], pg);
  auto root = fully_shard(model, pg);
  root->load_sharded_checkpoint(dir);
  const auto want = load_safetensors(std::string(dir) + "/full.safetensors");
  const auto got = root->full_state_dict(/*rank0_only=*/false);
  WCHECK(got.size() == want.size(), got.size(), " entries vs ", want.size());
  for (const auto& [name, t] : want) expect_close(got.at(name), t, 0, "loaded " + name);
  // A model of another shape is refused, naming the parameter.
  models::ModelConfig other = tiny_llama();
  other.intermediate_size = 176;
  manual_seed(1);
  models::GPT wrong(other, TensorOptions().dtype(kDouble));
  for (size_t l = 0; l < wrong->h->size(); ++l) fully_shard(wrong->h[l], pg);
  auto wrong_root = fully_shard(wrong, pg);
  expect_error([&] { wrong_root->load_sharded_checkpoint(dir); }, "mlp.fc_1.weight' has shape",
               "a checkpoint of another shape");
  std::cout << "rank " << pg->rank() << ": loaded a checkpoint written by another world size\n";
}

// Misuse ends in errors that say what is wrong.
void fsdp_errors() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int n = pg->size();
  {
    Mlp m = make_mlp(1);
    fully_shard(m->fc1, pg);
    expect_error([&] { fully_shard(m->fc1, pg); }, "is already sharded", "fully_shard twice");
  }
  {
    // One Linear registered in two parents: sharding both parents would shard it twice.
    nn::Linear shared(4, 4);
    shared->to(kDouble);
    auto a = std::make_shared<nn::Module>("A");
    auto b = std::make_shared<nn::Module>("B");
    a->register_module("fc", shared);
    b->register_module("fc", shared);
    fully_shard(a, pg);
    expect_error([&] { fully_shard(b, pg); }, "is already sharded by the fully_shard call on A",
                 "a module shared by two units");
  }
  Mlp m = make_mlp(2);
  auto u1 = fully_shard(m->fc1, pg);
  auto root = fully_shard(m, pg);
  expect_error([&] { u1->run([&] {
                       return m(ones({1, 8}, kDouble));
                     }); },
               "call run() on that root", "run() on a unit that is not the root");
  // Shards of another world size.
  auto sharded = root->sharded_state_dict();
  auto full = root->full_state_dict(/*rank0_only=*/false);
  std::map<std::string, Tensor> other = sharded;
  other["fc1.weight"] = full.at("fc1.weight").reshape({-1});  // a world-size-1 shard
  if (n > 1) {
    expect_error(
        [&] { root->load_sharded_state_dict(other); },
        "'fc1.weight' has shape [128], this rank's is [" + std::to_string(ceil_div(128, n)) + "]",
        "shards of another world size");
  }
  root->load_sharded_state_dict(sharded);  // its own shards load
  std::map<std::string, Tensor> bad = full;
  bad["fc2.weight"] = zeros({16, 15}, kDouble);
  bad.erase("fc3.bias");
  bad["extra"] = zeros({1});
  expect_error([&] { root->load_full_state_dict(bad); },
               "'fc2.weight' has shape [16, 15], the model's is [16, 16]; missing 'fc3.bias'",
               "a full state dict that does not fit");
  // A unit that the outputs do not reach.
  expect_error(
      [&] { root->run([&] {
              return m->fc2(ones({1, 16}, kDouble)).sum();
            }); },
      "no parameter of the unit on 'fc1' (kiln::nn::LinearImpl) is reachable from the outputs",
      "a unit outside the loss");
  // After the errors the model still trains.
  Tensor loss = root->run([&] { return m(ones({2, 8}, kDouble)).sum(); });
  loss.backward();
  WCHECK(m->fc1->weight.grad().defined() && m->fc1->weight.grad().dim() == 1,
         "the shard gradient arrives after the errors");
  // A backward that did not reach every unit is reported by the next run().
  Tensor partial = root->run([&] { return m(ones({2, 8}, kDouble)).sum(); });
  expect_error([&] { root->run([&] {
                       return m(ones({2, 8}, kDouble)).sum();
                     }); },
               "the last backward did not finish", "a run() whose outputs got no backward");
  // Its graph can no longer be run backward (its units' gathered buffers were emptied).
  expect_error([&] { partial.backward(); }, "a backward through the outputs of an earlier run()",
               "a backward through a graph that a later run() superseded");
  std::cout << "rank " << pg->rank() << ": errors are clear\n";
}

// --- Compiled FSDP: the training step through kiln::compile ------------------------------------

// Alias classes of a trace's values: a view's output, and an in-place op's output, alias the
// op's first input.
std::vector<int> alias_classes(const compiler::Trace& t) {
  std::vector<int> parent(t.values.size());
  for (size_t v = 0; v < parent.size(); ++v) parent[v] = static_cast<int>(v);
  std::function<int(int)> find = [&](int v) {
    while (parent[static_cast<size_t>(v)] != v) v = parent[static_cast<size_t>(v)];
    return v;
  };
  for (const compiler::BoundOp& op : t.ops) {
    if (op.op->kind != OpKind::kView && op.op->kind != OpKind::kInplace) continue;
    if (op.inputs.empty() || op.inputs[0] < 0 || op.outputs.empty() || op.outputs[0] < 0) continue;
    parent[static_cast<size_t>(find(op.outputs[0]))] = find(op.inputs[0]);
  }
  std::vector<int> out(parent.size());
  for (size_t v = 0; v < parent.size(); ++v) out[v] = find(static_cast<int>(v));
  return out;
}

// The training step (zero_grad, the forward through run() with each block gathered as the forward
// reaches it, backward, SGD with momentum on the shards) compiled, against one process on the
// global batch: losses and full weights after every step (float64: only the order of the reductions
// differs). The trace holds one all-gather per unit (ZeRO-3: and one more per block, in backward),
// the first one-unit-ahead, and one reduce-scatter per unit, the first before the backward's last
// mm; under ZeRO-3 no op of the backward reads what the forward's gathers of the blocks made (the
// program frees those buffers after the forward). A sharded checkpoint of the compiled run loads
// into a fresh model. FSDP_ZERO=2|3.
void fsdp_compiled() {
  auto pg = init_process_group("gloo", short_timeout(40000));
  const int r = pg->rank(), n = pg->size();
  const char* zero_env = std::getenv("FSDP_ZERO");
  const bool zero3 = zero_env == nullptr || std::string(zero_env) != "2";
  const int64_t local = 1, global = local * n, T = 16;
  models::GPT ref = make_gpt(11);
  auto make_sharded = [&](uint64_t seed, std::vector<std::shared_ptr<FSDPModule>>& blocks) {
    models::GPT m = make_gpt(seed);
    FSDPOptions o;
    o.reshard_after_forward = zero3;
    auto root = shard_per_block(m, pg, o, blocks);
    return std::make_pair(m, root);
  };
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  const auto made = make_sharded(11, blocks);
  models::GPT model = made.first;
  const std::shared_ptr<FSDPModule> root = made.second;
  const size_t units = blocks.size() + 1;
  // SGD with momentum: in float64 AdamW's update runs as its decomposition, which reads the step
  // counts on the host and so does not trace (the f32 and bf16 kernels do: kiln pretrain's test).
  auto sgd = [](models::GPT& m) {
    return optim::SGD(m->parameters(), optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
  };
  optim::SGD opt = sgd(model), ref_opt = sgd(ref);
  auto step = kiln::compile([&](const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = root->run([&] { return model->loss(x, y); });
    loss.backward();
    opt.step();
    return loss.detach();
  });
  manual_seed(5);
  for (int i = 0; i < 4; ++i) {
    Tensor idx = randint(0, 320, {global, T}), tgt = randint(0, 320, {global, T});
    Tensor l = step(idx.narrow(0, r * local, local).contiguous(),
                    tgt.narrow(0, r * local, local).contiguous())
                   .reshape({1})
                   .clone();
    ref_opt.zero_grad();
    Tensor ref_loss = ref->loss(idx, tgt);
    ref_loss.backward();
    ref_opt.step();
    pg->all_reduce(l, ReduceOp::kAvg)->wait();
    WCHECK(std::abs(l.item<double>() - ref_loss.item<double>()) < 1e-12, "step ", i, ": loss ",
           l.item<double>(), " vs one process ", ref_loss.item<double>());
    for (const auto& p : model->parameters()) WCHECK(p.dim() == 1, "a parameter is not a shard");
    expect_same_weights(*root, *ref, 1e-9, "compiled step " + std::to_string(i));
  }
  std::string reasons;
  for (const std::string& why : step.stats().recompile_reasons) reasons += "\n  " + why;
  // Traced twice: SGD's momentum buffers are made by the first call (state that outlives it).
  WCHECK(step.stats().misses == 2 && step.stats().hits == 2,
         "two compilations and two replays, got ", step.stats().misses, " and ", step.stats().hits,
         reasons);

  const compiler::Trace& trace = step.traces().back();
  const std::string listing = trace.str();
  std::vector<size_t> gathers, reduces, waits;
  size_t first_mm = trace.ops.size(), last_mm = 0;
  for (size_t k = 0; k < trace.ops.size(); ++k) {
    const std::string& name = trace.ops[k].name();
    if (name == "dist_all_gather_coalesced_") gathers.push_back(k);
    if (name == "dist_reduce_scatter_coalesced_") reduces.push_back(k);
    // The gathers write every parameter in its place, and the reduce-scatters read the full
    // gradients where they are: no packed collective, no copy out of a gather's buffer.
    WCHECK(name != "dist_all_gather_" && name != "dist_reduce_scatter_", "op ", k, " is ", name,
           ", a packed collective:\n", trace.str());
    if (name == "dist_wait_") waits.push_back(k);
    if (name == "mm") {
      first_mm = std::min(first_mm, k);
      last_mm = k;
    }
  }
  {
    // Nothing is copied out of a gather's buffer: the full parameters are views of it.
    const std::vector<int> cls = alias_classes(trace);
    std::unordered_set<int> gathered;
    for (size_t k : gathers) gathered.insert(cls[static_cast<size_t>(trace.ops[k].inputs[0])]);
    for (const compiler::BoundOp& op : trace.ops) {
      WCHECK(op.name() != "copy_" || op.inputs.size() != 2 || op.inputs[1] < 0 ||
                 !gathered.contains(cls[static_cast<size_t>(op.inputs[1])]),
             "a copy out of a gather's buffer:\n", listing);
    }
  }
  const size_t want_gathers = units + (zero3 ? blocks.size() : 0);
  WCHECK(gathers.size() == want_gathers, gathers.size(), " all-gathers in the trace, expected ",
         want_gathers, ":\n", listing);
  WCHECK(reduces.size() == units, reduces.size(), " reduce-scatters for ", units, " units:\n",
         listing);
  // Their buffers are values of the program (allocated by it, freed after their last reader), not
  // tensors it captured and would hold.
  for (size_t k : gathers) {
    const int v = trace.ops[k].inputs[0];  // the input is the packed shard, captured
    WCHECK(trace.roles[static_cast<size_t>(v)] == compiler::ValueRole::kOp, "an all-gather writes ",
           "a tensor captured by the program (p", v, "), not one of its values:\n", listing);
  }
  for (size_t k : reduces) {
    for (int v : trace.ops[k].inputs) {
      WCHECK(trace.roles[static_cast<size_t>(v)] == compiler::ValueRole::kOp, "a reduce-scatter ",
             "reads or writes a tensor captured by the program (p", v, "):\n", listing);
    }
  }
  WCHECK(waits.size() == gathers.size() + reduces.size(), waits.size(), " waits for ",
         gathers.size() + reduces.size(), " collectives");
  // The root, block 0 and block 1 (prefetched while block 0 computes) start before the first mm,
  // no other.
  size_t before_mm = 0;
  for (size_t g : gathers) before_mm += g < first_mm ? 1 : 0;
  WCHECK(before_mm == std::min<size_t>(3, units), before_mm, " all-gathers before the first mm:\n",
         listing);
  WCHECK(reduces.front() < last_mm,
         "the first reduce-scatter starts before the backward's last mm:\n", listing);
  if (zero3) {
    // The forward's gathers of the blocks (after the root's): their buffers and whatever was
    // copied out of them (the full parameters) are read by no op after the backward's first gather.
    const std::vector<int> cls = alias_classes(trace);
    std::unordered_set<int> forward_full;
    for (size_t b = 1; b <= blocks.size(); ++b) {
      forward_full.insert(cls[static_cast<size_t>(trace.ops[gathers[b]].inputs[0])]);
    }
    for (size_t k = 0; k < gathers[blocks.size() + 1]; ++k) {
      const compiler::BoundOp& op = trace.ops[k];
      if (op.name() == "copy_" && op.inputs.size() == 2 &&
          forward_full.contains(cls[static_cast<size_t>(op.inputs[1])])) {
        forward_full.insert(cls[static_cast<size_t>(op.inputs[0])]);
      }
    }
    const size_t backward_gather = gathers[blocks.size() + 1];
    for (size_t k = backward_gather; k < trace.ops.size(); ++k) {
      for (int v : trace.ops[k].inputs) {
        WCHECK(v < 0 || !forward_full.contains(cls[static_cast<size_t>(v)]), "op ", k, " (",
               trace.ops[k].name(), ") of the backward reads a block's forward gather:\n", listing);
      }
    }
  }
  if (r == 0) std::cout << listing << "\n";

  // A sharded checkpoint written after the compiled steps loads into a fresh sharded model.
  const std::string dir = "/tmp/kiln_fsdp_compiled_" + std::to_string(::getppid());
  root->save_sharded_checkpoint(dir);
  std::vector<std::shared_ptr<FSDPModule>> fresh_blocks;
  const auto fresh_made = make_sharded(99, fresh_blocks);
  models::GPT fresh = fresh_made.first;
  const std::shared_ptr<FSDPModule> fresh_root = fresh_made.second;
  fresh_root->load_sharded_checkpoint(dir);
  pg->barrier()->wait();
  if (r == 0) std::filesystem::remove_all(dir);
  const auto want = root->full_state_dict(/*rank0_only=*/false);
  const auto got = fresh_root->full_state_dict(/*rank0_only=*/false);
  for (const auto& [name, t] : want) expect_close(got.at(name), t, 0, "loaded " + name);
  models::set_block_hook(*fresh, {});
  models::set_block_hook(*model, {});
  std::cout << "rank " << r << ": compiled fsdp (zero" << (zero3 ? 3 : 2) << ") == one process, "
            << gathers.size() << " all-gathers, " << reduces.size() << " reduce-scatters\n";
}

// The compiled step with bf16 compute on f32 shards (the gathers in bf16, the reduce-scatters in
// f32) and two micro-batches inside it (the first without gradient sync: the summed gradients are a
// value of the program): the same as the eager FSDP step, on a second copy of the model. AdamW on
// the f32 shards (its fused kernel traces).
void fsdp_compiled_mixed() {
  auto pg = init_process_group("gloo", short_timeout(40000));
  const int r = pg->rank(), n = pg->size();
  const int64_t T = 16, micro = 2;
  FSDPOptions o;
  o.mp_policy = {kBFloat16, kFloat};
  auto make = [&](std::vector<std::shared_ptr<FSDPModule>>& blocks) {
    models::GPT m = make_gpt(13, kFloat);
    auto root = shard_per_block(m, pg, o, blocks);
    return std::make_pair(m, root);
  };
  std::vector<std::shared_ptr<FSDPModule>> blocks, eager_blocks;
  const auto made = make(blocks), eager_made = make(eager_blocks);
  models::GPT model = made.first, eager = eager_made.first;
  const std::shared_ptr<FSDPModule> root = made.second, eager_root = eager_made.second;
  optim::AdamW opt(model->parameters(), optim::AdamWOptions(3e-3).weight_decay(0.1));
  optim::AdamW eager_opt(eager->parameters(), optim::AdamWOptions(3e-3).weight_decay(0.1));
  auto train = [&](models::GPT& m, FSDPModule& fsdp, optim::AdamW& adam, const Tensor& x,
                   const Tensor& y) {
    adam.zero_grad();
    Tensor loss;
    for (int64_t k = 0; k < micro; ++k) {
      fsdp.set_requires_gradient_sync(k == micro - 1);
      Tensor part = fsdp.run([&] { return m->loss(x[k], y[k]) / static_cast<double>(micro); });
      part.backward();
      loss = loss.defined() ? loss + part.detach() : part.detach();
    }
    adam.step();
    return loss;
  };
  auto step = kiln::compile(
      [&](const Tensor& x, const Tensor& y) { return train(model, *root, opt, x, y); });
  manual_seed(17);
  for (int i = 0; i < 4; ++i) {
    Tensor idx = randint(0, 320, {n, micro, 1, T}), tgt = randint(0, 320, {n, micro, 1, T});
    const Tensor x = idx[r].contiguous(), y = tgt[r].contiguous();
    const double got = step(x, y).to(kDouble).item<double>();
    const double want = train(eager, *eager_root, eager_opt, x, y).to(kDouble).item<double>();
    WCHECK(std::abs(got - want) <= 1e-6 * std::abs(want), "step ", i, ": compiled loss ", got,
           " vs eager ", want);
    for (const auto& p : model->parameters()) {
      WCHECK(p.dtype() == kFloat && p.grad().dtype() == kFloat, "shards and grads stay f32");
    }
  }
  WCHECK(step.stats().misses == 2 && step.stats().hits == 2,
         "two compilations and two replays, got ", step.stats().misses, " and ", step.stats().hits);
  const std::string listing = step.traces().back().str();
  WCHECK(listing.find("dist_all_gather_coalesced_(") != std::string::npos &&
             listing.find("bf16[") != std::string::npos,
         "bf16 gathers in the trace:\n", listing);
  models::set_block_hook(*model, {});
  models::set_block_hook(*eager, {});
  const auto want = eager_root->full_state_dict(/*rank0_only=*/false);
  const auto got = root->full_state_dict(/*rank0_only=*/false);
  for (const auto& [name, t] : want) expect_close(got.at(name), t, 1e-6, "compiled " + name);
  std::cout << "rank " << r << ": compiled fsdp with bf16 compute and accumulation == eager\n";
}

// --- Memory: what a ZeRO-3 step keeps alive ----------------------------------------------------

// Counts the bytes of the CPU storages that are alive (the CPU allocator's cache not included) and
// their peak, wrapping the installed CPU allocator: each storage it hands out is one over the
// inner allocator's memory, whose deleter takes the bytes off.
class CountingAllocator final : public Allocator {
 public:
  explicit CountingAllocator(Allocator* inner) : inner_(inner) {}
  Storage allocate(size_t nbytes, Device device) override {
    Storage s = inner_->allocate(nbytes, device);
    void* data = s->data();
    const auto n = static_cast<int64_t>(nbytes);
    const int64_t now = live_.fetch_add(n) + n;
    for (int64_t p = peak_.load(); now > p && !peak_.compare_exchange_weak(p, now);) {
    }
    return std::make_shared<StorageImpl>(data, nbytes, device, [this, s, n](void*) mutable {
      s.reset();
      live_.fetch_sub(n);
    });
  }
  int64_t live() const { return live_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(live_.load()); }

 private:
  Allocator* inner_;
  std::atomic<int64_t> live_{0}, peak_{0};
};

// ZeRO-3 (per-block gathers, reshard after forward) on a Llama of 16 blocks whose parameters
// dominate the memory (d 256, 16 tokens): after the forward, what it holds beyond the same
// forward without sharding is the root's gathered parameters (no block's); the backward's peak
// above that stays a few units' worth, whatever the depth (each unit's gradients are packed and
// reduce-scattered, then let go: nothing full stays per unit); after the backward only the
// shards' gradients remain. The bytes counted are the CPU storages alive (CountingAllocator).
void fsdp_memory() {
  static auto* counter = new CountingAllocator(get_allocator(kCPU));  // outlives every storage
  set_allocator(kCPU, counter);
  auto pg = init_process_group("gloo", short_timeout(30000));
  const int r = pg->rank(), n = pg->size();
  const int64_t T = 16;
  const models::ModelConfig c = deep_tiny_llama();
  manual_seed(21);
  models::GPT ref(c, TensorOptions().dtype(kFloat));
  manual_seed(21);
  models::GPT model(c, TensorOptions().dtype(kFloat));
  FSDPOptions o;  // ZeRO-3
  std::vector<std::shared_ptr<FSDPModule>> blocks;
  auto root = shard_per_block(model, pg, o, blocks);
  const int64_t unit = blocks[0]->unsharded_numel() * 4;  // one block's full parameters, bytes
  const int64_t root_full = root->unsharded_numel() * 4;
  const int64_t shard_grads = shard_bytes(*root, blocks, 4);
  optim::AdamW opt(model->parameters(), optim::AdamWOptions(1e-3));
  manual_seed(22);
  for (int step = 0; step < 3; ++step) {
    Tensor idx = randint(0, 320, {1, T}), tgt = randint(0, 320, {1, T});
    // The same forward without sharding: its activations and logits.
    int64_t ref_forward = 0;
    {
      const int64_t before = counter->live();
      Tensor l = ref->loss(idx, tgt);
      ref_forward = counter->live() - before;
    }
    opt.zero_grad();
    // Gloo's thread lets go of a collective's tensors just after marking it done: a barrier
    // queued behind the last collective makes sure they are gone before each count.
    pg->barrier()->wait();
    const int64_t at_rest = counter->live();
    counter->reset_peak();
    Tensor loss = root->run([&] { return model->loss(idx, tgt); });
    pg->barrier()->wait();
    const int64_t after_forward = counter->live(), forward_peak = counter->peak() - at_rest;
    counter->reset_peak();
    loss.backward();
    const int64_t backward_peak = counter->peak() - after_forward;
    loss = Tensor();
    pg->barrier()->wait();
    const int64_t after_backward = counter->live() - at_rest;
    const double mb = 1 << 20;
    std::cout << "rank " << r << " step " << step << ": unit " << unit / mb << " MiB (x"
              << blocks.size() << "), root " << root_full / mb << " MiB; forward: peak +"
              << forward_peak / mb << ", after +" << (after_forward - at_rest) / mb
              << " (unsharded forward +" << ref_forward / mb << "); backward: peak +"
              << backward_peak / mb << " MiB (shard grads + "
              << static_cast<double>(backward_peak - shard_grads) / unit << " units), after +"
              << after_backward / mb << " (shard grads " << shard_grads / mb << ")\n";
    if (n == 1) continue;  // one rank: nothing is sharded, the bounds below are for shards
    WCHECK(after_forward - at_rest <= ref_forward + root_full + unit / 8, "step ", step,
           ": after the forward ", after_forward - at_rest, " bytes are alive, more than the ",
           "unsharded forward's ", ref_forward, " + the root's gathered ", root_full,
           " (a block's gathered parameters outlive its forward)");
    // Beyond the shards' gradients (which accumulate unit by unit): the unit being computed,
    // the next one's prefetch, its full gradients, their packed copy and Gloo's copy of that.
    WCHECK(backward_peak - shard_grads <= 6 * unit, "step ", step, ": the backward's peak is ",
           backward_peak, " bytes above the forward's end, ",
           static_cast<double>(backward_peak - shard_grads) / unit, " units of ", unit,
           " bytes beyond the shards' gradients (at most 6 expected: something full stays per ",
           "unit)");
    WCHECK(after_backward <= shard_grads + unit / 8, "step ", step, ": after the backward ",
           after_backward, " bytes more are alive than before the forward; the shards' ",
           "gradients take ", shard_grads);
    opt.step();
  }
  models::set_block_hook(*model, {});
  std::cout << "rank " << r << ": fsdp memory within bounds\n";
}

const test::Scenarios& scenarios() {
  static const test::Scenarios m = {
      {"fsdp_mlp", fsdp_mlp},
      {"fsdp_no_sync", fsdp_no_sync},
      {"fsdp_llama", fsdp_llama},
      {"fsdp_llama_per_unit", fsdp_llama_per_unit},
      {"fsdp_mixed_precision", fsdp_mixed_precision},
      {"fsdp_checkpoint_save", fsdp_checkpoint_save},
      {"fsdp_checkpoint_load", fsdp_checkpoint_load},
      {"fsdp_errors", fsdp_errors},
      {"fsdp_compiled", fsdp_compiled},
      {"fsdp_compiled_mixed", fsdp_compiled_mixed},
      {"fsdp_memory", fsdp_memory},
  };
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  return kiln::test::run_worker("fsdp_worker", scenarios(), argc, argv);
}
