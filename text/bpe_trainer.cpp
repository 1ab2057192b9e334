#include "text/bpe_trainer.h"

#include <algorithm>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "nn/json.h"
#include "tensor/error.h"
#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"

namespace kiln::text {
namespace {

constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

std::string tokenizer_json(const std::vector<std::string>& tokens,
                           const std::vector<std::pair<int32_t, int32_t>>& merges,
                           const std::vector<std::string>& specials) {
  using nn::json_string;
  std::string j = "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n";
  j += "  \"added_tokens\": [";
  for (size_t i = 0; i < specials.size(); ++i) {
    j += i ? ",\n    " : "\n    ";
    j += "{\"id\": " + std::to_string(i) + ", \"content\": " + json_string(specials[i]) +
         ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, "
         "\"special\": true}";
  }
  j += "\n  ],\n  \"normalizer\": null,\n";
  j += "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", "
       "\"pattern\": {\"Regex\": " +
       json_string(kLlama3Pattern) +
       "}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
       "\"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]},\n";
  j += "  \"post_processor\": ";
  if (specials.empty()) {
    j += "{\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": false, "
         "\"use_regex\": true},\n";
  } else {
    const std::string bos = json_string(specials[0]);
    j += "{\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": " + bos +
         ", \"type_id\": 0}}, {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"pair\": "
         "[{\"SpecialToken\": {\"id\": " +
         bos +
         ", \"type_id\": 0}}, {\"Sequence\": {\"id\": "
         "\"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": " +
         bos +
         ", \"type_id\": 1}}, "
         "{\"Sequence\": {\"id\": \"B\", \"type_id\": 1}}], \"special_tokens\": {" +
         bos + ": {\"id\": " + bos + ", \"ids\": [0], \"tokens\": [" + bos + "]}}},\n";
  }
  j += "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": "
       "true, \"use_regex\": true},\n";
  j += "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
       "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, \"fuse_unk\": false, "
       "\"byte_fallback\": false, \"ignore_merges\": true,\n    \"vocab\": {";
  for (size_t i = 0; i < tokens.size(); ++i) {
    j += i ? ",\n      " : "\n      ";
    j += json_string(tokens[i]) + ": " + std::to_string(i);
  }
  j += "\n    },\n    \"merges\": [";
  for (size_t i = 0; i < merges.size(); ++i) {
    j += i ? ",\n      " : "\n      ";
    j += "[" + json_string(tokens[merges[i].first]) + ", " + json_string(tokens[merges[i].second]) +
         "]";
  }
  j += "\n    ]\n  }\n}\n";
  return j;
}

}  // namespace

std::string train_bpe(const std::vector<std::string>& texts, const BpeTrainerOptions& options,
                      BpeTrainerStats* stats) {
  const auto& specials = options.special_tokens;
  absl::flat_hash_set<std::string> seen;
  for (const std::string& s : specials) {
    KILN_CHECK(!s.empty() && seen.insert(s).second, "[train_bpe] special token '", s,
               "' is empty or repeated");
  }
  const int64_t base = static_cast<int64_t>(specials.size()) + 256;
  KILN_CHECK(options.vocab_size >= base, "[train_bpe] vocab_size ", options.vocab_size,
             " is below the ", base, " tokens every vocabulary holds (256 bytes and ",
             specials.size(), " special tokens)");

  // Words: the pre-tokenizer's pieces, byte-level mapped, counted.
  const internal::Regex split(kLlama3Pattern);
  const internal::ByteLevelTable& table = internal::byte_level_table();
  absl::flat_hash_map<std::string, int64_t> counts;
  int64_t total_words = 0;
  std::vector<internal::Span> spans;
  for (const std::string& text : texts) {
    KILN_CHECK(nn::is_valid_utf8(text), "[train_bpe] a text is not valid UTF-8");
    spans.clear();
    split.find_all(text, spans);
    for (const internal::Span& s : spans) {
      ++counts[text.substr(s.begin, s.end - s.begin)];
      ++total_words;
    }
  }

  // The vocabulary: specials, then the bytes in order, then the merged tokens.
  std::vector<std::string> tokens(specials);
  absl::flat_hash_map<std::string, int32_t> ids;
  for (size_t i = 0; i < specials.size(); ++i) ids[specials[i]] = static_cast<int32_t>(i);
  std::array<int32_t, 256> byte_id{};
  for (int b = 0; b < 256; ++b) {
    byte_id[b] = static_cast<int32_t>(tokens.size());
    ids.try_emplace(table.byte_to_utf8[b], byte_id[b]);
    tokens.push_back(table.byte_to_utf8[b]);
  }

  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  words.reserve(counts.size());
  for (const auto& [word, n] : counts) {
    std::vector<int32_t> w;
    for (const char c : word) w.push_back(byte_id[static_cast<unsigned char>(c)]);
    words.push_back(std::move(w));
    freq.push_back(n);
  }
  // Pair counts and the words each pair occurs in (a superset: entries go stale, not away).
  absl::flat_hash_map<uint64_t, int64_t> pair_count;
  absl::flat_hash_map<uint64_t, std::vector<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    for (size_t i = 0; i + 1 < words[w].size(); ++i) {
      const uint64_t k = pair_key(words[w][i], words[w][i + 1]);
      pair_count[k] += freq[w];
      where[k].push_back(static_cast<int32_t>(w));
    }
  }
  // A max-heap of (count, pair) whose entries are checked against pair_count when popped.
  struct Entry {
    int64_t count;
    uint64_t pair;
    bool operator<(const Entry& o) const {
      return count != o.count ? count < o.count : pair > o.pair;
    }
  };
  std::priority_queue<Entry> heap;
  for (const auto& [k, n] : pair_count) heap.push({n, k});

  std::vector<std::pair<int32_t, int32_t>> merges;
  while (static_cast<int64_t>(tokens.size()) < options.vocab_size && !heap.empty()) {
    const Entry top = heap.top();
    heap.pop();
    const auto it = pair_count.find(top.pair);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current < options.min_frequency) break;
    const auto a = static_cast<int32_t>(top.pair >> 32);
    const auto b = static_cast<int32_t>(top.pair & 0xFFFFFFFFu);
    const std::string merged = tokens[a] + tokens[b];
    int32_t id;
    if (const auto known = ids.find(merged); known != ids.end()) {
      id = known->second;
    } else {
      id = static_cast<int32_t>(tokens.size());
      tokens.push_back(merged);
      ids[merged] = id;
    }
    merges.emplace_back(a, b);
    absl::flat_hash_set<uint64_t> touched;
    std::vector<int32_t> in_words = std::move(where[top.pair]);
    where.erase(top.pair);
    std::sort(in_words.begin(), in_words.end());
    in_words.erase(std::unique(in_words.begin(), in_words.end()), in_words.end());
    for (const int32_t w : in_words) {
      std::vector<int32_t>& word = words[w];
      const int64_t n = freq[w];
      for (size_t i = 0; i + 1 < word.size();) {
        if (word[i] != a || word[i + 1] != b) {
          ++i;
          continue;
        }
        // (prev, a) (a, b) (b, next) become (prev, ab) (ab, next).
        const auto bump = [&](int32_t x, int32_t y, int64_t d) {
          const uint64_t k = pair_key(x, y);
          pair_count[k] += d;
          touched.insert(k);
          if (d > 0) where[k].push_back(w);
        };
        if (i > 0) bump(word[i - 1], a, -n), bump(word[i - 1], id, n);
        if (i + 2 < word.size()) bump(b, word[i + 2], -n), bump(id, word[i + 2], n);
        pair_count[top.pair] -= n;
        word[i] = id;
        word.erase(word.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        ++i;
      }
    }
    pair_count.erase(top.pair);
    for (const uint64_t k : touched) {
      if (const auto c = pair_count.find(k); c != pair_count.end() && c->second > 0) {
        heap.push({c->second, k});
      }
    }
  }
  if (stats) {
    stats->words = total_words;
    stats->unique_words = static_cast<int64_t>(words.size());
    stats->merges = static_cast<int64_t>(merges.size());
  }
  return tokenizer_json(tokens, merges, specials);
}

}  // namespace kiln::text
