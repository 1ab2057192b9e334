// The shard set, the seeded window order and the rank-sharded, resumable loader
// (pretrain/loader.h, docs/data.md). Tests: tests/pretrain/loader_test.cpp; benchmark:
// benchmarks/pretrain_bench.cpp.
#include "pretrain/loader.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "nn/json.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::pretrain {
namespace {

namespace fs = std::filesystem;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) {
    if (!part.empty()) out.push_back(part);
  }
  return out;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

// --- ShardSet ----------------------------------------------------------------------------------

ShardSet ShardSet::open(const std::vector<std::string>& paths, bool verify) {
  KILN_CHECK(!paths.empty(), "[loader] no shard files or directories given");
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    std::error_code ec;
    const auto status = fs::status(p, ec);
    KILN_CHECK(fs::exists(status), "[loader] ", p, ": no such file or directory");
    if (fs::is_directory(status)) {
      std::vector<std::string> found;
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.is_regular_file() && e.path().extension() == kShardExtension) {
          found.push_back(e.path().string());
        }
      }
      KILN_CHECK(!found.empty(), "[loader] ", p, ": a directory without token shards (*",
                 kShardExtension, " files; `kiln prepare` writes them)");
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(p);
    }
  }
  ShardSet set;
  uint64_t fp = 0x6b696c6e2d736574ull;
  for (const std::string& f : files) {
    ShardFile shard = ShardFile::open(f, verify);
    if (!set.shards_.empty()) {
      const ShardMeta& a = set.shards_.front().meta();
      const ShardMeta& b = shard.meta();
      KILN_CHECK(a.tokenizer_fingerprint == b.tokenizer_fingerprint &&
                     a.vocab_size == b.vocab_size && a.eos_id == b.eos_id,
                 "[loader] ", f, " was written by another tokenizer than ",
                 set.shards_.front().path(), " (tokenizer fingerprint ",
                 hex64(b.tokenizer_fingerprint), " vs ", hex64(a.tokenizer_fingerprint),
                 ", vocab_size ", b.vocab_size, " vs ", a.vocab_size, ", eos_id ", b.eos_id, " vs ",
                 a.eos_id, ")");
    }
    fp = splitmix64(fp ^ shard.meta().checksum);
    fp = splitmix64(fp ^ static_cast<uint64_t>(shard.num_tokens()));
    set.num_tokens_ += shard.num_tokens();
    set.shards_.push_back(std::move(shard));
  }
  set.data_fingerprint_ = fp;
  return set;
}

ShardSet ShardSet::open(const std::string& spec, bool verify) {
  return open(split_commas(spec), verify);
}

int64_t ShardSet::num_documents() const {
  int64_t n = 0;
  for (const ShardFile& s : shards_) n += s.meta().num_documents;
  return n;
}

std::string ShardSet::describe() const {
  std::ostringstream s;
  s << shards_.size() << (shards_.size() == 1 ? " shard, " : " shards, ") << num_tokens_
    << " tokens (" << (shards_.size() == 1 ? "" : "first: ") << shards_.front().path() << ")";
  return s.str();
}

// --- LoaderState -------------------------------------------------------------------------------

std::string LoaderState::to_json() const {
  std::ostringstream s;
  s << "{\"position\": " << position << ", \"seed\": " << seed << ", \"seq_len\": " << seq_len
    << ", \"train_sequences\": " << train_sequences << ", \"data_fingerprint\": \""
    << hex64(data_fingerprint) << "\"}";
  return s.str();
}

LoaderState LoaderState::read_json(nn::JsonReader& r, const std::string& where) {
  LoaderState st;
  bool seen[5] = {};
  static constexpr const char* kKeys[5] = {"position", "seed", "seq_len", "train_sequences",
                                           "data_fingerprint"};
  r.begin_object();
  while (auto key = r.next_key()) {
    const auto it = std::find(std::begin(kKeys), std::end(kKeys), *key);
    KILN_CHECK(it != std::end(kKeys), "[loader] ", where, ": unknown loader state field \"", *key,
               "\"");
    const auto k = it - std::begin(kKeys);
    KILN_CHECK(!seen[k], "[loader] ", where, ": loader state field \"", *key, "\" given twice");
    seen[k] = true;
    switch (k) {
      case 0:
        st.position = r.read_uint64("position");
        break;
      case 1:
        st.seed = r.read_uint64("seed");
        break;
      case 2:
        st.seq_len = r.read_int64("seq_len");
        break;
      case 3:
        st.train_sequences = r.read_int64("train_sequences");
        break;
      default: {
        const std::string hex = r.read_string();
        char* end = nullptr;
        st.data_fingerprint = std::strtoull(hex.c_str(), &end, 16);
        KILN_CHECK(hex.size() == 16 && end == hex.c_str() + hex.size(), "[loader] ", where,
                   ": data_fingerprint must be 16 hex digits, got \"", hex, "\"");
      }
    }
  }
  for (int k = 0; k < 5; ++k) {
    KILN_CHECK(seen[k], "[loader] ", where, ": the loader state has no \"", kKeys[k], "\"");
  }
  KILN_CHECK(st.seq_len > 0 && st.train_sequences > 0, "[loader] ", where,
             ": seq_len and train_sequences must be positive, got ", st.seq_len, " and ",
             st.train_sequences);
  return st;
}

LoaderState LoaderState::from_json(std::string_view json, const std::string& where) {
  try {
    nn::JsonReader r(json);
    LoaderState st = read_json(r, where);
    r.end_document();
    return st;
  } catch (const nn::JsonError& e) {
    KILN_FAIL("[loader] ", where, ": ", e.what());
  }
}

// --- Permutation -------------------------------------------------------------------------------

Permutation::Permutation(uint64_t n, uint64_t seed) : n_(n) {
  KILN_CHECK(n > 0, "[loader] a permutation of nothing");
  int bits = std::max(2, static_cast<int>(std::bit_width(n - 1)));
  bits += bits & 1;
  half_bits_ = bits / 2;
  mask_ = (uint64_t{1} << half_bits_) - 1;
  uint64_t k = splitmix64(seed ^ 0x7065726d75746521ull);
  for (uint64_t& key : keys_) key = k = splitmix64(k);
}

uint64_t Permutation::operator()(uint64_t i) const {
  KILN_CHECK(i < n_, "[loader] permutation index ", i, " out of [0, ", n_, ")");
  uint64_t x = i;
  do {  // cycle walking: a bijection of [0, 4^half) restricted to [0, n)
    uint64_t l = x >> half_bits_, r = x & mask_;
    for (const uint64_t key : keys_) {
      const uint64_t f = splitmix64(r ^ key) & mask_;
      const uint64_t t = l ^ f;
      l = r;
      r = t;
    }
    x = (l << half_bits_) | r;
  } while (x >= n_);
  return x;
}

// --- ShardLoader -------------------------------------------------------------------------------

ShardLoader::ShardLoader(std::shared_ptr<const ShardSet> shards, const LoaderOptions& o)
    : shards_(std::move(shards)), o_(o) {
  KILN_CHECK(shards_ != nullptr && shards_->size() > 0, "[loader] no shards");
  KILN_CHECK(o.seq_len > 0 && o.batch_size > 0,
             "[loader] seq_len and batch_size must be positive, got ", o.seq_len, " and ",
             o.batch_size);
  KILN_CHECK(o.world_size > 0 && o.rank >= 0 && o.rank < o.world_size, "[loader] rank ", o.rank,
             " is outside a world of ", o.world_size);
  KILN_CHECK(o.val_fraction >= 0 && o.val_fraction < 1 && o.max_val_sequences >= 0,
             "[loader] val_fraction must be in [0, 1) and max_val_sequences >= 0, got ",
             o.val_fraction, " and ", o.max_val_sequences);
  int64_t w = 0;
  for (size_t i = 0; i < shards_->size(); ++i) {
    first_window_.push_back(w);
    const int64_t n = (*shards_)[i].num_tokens();
    if (n > o.seq_len) w += (n - 1) / o.seq_len;
  }
  first_window_.push_back(w);
  val_windows_ =
      std::min<int64_t>(static_cast<int64_t>(std::floor(static_cast<double>(w) * o.val_fraction)),
                        o.max_val_sequences);
  train_windows_ = w - val_windows_;
  KILN_CHECK(train_windows_ > 0, "[loader] ", shards_->describe(),
             ": no training sequence of seq_len + 1 = ", o.seq_len + 1, " tokens (", w,
             " windows in all, ", val_windows_, " held out for validation)");
}

int64_t ShardLoader::window_of(uint64_t g) const {
  const auto t = static_cast<uint64_t>(train_windows_);
  const auto epoch = static_cast<int64_t>(g / t);
  if (epoch != perm_epoch_) {
    perm_ = std::make_unique<Permutation>(
        t, splitmix64(o_.seed) ^ splitmix64(~static_cast<uint64_t>(epoch)));
    perm_epoch_ = epoch;
  }
  return static_cast<int64_t>((*perm_)(g % t));
}

void ShardLoader::read_window(int64_t window, int64_t* tokens) const {
  KILN_CHECK(window >= 0 && window < first_window_.back(), "[loader] window ", window,
             " out of [0, ", first_window_.back(), ")");
  const auto it = std::upper_bound(first_window_.begin(), first_window_.end() - 1, window) - 1;
  const size_t shard = static_cast<size_t>(it - first_window_.begin());
  (*shards_)[shard].read((window - *it) * o_.seq_len, o_.seq_len + 1, tokens);
}

void ShardLoader::fill_rows(const std::vector<int64_t>& windows, int64_t* x, int64_t* y) const {
  const int64_t t = o_.seq_len;
  std::vector<int64_t> buf(static_cast<size_t>(t + 1));
  for (size_t b = 0; b < windows.size(); ++b) {
    read_window(windows[b], buf.data());
    std::copy(buf.begin(), buf.end() - 1, x + static_cast<int64_t>(b) * t);
    std::copy(buf.begin() + 1, buf.end(), y + static_cast<int64_t>(b) * t);
  }
}

std::vector<uint64_t> ShardLoader::next_sequence_ids() const {
  std::vector<uint64_t> ids;
  const uint64_t base = position_ + static_cast<uint64_t>(o_.rank * o_.batch_size);
  for (int64_t b = 0; b < o_.batch_size; ++b) ids.push_back(base + static_cast<uint64_t>(b));
  return ids;
}

void ShardLoader::next_into(int64_t* inputs, int64_t* targets) {
  std::vector<int64_t> windows;
  for (uint64_t g : next_sequence_ids()) windows.push_back(window_of(g));
  fill_rows(windows, inputs, targets);
  position_ += static_cast<uint64_t>(o_.world_size * o_.batch_size);
}

std::pair<Tensor, Tensor> ShardLoader::next(Device device) {
  Tensor x = empty({o_.batch_size, o_.seq_len}, kInt64);
  Tensor y = empty({o_.batch_size, o_.seq_len}, kInt64);
  next_into(x.data_ptr<int64_t>(), y.data_ptr<int64_t>());
  if (!device.is_cpu()) return {x.to(device), y.to(device)};
  return {x, y};
}

std::pair<Tensor, Tensor> ShardLoader::validation_batch(int64_t index, int64_t batch,
                                                        Device device) const {
  KILN_CHECK(val_windows_ > 0, "[loader] ", shards_->describe(),
             ": no validation sequences (val_fraction ", o_.val_fraction, ")");
  KILN_CHECK(index >= 0 && batch > 0, "[loader] validation_batch(", index, ", ", batch, ")");
  std::vector<int64_t> windows;
  for (int64_t b = 0; b < batch; ++b) {
    windows.push_back(train_windows_ + (index * batch + b) % val_windows_);
  }
  Tensor x = empty({batch, o_.seq_len}, kInt64);
  Tensor y = empty({batch, o_.seq_len}, kInt64);
  fill_rows(windows, x.data_ptr<int64_t>(), y.data_ptr<int64_t>());
  if (!device.is_cpu()) return {x.to(device), y.to(device)};
  return {x, y};
}

LoaderState ShardLoader::state() const {
  LoaderState s;
  s.position = position_;
  s.seed = o_.seed;
  s.seq_len = o_.seq_len;
  s.train_sequences = train_windows_;
  s.data_fingerprint = shards_->data_fingerprint();
  return s;
}

void ShardLoader::load_state(const LoaderState& s, bool allow_other_data) {
  if (!allow_other_data) {
    KILN_CHECK(s.seed == o_.seed, "[loader] the saved position is for seed ", s.seed, ", not ",
               o_.seed);
    KILN_CHECK(s.seq_len == o_.seq_len, "[loader] the saved position is for seq_len ", s.seq_len,
               ", not ", o_.seq_len);
    KILN_CHECK(
        s.train_sequences == train_windows_ && s.data_fingerprint == shards_->data_fingerprint(),
        "[loader] the saved position is in other data (", s.train_sequences,
        " training sequences, fingerprint ", hex64(s.data_fingerprint),
        "; these shards: ", train_windows_, ", ", hex64(shards_->data_fingerprint()), ")");
  }
  position_ = s.position;
}

}  // namespace kiln::pretrain
