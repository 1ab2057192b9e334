// Normalizers and pre-tokenizers (text/internal/pipeline.h), with the semantics of the
// tokenizers library's Prepend, Replace, Sequence, ByteLevel, Split and Metaspace.
#include <algorithm>

#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"

namespace kiln::text::internal {

void Pattern::find_all(std::string_view s, std::vector<Span>& out) const {
  if (regex) {
    regex->find_all(s, out);
    return;
  }
  if (literal.empty()) return;
  for (size_t pos = s.find(literal); pos != std::string_view::npos;
       pos = s.find(literal, pos + literal.size())) {
    out.push_back({pos, pos + literal.size()});
  }
}

void Normalizer::apply(std::string& s) const {
  switch (kind) {
    case Kind::kSequence:
      for (const Normalizer& n : children) n.apply(s);
      return;
    case Kind::kPrepend:
      if (!s.empty()) s.insert(0, text);
      return;
    case Kind::kReplace: {
      std::vector<Span> spans;
      pattern.find_all(s, spans);
      if (spans.empty()) return;
      std::string out;
      out.reserve(s.size());
      size_t prev = 0;
      for (const Span& m : spans) {
        out.append(s, prev, m.begin - prev);
        out += text;
        prev = m.end;
      }
      out.append(s, prev, std::string::npos);
      s = std::move(out);
      return;
    }
  }
}

namespace {

// Splits `piece` at the matches of `pattern` per `behavior` (HF's NormalizedString::split),
// appending the non-empty parts to `out`.
void split_piece(Piece&& piece, const Pattern& pattern, SplitBehavior behavior, bool invert,
                 std::vector<Piece>& out) {
  thread_local std::vector<Span> matches;
  matches.clear();
  pattern.find_all(piece.text, matches);
  // Every byte of the piece in one range, each flagged as a match or not.
  struct Range {
    size_t begin, end;
    bool match;
  };
  thread_local std::vector<Range> ranges;
  ranges.clear();
  size_t prev = 0;
  for (const Span& m : matches) {
    if (m.begin > prev) ranges.push_back({prev, m.begin, invert});
    ranges.push_back({m.begin, m.end, !invert});
    prev = m.end;
  }
  if (prev < piece.text.size()) ranges.push_back({prev, piece.text.size(), invert});

  thread_local std::vector<Span> parts;
  parts.clear();
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const Range& r : ranges) parts.push_back({r.begin, r.end});
      break;
    case SplitBehavior::kRemoved:
      for (const Range& r : ranges) {
        if (!r.match) parts.push_back({r.begin, r.end});
      }
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Range& r : ranges) {
        if (r.match && !previous_match && !parts.empty()) {
          parts.back().end = r.end;
        } else {
          parts.push_back({r.begin, r.end});
        }
        previous_match = r.match;
      }
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (size_t k = ranges.size(); k-- > 0;) {
        const Range& r = ranges[k];
        if (r.match && !previous_match && !parts.empty()) {
          parts.back().begin = r.begin;
        } else {
          parts.push_back({r.begin, r.end});
        }
        previous_match = r.match;
      }
      std::reverse(parts.begin(), parts.end());
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Range& r : ranges) {
        if (r.match == previous_match && !parts.empty()) {
          parts.back().end = r.end;
        } else {
          parts.push_back({r.begin, r.end});
        }
        previous_match = r.match;
      }
      break;
    }
  }
  if (parts.size() == 1 && parts[0].begin == 0 && parts[0].end == piece.text.size()) {
    out.push_back(std::move(piece));
    return;
  }
  for (const Span& p : parts) {
    if (p.end == p.begin) continue;
    out.push_back(
        {piece.text.substr(p.begin, p.end - p.begin), -1, piece.at_start && p.begin == 0});
  }
}

const Pattern& gpt2_pattern() {
  static const Pattern pattern{
      "", std::make_shared<const Regex>(
              R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)")};
  return pattern;
}

void byte_level_map(std::string& s) {
  const ByteLevelTable& t = byte_level_table();
  std::string out;
  out.reserve(s.size() + s.size() / 2);
  for (const char c : s) out += t.byte_to_utf8[static_cast<unsigned char>(c)];
  s = std::move(out);
}

void replace_all(std::string& s, char from, std::string_view to) {
  if (s.find(from) == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + 2 * to.size());
  for (const char c : s) {
    if (c == from) {
      out += to;
    } else {
      out.push_back(c);
    }
  }
  s = std::move(out);
}

}  // namespace

void PreTokenizer::apply(std::vector<Piece>& pieces) const {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  switch (kind) {
    case Kind::kSequence:
      for (const PreTokenizer& p : children) p.apply(pieces);
      return;
    case Kind::kByteLevel:
      for (Piece& piece : pieces) {
        if (add_prefix_space && piece.text.rfind(' ', 0) != 0) piece.text.insert(0, " ");
        if (use_regex) {
          split_piece(std::move(piece), gpt2_pattern(), SplitBehavior::kIsolated, false, out);
        } else if (!piece.text.empty()) {
          out.push_back(std::move(piece));
        }
      }
      for (Piece& piece : out) byte_level_map(piece.text);
      break;
    case Kind::kSplit:
      for (Piece& piece : pieces) split_piece(std::move(piece), pattern, behavior, invert, out);
      break;
    case Kind::kMetaspace: {
      Pattern delimiter{replacement, nullptr};
      for (Piece& piece : pieces) {
        replace_all(piece.text, ' ', replacement);
        const bool starts = piece.text.rfind(replacement, 0) == 0;
        if (!starts && (prepend_scheme == PrependScheme::kAlways ||
                        (prepend_scheme == PrependScheme::kFirst && piece.at_start))) {
          piece.text.insert(0, replacement);
        }
        if (split) {
          split_piece(std::move(piece), delimiter, SplitBehavior::kMergedWithNext, false, out);
        } else if (!piece.text.empty()) {
          out.push_back(std::move(piece));
        }
      }
      break;
    }
  }
  pieces = std::move(out);
}

}  // namespace kiln::text::internal
