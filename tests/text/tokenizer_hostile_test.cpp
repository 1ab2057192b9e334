// Hostile tokenizer.json files (what tests/text/tokenizer_fuzz.cpp found, and its neighbours):
// every id that encode() returns is below vocab_size(), and ids that do not fit a token id are
// errors naming the field, not wrapped or converted out of range.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/error.h"
#include "text/tokenizer.h"

namespace kiln::text {
namespace {

// A byte-level BPE of 9 tokens; `post` and `added` are spliced in.
std::string tokenizer_json(const std::string& post, const std::string& added = "[]",
                           const std::string& vocab_extra = "") {
  return R"({"added_tokens": )" + added + R"(,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "post_processor": )" +
         post + R"(,
  "decoder": {"type": "ByteLevel"},
  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "\u0120": 3, "ab": 4, "abc": 5,
            "\u0120a": 6, "\u0120ab": 7, "d": 8)" +
         vocab_extra + R"(},
            "merges": ["a b", "ab c", "\u0120 a", "\u0120a b"]}})";
}

std::string template_with_ids(const std::string& ids) {
  return R"({"type": "TemplateProcessing",
    "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<e>", "type_id": 0}}],
    "special_tokens": {"<e>": {"id": "<e>", "ids": )" +
         ids + R"(, "tokens": ["<e>"]}}})";
}

std::string error_of(const std::string& json) {
  try {
    Tokenizer::from_json(json, "t.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TokenizerHostile, PostProcessorIdsCountInTheVocabSize) {
  // The template's token has id 9, past the 9 tokens of the vocabulary and with no added token
  // (tokenizer_fuzz: encode returned 9 with vocab_size() 9).
  const Tokenizer tok = Tokenizer::from_json(tokenizer_json(template_with_ids("[9]")), "t.json");
  EXPECT_EQ(tok.vocab_size(), 10);
  const std::vector<int64_t> ids = tok.encode("abc ab");
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), 9);
  for (const int64_t id : ids) EXPECT_LT(id, tok.vocab_size());
  const Tokenizer roberta = Tokenizer::from_json(
      tokenizer_json(R"({"type": "RobertaProcessing", "cls": ["<s>", 20], "sep": ["</s>", 21]})"),
      "t.json");
  EXPECT_EQ(roberta.vocab_size(), 22);
}

TEST(TokenizerHostile, IdsThatAreNoTokenIdsAreErrors) {
  for (const std::string ids : {"[-1]", "[2147483648]", "[4294967305]", "[1e300]", "[0.5]"}) {
    SCOPED_TRACE(ids);
    const std::string what = error_of(tokenizer_json(template_with_ids(ids)));
    EXPECT_NE(what.find("[Tokenizer] t.json: post_processor TemplateProcessing id"),
              std::string::npos)
        << what;
  }
  // An added token's id of 2^32 + 5 is an error, not token 5.
  const std::string added =
      R"([{"id": 4294967301, "content": "<x>", "special": true, "normalized": false}])";
  EXPECT_NE(error_of(tokenizer_json("null", added))
                .find("added token id 4294967301 is not a token id (0 to 2^31 - 1)"),
            std::string::npos);
  EXPECT_NE(error_of(tokenizer_json(R"({"type": "BertProcessing", "cls": ["[CLS]", -3],
                                        "sep": ["[SEP]", 1]})"))
                .find("post_processor BertProcessing cls -3 is not a token id"),
            std::string::npos);
}

TEST(TokenizerHostile, SparseVocabularyIsAnErrorNotGigabytes) {
  EXPECT_NE(error_of(tokenizer_json("null", "[]", R"(, "z": 2147483647)"))
                .find("[Tokenizer] t.json: model vocab: id 2147483647 is more than 2^20 past the "
                      "10 tokens"),
            std::string::npos);
}

}  // namespace
}  // namespace kiln::text
