// dist: Gloo all-reduce between 2 ranks of this process (a helper thread is rank 1) over
// loopback TCP, f32 sum, in place: time per collective and algorithm bandwidth (bytes reduced per
// second). Each run builds its own pair of groups; the helper reduces until rank 0 raises a stop
// flag carried in the last element, so both ranks run the same number of collectives whatever
// iteration count the library picks.
#include <benchmark/benchmark.h>

#include <thread>

#include "dist/process_group_gloo.h"
#include "tensor/ops.h"

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

}  // namespace
