// UTF-8 helpers for the tokenizer: code points, Rust's lossy decoding, white space, and GPT-2's
// byte-to-character table (ByteLevel).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "nn/json.h"

namespace kiln::text::internal {

// The length of the UTF-8 sequence that starts with byte `lead` (1 for continuation bytes, so
// that a scan always moves forward; the input is checked to be valid UTF-8 before).
inline size_t utf8_length(unsigned char lead) {
  if (lead < 0xC0) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// Decodes the code point at s[i] (valid UTF-8); sets `len` to its byte length.
uint32_t decode_utf8(std::string_view s, size_t i, size_t* len);
using nn::append_utf8;  // nn/json.h: code point -> UTF-8

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode's White_Space property (what Rust's regex \s matches).
bool is_white_space(uint32_t cp);

// GPT-2's reversible map of the 256 bytes onto printable characters ("Ġ" is the space byte).
struct ByteLevelTable {
  std::array<std::string, 256> byte_to_utf8;  // the character of each byte, UTF-8 encoded
  std::array<int16_t, 512> char_to_byte;      // code point (< 512) -> byte, or -1
};
const ByteLevelTable& byte_level_table();

}  // namespace kiln::text::internal
