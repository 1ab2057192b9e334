// The stages of kiln::text::Tokenizer, one struct per kind of tokenizer.json component, as
// the tokenizers library runs them:
//
//   text -> added tokens split out (raw text) -> Normalizer on each other piece -> added tokens
//        split out (normalized text) -> PreTokenizer -> Bpe on each word -> post-processor ids
//   ids  -> token strings -> Decoder -> text
//
// Each stage is read from its JSON by text/tokenizer_json.cpp and applied by
// text/normalize.cpp (normalizers, pre-tokenizers), text/bpe.cpp and text/decoders.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "text/internal/regex.h"

namespace kiln::text::internal {

// absl's own string_view (Debian's absl does not alias std::string_view), for heterogeneous
// lookups in the string-keyed maps.
inline absl::string_view key(std::string_view s) { return absl::string_view(s.data(), s.size()); }

// A piece of the text on its way through the pipeline. `id` >= 0 for an added token (its
// text is then final); `at_start` whether it begins at offset 0 of the original text
// (Metaspace's prepend_scheme "first" asks).
struct Piece {
  std::string text;
  int32_t id = -1;
  bool at_start = false;
};

// HF's pattern object: {"String": "..."} (a literal) or {"Regex": "..."}.
struct Pattern {
  std::string literal;
  std::shared_ptr<const Regex> regex;  // set for a Regex pattern
  void find_all(std::string_view s, std::vector<Span>& out) const;
};

struct Normalizer {
  enum class Kind { kSequence, kPrepend, kReplace };
  Kind kind = Kind::kSequence;
  std::string text;  // Prepend: what is prepended; Replace: the replacement
  Pattern pattern;   // Replace
  std::vector<Normalizer> children;
  void apply(std::string& s) const;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };
enum class PrependScheme { kAlways, kFirst, kNever };

struct PreTokenizer {
  enum class Kind { kSequence, kByteLevel, kSplit, kMetaspace };
  Kind kind = Kind::kSequence;
  // ByteLevel
  bool add_prefix_space = false;
  bool use_regex = true;
  // Split (and ByteLevel's GPT-2 regex, Isolated)
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // Metaspace
  std::string replacement;  // one character, UTF-8
  PrependScheme prepend_scheme = PrependScheme::kAlways;
  bool split = true;
  std::vector<PreTokenizer> children;

  // Replaces `pieces` (none of them added tokens) by their pre-tokenized words.
  void apply(std::vector<Piece>& pieces) const;
};

struct Decoder {
  enum class Kind { kSequence, kByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip };
  Kind kind = Kind::kSequence;
  std::string text;  // Replace: content; Metaspace: the replacement; Strip: the character
  Pattern pattern;   // Replace
  PrependScheme prepend_scheme = PrependScheme::kAlways;  // Metaspace
  size_t start = 0, stop = 0;                             // Strip
  std::vector<Decoder> children;
  void apply(std::vector<std::string>& tokens) const;
};

// The BPE model with a word cache. Thread-safe: the cache is sharded behind mutexes.
class Bpe {
 public:
  absl::flat_hash_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // "" where an id has no token
  std::vector<uint8_t> has_id;
  // (left id << 32 | right id) -> (rank, merged id)
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  int32_t unk_id = -1;
  bool byte_fallback = false;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_ids{};  // "<0xXX>" tokens, -1 where absent

  // Sets up what the fields above imply (byte tokens, the single-character fast path).
  void finish();
  // Appends the ids of one pre-tokenized word.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

 private:
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;

  static constexpr int kShards = 32;
  static constexpr size_t kShardCapacity = 8192;   // words per shard; then the shard stops growing
  static constexpr size_t kMaxCachedLength = 256;  // bytes, as the tokenizers library
  struct Shard {
    std::mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> words;
  };
  mutable std::unique_ptr<Shard[]> shards_ = std::make_unique<Shard[]>(kShards);
  std::array<int32_t, 512> small_char_ids_{};  // code point < 512 -> id, -1 if not a token
};

// An entry of "added_tokens". `decoded` is what decode() gives for it: its content, or for a
// `normalized` token the content run through the normalizer (as the library caches it).
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
  std::string decoded;
};

// Finds added tokens in a text, leftmost first and longest among those starting there (the
// library's Aho-Corasick automaton in LeftmostLongest mode), honouring single_word, lstrip and
// rstrip, and splits the text around them.
class AddedMatcher {
 public:
  // `index` into the tokens given to split(); `pattern` is the text to find.
  void add(std::string pattern, size_t index);
  bool empty() const { return count_ == 0; }
  // Splits `piece` (not an added token) into pieces: the added tokens found (id set) and the
  // text between them (id -1). Appends the non-empty ones to `out`.
  void split(Piece&& piece, const std::vector<AddedToken>& tokens, std::vector<Piece>& out) const;

 private:
  // Patterns by their first byte, longest first.
  std::array<std::vector<std::pair<std::string, size_t>>, 256> by_first_byte_;
  size_t count_ = 0;
};

// Everything a Tokenizer holds; immutable after loading except for the BPE word cache.
struct Pipeline {
  std::string name;  // the file, or "<json>", for error messages
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Decoder> decoder;
  Bpe model;
  std::vector<AddedToken> added;
  absl::flat_hash_map<std::string, int32_t> added_by_content;
  absl::flat_hash_map<int32_t, size_t> added_by_id;  // -> index into `added`
  AddedMatcher raw_matcher;         // tokens with normalized = false, found in the raw text
  AddedMatcher normalized_matcher;  // the others, found in the normalized text
  // What the post-processor puts around the ids of a single sequence (add_special_tokens).
  std::vector<int32_t> prefix, suffix;
  int64_t vocab_size = 0;
  int64_t bos_id = -1, eos_id = -1;
};

}  // namespace kiln::text::internal
