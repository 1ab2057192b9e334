// kiln::text::train_bpe: trains a byte-level BPE tokenizer (the Llama 3 style) on a corpus and
// returns its tokenizer.json, which Tokenizer::from_json and the tokenizers library both load.
// For a user without a model hub; `kiln tokenizer train` runs it on a text file.
//
//   kiln::text::BpeTrainerOptions options;
//   options.vocab_size = 4096;
//   std::string json = kiln::text::train_bpe({corpus}, options);
//   auto tok = kiln::text::Tokenizer::from_json(json);
//
// The tokenizer: pre-tokenizer Split (Llama 3's regex, Isolated) then ByteLevel; the 256 byte
// characters and the special tokens always in the vocabulary (so every text round-trips);
// ignore_merges; the first special token as bos (TemplateProcessing "<bos> $A"); decoder
// ByteLevel. Training counts the pre-tokenized words, then merges the most frequent adjacent
// pair until the vocabulary is full or no pair occurs min_frequency times (ties: the pair of
// smaller ids first), updating the pair counts incrementally. Not the library's trainer, so
// the merges can differ from what it would learn on the same text.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::text {

struct BpeTrainerOptions {
  int64_t vocab_size = 8192;  // special tokens and the 256 bytes included
  int64_t min_frequency = 2;
  std::vector<std::string> special_tokens = {"<|begin_of_text|>", "<|end_of_text|>"};
};

struct BpeTrainerStats {
  int64_t words = 0;         // pre-tokenized words in the corpus
  int64_t unique_words = 0;  // distinct ones
  int64_t merges = 0;
};

// Errors "[train_bpe] ..." for a vocab_size too small for the bytes and special tokens, or
// special tokens that are empty or repeated. Texts must be UTF-8.
std::string train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options,
                      BpeTrainerStats* stats = nullptr);

}  // namespace kiln::text
