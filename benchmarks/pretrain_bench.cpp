// Pretraining data throughput per worker (one ShardLoader on one thread), against the 90,000
// tokens/s per worker of IBM's loader for torch (issue 20's anchor).
//
//   build/benchmarks/kiln_bench --benchmark_filter=Shard
//
//   ShardLoaderNext/T/B:     loader.next(): B random windows of T + 1 tokens (pread) from 4
//                            u16 shards (64 M tokens, 128 MB, in the page cache) into two fresh
//                            int64 [B, T] tensors; tokens/s counts B x T per call
//   ShardLoaderNextU32/T/B:  the same from u32 shards (vocab > 65536)
//   ShardOpenVerify:         ShardFile::open with verify (checksum and id range) of one 16 M token
//                            shard: the cost of validating data at the start of a run
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "pretrain/loader.h"
#include "pretrain/shard.h"

namespace {

namespace fs = std::filesystem;

constexpr int64_t kShardTokens = int64_t{16} << 20;

// Four shards of pseudo-random ids, written once per process under the temporary directory and
// removed at exit.
struct Shards {
  fs::path dir;
  std::shared_ptr<const kiln::pretrain::ShardSet> set;
  Shards(int64_t vocab_size, const std::string& tag) {
    dir = fs::temp_directory_path() /
          ("kiln_pretrain_bench_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    fs::create_directories(dir);
    uint64_t x = 88172645463325252ull;
    std::vector<int64_t> ids(static_cast<size_t>(kShardTokens));
    for (int s = 0; s < 4; ++s) {
      for (auto& id : ids) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        id = static_cast<int64_t>(x % static_cast<uint64_t>(vocab_size));
      }
      kiln::pretrain::ShardWriter w((dir / ("shard-" + std::to_string(s) + ".tokens")).string(),
                                    {.vocab_size = vocab_size});
      w.append_document(ids);
      w.finish();
    }
    set = std::make_shared<kiln::pretrain::ShardSet>(kiln::pretrain::ShardSet::open(dir.string()));
  }
  ~Shards() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
};

const Shards& shards(bool u32) {
  static const Shards u16_shards(50304, "u16");
  if (!u32) return u16_shards;
  static const Shards u32_shards(128256, "u32");
  return u32_shards;
}

void run_loader(benchmark::State& state, bool u32) {
  const int64_t seq = state.range(0), batch = state.range(1);
  kiln::pretrain::ShardLoader loader(shards(u32).set,
                                     {.seq_len = seq, .batch_size = batch, .seed = 1});
  for (auto _ : state) {
    auto xy = loader.next();
    benchmark::DoNotOptimize(xy);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(seq * batch) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}

void BM_ShardLoaderNext(benchmark::State& state) { run_loader(state, false); }
void BM_ShardLoaderNextU32(benchmark::State& state) { run_loader(state, true); }
BENCHMARK(BM_ShardLoaderNext)
    ->Args({1024, 8})
    ->Args({2048, 4})
    ->Args({4096, 1})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ShardLoaderNextU32)->Args({2048, 4})->Unit(benchmark::kMicrosecond);

void BM_ShardOpenVerify(benchmark::State& state) {
  const std::string path = shards(false).set->operator[](0).path();
  for (auto _ : state) {
    auto f = kiln::pretrain::ShardFile::open(path, /*verify=*/true);
    benchmark::DoNotOptimize(f);
  }
  state.SetBytesProcessed(state.iterations() * kShardTokens * 2);
}
BENCHMARK(BM_ShardOpenVerify)->Unit(benchmark::kMillisecond);

}  // namespace
