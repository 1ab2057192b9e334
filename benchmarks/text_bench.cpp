// kiln::text::Tokenizer throughput on the bundled corpus (tiny Shakespeare, 1.1 MB), for a
// byte-level (Llama 3 style) and a SentencePiece-style (Llama 2 style) BPE tokenizer trained by
// the tokenizers library (tests/text/data/). benchmarks/text_bench.py times the library on the
// same text and prints both side by side.
//
//   build/benchmarks/kiln_bench --benchmark_filter=Tokenizer
//
//   Corpus:     the whole corpus as one text, one thread (the SentencePiece-style files have no
//               pre-tokenizer, so there it is one 1.1 MB word: lines are the fair measure)
//   Lines:      its 40,000 lines one by one, one thread
//   Batch/N:    encode_batch over the lines on N threads
#include <benchmark/benchmark.h>

#include <string>
#include <vector>

#include "nn/safetensors.h"
#include "tensor/parallel.h"
#include "text/tokenizer.h"

namespace {

const std::string& corpus() {
  static const std::string text =
      kiln::read_file(std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt");
  return text;
}

// The corpus split after each '\n' (the newline stays with its line), as text_bench.py does.
const std::vector<std::string>& lines() {
  static const std::vector<std::string> all = [] {
    std::vector<std::string> out;
    const std::string& text = corpus();
    size_t start = 0;
    while (start < text.size()) {
      size_t end = text.find('\n', start);
      end = end == std::string::npos ? text.size() : end + 1;
      out.push_back(text.substr(start, end - start));
      start = end;
    }
    return out;
  }();
  return all;
}

const kiln::text::Tokenizer& tokenizer(int64_t which) {
  static const kiln::text::Tokenizer llama3 = kiln::text::Tokenizer::from_file(
      std::string(KILN_SOURCE_DIR) + "/tests/text/data/llama3.json");
  static const kiln::text::Tokenizer llama2 = kiln::text::Tokenizer::from_file(
      std::string(KILN_SOURCE_DIR) + "/tests/text/data/llama2.json");
  return which == 0 ? llama3 : llama2;
}

void set_counters(benchmark::State& state, size_t tokens) {
  const double n = static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(corpus().size() * state.iterations()));
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(tokens) * n, benchmark::Counter::kIsRate);
  state.SetLabel(state.range(0) == 0 ? "llama3 (byte-level)" : "llama2 (SentencePiece-style)");
}

void BM_TokenizerCorpus(benchmark::State& state) {
  const auto& tok = tokenizer(state.range(0));
  size_t tokens = 0;
  for (auto _ : state) {
    const auto ids = tok.encode(corpus(), /*add_special_tokens=*/false);
    tokens = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  set_counters(state, tokens);
}
BENCHMARK(BM_TokenizerCorpus)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TokenizerLines(benchmark::State& state) {
  const auto& tok = tokenizer(state.range(0));
  size_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const std::string& line : lines()) tokens += tok.encode(line, false).size();
  }
  set_counters(state, tokens);
}
BENCHMARK(BM_TokenizerLines)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_TokenizerBatch(benchmark::State& state) {
  const auto& tok = tokenizer(state.range(0));
  const int threads = kiln::get_num_threads();
  kiln::set_num_threads(static_cast<int>(state.range(1)));
  size_t tokens = 0;
  for (auto _ : state) {
    const auto ids = tok.encode_batch(lines(), false);
    tokens = 0;
    for (const auto& v : ids) tokens += v.size();
  }
  kiln::set_num_threads(threads);
  set_counters(state, tokens);
}
BENCHMARK(BM_TokenizerBatch)
    ->ArgsProduct({{0, 1}, {1, 2}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
