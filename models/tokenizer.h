// kiln::models::ByteTokenizer: the byte-level tokenizer of the default config ("kiln-tiny").
//
//   kiln::models::ByteTokenizer tok;
//   std::vector<int64_t> ids = tok.encode("To be");   // {84, 111, 32, 98, 101}
//   std::string text = tok.decode(ids);               // "To be"
//
// Token id i (0 <= i < 256) is the byte i; there are no special tokens and no merges, so any
// byte string (UTF-8 or not) round-trips exactly and a model's vocabulary needs only 256 rows.
// decode rejects ids outside [0, 256) with "[ByteTokenizer] ..." (a model with a larger vocab
// can generate them); decode_lossy writes them as U+FFFD instead.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::models {

class ByteTokenizer {
 public:
  static constexpr int64_t kVocabSize = 256;

  int64_t vocab_size() const { return kVocabSize; }
  std::vector<int64_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int64_t>& ids) const;
  std::string decode_lossy(const std::vector<int64_t>& ids) const;
};

}  // namespace kiln::models
