#include "text/internal/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tensor/error.h"
#include "text/internal/unicode.h"

namespace kiln::text::internal {
namespace {

pcre2_code* code_of(void* p) { return static_cast<pcre2_code*>(p); }

// One match-data block per thread, grown to the largest pattern seen; only the whole match's
// offsets are read.
pcre2_match_data* thread_match_data() {
  struct Holder {
    pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
    ~Holder() { pcre2_match_data_free(data); }
  };
  thread_local Holder holder;
  return holder.data;
}

// Unicode's White_Space, what \s matches in the library's engines (Oniguruma, Rust's regex).
// PCRE2's own \s also takes U+180E (MONGOLIAN VOWEL SEPARATOR), which is no longer White_Space.
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

// The pattern with \s (and \S outside character classes) spelled as White_Space, so that PCRE2
// splits where the tokenizers library does. Escapes and classes are tracked, nothing else.
std::string with_white_space(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      } else if (e == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpace) + "]";
      } else {
        out.push_back(c);
        out.push_back(e);
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t end = p.find(":]", i + 2);
      if (end != std::string::npos) {
        out.append(p, i, end + 2 - i);
        i = end + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  const std::string translated = with_white_space(pattern);
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    KILN_FAIL("[Regex] cannot compile '", pattern, "': ", reinterpret_cast<const char*>(message),
              " at offset ", offset);
  }
  code_ = code;
  // Without a JIT for this CPU (or when it is disabled) the interpreter runs the same pattern.
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(code_of(code_)); }

void Regex::find_all(std::string_view s, std::vector<Span>& out) const {
  pcre2_match_data* md = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t start = 0;
  while (start <= s.size()) {
    const int rc = jit_ ? pcre2_jit_match(code_of(code_), subject, s.size(), start, 0, md, nullptr)
                        : pcre2_match(code_of(code_), subject, s.size(), start, PCRE2_NO_UTF_CHECK,
                                      md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0 && rc != PCRE2_ERROR_NOMEMORY) {  // NOMEMORY: ovector too small, still matched
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof(message));
      KILN_FAIL("[Regex] matching '", pattern_,
                "' failed: ", reinterpret_cast<const char*>(message));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    out.push_back({b, e});
    if (e > b) {
      start = e;
    } else {  // an empty match: step over one character
      if (e >= s.size()) return;
      start = e + utf8_length(static_cast<unsigned char>(s[e]));
    }
  }
}

bool Regex::search(std::string_view s) const {
  pcre2_match_data* md = thread_match_data();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  const int rc =
      jit_ ? pcre2_jit_match(code_of(code_), subject, s.size(), 0, 0, md, nullptr)
           : pcre2_match(code_of(code_), subject, s.size(), 0, PCRE2_NO_UTF_CHECK, md, nullptr);
  return rc >= 0 || rc == PCRE2_ERROR_NOMEMORY;
}

}  // namespace kiln::text::internal
