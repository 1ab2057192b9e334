// kiln::text::train_bpe: the tokenizer.json it writes loads, round-trips the corpus, holds the
// requested vocabulary, and merges what is frequent.
#include "text/bpe_trainer.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "tensor/error.h"
#include "text/tokenizer.h"

namespace kiln::text {
namespace {

std::string corpus() {
  std::ifstream in(std::string(KILN_SOURCE_DIR) + "/data/tinyshakespeare.txt", std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(BpeTrainerTest, TrainsALoadableTokenizer) {
  const std::string text = corpus();
  BpeTrainerOptions options;
  options.vocab_size = 600;
  BpeTrainerStats stats;
  const Tokenizer tok = Tokenizer::from_json(train_bpe({text}, options, &stats), "trained");
  EXPECT_EQ(tok.vocab_size(), 600);
  EXPECT_EQ(stats.merges, 600 - 256 - 2);
  EXPECT_GT(stats.unique_words, 10000);
  EXPECT_EQ(tok.bos_id(), 0);
  EXPECT_EQ(tok.eos_id(), 1);
  EXPECT_EQ(tok.token_to_id("Ġthe").has_value(), true);  // the commonest word is one token

  const std::vector<int64_t> ids = tok.encode(text, /*add_special_tokens=*/false);
  EXPECT_LT(ids.size(), text.size() / 2);
  EXPECT_EQ(tok.decode(ids), text);
  const std::string unicode = "naïve 東京 😀 <|end_of_text|>";
  EXPECT_EQ(tok.decode(tok.encode(unicode), /*skip_special_tokens=*/false),
            "<|begin_of_text|>" + unicode);
}

TEST(BpeTrainerTest, Errors) {
  BpeTrainerOptions options;
  options.vocab_size = 100;
  EXPECT_THROW(train_bpe({"abc"}, options), kiln::Error);
  options.vocab_size = 300;
  options.special_tokens = {"<s>", "<s>"};
  EXPECT_THROW(train_bpe({"abc"}, options), kiln::Error);
}

}  // namespace
}  // namespace kiln::text
