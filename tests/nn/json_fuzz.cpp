// libFuzzer target for kiln::nn::JsonReader (nn/json.h): arbitrary bytes must be rejected with
// JsonError or accepted, the same way by a caller that skips every value and by one that reads
// each value with its typed method; what is accepted must print back (compact) to a document
// that reads the same; numbers must read as std::from_chars reads them, and strings must survive
// json_string. Any crash, over-read (AddressSanitizer) or mismatch (abort) is a finding.
//
//   D=tests/nn/data
//   build-fuzz/json_fuzz -max_total_time=60 -dict=$D/json.dict $D/json_fuzz
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "nn/json.h"

namespace {

using kiln::nn::JsonError;
using kiln::nn::JsonReader;

void check(bool ok, const char* what, std::string_view input) {
  if (!ok) {
    std::fprintf(stderr, "json_fuzz: %s (input: %.*s)\n", what, static_cast<int>(input.size()),
                 input.data());
    std::abort();
  }
}

// A number token, read by each typed method, against std::from_chars.
void check_number(std::string_view tok) {
  const bool integral = tok.find_first_of(".eE") == std::string_view::npos;
  {
    double want = 0;
    const auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), want);
    const bool ok = ec == std::errc() && end == tok.data() + tok.size();
    JsonReader r(tok);
    try {
      const double got = r.read_double("n");
      check(ok && (got == want || (got != got && want != want)), "read_double differs", tok);
    } catch (const JsonError&) {
      check(!ok, "read_double rejects a number from_chars reads", tok);
    }
  }
  {
    int64_t want = 0;
    const auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), want);
    const bool ok = integral && ec == std::errc() && end == tok.data() + tok.size();
    JsonReader r(tok);
    try {
      const int64_t got = r.read_int64("n");
      check(ok && got == want, "read_int64 differs", tok);
    } catch (const JsonError&) {
      check(!ok, "read_int64 rejects an int64", tok);
    }
  }
  {
    uint64_t want = 0;
    const auto [end, ec] = std::from_chars(tok.data(), tok.data() + tok.size(), want);
    const bool ok =
        integral && tok[0] != '-' && ec == std::errc() && end == tok.data() + tok.size();
    JsonReader r(tok);
    try {
      const uint64_t got = r.read_uint64("n");
      check(ok && got == want, "read_uint64 differs", tok);
    } catch (const JsonError&) {
      check(!ok, "read_uint64 rejects a uint64", tok);
    }
  }
}

// Reads one value with the typed methods and appends it, compact, to `out`. Nesting is bounded
// as skip_value bounds it, so that both callers accept the same documents.
void print_value(JsonReader& r, std::string_view text, std::string& out, int depth) {
  if (depth >= JsonReader::kMaxDepth) r.fail("too deep");
  switch (r.peek_kind()) {
    case '{': {
      r.begin_object();
      out += '{';
      bool first = true;
      while (auto key = r.next_key()) {
        if (!first) out += ',';
        first = false;
        kiln::nn::append_json_string(out, *key);
        out += ':';
        print_value(r, text, out, depth + 1);
      }
      out += '}';
      return;
    }
    case '[': {
      r.begin_array();
      out += '[';
      bool first = true;
      while (r.next_element()) {
        if (!first) out += ',';
        first = false;
        print_value(r, text, out, depth + 1);
      }
      out += ']';
      return;
    }
    case '"': {
      const std::string s = r.read_string();
      const std::string quoted = kiln::nn::json_string(s);
      JsonReader again(quoted);
      check(again.read_string() == s, "json_string does not read back", quoted);
      out += quoted;
      return;
    }
    case 'n': {
      // The token as written (peek_kind stopped at its first byte), as skip_value consumes it.
      const size_t begin = r.offset();
      r.skip_value();
      const std::string_view tok = text.substr(begin, r.offset() - begin);
      check_number(tok);
      out += tok;
      return;
    }
    case 't':
    case 'f':
      out += r.read_bool("b") ? "true" : "false";
      return;
    default:
      r.read_null();
      out += "null";
  }
}

// Appends the compact print of `text` to `out`; false when the reader rejects `text`.
bool print_document(std::string_view text, std::string& out) {
  try {
    JsonReader r(text);
    print_value(r, text, out, 0);
    r.end_document();
    return true;
  } catch (const JsonError&) {
    return false;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  bool skipped = true;
  try {
    JsonReader r(text);
    r.skip_value();
    r.end_document();
  } catch (const JsonError&) {
    skipped = false;
  }
  std::string printed;
  const bool read = print_document(text, printed);
  check(skipped == read, "skip_value and the typed reads disagree", text);
  if (!read) return 0;
  std::string again;
  check(print_document(printed, again), "the compact print does not read back", printed);
  check(again == printed, "the compact print reads back differently", printed);
  return 0;
}
