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

}  // namespace

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
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
