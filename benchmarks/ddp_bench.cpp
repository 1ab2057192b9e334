// dist: what DistributedDataParallel (dist/ddp.h) adds to a training step's forward and backward
// by itself (the hooks, the copies into and out of the buckets, the bookkeeping): over a group of
// one rank whose collectives do nothing, so that neither a network nor a backend's own passes
// over the data (Gloo's kAvg divides after summing) show. A stack of six Linear(1024, 1024), f32,
// batch 16, zero_grad() to undefined before each step, as kiln pretrain does. Run it with
// OMP_NUM_THREADS=1 on a shared machine.
//
//   BM_DdpStep/mode:0  no DDP: the baseline
//   BM_DdpStep/mode:1  gradient_as_bucket_view off: every gradient copied in and back out
//   BM_DdpStep/mode:2  gradient_as_bucket_view on (the default): copied in once, no copy out
//   BM_DdpStep/mode:3  on, with buckets of 1 MiB: every weight alone in its bucket, reduced in
//                      its own grad(), no copy at all
#include <benchmark/benchmark.h>

#include <optional>

#include "dist/ddp.h"
#include "dist/process_group.h"
#include "nn/modules/container.h"
#include "nn/modules/linear.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace {

using namespace kiln;
using namespace kiln::dist;

// One rank; every collective is done at once (the identity at world size 1).
class NullGroup final : public ProcessGroup {
 public:
  NullGroup() : ProcessGroup(0, 1) {}
  std::string backend_name() const override { return "null"; }
  std::shared_ptr<Work> all_reduce(Tensor&, ReduceOp) override { return done("all_reduce"); }
  std::shared_ptr<Work> broadcast(Tensor&, int) override { return done("broadcast"); }
  std::shared_ptr<Work> all_gather_into_tensor(Tensor&, const Tensor&) override { unused(); }
  std::shared_ptr<Work> all_gather(std::vector<Tensor>&, const Tensor&) override { unused(); }
  std::shared_ptr<Work> reduce_scatter_tensor(Tensor&, const Tensor&, ReduceOp) override {
    unused();
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
  [[noreturn]] static void unused() { KILN_FAIL("[NullGroup] not used by DDP"); }
};

enum Mode { kPlain, kCopies, kViews, kViewsSolo };

void BM_DdpStep(benchmark::State& state) {
  const auto mode = static_cast<Mode>(state.range(0));
  auto pg = std::make_shared<NullGroup>();
  manual_seed(0);
  nn::Sequential net;
  for (int l = 0; l < 6; ++l) net->push_back(nn::Linear(1024, 1024));
  std::optional<DistributedDataParallel<nn::Sequential>> ddp;
  if (mode != kPlain) {
    DDPOptions o;
    o.gradient_as_bucket_view = mode != kCopies;
    if (mode == kViewsSolo) o.bucket_cap_mb = 1;
    ddp.emplace(net, pg, o);
  }
  const Tensor x = randn({16, 1024});
  for (auto _ : state) {
    net->zero_grad();
    Tensor out = ddp ? (*ddp)(x) : net->forward(x);
    out.square().mean().backward();
    benchmark::DoNotOptimize(net->parameters()[0].grad().data_ptr());
  }
}
BENCHMARK(BM_DdpStep)
    ->ArgName("mode")
    ->Arg(kPlain)
    ->Arg(kCopies)
    ->Arg(kViews)
    ->Arg(kViewsSolo)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
