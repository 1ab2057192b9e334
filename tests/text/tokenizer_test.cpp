// kiln::text::Tokenizer against the tokenizers library: the ids and decoded texts of
// tests/text/data/expected.json (written by make_tokenizer_fixtures.py with the library), for
// the byte-level (Llama 3, GPT-2) and SentencePiece-style (Llama 2, Metaspace) fixtures; the
// bundled corpus round trip; encode_batch; and the errors.
#include "nn/safetensors.h"
#include "text/tokenizer.h"

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "tensor/parallel.h"
#include "text/internal/json_value.h"

namespace kiln::text {
namespace {

std::string fixture(const std::string& name) {
  return std::string(KILN_TEXT_TEST_DATA) + "/" + name + ".json";
}

struct Case {
  std::string text, decoded, decoded_skip;
  std::vector<int64_t> ids, ids_plain;
};

const internal::JsonValue& expected() {
  static const internal::JsonValue all = [] {
    const std::string text = read_file(fixture("expected"));
    nn::JsonReader r(text);
    return internal::JsonValue::read(r);
  }();
  return all;
}

std::vector<Case> expected_cases(const std::string& name) {
  const internal::JsonValue* list = expected().find(name);
  EXPECT_NE(list, nullptr) << name;
  std::vector<Case> cases;
  if (list == nullptr) return cases;
  const auto ids_of = [](const internal::JsonValue& v) {
    std::vector<int64_t> ids;
    for (const auto& x : v.array) ids.push_back(static_cast<int64_t>(x.number));
    return ids;
  };
  for (const auto& c : list->array) {
    cases.push_back({c.find("text")->string, c.find("decoded")->string,
                     c.find("decoded_skip")->string, ids_of(*c.find("ids")),
                     ids_of(*c.find("ids_plain"))});
  }
  return cases;
}

std::string corpus() {
  return read_file(std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt");
}

class TokenizerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(TokenizerParity, EncodeMatchesTheLibrary) {
  const Tokenizer tok = Tokenizer::from_file(fixture(GetParam()));
  const std::vector<Case> cases = expected_cases(GetParam());
  ASSERT_GT(cases.size(), 50u);
  for (const Case& c : cases) {
    EXPECT_EQ(tok.encode(c.text), c.ids) << "text: '" << c.text << "'";
    EXPECT_EQ(tok.encode(c.text, /*add_special_tokens=*/false), c.ids_plain)
        << "text: '" << c.text << "'";
  }
}

TEST_P(TokenizerParity, DecodeMatchesTheLibrary) {
  const Tokenizer tok = Tokenizer::from_file(fixture(GetParam()));
  for (const Case& c : expected_cases(GetParam())) {
    EXPECT_EQ(tok.decode(c.ids, /*skip_special_tokens=*/false), c.decoded)
        << "text: '" << c.text << "'";
    EXPECT_EQ(tok.decode(c.ids, /*skip_special_tokens=*/true), c.decoded_skip)
        << "text: '" << c.text << "'";
  }
}

TEST_P(TokenizerParity, CorpusRoundTrips) {
  const Tokenizer tok = Tokenizer::from_file(fixture(GetParam()));
  const std::string text = corpus();
  const std::vector<int64_t> ids = tok.encode(text, /*add_special_tokens=*/false);
  // The library's ids for the whole corpus: their number and a position-weighted sum.
  const internal::JsonValue* want = expected().find("corpus")->find(GetParam());
  ASSERT_NE(want, nullptr);
  uint64_t checksum = 0;
  for (size_t i = 0; i < ids.size(); ++i) checksum += (i % 997 + 1) * static_cast<uint64_t>(ids[i]);
  EXPECT_EQ(ids.size(), static_cast<size_t>(want->find("count")->number));
  EXPECT_EQ(checksum, static_cast<uint64_t>(want->find("checksum")->number));
  EXPECT_EQ(tok.decode(ids), text);
}

TEST_P(TokenizerParity, BatchEqualsOneByOne) {
  const Tokenizer tok = Tokenizer::from_file(fixture(GetParam()));
  std::vector<std::string> texts;
  std::istringstream lines(corpus());
  for (std::string line; std::getline(lines, line) && texts.size() < 3000;) texts.push_back(line);
  for (const Case& c : expected_cases(GetParam())) texts.push_back(c.text);
  const int threads = get_num_threads();
  set_num_threads(4);
  const auto batch = tok.encode_batch(texts);
  set_num_threads(threads);
  ASSERT_EQ(batch.size(), texts.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    ASSERT_EQ(batch[i], tok.encode(texts[i])) << "text " << i << ": '" << texts[i] << "'";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerParity,
                         ::testing::Values("llama3", "gpt2", "llama2", "metaspace"),
                         [](const auto& info) { return info.param; });

TEST(TokenizerTest, VocabularyAndSpecialTokens) {
  const Tokenizer llama3 = Tokenizer::from_file(fixture("llama3"));
  EXPECT_EQ(llama3.vocab_size(), 1500);
  EXPECT_EQ(llama3.bos_id(), 0);
  EXPECT_EQ(llama3.eos_id(), 1);  // <|end_of_text|>, a special added token
  EXPECT_EQ(llama3.token_to_id("<|end_of_text|>"), 1);
  EXPECT_EQ(llama3.id_to_token(0), "<|begin_of_text|>");
  EXPECT_EQ(llama3.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(llama3.id_to_token(123456), std::nullopt);

  const Tokenizer gpt2 = Tokenizer::from_file(fixture("gpt2"));
  EXPECT_EQ(gpt2.vocab_size(), 1504);
  EXPECT_EQ(gpt2.token_to_id("<mask>"), 1500);

  const Tokenizer llama2 = Tokenizer::from_file(fixture("llama2"));
  EXPECT_EQ(llama2.vocab_size(), 1458);
  EXPECT_EQ(llama2.bos_id(), 1);
  EXPECT_EQ(llama2.eos_id(), 2);
  EXPECT_EQ(llama2.token_to_id("<0x0A>"), 3 + 0x0A);
  EXPECT_EQ(llama2.encode("\xC3\xA9", false), (std::vector<int64_t>{323, 3 + 0xC3, 3 + 0xA9}));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const kiln::Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenizerTest, Errors) {
  EXPECT_NE(error_of([] {
              Tokenizer::from_file("/no/such/tokenizer.json");
            }).find("[Tokenizer] /no/such/tokenizer.json: cannot open"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              Tokenizer::from_json("{\"model\": {", "broken.json");
            }).find("[Tokenizer] broken.json: invalid JSON"),
            std::string::npos);

  // The llama2 fixture with one component swapped for an unsupported one.
  const std::string good = read_file(fixture("llama2"));
  const auto with = [&](const std::string& from, const std::string& to) {
    std::string s = good;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return s.replace(at, from.size(), to);
  };
  const std::string nfc =
      with("\"normalizer\": {", "\"normalizer\": {\"type\": \"NFC\"}, \"x\": {");
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json(nfc, "nfc.json");
            }).find("[Tokenizer] nfc.json: unsupported normalizer 'NFC'"),
            std::string::npos);
  const std::string wordpiece = with("\"type\": \"BPE\"", "\"type\": \"WordPiece\"");
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json(wordpiece, "wp.json");
            }).find("unsupported model 'WordPiece'"),
            std::string::npos);
  const std::string ctc = with("\"type\": \"ByteFallback\"", "\"type\": \"CTC\"");
  EXPECT_NE(
      error_of([&] { Tokenizer::from_json(ctc, "ctc.json"); }).find("unsupported decoder 'CTC'"),
      std::string::npos);
  const std::string digits =
      with("\"pre_tokenizer\": null", "\"pre_tokenizer\": {\"type\": \"Digits\"}");
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json(digits, "d.json");
            }).find("unsupported pre_tokenizer 'Digits'"),
            std::string::npos);
  const std::string bad_regex = with(
      "\"pre_tokenizer\": null",
      "\"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": "
      "\"Isolated\", \"invert\": false}");
  EXPECT_NE(
      error_of([&] { Tokenizer::from_json(bad_regex, "re.json"); }).find("cannot compile '('"),
      std::string::npos);

  const std::string unk = with("\"unk_token\": \"<unk>\"", "\"unk_token\": \"<nope>\"");
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json(unk, "unk.json");
            }).find("[Tokenizer] unk.json: model BPE: unk_token '<nope>' is not in the vocabulary"),
            std::string::npos);
  const std::string merge = with("\"merges\": [\"", "\"merges\": [\"a b c\", \"");
  EXPECT_NE(
      error_of([&] { Tokenizer::from_json(merge, "m.json"); }).find("'a b c' is not two tokens"),
      std::string::npos);

  const Tokenizer tok = Tokenizer::from_file(fixture("llama3"));
  EXPECT_NE(error_of([&] { tok.encode("\xFF"); }).find("not valid UTF-8"), std::string::npos);
  // An error on one of the batch's threads reaches the caller.
  const std::vector<std::string> batch = {"fine", "also fine", "bad \xC3", "fine again"};
  EXPECT_NE(error_of([&] { tok.encode_batch(batch); }).find("not valid UTF-8"), std::string::npos);
}

}  // namespace
}  // namespace kiln::text
