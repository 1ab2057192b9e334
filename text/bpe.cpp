// The BPE model: characters (or their bytes, with byte_fallback, or the unknown token) merged
// pair by pair, lowest merge rank first and leftmost first among equals, as the tokenizers
// library's Word::merge_all does with its heap. Words are cached per tokenizer.
#include <algorithm>
#include <functional>

#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"

namespace kiln::text::internal {

void Bpe::finish() {
  static constexpr char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) {
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    const auto it = vocab.find(name);
    byte_ids[b] = it == vocab.end() ? -1 : it->second;
  }
  small_char_ids_.fill(-1);
  for (uint32_t cp = 0; cp < small_char_ids_.size(); ++cp) {
    std::string s;
    append_utf8(cp, s);
    const auto it = vocab.find(s);
    if (it != vocab.end()) small_char_ids_[cp] = it->second;
  }
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (word.size() >= kMaxCachedLength) {
    const auto it = ignore_merges ? vocab.find(key(word)) : vocab.end();
    if (it != vocab.end()) {
      out.push_back(it->second);
    } else {
      merge_word(word, out);
    }
    return;
  }
  // The cache holds every word seen (with ignore_merges, a word of the vocabulary as its one
  // id), so a hit costs one lookup.
  const size_t hash = std::hash<std::string_view>()(word);
  Shard& shard = shards_[hash % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    const auto it = shard.words.find(key(word));
    if (it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  const auto it = ignore_merges ? vocab.find(key(word)) : vocab.end();
  if (it != vocab.end()) {
    out.push_back(it->second);
  } else {
    merge_word(word, out);
  }
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.words.size() < kShardCapacity) {
    shard.words.try_emplace(std::string(word), out.begin() + first, out.end());
  }
}

void Bpe::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  // The symbols of the word, as a doubly linked list over a vector (removed ones: len 0).
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    uint32_t len;
  };
  thread_local std::vector<Symbol> symbols;
  symbols.clear();
  const auto add = [&](int32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1, len});
  };
  int32_t pending_unk = -1;  // an unknown run not yet added (fuse_unk joins consecutive ones)
  uint32_t pending_len = 0;
  for (size_t i = 0; i < word.size();) {
    size_t len = 0;
    const uint32_t cp = decode_utf8(word, i, &len);
    int32_t id = cp < small_char_ids_.size() ? small_char_ids_[cp] : -1;
    if (id < 0 && cp >= small_char_ids_.size()) {
      const auto it = vocab.find(key(word.substr(i, len)));
      if (it != vocab.end()) id = it->second;
    }
    if (id >= 0) {
      if (pending_unk >= 0) add(pending_unk, pending_len), pending_unk = -1;
      add(id, static_cast<uint32_t>(len));
    } else {
      bool fell_back = false;
      if (byte_fallback) {
        fell_back = true;
        for (size_t k = 0; k < len; ++k) {
          if (byte_ids[static_cast<unsigned char>(word[i + k])] < 0) fell_back = false;
        }
        if (fell_back) {
          // As the library does, a pending unknown run stays pending across byte tokens.
          for (size_t k = 0; k < len; ++k)
            add(byte_ids[static_cast<unsigned char>(word[i + k])], 1);
        }
      }
      if (!fell_back && unk_id >= 0) {
        if (pending_unk >= 0 && fuse_unk) {
          pending_len += static_cast<uint32_t>(len);
        } else {
          if (pending_unk >= 0) add(pending_unk, pending_len);
          pending_unk = unk_id;
          pending_len = static_cast<uint32_t>(len);
        }
      }
    }
    i += len;
  }
  if (pending_unk >= 0) add(pending_unk, pending_len);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  struct Merge {
    int32_t rank, pos, new_id;
    // std::priority_queue pops the largest: make that the lowest rank, then the leftmost.
    bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Merge> queue;  // a heap (std::push_heap / std::pop_heap)
  queue.clear();
  const auto push = [&](Merge m) {
    queue.push_back(m);
    std::push_heap(queue.begin(), queue.end());
  };
  const auto pair_key = [](int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  };
  for (size_t k = 0; k + 1 < symbols.size(); ++k) {
    const auto it = merges.find(pair_key(symbols[k].id, symbols[k + 1].id));
    if (it != merges.end()) {
      push({it->second.first, static_cast<int32_t>(k), it->second.second});
    }
  }
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end());
    const Merge top = queue.back();
    queue.pop_back();
    Symbol& left = symbols[top.pos];
    if (left.len == 0 || left.next == -1) continue;
    const int32_t next_pos = left.next;
    const Symbol right = symbols[next_pos];
    const auto it = merges.find(pair_key(left.id, right.id));
    if (it == merges.end() || it->second.second != top.new_id) continue;  // a stale entry
    left.id = top.new_id;
    left.len += right.len;
    left.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      const auto p = merges.find(pair_key(symbols[left.prev].id, left.id));
      if (p != merges.end()) push({p->second.first, left.prev, p->second.second});
    }
    if (left.next >= 0) {
      const auto n = merges.find(pair_key(left.id, symbols[left.next].id));
      if (n != merges.end()) push({n->second.first, top.pos, n->second.second});
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len > 0) out.push_back(s.id);
  }
}

}  // namespace kiln::text::internal
