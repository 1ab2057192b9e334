// kiln::text::Tokenizer: Hugging Face tokenizer.json files for BPE models, encoding and
// decoding token for token as the tokenizers library does.
//
//   auto tok = kiln::text::Tokenizer::from_file("llama3/tokenizer.json");
//   std::vector<int64_t> ids = tok.encode("To be, or not to be");  // <|begin_of_text|> first
//   std::string text = tok.decode(ids, /*skip_special_tokens=*/true);
//   auto batch = tok.encode_batch(lines);   // parallel over the texts (kiln's thread pool)
//
// Both styles of BPE tokenizer are supported: byte-level (GPT-2, Llama 3: the ByteLevel
// pre-tokenizer, or Split with a regex, run by PCRE2 with its JIT) and SentencePiece-style
// (Llama 2, Mistral, Gemma: the ▁ metaspace through Prepend/Replace normalizers or the Metaspace
// pre-tokenizer, byte_fallback). docs/text.md lists every component and option read.
//
// Pitfalls:
// - Errors are kiln::Error "[Tokenizer] <file>: ..." naming the component and the value: a
//   missing file, invalid JSON, a model other than BPE, an unsupported normalizer,
//   pre-tokenizer, decoder or post-processor type (NFC, WordPiece, ...).
// - encode() takes UTF-8 and rejects anything else (the library takes only str either).
// - decode() drops ids that are no token, as the library does; skip_special_tokens defaults to
//   true as in the library's Python API.
// - "truncation" and "padding" are ignored: encode never truncates or pads.
// - A Tokenizer is cheap to copy (it shares its immutable tables and its word cache) and all
//   its const methods may be called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::text {

namespace internal {
struct Pipeline;
}

class Tokenizer {
 public:
  static Tokenizer from_file(const std::string& path);
  // `name` stands for the file in error messages.
  static Tokenizer from_json(std::string_view json, const std::string& name = "<json>");

  // The ids of `text`; with add_special_tokens the post-processor's tokens (bos...) too.
  std::vector<int64_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // encode() of each text, the texts spread over kiln's threads (kiln::set_num_threads).
  std::vector<std::vector<int64_t>> encode_batch(const std::vector<std::string>& texts,
                                                 bool add_special_tokens = true) const;
  std::string decode(const std::vector<int64_t>& ids, bool skip_special_tokens = true) const;

  // The number of ids: one more than the largest id of the vocabulary and the added tokens
  // (the rows a model's embedding needs; the library's get_vocab_size() for dense vocabularies).
  int64_t vocab_size() const;
  std::optional<int64_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int64_t id) const;
  // The beginning- and end-of-sequence tokens: from the post-processor (the tokens it puts
  // before and after the text), else special added tokens of the usual names (<s>, </s>,
  // <|begin_of_text|>, <|end_of_text|>, <|endoftext|>, <bos>, <eos>).
  std::optional<int64_t> bos_id() const;
  std::optional<int64_t> eos_id() const;
  const std::string& name() const;

 private:
  explicit Tokenizer(std::shared_ptr<internal::Pipeline> p) : p_(std::move(p)) {}
  std::shared_ptr<internal::Pipeline> p_;
};

}  // namespace kiln::text
