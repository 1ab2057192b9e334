// kiln::text::internal::Regex: a PCRE2 pattern compiled for UTF-8 with Unicode properties
// (PCRE2_UTF | PCRE2_UCP, so \p{L}, \w and \d are Unicode-aware as in the Oniguruma engine the
// tokenizers library uses; \s is rewritten to Unicode's White_Space, which is what Oniguruma
// matches) and JIT-compiled when PCRE2 has a JIT for this machine.
//
//   Regex re("\\p{L}+");
//   std::vector<Span> spans;
//   re.find_all("ab 12 cd", spans);   // {0, 2}, {6, 8}
//
// Subjects must be valid UTF-8 (the tokenizer checks its input once; matching skips the check).
// A Regex is immutable after construction and can be shared between threads: each thread keeps
// its own match data.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::text::internal {

struct Span {
  size_t begin;
  size_t end;
};

class Regex {
 public:
  // Throws kiln::Error "[Regex] cannot compile '<pattern>': <PCRE2's message> at offset N".
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the non-overlapping matches of the pattern in `s`, left to right (an empty match
  // advances by one character, as Rust's and Oniguruma's iterators do).
  void find_all(std::string_view s, std::vector<Span>& out) const;
  // Whether the pattern matches somewhere in `s`.
  bool search(std::string_view s) const;
  const std::string& pattern() const { return pattern_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8
  bool jit_ = false;
};

}  // namespace kiln::text::internal
