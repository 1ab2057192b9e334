// libFuzzer target for the tokenizer.json reader (Tokenizer::from_json, text/): arbitrary bytes
// must be rejected with a kiln::Error that names the file ("[Tokenizer] <name>: ...") or give a
// tokenizer that encodes a few texts (fixed ones, and the input's own bytes when they are UTF-8)
// into ids inside its vocabulary and decodes any ids, out-of-range ones included. Any crash,
// over-read (AddressSanitizer), other exception or violated invariant (abort) is a finding.
//
//   D=tests/text/data
//   build-fuzz/tokenizer_fuzz -max_total_time=60 -dict=$D/tokenizer.dict $D/tokenizer_fuzz
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "nn/json.h"
#include "tensor/error.h"
#include "text/tokenizer.h"

namespace {

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "tokenizer_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kiln::text::Tokenizer;
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  std::optional<Tokenizer> tok;
  try {
    tok.emplace(Tokenizer::from_json(json, "fuzz.json"));
  } catch (const kiln::Error& e) {
    check(std::string(e.what()).starts_with("[Tokenizer] fuzz.json: "),
          "an error that does not name the file", e.what());
    return 0;
  }
  const int64_t vocab = tok->vocab_size();
  std::vector<std::string> texts = {
      "Hello, world! 123  tabs\tand\nnewlines",
      "\xc3\xa9t\xc3\xa9 \xe2\x96\x81 \xe4\xbd\xa0\xe5\xa5\xbd \xf0\x9f\x99\x82", ""};
  const std::string_view head = json.substr(0, 256);
  if (kiln::nn::is_valid_utf8(head)) texts.emplace_back(head);
  for (const std::string& text : texts) {
    for (const bool special : {true, false}) {
      const std::vector<int64_t> ids = tok->encode(text, special);
      for (const int64_t id : ids) {
        check(id >= 0 && id < vocab, "an id outside the vocabulary",
              "id " + std::to_string(id) + " of " + std::to_string(vocab) + " for '" + text + "'");
      }
      (void)tok->decode(ids, true);
      (void)tok->decode(ids, false);
    }
  }
  (void)tok->decode({-1, vocab, std::numeric_limits<int64_t>::max(), 0}, false);
  (void)tok->bos_id();
  (void)tok->eos_id();
  return 0;
}
