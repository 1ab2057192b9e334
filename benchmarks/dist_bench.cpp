// dist: Gloo collectives and FSDP between ranks that are threads of this process (BM_GlooAllReduce,
// BM_FsdpTinyLlamaStep, further down). Gloo all-reduce between 2 ranks of this process (a helper
// thread is rank 1) over loopback TCP, f32 sum, in place: time per collective and algorithm
// bandwidth (bytes reduced per second). Each run builds its own pair of groups; the helper reduces
// until rank 0 raises a stop flag carried in the last element, so both ranks run the same number of
// collectives whatever iteration count the library picks.
#include <benchmark/benchmark.h>

#include <thread>

#include "dist/fsdp.h"
#include "dist/process_group_gloo.h"
#include "models/gpt.h"
#include "nn/optim/adamw.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace {

using namespace kiln;
using namespace kiln::dist;

void BM_GlooAllReduce(benchmark::State& state) {
  const int64_t n = state.range(0);
  TCPStoreOptions so;
  so.port = 0;
  so.is_server = true;
  so.timeout = std::chrono::seconds(30);
  auto server = std::make_shared<TCPStore>("127.0.0.1", so);
  ProcessGroupGlooOptions go;
  go.timeout = std::chrono::seconds(30);
  go.hostname = "127.0.0.1";
  std::thread helper([&, port = server->port()] {
    TCPStoreOptions co = so;
    co.is_server = false;
    co.port = port;
    auto store = std::make_shared<TCPStore>("127.0.0.1", co);
    ProcessGroupGloo pg(store, 1, 2, go);
    Tensor t = zeros({n + 1});
    for (;;) {
      t.zero_();
      pg.all_reduce(t)->wait();
      if (t[n].item<float>() != 0) break;
    }
  });
  {
    ProcessGroupGloo pg(server, 0, 2, go);
    Tensor t = zeros({n + 1});
    for (auto _ : state) {
      pg.all_reduce(t)->wait();
      benchmark::DoNotOptimize(t.data_ptr());
    }
    t.fill_(1);  // stop the helper
    pg.all_reduce(t)->wait();
    helper.join();
  }
  state.SetBytesProcessed(state.iterations() * n * 4);
}
BENCHMARK(BM_GlooAllReduce)
    ->Arg(1 << 10)
    ->Arg(1 << 16)
    ->Arg(1 << 20)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// FSDP: one AdamW training step of the tiny Llama (f32, batch 4 x 64 tokens per rank) with every
// block and the root fully_shard-ed over 2 ranks of this process (threads over loopback Gloo),
// against the same step of the unsharded model on one rank's batch (BM_TinyLlamaStep). The
// difference is what sharding costs here: the all-gathers, reduce-scatters and copies (the two
// ranks also share the machine's cores). A fixed number of iterations, which the helper rank runs
// too.
constexpr int kFsdpSteps = 5;

struct LlamaStep {
  models::GPT model;
  Tensor idx, tgt;
};

LlamaStep make_llama_step(uint64_t seed) {
  manual_seed(seed);
  LlamaStep s{models::GPT(models::ModelConfig::from_name("tiny-llama")), Tensor(), Tensor()};
  s.idx = randint(0, 320, {4, 64});
  s.tgt = randint(0, 320, {4, 64});
  return s;
}

void fsdp_rank(LlamaStep& s, std::shared_ptr<ProcessGroup> pg, benchmark::State* state) {
  for (size_t l = 0; l < s.model->h->size(); ++l) fully_shard(s.model->h[l], pg);
  auto root = fully_shard(s.model, pg);
  optim::AdamW opt(s.model->parameters(), 1e-3);
  auto step = [&] {
    opt.zero_grad();
    Tensor loss = root->run([&] { return s.model->loss(s.idx, s.tgt); });
    loss.backward();
    opt.step();
  };
  step();  // first-use costs (RoPE tables, optimizer state)
  if (state != nullptr) {
    for (auto _ : *state) step();
  } else {
    for (int i = 0; i < kFsdpSteps; ++i) step();
  }
}

void BM_FsdpTinyLlamaStep(benchmark::State& state) {
  TCPStoreOptions so;
  so.port = 0;
  so.is_server = true;
  so.timeout = std::chrono::seconds(60);
  auto server = std::make_shared<TCPStore>("127.0.0.1", so);
  ProcessGroupGlooOptions go;
  go.timeout = std::chrono::seconds(60);
  go.hostname = "127.0.0.1";
  LlamaStep mine = make_llama_step(1), theirs = make_llama_step(2);
  std::thread helper([&, port = server->port()] {
    TCPStoreOptions co = so;
    co.is_server = false;
    co.port = port;
    auto store = std::make_shared<TCPStore>("127.0.0.1", co);
    fsdp_rank(theirs, std::make_shared<ProcessGroupGloo>(store, 1, 2, go), nullptr);
  });
  fsdp_rank(mine, std::make_shared<ProcessGroupGloo>(server, 0, 2, go), &state);
  helper.join();
  state.SetItemsProcessed(state.iterations() * 4 * 64);
}
BENCHMARK(BM_FsdpTinyLlamaStep)
    ->Iterations(kFsdpSteps)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_TinyLlamaStep(benchmark::State& state) {
  LlamaStep s = make_llama_step(1);
  optim::AdamW opt(s.model->parameters(), 1e-3);
  auto step = [&] {
    opt.zero_grad();
    s.model->loss(s.idx, s.tgt).backward();
    opt.step();
  };
  step();
  for (auto _ : state) step();
  state.SetItemsProcessed(state.iterations() * 4 * 64);
}
BENCHMARK(BM_TinyLlamaStep)->Iterations(kFsdpSteps)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
