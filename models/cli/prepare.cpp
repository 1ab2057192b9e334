// `kiln prepare`: text and JSONL files -> token shards (pretrain/prepare.h). main.cpp dispatches
// here; this file parses the command's own flags.
#include "models/cli/prepare.h"

#include <algorithm>
#include <charconv>
#include <iomanip>
#include <iostream>
#include <optional>

#include "pretrain/prepare.h"
#include "tensor/parallel.h"

namespace kiln::cli {
namespace {

const char* const kPrepareUsage = R"(usage: kiln prepare [flags] INPUT...
  turn text and JSONL files into token shards for `kiln pretrain --data DIR` (docs/data.md)
  INPUT                        files or directories (their .txt, .md, .jsonl files, recursively);
                               a text file is one document, a .jsonl line is one
      --out DIR                the shard directory to create (must not exist or be empty)
      --tokenizer FILE|byte    a Hugging Face tokenizer.json, or byte (default: byte)
      --field NAME             the text field of each JSONL object (default: text)
      --shard-tokens N         tokens per shard (default: 100000000)
      --eos ID|none            the id after each document (default: the tokenizer's eos;
                               the byte tokenizer has none)
      --threads N              encoding threads (default: kiln's, all cores)
      --no-progress            plain lines even on a terminal
)";

struct Usage {
  std::string message;
};

int64_t to_int(const std::string& flag, const std::string& s, int64_t min) {
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
    throw Usage{"--" + flag + ": '" + s + "' is not an integer"};
  }
  if (v < min) throw Usage{"--" + flag + " must be >= " + std::to_string(min) + ", got " + s};
  return v;
}

}  // namespace

int run_prepare_command(const std::vector<std::string>& args) {
  pretrain::PrepareOptions o;
  try {
    std::vector<std::string> seen;
    for (size_t i = 0; i < args.size(); ++i) {
      std::string arg = args[i];
      if (arg.rfind("--", 0) != 0) {
        o.inputs.push_back(arg);
        continue;
      }
      std::optional<std::string> value;
      if (const size_t eq = arg.find('='); eq != std::string::npos) {
        value = arg.substr(eq + 1);
        arg = arg.substr(0, eq);
      }
      const std::string name = arg.substr(2);
      if (std::find(seen.begin(), seen.end(), name) != seen.end()) {
        throw Usage{"--" + name + " given twice"};
      }
      seen.push_back(name);
      if (name == "help") {
        std::cout << kPrepareUsage;
        return 0;
      }
      if (name == "no-progress") {
        if (value) throw Usage{"--no-progress takes no value"};
        o.progress_bar = false;
        continue;
      }
      if (name != "out" && name != "tokenizer" && name != "field" && name != "shard-tokens" &&
          name != "eos" && name != "threads") {
        throw Usage{"unknown flag --" + name};
      }
      if (!value) {
        if (i + 1 >= args.size()) throw Usage{"--" + name + " needs a value"};
        value = args[++i];
      }
      if (name == "out") {
        o.out_dir = *value;
      } else if (name == "tokenizer") {
        o.tokenizer = *value;
      } else if (name == "field") {
        o.field = *value;
      } else if (name == "shard-tokens") {
        o.shard_tokens = to_int(name, *value, 1);
      } else if (name == "eos") {
        o.eos_id = *value == "none" ? -1 : to_int(name, *value, 0);
      } else {
        set_num_threads(static_cast<int>(to_int(name, *value, 1)));
      }
    }
    if (o.inputs.empty()) throw Usage{"prepare needs at least one INPUT file or directory"};
    if (o.out_dir.empty()) throw Usage{"prepare needs --out DIR"};
  } catch (const Usage& e) {
    std::cerr << "kiln prepare: " << e.message << "\n\n" << kPrepareUsage;
    return 2;
  }
  const pretrain::PrepareSummary s = pretrain::prepare(o, std::cout);
  std::cout << std::fixed << std::setprecision(1) << "done: " << s.documents
            << (s.documents == 1 ? " document, " : " documents, ") << s.tokens << " tokens in "
            << s.shards << (s.shards == 1 ? " shard" : " shards") << " (" << s.files << " files, "
            << s.bytes << " bytes) in " << s.seconds << " s, " << std::setprecision(0)
            << static_cast<double>(s.tokens) / std::max(s.seconds, 1e-9) << " tokens/s -> "
            << o.out_dir << "\n"
            << "train on it: kiln pretrain --data " << o.out_dir << "\n";
  return 0;
}

const char* prepare_usage() { return kPrepareUsage; }

}  // namespace kiln::cli
