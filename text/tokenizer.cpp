// kiln::text::Tokenizer: the encode and decode pipelines (loading is text/tokenizer_json.cpp).
#include "text/tokenizer.h"

#include <algorithm>

#include "nn/json.h"
#include "tensor/error.h"
#include "tensor/parallel.h"
#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"

namespace kiln::text {
namespace internal {
namespace {

bool is_word_char(uint32_t cp) {
  if (cp < 0x80) {
    return (cp >= '0' && cp <= '9') || (cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z') ||
           cp == '_';
  }
  // Rust's \w (what the library's single_word check uses): Alphabetic, marks, decimal digits,
  // connector punctuation and the joiners. PCRE2's \w leaves marks out before 10.43.
  static const Regex word("^[\\p{L}\\p{Nl}\\p{M}\\p{Nd}\\p{Pc}\\x{200C}\\x{200D}]$");
  std::string s;
  append_utf8(cp, s);
  return word.search(s);
}

// The code point that ends at s[end) (valid UTF-8, end > 0).
uint32_t last_code_point(std::string_view s, size_t end, size_t* begin) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  size_t len = 0;
  *begin = i;
  return decode_utf8(s, i, &len);
}

}  // namespace

void AddedMatcher::add(std::string pattern, size_t index) {
  if (pattern.empty()) return;
  auto& list = by_first_byte_[static_cast<unsigned char>(pattern[0])];
  list.emplace_back(std::move(pattern), index);
  std::stable_sort(list.begin(), list.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  ++count_;
}

void AddedMatcher::split(Piece&& piece, const std::vector<AddedToken>& tokens,
                         std::vector<Piece>& out) const {
  const std::string_view s = piece.text;
  size_t emitted = 0;  // the end of what is already in `out`
  size_t i = 0;
  bool any = false;
  while (i < s.size()) {
    const auto& candidates = by_first_byte_[static_cast<unsigned char>(s[i])];
    const std::pair<std::string, size_t>* hit = nullptr;
    for (const auto& c : candidates) {
      if (s.compare(i, c.first.size(), c.first) == 0) {
        hit = &c;
        break;
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    const AddedToken& token = tokens[hit->second];
    size_t start = i, stop = i + hit->first.size();
    i = stop;  // the automaton goes on after the match, whether it is kept or not
    if (token.single_word) {
      size_t b = 0, len = 0;
      const bool start_space = start == 0 || !is_word_char(last_code_point(s, start, &b));
      const bool stop_space = stop == s.size() || !is_word_char(decode_utf8(s, stop, &len));
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        size_t b = 0;
        if (!is_white_space(last_code_point(s, new_start, &b))) break;
        new_start = b;
      }
      start = std::max(new_start, emitted);
    }
    if (token.rstrip) {
      while (stop < s.size()) {
        size_t len = 0;
        if (!is_white_space(decode_utf8(s, stop, &len))) break;
        stop += len;
      }
      i = stop;
    }
    if (emitted < start) {
      out.push_back(
          {std::string(s.substr(emitted, start - emitted)), -1, piece.at_start && emitted == 0});
    }
    out.push_back({std::string(s.substr(start, stop - start)), token.id, false});
    emitted = stop;
    any = true;
  }
  if (!any) {
    if (!piece.text.empty()) out.push_back(std::move(piece));
    return;
  }
  if (emitted < s.size()) out.push_back({std::string(s.substr(emitted)), -1, false});
}

namespace {

void encode_into(const Pipeline& p, std::string_view text, bool add_special_tokens,
                 std::vector<int64_t>& ids) {
  KILN_CHECK(nn::is_valid_utf8(text), "[Tokenizer] ", p.name,
             ": encode: the text is not valid UTF-8");
  thread_local std::vector<int32_t> out;
  out.clear();
  if (add_special_tokens) out.insert(out.end(), p.prefix.begin(), p.prefix.end());

  std::vector<Piece> pieces;
  Piece whole{std::string(text), -1, true};
  if (p.raw_matcher.empty()) {
    if (!whole.text.empty()) pieces.push_back(std::move(whole));
  } else {
    p.raw_matcher.split(std::move(whole), p.added, pieces);
  }
  std::vector<Piece> parts, words;
  for (Piece& piece : pieces) {
    if (piece.id >= 0) {
      out.push_back(piece.id);
      continue;
    }
    if (p.normalizer) p.normalizer->apply(piece.text);
    parts.clear();
    if (p.normalized_matcher.empty()) {
      if (!piece.text.empty()) parts.push_back(std::move(piece));
    } else {
      p.normalized_matcher.split(std::move(piece), p.added, parts);
    }
    for (Piece& part : parts) {
      if (part.id >= 0) {
        out.push_back(part.id);
        continue;
      }
      words.clear();
      words.push_back(std::move(part));
      if (p.pre_tokenizer) p.pre_tokenizer->apply(words);
      for (const Piece& word : words) p.model.tokenize(word.text, out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), p.suffix.begin(), p.suffix.end());
  ids.assign(out.begin(), out.end());
}

}  // namespace
}  // namespace internal

std::vector<int64_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int64_t> ids;
  internal::encode_into(*p_, text, add_special_tokens, ids);
  return ids;
}

std::vector<std::vector<int64_t>> Tokenizer::encode_batch(const std::vector<std::string>& texts,
                                                          bool add_special_tokens) const {
  std::vector<std::vector<int64_t>> result(texts.size());
  kiln::internal::parallel_for(0, static_cast<int64_t>(texts.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      internal::encode_into(*p_, texts[i], add_special_tokens, result[i]);
    }
  });
  return result;
}

std::string Tokenizer::decode(const std::vector<int64_t>& ids, bool skip_special_tokens) const {
  const internal::Pipeline& p = *p_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const int64_t id : ids) {
    const std::string* token = nullptr;
    if (id < 0 || id > INT32_MAX) continue;
    if (const auto it = p.added_by_id.find(static_cast<int32_t>(id)); it != p.added_by_id.end()) {
      token = &p.added[it->second].decoded;
    } else if (static_cast<size_t>(id) < p.model.has_id.size() && p.model.has_id[id]) {
      token = &p.model.id_to_token[id];
    } else {
      continue;  // no such token: dropped, as the library does
    }
    if (skip_special_tokens) {
      const auto it = p.added_by_content.find(*token);
      if (it != p.added_by_content.end() && p.added[p.added_by_id.at(it->second)].special) {
        continue;
      }
    }
    tokens.push_back(*token);
  }
  if (!p.decoder) {
    std::string text;
    for (size_t i = 0; i < tokens.size(); ++i) text += (i ? " " : "") + tokens[i];
    return text;
  }
  p.decoder->apply(tokens);
  std::string text;
  for (const std::string& t : tokens) text += t;
  return text;
}

int64_t Tokenizer::vocab_size() const { return p_->vocab_size; }

std::optional<int64_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const auto it = p_->added_by_content.find(internal::key(token));
      it != p_->added_by_content.end()) {
    return it->second;
  }
  if (const auto it = p_->model.vocab.find(internal::key(token)); it != p_->model.vocab.end())
    return it->second;
  return std::nullopt;
}

std::optional<std::string> Tokenizer::id_to_token(int64_t id) const {
  if (id < 0 || id > INT32_MAX) return std::nullopt;
  if (const auto it = p_->added_by_id.find(static_cast<int32_t>(id)); it != p_->added_by_id.end()) {
    return p_->added[it->second].content;
  }
  if (static_cast<size_t>(id) < p_->model.has_id.size() && p_->model.has_id[id]) {
    return p_->model.id_to_token[id];
  }
  return std::nullopt;
}

std::optional<int64_t> Tokenizer::bos_id() const {
  return p_->bos_id >= 0 ? std::optional<int64_t>(p_->bos_id) : std::nullopt;
}
std::optional<int64_t> Tokenizer::eos_id() const {
  return p_->eos_id >= 0 ? std::optional<int64_t>(p_->eos_id) : std::nullopt;
}
const std::string& Tokenizer::name() const { return p_->name; }

}  // namespace kiln::text
