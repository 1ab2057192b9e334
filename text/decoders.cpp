// Decoders (text/internal/pipeline.h), with the semantics of the tokenizers library's
// ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip and Sequence: each maps the list of
// token strings to a new list; the tokenizer joins the last one.
#include "nn/json.h"
#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"

namespace kiln::text::internal {
namespace {

// "<0xAB>" -> 0xAB, or -1.
int byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (const char c : t.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= c - '0';
    } else if (c >= 'a' && c <= 'f') {
      v |= c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      v |= c - 'A' + 10;
    } else {
      return -1;
    }
  }
  return v;
}

}  // namespace

void Decoder::apply(std::vector<std::string>& tokens) const {
  static constexpr const char* kReplacement = "\xEF\xBF\xBD";
  switch (kind) {
    case Kind::kSequence:
      for (const Decoder& d : children) d.apply(tokens);
      return;
    case Kind::kByteLevel: {
      // Each token whose characters all come from the byte table gives those bytes; any other
      // token gives its own UTF-8 bytes. The whole is then decoded lossily.
      const ByteLevelTable& t = byte_level_table();
      std::string bytes;
      for (const std::string& token : tokens) {
        const size_t start = bytes.size();
        bool mapped = true;
        for (size_t i = 0; i < token.size();) {
          size_t len = 0;
          const uint32_t cp = decode_utf8(token, i, &len);
          const int b = cp < t.char_to_byte.size() ? t.char_to_byte[cp] : -1;
          if (b < 0) {
            mapped = false;
            break;
          }
          bytes.push_back(static_cast<char>(b));
          i += len;
        }
        if (!mapped) {
          bytes.resize(start);
          bytes += token;
        }
      }
      tokens.assign(1, utf8_lossy(bytes));
      return;
    }
    case Kind::kMetaspace:
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::string out;
        const std::string& token = tokens[i];
        const bool drop = i == 0 && prepend_scheme != PrependScheme::kNever;
        for (size_t k = 0; k < token.size();) {
          if (token.compare(k, text.size(), text) == 0) {
            if (!drop) out.push_back(' ');
            k += text.size();
          } else {
            out.push_back(token[k++]);
          }
        }
        tokens[i] = std::move(out);
      }
      return;
    case Kind::kReplace: {
      Normalizer replace;
      replace.kind = Normalizer::Kind::kReplace;
      replace.pattern = pattern;
      replace.text = text;
      for (std::string& token : tokens) replace.apply(token);
      return;
    }
    case Kind::kByteFallback: {
      std::vector<std::string> out;
      out.reserve(tokens.size());
      std::string bytes;
      const auto flush = [&] {
        if (bytes.empty()) return;
        if (nn::is_valid_utf8(bytes)) {
          out.push_back(bytes);
        } else {
          for (size_t k = 0; k < bytes.size(); ++k) out.emplace_back(kReplacement);
        }
        bytes.clear();
      };
      for (std::string& token : tokens) {
        const int b = byte_token(token);
        if (b >= 0) {
          bytes.push_back(static_cast<char>(b));
        } else {
          flush();
          out.push_back(std::move(token));
        }
      }
      flush();
      tokens = std::move(out);
      return;
    }
    case Kind::kFuse: {
      std::string all;
      for (const std::string& token : tokens) all += token;
      tokens.assign(1, std::move(all));
      return;
    }
    case Kind::kStrip:
      for (std::string& token : tokens) {
        // Up to `start` copies of the character cut from the front, `stop` from the back.
        size_t b = 0;
        for (size_t k = 0; k < start && token.compare(b, text.size(), text) == 0; ++k) {
          b += text.size();
        }
        size_t e = token.size();
        for (size_t k = 0; k < stop && e >= b + text.size() &&
                           token.compare(e - text.size(), text.size(), text) == 0;
             ++k) {
          e -= text.size();
        }
        token = token.substr(b, e - b);
      }
      return;
  }
}

}  // namespace kiln::text::internal
