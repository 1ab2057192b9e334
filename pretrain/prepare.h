// kiln::pretrain::prepare: text and JSONL files -> token shards (pretrain/shard.h), what
// `kiln prepare` runs. docs/data.md has the user's guide.
//
//   kiln::pretrain::PrepareOptions o;
//   o.inputs = {"corpus/"};                 // files, or directories searched recursively
//   o.tokenizer = "llama3/tokenizer.json";  // or "byte"
//   o.out_dir = "data/shards";
//   auto s = kiln::pretrain::prepare(o, std::cout);   // s.tokens, s.documents, s.shards
//
// Documents: a text file (any extension but .jsonl) is one document; a .jsonl file holds one
// JSON object per line and `field` (default "text", a string) of each is a document (blank lines
// are skipped). A directory contributes its .txt, .md and .jsonl files, recursively, in name
// order. Each document is encoded without the tokenizer's special tokens and followed by the
// EOS id (the tokenizer's eos_id(), or PrepareOptions::eos_id; the byte tokenizer has none, so
// its documents are joined without a separator unless eos_id is given).
//
// The texts are encoded in parallel (Tokenizer::encode_batch, kiln's threads) in batches of
// about batch_bytes; the ids go to the shards in input order, so the output does not depend on
// the thread count. A shard is closed once it holds shard_tokens tokens (documents are never
// split, so a shard may exceed it by one document).
//
// The output appears whole or not at all: the shards and prepare.json (what was prepared, with
// which tokenizer) are written into a temporary directory beside out_dir, renamed to out_dir at
// the end. out_dir must not exist or be empty.
//
// Errors are kiln::Error "[prepare] ..." naming the file (and line for JSONL): a missing input, a
// line that is no JSON object or lacks the field, invalid UTF-8 for a tokenizer.json, an
// existing non-empty out_dir.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace kiln::pretrain {

struct PrepareOptions {
  std::vector<std::string> inputs;
  std::string out_dir;
  std::string tokenizer = "byte";  // a tokenizer.json, or "byte" (kiln's byte tokenizer)
  std::string field = "text";      // of each JSONL object
  int64_t shard_tokens = 100'000'000;
  std::optional<int64_t> eos_id;  // default: the tokenizer's; -1: none
  int64_t batch_bytes = 4 << 20;  // text encoded per parallel batch
  // nullopt: a bar when the log is a terminal (Progress::is_terminal), plain lines otherwise.
  std::optional<bool> progress_bar;
};

struct PrepareSummary {
  int64_t files = 0;
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;  // of input text
  int64_t shards = 0;
  int64_t vocab_size = 0;
  int64_t eos_id = -1;
  uint64_t tokenizer_fingerprint = 0;
  double seconds = 0;
};

PrepareSummary prepare(const PrepareOptions& options, std::ostream& log);

}  // namespace kiln::pretrain
