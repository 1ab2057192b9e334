// Text and JSONL files -> token shards (pretrain/prepare.h). Tests:
// tests/pretrain/prepare_test.cpp.
#include "pretrain/prepare.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "models/tokenizer.h"
#include "nn/json.h"
#include "nn/safetensors.h"
#include "pretrain/progress.h"
#include "pretrain/shard.h"
#include "tensor/error.h"
#include "tensor/parallel.h"
#include "text/tokenizer.h"

namespace kiln::pretrain {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

bool is_jsonl(const fs::path& p) { return p.extension() == ".jsonl"; }

// The inputs, directories expanded (recursively, .txt/.md/.jsonl files in name order).
std::vector<fs::path> expand_inputs(const std::vector<std::string>& inputs) {
  KILN_CHECK(!inputs.empty(), "[prepare] no input files");
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    const auto st = fs::status(in, ec);
    KILN_CHECK(fs::exists(st), "[prepare] ", in, ": no such file or directory");
    if (fs::is_directory(st)) {
      std::vector<fs::path> found;
      for (const auto& e : fs::recursive_directory_iterator(in)) {
        const auto ext = e.path().extension();
        if (e.is_regular_file() && (ext == ".txt" || ext == ".md" || ext == ".jsonl")) {
          found.push_back(e.path());
        }
      }
      KILN_CHECK(!found.empty(), "[prepare] ", in, ": no .txt, .md or .jsonl files in it");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      KILN_CHECK(fs::is_regular_file(st), "[prepare] ", in, ": not a regular file");
      files.emplace_back(in);
    }
  }
  return files;
}

// The tokenizer: a tokenizer.json, or kiln's byte tokenizer.
class Encoder {
 public:
  explicit Encoder(const std::string& spec) {
    if (spec == "byte") {
      vocab_size_ = models::ByteTokenizer::kVocabSize;
      fingerprint_ = kByteTokenizerFingerprint;
      name_ = "byte";
      return;
    }
    const std::string json = read_file(spec, "prepare");
    tok_.emplace(text::Tokenizer::from_json(json, spec));
    vocab_size_ = tok_->vocab_size();
    eos_id_ = tok_->eos_id().value_or(-1);
    fingerprint_ = tokenizer_fingerprint(json);
    name_ = spec;
  }

  bool needs_utf8() const { return tok_.has_value(); }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t eos_id() const { return eos_id_; }
  uint64_t fingerprint() const { return fingerprint_; }
  const std::string& name() const { return name_; }

  std::vector<std::vector<int64_t>> encode(const std::vector<std::string>& docs) const {
    if (tok_) return tok_->encode_batch(docs, /*add_special_tokens=*/false);
    std::vector<std::vector<int64_t>> out(docs.size());
    internal::parallel_for(0, static_cast<int64_t>(docs.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const std::string& d = docs[static_cast<size_t>(i)];
        out[static_cast<size_t>(i)].assign(
            reinterpret_cast<const unsigned char*>(d.data()),
            reinterpret_cast<const unsigned char*>(d.data()) + d.size());
      }
    });
    return out;
  }

 private:
  std::optional<text::Tokenizer> tok_;
  int64_t vocab_size_ = 0;
  int64_t eos_id_ = -1;
  uint64_t fingerprint_ = 0;
  std::string name_;
};

std::string jsonl_field(const std::string& line, const std::string& field,
                        const std::string& where) {
  try {
    nn::JsonReader r(line);
    KILN_CHECK(r.peek_kind() == '{', "[prepare] ", where, ": expected a JSON object per line");
    r.begin_object();
    std::optional<std::string> value;
    while (auto key = r.next_key()) {
      if (*key == field && !value) {
        KILN_CHECK(r.peek_kind() == '"', "[prepare] ", where, ": \"", field, "\" is not a string");
        value = r.read_string();
      } else {
        r.skip_value();
      }
    }
    r.end_document();
    KILN_CHECK(value.has_value(), "[prepare] ", where, ": no \"", field, "\" field");
    return *value;
  } catch (const nn::JsonError& e) {
    KILN_FAIL("[prepare] ", where, ": ", e.what());
  }
}

std::string shard_name(int64_t i) {
  std::ostringstream s;
  s << "shard-" << std::setw(5) << std::setfill('0') << i << kShardExtension;
  return s.str();
}

// Writes the shards in order, closing each at shard_tokens.
class ShardSink {
 public:
  ShardSink(fs::path dir, ShardMeta meta, int64_t shard_tokens, Progress& progress)
      : dir_(std::move(dir)), meta_(meta), shard_tokens_(shard_tokens), progress_(progress) {}

  void add(const std::vector<int64_t>& ids) {
    if (!writer_) {
      writer_ = std::make_unique<ShardWriter>((dir_ / shard_name(shards_)).string(), meta_);
    }
    writer_->append_document(ids);
    if (writer_->num_tokens() >= shard_tokens_) close();
  }

  void close() {
    if (!writer_) return;
    const ShardMeta m = writer_->finish();
    writer_.reset();
    std::ostringstream s;
    s << shard_name(shards_) << ": " << m.num_tokens << " tokens, " << m.num_documents
      << " documents";
    progress_.line(s.str());
    ++shards_;
  }
  int64_t shards() const { return shards_; }

 private:
  fs::path dir_;
  ShardMeta meta_;
  int64_t shard_tokens_;
  Progress& progress_;
  std::unique_ptr<ShardWriter> writer_;
  int64_t shards_ = 0;
};

// Removes the temporary output directory unless released.
struct TempDir {
  fs::path path;
  bool keep = false;
  ~TempDir() {
    std::error_code ec;
    if (!keep) fs::remove_all(path, ec);
  }
};

}  // namespace

PrepareSummary prepare(const PrepareOptions& o, std::ostream& log) {
  const auto t0 = Clock::now();
  KILN_CHECK(!o.out_dir.empty(), "[prepare] no output directory given");
  KILN_CHECK(o.shard_tokens > 0, "[prepare] shard_tokens must be positive, got ", o.shard_tokens);
  KILN_CHECK(o.batch_bytes > 0, "[prepare] batch_bytes must be positive, got ", o.batch_bytes);
  KILN_CHECK(!o.field.empty(), "[prepare] the JSONL field name is empty");
  fs::path out = fs::path(o.out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "dir/"
  {
    std::error_code ec;
    const auto st = fs::status(out, ec);
    KILN_CHECK(!fs::exists(st) || (fs::is_directory(st) && fs::is_empty(out)), "[prepare] ",
               o.out_dir, ": already exists and is not an empty directory (prepare writes a new ",
               "shard directory; remove it or choose another --out)");
  }
  const std::vector<fs::path> files = expand_inputs(o.inputs);
  const Encoder enc(o.tokenizer);
  const int64_t eos = o.eos_id.value_or(enc.eos_id());
  KILN_CHECK(eos >= -1 && eos < enc.vocab_size(), "[prepare] eos id ", eos,
             " is outside the vocabulary of ", enc.name(), " (", enc.vocab_size(), ")");

  PrepareSummary sum;
  sum.files = static_cast<int64_t>(files.size());
  sum.vocab_size = enc.vocab_size();
  sum.eos_id = eos;
  sum.tokenizer_fingerprint = enc.fingerprint();
  int64_t total_bytes = 0;
  for (const fs::path& f : files) total_bytes += static_cast<int64_t>(fs::file_size(f));

  // The shards go to a sibling directory first; one rename publishes them.
  fs::path parent = out.parent_path();
  if (parent.empty()) parent = ".";
  fs::create_directories(parent);
  TempDir tmp{parent / (out.filename().string() + ".partial-" + std::to_string(::getpid()))};
  fs::remove_all(tmp.path);
  fs::create_directories(tmp.path);

  const bool bar = o.progress_bar.value_or(Progress::is_terminal(log));
  log << "prepare: " << files.size() << (files.size() == 1 ? " file, " : " files, ") << total_bytes
      << " bytes, tokenizer " << enc.name() << " (vocab " << enc.vocab_size() << ", eos "
      << (eos >= 0 ? std::to_string(eos) : "none") << "), " << get_num_threads() << " threads -> "
      << o.out_dir << "\n"
      << std::flush;
  Progress progress(log, bar, static_cast<double>(total_bytes), "bytes");
  ShardMeta meta;
  meta.vocab_size = enc.vocab_size();
  meta.eos_id = eos;
  meta.tokenizer_fingerprint = enc.fingerprint();
  ShardSink sink(tmp.path, meta, o.shard_tokens, progress);

  std::vector<std::string> batch;
  int64_t batch_bytes = 0, done_bytes = 0;
  auto last_line = Clock::now();
  auto status = [&]() {
    const double s = std::max(1e-9, std::chrono::duration<double>(Clock::now() - t0).count());
    std::ostringstream f;
    f << sum.documents << " docs | " << sum.tokens << " tokens | " << std::fixed
      << std::setprecision(1) << static_cast<double>(done_bytes) / 1e6 / s << " MB/s";
    return f.str();
  };
  auto flush = [&]() {
    if (batch.empty()) return;
    for (const std::vector<int64_t>& ids : enc.encode(batch)) {
      sink.add(ids);
      sum.tokens += static_cast<int64_t>(ids.size()) + (eos >= 0 ? 1 : 0);
      ++sum.documents;
    }
    done_bytes += batch_bytes;
    batch.clear();
    batch_bytes = 0;
    progress.update(static_cast<double>(done_bytes), status());
    if (!bar && Clock::now() - last_line > std::chrono::seconds(5)) {
      last_line = Clock::now();
      const double frac = total_bytes > 0 ? 100.0 * static_cast<double>(done_bytes) /
                                                static_cast<double>(total_bytes)
                                          : 100.0;
      std::ostringstream l;
      l << "prepare: " << std::fixed << std::setprecision(1) << frac << "% | " << status()
        << " | ETA "
        << Progress::format_duration(progress.eta_seconds(static_cast<double>(done_bytes)));
      progress.line(l.str());
    }
  };
  auto add_doc = [&](std::string doc, int64_t bytes, const std::string& where) {
    KILN_CHECK(!enc.needs_utf8() || nn::is_valid_utf8(doc), "[prepare] ", where,
               ": not valid UTF-8 (the tokenizer takes UTF-8 text)");
    batch.push_back(std::move(doc));
    batch_bytes += bytes;
    if (batch_bytes >= o.batch_bytes) flush();
  };

  for (const fs::path& f : files) {
    std::ifstream in(f, std::ios::binary);
    KILN_CHECK(in.good(), "[prepare] ", f.string(), ": cannot open");
    if (is_jsonl(f)) {
      std::string line;
      for (int64_t n = 1; std::getline(in, line); ++n) {
        const auto bytes = static_cast<int64_t>(line.size()) + 1;
        if (line.find_first_not_of(" \t\r") == std::string::npos) {
          batch_bytes += bytes;
          continue;
        }
        const std::string where = f.string() + ":" + std::to_string(n);
        add_doc(jsonl_field(line, o.field, where), bytes, where);
      }
      KILN_CHECK(!in.bad(), "[prepare] ", f.string(), ": read error");
    } else {
      std::stringstream s;
      s << in.rdbuf();
      KILN_CHECK(!in.bad(), "[prepare] ", f.string(), ": read error");
      std::string text = s.str();
      const auto bytes = static_cast<int64_t>(text.size());
      if (!text.empty()) add_doc(std::move(text), bytes, f.string());
    }
    sum.bytes += static_cast<int64_t>(fs::file_size(f));
  }
  flush();
  sink.close();
  progress.finish();
  KILN_CHECK(sum.documents > 0, "[prepare] the inputs hold no documents (empty files)");
  sum.shards = sink.shards();

  std::ostringstream js;
  js << "{\n  \"format\": \"kiln token shards\",\n  \"version\": " << kShardVersion
     << ",\n  \"tokenizer\": " << nn::json_string(enc.name())
     << ",\n  \"tokenizer_fingerprint\": \"" << std::hex << std::setw(16) << std::setfill('0')
     << enc.fingerprint() << std::dec << std::setfill(' ')
     << "\",\n  \"vocab_size\": " << enc.vocab_size() << ",\n  \"eos_id\": " << eos
     << ",\n  \"shards\": " << sum.shards << ",\n  \"documents\": " << sum.documents
     << ",\n  \"tokens\": " << sum.tokens << ",\n  \"input_bytes\": " << sum.bytes
     << ",\n  \"inputs\": [";
  for (size_t i = 0; i < files.size(); ++i) {
    js << (i ? ", " : "") << nn::json_string(files[i].string());
  }
  js << "]\n}\n";
  write_file_atomically((tmp.path / "prepare.json").string(), js.str(), "prepare");

  std::error_code ec;
  if (fs::exists(out)) fs::remove(out, ec);  // empty, checked above
  fs::rename(tmp.path, out, ec);
  KILN_CHECK(!ec, "[prepare] ", o.out_dir, ": cannot rename ", tmp.path.string(),
             " to it: ", ec.message());
  tmp.keep = true;
  sum.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return sum;
}

}  // namespace kiln::pretrain
