#include "models/tokenizer.h"

#include "tensor/error.h"

namespace kiln::models {

std::vector<int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  ids.reserve(text.size());
  for (char c : text) ids.push_back(static_cast<unsigned char>(c));
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    KILN_CHECK(ids[i] >= 0 && ids[i] < kVocabSize, "[ByteTokenizer] id ", ids[i], " at position ",
               i, " is not a byte (ids are 0..255)");
    text.push_back(static_cast<char>(static_cast<unsigned char>(ids[i])));
  }
  return text;
}

std::string ByteTokenizer::decode_lossy(const std::vector<int64_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (int64_t id : ids) {
    if (id >= 0 && id < kVocabSize) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else {
      text += "\xEF\xBF\xBD";  // U+FFFD REPLACEMENT CHARACTER
    }
  }
  return text;
}

}  // namespace kiln::models
