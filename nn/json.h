// JSON for kiln's own files: a strict pull parser (RFC 8259) and string literal writers, enough
// for safetensors headers, Hugging Face config.json / model.safetensors.index.json files and the
// trainer's state file. kiln::nn::JsonReader is what nn/safetensors.cpp, models/hf_config.cpp,
// models/hf_weights.cpp and models/trainer.cpp read them with; it serves any small JSON document
// whose shape the reader knows.
//
//   // {"n": 3, "name": "tiny", ...}
//   kiln::nn::JsonReader r(text);
//   r.begin_object();
//   while (auto key = r.next_key()) {
//     if (*key == "n") {
//       n = r.read_uint64("n");
//     } else if (*key == "name") {
//       name = r.read_string();
//     } else {
//       r.skip_value();   // checked, not kept
//     }
//   }
//   r.end_document();     // nothing but white space may follow
//
//   std::string out = "{\"name\": " + kiln::nn::json_string(name) + "}";
//
// The caller drives the reader with the shape it expects (begin_object, next_key, read_string,
// ...), so nothing is built that the schema does not need: a hostile document cannot make it
// allocate more than the strings and integers it returns. Values the caller does not want are
// checked and skipped by skip_value().
//
// Pitfalls:
// - Errors throw JsonError (a std::runtime_error, not a kiln::Error) with the byte offset; the
//   caller catches it and adds the file name.
// - Nesting deeper than JsonReader::kMaxDepth is rejected, which bounds the recursion.
// - read_string() resolves escapes but passes other bytes through unchecked: check the whole
//   document with is_valid_utf8() first where it must be UTF-8 (safetensors does).
// - There is no DOM: to read a value twice, or out of order, parse the document again.
// - A key that appears twice in one object is an error (RFC 8259 lets readers differ on which
//   value wins; two of them must never read one file differently). The reader remembers the
//   keys of every object it is inside, so read each object to its closing brace.
#pragma once

#include <charconv>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::nn {

class JsonError : public std::runtime_error {
 public:
  JsonError(const std::string& what, size_t offset)
      : std::runtime_error(what + " at byte " + std::to_string(offset)) {}
};

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points > U+10FFFF).
inline bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return false;
    }
    if (s.size() - i < static_cast<size_t>(len)) return false;
    for (int k = 1; k < len; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

// Appends `s` to `out` as a JSON string literal: quotes, backslash escapes for '"' and '\\',
// \u00XX for control characters; other bytes (UTF-8) pass through. The writer side of the
// files whose JSON JsonReader reads back (safetensors headers, config.json, trainer state).
inline void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  for (const char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      out += "\\u00";
      out.push_back(kHex[u >> 4]);
      out.push_back(kHex[u & 15]);
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
}
inline std::string json_string(std::string_view s) {
  std::string out;
  append_json_string(out, s);
  return out;
}

// Appends code point `cp` (at most U+10FFFF) to `out` in UTF-8.
inline void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

class JsonReader {
 public:
  static constexpr int kMaxDepth = 64;

  explicit JsonReader(std::string_view text) : s_(text) {}

  size_t offset() const { return pos_; }

  // What the next value is: '{', '[', '"', 'n' (number), 't'/'f' (bool), 'z' (null).
  char peek_kind() {
    skip_ws();
    if (pos_ >= s_.size()) fail("unexpected end of JSON");
    const char c = s_[pos_];
    if (c == '{' || c == '[' || c == '"') return c;
    if (c == '-' || (c >= '0' && c <= '9')) return 'n';
    if (c == 't' || c == 'f') return c;
    if (c == 'n') return 'z';
    fail(std::string("unexpected character '") + printable(c) + "'");
  }

  void begin_object() {
    expect('{', "expected '{'"), first_ = true;
    object_keys_.emplace_back();
  }
  void begin_array() { expect('[', "expected '['"), first_ = true; }

  // The next key of the current object, or nullopt after its closing brace.
  std::optional<std::string> next_key() {
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      first_ = false;
      if (!object_keys_.empty()) object_keys_.pop_back();
      return std::nullopt;
    }
    if (!first_) expect(',', "expected ',' or '}' in object");
    first_ = false;
    skip_ws();
    if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string key");
    const size_t key_start = pos_;
    std::string key = read_string();
    // RFC 8259 leaves duplicate names to the reader; two readers of one file could then see
    // different values (the first or the last), so kiln rejects them.
    if (!object_keys_.empty() && !object_keys_.back().insert(key).second) {
      pos_ = key_start;
      fail("duplicate key \"" + printable_key(key) + "\"");
    }
    expect(':', "expected ':' after object key");
    return key;
  }

  // Whether the current array has another element (consumes the ',' or the closing ']').
  bool next_element() {
    skip_ws();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      first_ = false;
      return false;
    }
    if (!first_) expect(',', "expected ',' or ']' in array");
    first_ = false;
    return true;
  }

  std::string read_string() {
    expect('"', "expected a string");
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in string");
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      switch (const char e = s_[pos_++]) {
        case '"':
        case '\\':
        case '/':
          out.push_back(e);
          break;
        case 'b':
          out.push_back('\b');
          break;
        case 'f':
          out.push_back('\f');
          break;
        case 'n':
          out.push_back('\n');
          break;
        case 'r':
          out.push_back('\r');
          break;
        case 't':
          out.push_back('\t');
          break;
        case 'u':
          append_utf8(read_escaped_code_point(), out);
          break;
        default:
          fail(std::string("invalid escape '\\") + printable(e) + "'");
      }
    }
  }

  // A JSON number that must be a non-negative integer fitting in uint64 ("what" names it in
  // errors). Fractions, exponents and negative values are rejected with distinct messages.
  uint64_t read_uint64(std::string_view what) {
    skip_ws();
    const size_t start = pos_;
    const std::string_view tok = scan_number();
    if (tok[0] == '-') {
      pos_ = start;
      fail(std::string(what) + " is negative (" + std::string(tok) + ")");
    }
    if (tok.find_first_of(".eE") != std::string_view::npos) {
      pos_ = start;
      fail(std::string(what) + " is not an integer (" + std::string(tok) + ")");
    }
    uint64_t v = 0;
    for (const char c : tok) {
      const uint64_t d = static_cast<uint64_t>(c - '0');
      if (v > (UINT64_MAX - d) / 10) {
        pos_ = start;
        fail(std::string(what) + " is too large (" + std::string(tok) + ")");
      }
      v = v * 10 + d;
    }
    return v;
  }

  // A JSON number that must be an integer fitting in int64 (may be negative).
  int64_t read_int64(std::string_view what) {
    skip_ws();
    const size_t start = pos_;
    const std::string_view tok = scan_number();
    if (tok.find_first_of(".eE") != std::string_view::npos) {
      pos_ = start;
      fail(std::string(what) + " is not an integer (" + std::string(tok) + ")");
    }
    int64_t v = 0;
    const auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (ec != std::errc() || end != tok.data() + tok.size()) {
      pos_ = start;
      fail(std::string(what) + " does not fit in int64 (" + std::string(tok) + ")");
    }
    return v;
  }

  // Any JSON number as the nearest double (locale-independent); out-of-range values fail.
  double read_double(std::string_view what) {
    skip_ws();
    const size_t start = pos_;
    const std::string_view tok = scan_number();
    double v = 0;
    const auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), v);
    if (ec != std::errc() || end != tok.data() + tok.size()) {
      pos_ = start;
      fail(std::string(what) + " is out of range for a double (" + std::string(tok) + ")");
    }
    return v;
  }

  bool read_bool(std::string_view what) {
    const char k = peek_kind();
    if (k != 't' && k != 'f') fail(std::string(what) + " is not a boolean");
    expect_word(k == 't' ? "true" : "false");
    return k == 't';
  }

  // Checks and skips one value of any type.
  void skip_value(int depth = 0) {
    if (depth >= kMaxDepth) fail("JSON nested deeper than " + std::to_string(kMaxDepth));
    switch (peek_kind()) {
      case '{':
        begin_object();
        while (next_key()) skip_value(depth + 1);
        return;
      case '[':
        begin_array();
        while (next_element()) skip_value(depth + 1);
        return;
      case '"':
        (void)read_string();
        return;
      case 'n':
        (void)scan_number();
        return;
      case 't':
        expect_word("true");
        return;
      case 'f':
        expect_word("false");
        return;
      default:
        expect_word("null");
        return;
    }
  }

  void read_null() { skip_ws(), expect_word("null"); }

  // Only whitespace may follow the top-level value (safetensors pads the header with spaces).
  void end_document() {
    skip_ws();
    if (pos_ != s_.size()) fail("trailing characters after the JSON value");
  }

  [[noreturn]] void fail(const std::string& what) const { throw JsonError(what, pos_); }

 private:
  static std::string printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7F) return std::string(1, c);
    static constexpr char kHex[] = "0123456789abcdef";
    return std::string("\\x") + kHex[u >> 4] + kHex[u & 15];
  }
  // A key for an error message: control and non-ASCII bytes escaped, at most 64 bytes.
  static std::string printable_key(const std::string& key) {
    std::string out;
    for (size_t i = 0; i < key.size() && i < 64; ++i) out += printable(key[i]);
    return key.size() > 64 ? out + "..." : out;
  }

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }

  void expect(char c, const char* what) {
    skip_ws();
    if (pos_ >= s_.size() || s_[pos_] != c) fail(what);
    ++pos_;
  }

  void expect_word(std::string_view w) {
    if (s_.substr(pos_, w.size()) != w) fail("invalid literal");
    pos_ += w.size();
  }

  bool at_digit() const { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; }

  // Consumes one number per the JSON grammar: -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
  std::string_view scan_number() {
    const size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (!at_digit()) fail("invalid number");
    if (s_[pos_] == '0') {
      ++pos_;
      if (at_digit()) fail("leading zero in number");
    } else {
      while (at_digit()) ++pos_;
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      if (!at_digit()) fail("invalid number: digits expected after '.'");
      while (at_digit()) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (!at_digit()) fail("invalid number: digits expected in exponent");
      while (at_digit()) ++pos_;
    }
    return s_.substr(start, pos_ - start);
  }

  uint32_t read_hex4() {
    if (s_.size() - pos_ < 4) fail("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= c - '0';
      else if (c >= 'a' && c <= 'f')
        v |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F')
        v |= c - 'A' + 10;
      else
        fail("invalid \\u escape");
    }
    return v;
  }

  // After "\u": one code point, joining a UTF-16 surrogate pair; lone surrogates are errors.
  uint32_t read_escaped_code_point() {
    const uint32_t hi = read_hex4();
    if (hi >= 0xDC00 && hi <= 0xDFFF) fail("lone low surrogate in \\u escape");
    if (hi < 0xD800 || hi > 0xDBFF) return hi;
    if (s_.substr(pos_, 2) != "\\u") fail("high surrogate not followed by a low surrogate");
    pos_ += 2;
    const uint32_t lo = read_hex4();
    if (lo < 0xDC00 || lo > 0xDFFF) fail("high surrogate not followed by a low surrogate");
    return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
  }

  std::string_view s_;
  size_t pos_ = 0;
  // Whether the container just opened has had no element yet (its ',' rules differ).
  bool first_ = false;
  // The keys seen in each object being read, innermost last: duplicates are errors.
  std::vector<std::set<std::string, std::less<>>> object_keys_;
};

}  // namespace kiln::nn
