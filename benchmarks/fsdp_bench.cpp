// dist: what fully_shard (dist/fsdp.h) adds to a training step's forward and backward by itself
// (the copies into and out of the collectives' buffers, the allocations, the hooks), at world size
// 2 over a group whose collectives are plain copies in this process (an all-gather writes the
// input into every slot, a reduce-scatter takes its rank's slot), so that neither a network nor a
// backend shows. Six Linear(1024, 1024), each a unit, f32, batch 16, zero_grad() to undefined
// before each step. Run it with OMP_NUM_THREADS=1 on a shared machine.
//
//   BM_FsdpStep/mode:0  no FSDP: the baseline
//   BM_FsdpStep/mode:1  ZeRO-3: gathered for forward, freed, gathered again in backward
//   BM_FsdpStep/mode:2  ZeRO-2: gathered once, kept until the unit's backward
#include <benchmark/benchmark.h>

#include <memory>

#include "dist/fsdp.h"
#include "dist/process_group.h"
#include "nn/modules/container.h"
#include "nn/modules/linear.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace {

using namespace kiln;
using namespace kiln::dist;

// Rank 0 of `world`; every collective done at once, as copies within this process.
class CopyGroup final : public ProcessGroup {
 public:
  explicit CopyGroup(int world) : ProcessGroup(0, world) {}
  std::string backend_name() const override { return "copy"; }
  std::shared_ptr<Work> all_reduce(Tensor&, ReduceOp) override { return done("all_reduce"); }
  std::shared_ptr<Work> broadcast(Tensor&, int) override { return done("broadcast"); }
  std::shared_ptr<Work> all_gather_into_tensor(Tensor& out, const Tensor& in) override {
    const int64_t n = in.numel();
    for (int r = 0; r < size(); ++r) out.reshape({-1}).narrow(0, r * n, n).copy_(in.reshape({-1}));
    return done("all_gather_into_tensor");
  }
  std::shared_ptr<Work> all_gather(std::vector<Tensor>&, const Tensor&) override { unused(); }
  std::shared_ptr<Work> reduce_scatter_tensor(Tensor& out, const Tensor& in, ReduceOp) override {
    const int64_t n = out.numel();
    out.reshape({-1}).copy_(in.reshape({-1}).narrow(0, rank() * n, n));
    return done("reduce_scatter_tensor");
  }
  std::shared_ptr<Work> reduce_scatter(Tensor&, const std::vector<Tensor>&, ReduceOp) override {
    unused();
  }
  std::shared_ptr<Work> barrier() override { return done("barrier"); }
  std::shared_ptr<Work> send(const Tensor&, int, int) override { unused(); }
  std::shared_ptr<Work> recv(Tensor&, int, int) override { unused(); }

 private:
  static std::shared_ptr<Work> done(const char* op) {
    auto w = std::make_shared<Work>(op);
    w->finish();
    return w;
  }
  [[noreturn]] static void unused() { KILN_FAIL("[CopyGroup] not used by FSDP's step"); }
};

enum Mode { kPlain, kZero3, kZero2 };

void BM_FsdpStep(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  manual_seed(0);
  nn::Sequential net;
  for (int l = 0; l < 6; ++l) net->push_back(nn::Linear(1024, 1024));
  std::shared_ptr<FSDPModule> root;
  if (mode != kPlain) {
    auto pg = std::make_shared<CopyGroup>(2);
    FSDPOptions o;
    o.reshard_after_forward = mode == kZero3;
    for (size_t l = 0; l < net->size(); ++l) fully_shard(net->ptr(l), pg, o);
    root = fully_shard(net, pg, o);
  }
  const Tensor x = randn({16, 1024});
  for (auto _ : state) {
    net->zero_grad();
    Tensor out = root ? root->run([&] { return net->forward(x); }) : net->forward(x);
    out.square().mean().backward();
    benchmark::DoNotOptimize(net->parameters()[0].grad().data_ptr());
  }
}
BENCHMARK(BM_FsdpStep)->ArgName("mode")->DenseRange(0, 2)->Unit(benchmark::kMillisecond);

}  // namespace
