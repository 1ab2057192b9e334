// Loading a tokenizer.json into the pipeline of text/internal/pipeline.h. The model (nearly
// all of the file) is read straight from the JsonReader; the small components through
// JsonValue, since their keys may come in any order.

#include <cmath>
#include <cstdint>

#include "nn/json.h"
#include "nn/safetensors.h"
#include "tensor/error.h"
#include "text/internal/json_value.h"
#include "text/internal/pipeline.h"
#include "text/internal/unicode.h"
#include "text/tokenizer.h"

namespace kiln::text {
namespace internal {
namespace {

class Loader {
 public:
  explicit Loader(Pipeline& p) : p_(p) {}

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    KILN_FAIL("[Tokenizer] ", p_.name, ": ", args...);
  }

  std::string type_of(const JsonValue& v, const char* what) const {
    const JsonValue* t = v.find("type");
    if (t == nullptr || !t->is_string()) fail(what, " without a \"type\"");
    return t->string;
  }
  const JsonValue& member(const JsonValue& v, const char* key, const std::string& what) const {
    const JsonValue* m = v.find(key);
    if (m == nullptr) fail(what, " has no \"", key, "\"");
    return *m;
  }
  std::string string_of(const JsonValue& v, const char* key, const std::string& what) const {
    const JsonValue& m = member(v, key, what);
    if (!m.is_string()) fail(what, ": \"", key, "\" is not a string");
    return m.string;
  }
  bool bool_of(const JsonValue& v, const char* key, bool fallback) const {
    const JsonValue* m = v.find(key);
    if (m == nullptr || m->is_null()) return fallback;
    if (m->kind != JsonValue::Kind::kBool) fail("\"", key, "\" is not a boolean");
    return m->boolean;
  }
  int64_t int_of(const JsonValue& v, const std::string& what) const {
    // The range check comes first: converting a double outside int64 is undefined.
    if (v.kind != JsonValue::Kind::kNumber || !(std::abs(v.number) < 0x1p63) ||
        v.number != static_cast<double>(static_cast<int64_t>(v.number))) {
      fail(what, " is not an integer");
    }
    return static_cast<int64_t>(v.number);
  }
  // A token id: an integer in [0, 2^31).
  int32_t token_id_of(const JsonValue& v, const std::string& what) const {
    const int64_t id = int_of(v, what);
    if (id < 0 || id > INT32_MAX) fail(what, " ", id, " is not a token id (0 to 2^31 - 1)");
    return static_cast<int32_t>(id);
  }
  const std::vector<JsonValue>& array_of(const JsonValue& v, const char* key,
                                         const std::string& what) const {
    const JsonValue& m = member(v, key, what);
    if (!m.is_array()) fail(what, ": \"", key, "\" is not an array");
    return m.array;
  }

  Pattern pattern(const JsonValue& v, const std::string& what) const {
    const JsonValue& m = member(v, "pattern", what);
    if (const JsonValue* s = m.find("String"); s && s->is_string()) return {s->string, nullptr};
    if (const JsonValue* r = m.find("Regex"); r && r->is_string()) {
      try {
        return {"", std::make_shared<const Regex>(r->string)};
      } catch (const kiln::Error& e) {
        fail(what, ": ", e.what());
      }
    }
    fail(what, ": \"pattern\" is neither {\"String\": ...} nor {\"Regex\": ...}");
  }

  PrependScheme prepend_scheme(const JsonValue& v, const std::string& what) const {
    PrependScheme scheme = PrependScheme::kAlways;
    if (const JsonValue* s = v.find("prepend_scheme"); s && s->is_string()) {
      if (s->string == "always") {
        scheme = PrependScheme::kAlways;
      } else if (s->string == "first") {
        scheme = PrependScheme::kFirst;
      } else if (s->string == "never") {
        scheme = PrependScheme::kNever;
      } else {
        fail(what, ": unknown prepend_scheme '", s->string, "'");
      }
    }
    if (!bool_of(v, "add_prefix_space", true)) scheme = PrependScheme::kNever;  // older files
    return scheme;
  }

  std::string one_char(const JsonValue& v, const char* key, const std::string& what) const {
    std::string s = string_of(v, key, what);
    if (s.empty() || utf8_length(static_cast<unsigned char>(s[0])) != s.size()) {
      fail(what, ": \"", key, "\" must be one character, got '", s, "'");
    }
    return s;
  }

  Normalizer normalizer(const JsonValue& v) const {
    Normalizer n;
    const std::string type = type_of(v, "normalizer");
    const std::string what = "normalizer " + type;
    if (type == "Sequence") {
      n.kind = Normalizer::Kind::kSequence;
      for (const JsonValue& c : array_of(v, "normalizers", what))
        n.children.push_back(normalizer(c));
    } else if (type == "Prepend") {
      n.kind = Normalizer::Kind::kPrepend;
      n.text = string_of(v, "prepend", what);
    } else if (type == "Replace") {
      n.kind = Normalizer::Kind::kReplace;
      n.pattern = pattern(v, what);
      n.text = string_of(v, "content", what);
    } else {
      fail("unsupported normalizer '", type, "' (supported: Sequence, Prepend, Replace)");
    }
    return n;
  }

  PreTokenizer pre_tokenizer(const JsonValue& v) const {
    PreTokenizer t;
    const std::string type = type_of(v, "pre_tokenizer");
    const std::string what = "pre_tokenizer " + type;
    if (type == "Sequence") {
      t.kind = PreTokenizer::Kind::kSequence;
      for (const JsonValue& c : array_of(v, "pretokenizers", what)) {
        t.children.push_back(pre_tokenizer(c));
      }
    } else if (type == "ByteLevel") {
      t.kind = PreTokenizer::Kind::kByteLevel;
      t.add_prefix_space = bool_of(v, "add_prefix_space", true);
      t.use_regex = bool_of(v, "use_regex", true);
    } else if (type == "Split") {
      t.kind = PreTokenizer::Kind::kSplit;
      t.pattern = pattern(v, what);
      t.invert = bool_of(v, "invert", false);
      const std::string b = string_of(v, "behavior", what);
      if (b == "Removed") {
        t.behavior = SplitBehavior::kRemoved;
      } else if (b == "Isolated") {
        t.behavior = SplitBehavior::kIsolated;
      } else if (b == "MergedWithPrevious") {
        t.behavior = SplitBehavior::kMergedWithPrevious;
      } else if (b == "MergedWithNext") {
        t.behavior = SplitBehavior::kMergedWithNext;
      } else if (b == "Contiguous") {
        t.behavior = SplitBehavior::kContiguous;
      } else {
        fail(what, ": unknown behavior '", b, "'");
      }
    } else if (type == "Metaspace") {
      t.kind = PreTokenizer::Kind::kMetaspace;
      t.replacement = one_char(v, "replacement", what);
      t.prepend_scheme = prepend_scheme(v, what);
      t.split = bool_of(v, "split", true);
    } else {
      fail("unsupported pre_tokenizer '", type,
           "' (supported: Sequence, ByteLevel, Split, Metaspace)");
    }
    return t;
  }

  Decoder decoder(const JsonValue& v) const {
    Decoder d;
    const std::string type = type_of(v, "decoder");
    const std::string what = "decoder " + type;
    if (type == "Sequence") {
      d.kind = Decoder::Kind::kSequence;
      for (const JsonValue& c : array_of(v, "decoders", what)) d.children.push_back(decoder(c));
    } else if (type == "ByteLevel") {
      d.kind = Decoder::Kind::kByteLevel;
    } else if (type == "Metaspace") {
      d.kind = Decoder::Kind::kMetaspace;
      d.text = one_char(v, "replacement", what);
      d.prepend_scheme = prepend_scheme(v, what);
    } else if (type == "Replace") {
      d.kind = Decoder::Kind::kReplace;
      d.pattern = pattern(v, what);
      d.text = string_of(v, "content", what);
    } else if (type == "ByteFallback") {
      d.kind = Decoder::Kind::kByteFallback;
    } else if (type == "Fuse") {
      d.kind = Decoder::Kind::kFuse;
    } else if (type == "Strip") {
      d.kind = Decoder::Kind::kStrip;
      d.text = one_char(v, "content", what);
      d.start = static_cast<size_t>(int_of(member(v, "start", what), what + " start"));
      d.stop = static_cast<size_t>(int_of(member(v, "stop", what), what + " stop"));
    } else {
      fail("unsupported decoder '", type,
           "' (supported: Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip)");
    }
    return d;
  }

  // Puts what the post-processor adds around a single sequence into prefix/suffix.
  void post_processor(const JsonValue& v) const {
    const std::string type = type_of(v, "post_processor");
    const std::string what = "post_processor " + type;
    if (type == "Sequence") {
      for (const JsonValue& c : array_of(v, "processors", what)) post_processor(c);
    } else if (type == "ByteLevel") {
      // Offsets only: no ids.
    } else if (type == "TemplateProcessing") {
      const JsonValue& specials = member(v, "special_tokens", what);
      std::vector<int32_t> before, after;
      bool seen_a = false;
      for (const JsonValue& item : array_of(v, "single", what)) {
        if (const JsonValue* s = item.find("SpecialToken")) {
          const std::string id = string_of(*s, "id", what + " SpecialToken");
          const JsonValue* entry = specials.find(id);
          if (entry == nullptr) fail(what, ": special token '", id, "' not in special_tokens");
          for (const JsonValue& x : array_of(*entry, "ids", what + " " + id)) {
            (seen_a ? after : before).push_back(token_id_of(x, what + " id"));
          }
        } else if (const JsonValue* s = item.find("Sequence")) {
          if (string_of(*s, "id", what + " Sequence") != "A") {
            fail(what, ": the single template names a sequence other than A");
          }
          seen_a = true;
        } else {
          fail(what, ": unknown template item");
        }
      }
      p_.prefix.insert(p_.prefix.begin(), before.begin(), before.end());
      p_.suffix.insert(p_.suffix.end(), after.begin(), after.end());
    } else if (type == "RobertaProcessing" || type == "BertProcessing") {
      const auto id_of = [&](const char* key) {
        const std::vector<JsonValue>& pair = array_of(v, key, what);
        if (pair.size() != 2) fail(what, ": \"", key, "\" is not [token, id]");
        return token_id_of(pair[1], what + " " + key);
      };
      p_.prefix.insert(p_.prefix.begin(), id_of("cls"));
      p_.suffix.push_back(id_of("sep"));
    } else {
      fail("unsupported post_processor '", type,
           "' (supported: Sequence, ByteLevel, TemplateProcessing, RobertaProcessing, "
           "BertProcessing)");
    }
  }

  void added_tokens(const JsonValue& v) const {
    if (!v.is_array()) fail("\"added_tokens\" is not an array");
    for (const JsonValue& e : v.array) {
      AddedToken t;
      t.id = token_id_of(member(e, "id", "added token"), "added token id");
      t.content = string_of(e, "content", "added token");
      t.single_word = bool_of(e, "single_word", false);
      t.lstrip = bool_of(e, "lstrip", false);
      t.rstrip = bool_of(e, "rstrip", false);
      t.special = bool_of(e, "special", false);
      t.normalized = bool_of(e, "normalized", !t.special);
      p_.added.push_back(std::move(t));
    }
  }

  // "model": {"type": "BPE", "vocab": {...}, "merges": [...], ...}
  void model(nn::JsonReader& r) const {
    Bpe& m = p_.model;
    std::string type;
    std::optional<std::string> unk;
    std::vector<std::pair<std::string, std::string>> merges;
    r.begin_object();
    while (auto key = r.next_key()) {
      const std::string& k = *key;
      if (k == "type") {
        type = r.read_string();
      } else if (k == "vocab") {
        r.begin_object();
        while (auto token = r.next_key()) {
          const int64_t id = r.read_int64("vocab id");
          if (id < 0 || id > INT32_MAX) fail("model vocab: id ", id, " of '", *token, "'");
          m.vocab[std::move(*token)] = static_cast<int32_t>(id);
        }
      } else if (k == "merges") {
        r.begin_array();
        while (r.next_element()) {
          if (r.peek_kind() == '"') {
            const std::string merge = r.read_string();
            const size_t space = merge.find(' ');
            if (space == std::string::npos || merge.find(' ', space + 1) != std::string::npos) {
              fail("model merges: '", merge, "' is not two tokens separated by a space");
            }
            merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
          } else {
            r.begin_array();
            std::vector<std::string> pair;
            while (r.next_element()) pair.push_back(r.read_string());
            if (pair.size() != 2) fail("model merges: entry ", merges.size(), " is not a pair");
            merges.emplace_back(std::move(pair[0]), std::move(pair[1]));
          }
        }
      } else if (k == "unk_token") {
        if (r.peek_kind() == 'z') {
          r.read_null();
        } else {
          unk = r.read_string();
        }
      } else if (k == "byte_fallback" || k == "fuse_unk" || k == "ignore_merges") {
        const bool b = r.peek_kind() == 'z' ? (r.read_null(), false) : r.read_bool(k);
        (k == "byte_fallback" ? m.byte_fallback
         : k == "fuse_unk"    ? m.fuse_unk
                              : m.ignore_merges) = b;
      } else if (k == "dropout") {
        if (r.peek_kind() == 'z') {
          r.read_null();
        } else if (const double d = r.read_double("dropout"); d != 0) {
          fail("model BPE: dropout ", d, " is not supported (only null or 0)");
        }
      } else if (k == "continuing_subword_prefix" || k == "end_of_word_suffix") {
        if (r.peek_kind() == 'z') {
          r.read_null();
        } else if (const std::string s = r.read_string(); !s.empty()) {
          fail("model BPE: ", k, " '", s, "' is not supported");
        }
      } else {
        r.skip_value();
      }
    }
    if (type != "BPE") fail("unsupported model '", type, "' (supported: BPE)");
    int32_t max_id = -1;
    for (const auto& [token, id] : m.vocab) max_id = std::max(max_id, id);
    // id_to_token is dense: a vocabulary with a few huge ids would allocate gigabytes.
    if (max_id >= static_cast<int64_t>(m.vocab.size()) + (int64_t{1} << 20)) {
      fail("model vocab: id ", max_id, " is more than 2^20 past the ", m.vocab.size(),
           " tokens (the ids of a vocabulary are dense)");
    }
    m.id_to_token.assign(max_id + 1, std::string());
    m.has_id.assign(max_id + 1, 0);
    for (const auto& [token, id] : m.vocab) m.id_to_token[id] = token, m.has_id[id] = 1;
    m.merges.reserve(merges.size());
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const auto& [a, b] = merges[rank];
      const auto ia = m.vocab.find(a), ib = m.vocab.find(b), iab = m.vocab.find(a + b);
      if (ia == m.vocab.end() || ib == m.vocab.end() || iab == m.vocab.end()) {
        fail("model merges: merge ", rank, " ('", a, "', '", b, "') names a token that is not in ",
             "the vocabulary");
      }
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(ia->second)) << 32) |
                           static_cast<uint32_t>(ib->second);
      m.merges.try_emplace(key, static_cast<int32_t>(rank), iab->second);
    }
    if (unk) {
      const auto it = m.vocab.find(*unk);
      if (it == m.vocab.end()) fail("model BPE: unk_token '", *unk, "' is not in the vocabulary");
      m.unk_id = it->second;
    }
    m.finish();
  }

 private:
  Pipeline& p_;
};

int32_t find_special(const Pipeline& p, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const auto it = p.added_by_content.find(name);
    if (it != p.added_by_content.end() && p.added[p.added_by_id.at(it->second)].special) {
      return it->second;
    }
  }
  return -1;
}

}  // namespace
}  // namespace internal

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json(read_file(path, "Tokenizer"), path);
}

Tokenizer Tokenizer::from_json(std::string_view json, const std::string& name) {
  using internal::JsonValue;
  auto p = std::make_shared<internal::Pipeline>();
  p->name = name;
  internal::Loader loader(*p);
  JsonValue normalizer, pre_tokenizer, post_processor, decoder, added;
  bool has_model = false;
  try {
    nn::JsonReader r(json);
    r.begin_object();
    while (auto key = r.next_key()) {
      if (*key == "model") {
        loader.model(r);
        has_model = true;
      } else if (*key == "normalizer") {
        normalizer = JsonValue::read(r);
      } else if (*key == "pre_tokenizer") {
        pre_tokenizer = JsonValue::read(r);
      } else if (*key == "post_processor") {
        post_processor = JsonValue::read(r);
      } else if (*key == "decoder") {
        decoder = JsonValue::read(r);
      } else if (*key == "added_tokens") {
        added = JsonValue::read(r);
      } else {
        r.skip_value();  // version, truncation, padding
      }
    }
    r.end_document();
  } catch (const nn::JsonError& e) {
    KILN_FAIL("[Tokenizer] ", name, ": invalid JSON: ", e.what());
  }
  if (!has_model) loader.fail("no \"model\"");
  if (!normalizer.is_null()) {
    p->normalizer = std::make_unique<internal::Normalizer>(loader.normalizer(normalizer));
  }
  if (!pre_tokenizer.is_null()) {
    p->pre_tokenizer =
        std::make_unique<internal::PreTokenizer>(loader.pre_tokenizer(pre_tokenizer));
  }
  if (!decoder.is_null()) p->decoder = std::make_unique<internal::Decoder>(loader.decoder(decoder));
  if (!post_processor.is_null()) loader.post_processor(post_processor);
  if (!added.is_null()) loader.added_tokens(added);

  int64_t max_id = static_cast<int64_t>(p->model.id_to_token.size()) - 1;
  for (size_t i = 0; i < p->added.size(); ++i) {
    internal::AddedToken& t = p->added[i];
    t.decoded = t.content;
    if (t.normalized && p->normalizer) p->normalizer->apply(t.decoded);
    p->added_by_content[t.content] = t.id;
    p->added_by_id[t.id] = i;
    (t.normalized ? p->normalized_matcher : p->raw_matcher)
        .add(t.normalized ? t.decoded : t.content, i);
    max_id = std::max<int64_t>(max_id, t.id);
  }
  // The post-processor's ids are ids that encode() returns, even when no token has them.
  for (const int32_t id : p->prefix) max_id = std::max<int64_t>(max_id, id);
  for (const int32_t id : p->suffix) max_id = std::max<int64_t>(max_id, id);
  p->vocab_size = max_id + 1;
  p->bos_id =
      p->prefix.size() == 1
          ? p->prefix[0]
          : internal::find_special(*p, {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
  p->eos_id =
      p->suffix.size() == 1
          ? p->suffix[0]
          : internal::find_special(*p, {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"});
  return Tokenizer(std::move(p));
}

}  // namespace kiln::text
