// kiln prepare's library side (pretrain/prepare.h): text and JSONL to shards with the byte
// tokenizer and a tokenizer.json (each document = the tokenizer's ids + eos, in input order),
// shards closed at shard_tokens, the same bytes on 1 and 2 threads, and clear errors.
#include "pretrain/prepare.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <sstream>

#include "pretrain/loader.h"
#include "pretrain_test_util.h"
#include "tensor/parallel.h"
#include "test_util.h"
#include "text/tokenizer.h"

namespace kiln::pretrain {
namespace {

namespace fs = std::filesystem;

const std::string kLlama3 = std::string(KILN_SOURCE_DIR) + "/tests/text/data/llama3.json";

class PrepareTest : public test::TempDirTest {
 protected:
  PrepareSummary run(PrepareOptions o) {
    o.progress_bar = false;
    std::ostringstream log;
    return prepare(o, log);
  }
  std::vector<int64_t> all_tokens(const std::string& out) {
    const ShardSet set = ShardSet::open(out);
    std::vector<int64_t> ids;
    for (size_t i = 0; i < set.size(); ++i) {
      std::vector<int64_t> part(static_cast<size_t>(set[i].num_tokens()));
      set[i].read(0, set[i].num_tokens(), part.data());
      ids.insert(ids.end(), part.begin(), part.end());
    }
    return ids;
  }
};

TEST_F(PrepareTest, ByteTokenizerTextAndJsonl) {
  test::write_bytes(file("a.txt"), "To be\n");
  test::write_bytes(
      file("b.jsonl"),
      "{\"text\": \"or\", \"id\": 1}\n\n{\"meta\": {\"x\": [1]}, \"text\": \"n\\u00e9\"}\n");
  const PrepareSummary s =
      run({.inputs = {file("a.txt"), file("b.jsonl")}, .out_dir = file("out")});
  EXPECT_EQ(s.documents, 3);
  EXPECT_EQ(s.eos_id, -1);
  EXPECT_EQ(s.shards, 1);
  const std::string joined =
      "To be\nor"
      "n\xc3\xa9";
  EXPECT_EQ(s.tokens, static_cast<int64_t>(joined.size()));
  std::vector<int64_t> expected(joined.begin(), joined.end());
  for (auto& v : expected) v &= 0xff;
  EXPECT_EQ(all_tokens(file("out")), expected);
  EXPECT_TRUE(fs::exists(file("out/prepare.json")));
  const ShardSet set = ShardSet::open(file("out"));
  EXPECT_EQ(set.tokenizer_fingerprint(), kByteTokenizerFingerprint);
  EXPECT_EQ(set.num_documents(), 3);
  // Nothing else is left beside the output.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir()), fs::directory_iterator()), 3);
}

TEST_F(PrepareTest, TokenizerJsonDocumentsEndWithEosAndShardsCloseAtTheLimit) {
  const text::Tokenizer tok = text::Tokenizer::from_file(kLlama3);
  ASSERT_TRUE(tok.eos_id().has_value());
  std::vector<std::string> docs;
  std::string jsonl;
  for (int i = 0; i < 40; ++i) {
    docs.push_back("Line " + std::to_string(i) + ": the quick brown fox, " +
                   std::string(i % 7, 'z'));
    jsonl += "{\"body\": \"" + docs.back() + "\"}\n";
  }
  fs::create_directories(dir() / "in" / "sub");
  test::write_bytes(file("in/sub/b.jsonl"), jsonl);
  test::write_bytes(file("in/a.txt"), "First, the text file.");
  test::write_bytes(file("in/ignored.bin"), "not read");
  std::vector<int64_t> expected;
  auto add = [&](const std::string& d) {
    const auto ids = tok.encode(d, false);
    expected.insert(expected.end(), ids.begin(), ids.end());
    expected.push_back(*tok.eos_id());
  };
  add("First, the text file.");
  for (const auto& d : docs) add(d);

  set_num_threads(2);
  const PrepareSummary s = run({.inputs = {file("in")},
                                .out_dir = file("out2"),
                                .tokenizer = kLlama3,
                                .field = "body",
                                .shard_tokens = 100,
                                .batch_bytes = 200});
  EXPECT_EQ(s.documents, 41);
  EXPECT_EQ(s.tokens, static_cast<int64_t>(expected.size()));
  EXPECT_EQ(all_tokens(file("out2")), expected);
  const ShardSet set = ShardSet::open(file("out2"));
  EXPECT_EQ(static_cast<int64_t>(set.size()), s.shards);
  EXPECT_GT(s.shards, 3);
  for (size_t i = 0; i + 1 < set.size(); ++i) {
    EXPECT_GE(set[i].num_tokens(), 100);
    EXPECT_EQ(set[i].token(set[i].num_tokens() - 1), *tok.eos_id());  // documents not split
  }
  EXPECT_EQ(set.eos_id(), *tok.eos_id());
  EXPECT_EQ(set.vocab_size(), tok.vocab_size());

  set_num_threads(1);
  run({.inputs = {file("in")},
       .out_dir = file("out1"),
       .tokenizer = kLlama3,
       .field = "body",
       .shard_tokens = 100,
       .batch_bytes = 200});
  set_num_threads(2);
  for (size_t i = 0; i < set.size(); ++i) {
    const std::string name = fs::path(set[i].path()).filename().string();
    EXPECT_EQ(test::read_bytes(file("out1/" + name)), test::read_bytes(file("out2/" + name)));
  }
}

TEST_F(PrepareTest, BadInputsGetErrorsNamingTheFileAndLine) {
  test::write_bytes(file("ok.txt"), "fine");
  test::write_bytes(file("bad.jsonl"), "{\"text\": \"a\"}\n{\"text\": 3}\n");
  EXPECT_KILN_ERROR(run({.inputs = {file("bad.jsonl")}, .out_dir = file("o")}),
                    "bad.jsonl:2: \"text\" is not a string");
  test::write_bytes(file("nofield.jsonl"), "{\"content\": \"a\"}\n");
  EXPECT_KILN_ERROR(run({.inputs = {file("nofield.jsonl")}, .out_dir = file("o")}),
                    "nofield.jsonl:1: no \"text\" field");
  test::write_bytes(file("array.jsonl"), "[1, 2]\n");
  EXPECT_KILN_ERROR(run({.inputs = {file("array.jsonl")}, .out_dir = file("o")}),
                    "array.jsonl:1: expected a JSON object per line");
  test::write_bytes(file("broken.jsonl"), "{\"text\": \"a\n");
  EXPECT_KILN_ERROR(run({.inputs = {file("broken.jsonl")}, .out_dir = file("o")}),
                    "broken.jsonl:1: ");
  EXPECT_KILN_ERROR(run({.inputs = {file("missing.txt")}, .out_dir = file("o")}),
                    "missing.txt: no such file or directory");
  test::write_bytes(file("latin1.txt"), "caf\xe9");
  EXPECT_KILN_ERROR(
      run({.inputs = {file("latin1.txt")}, .out_dir = file("o"), .tokenizer = kLlama3}),
      "latin1.txt: not valid UTF-8");
  test::write_bytes(file("tok.json"), "{\"model\": ");
  EXPECT_KILN_ERROR(
      run({.inputs = {file("ok.txt")}, .out_dir = file("o"), .tokenizer = file("tok.json")}),
      "tok.json");
  EXPECT_KILN_ERROR(run({.inputs = {file("ok.txt")}, .out_dir = file("o"), .eos_id = 256}),
                    "eos id 256 is outside the vocabulary of byte (256)");
  run({.inputs = {file("ok.txt")}, .out_dir = file("o")});
  EXPECT_KILN_ERROR(run({.inputs = {file("ok.txt")}, .out_dir = file("o")}),
                    "o: already exists and is not an empty directory");
  test::write_bytes(file("empty.txt"), "");
  EXPECT_KILN_ERROR(run({.inputs = {file("empty.txt")}, .out_dir = file("o3")}), "no documents");
  // A failed run leaves no output and no temporary directory behind.
  EXPECT_FALSE(fs::exists(file("o3")));
  for (const auto& e : fs::directory_iterator(dir())) {
    EXPECT_EQ(e.path().filename().string().find(".partial-"), std::string::npos) << e.path();
  }
}

}  // namespace
}  // namespace kiln::pretrain
