// kiln::pretrain::ShardLoader: fixed-length training sequences streamed from token shards (one
// pread per sequence), in a seeded order, each rank a disjoint part, resumable and rescalable from a small
// state. docs/data.md gives the semantics; pretrain/shard.h the file format.
//
//   auto shards = std::make_shared<ShardSet>(ShardSet::open({"data/shards"}));
//   ShardLoader loader(shards, {.seq_len = 1024, .batch_size = 8, .rank = r, .world_size = n,
//                               .seed = 1337});
//   auto [x, y] = loader.next();           // int64 [8, 1024]; y is x shifted left by one
//   std::string saved = loader.state().to_json();        // into the checkpoint
//   ...
//   ShardLoader resumed(shards, {... any rank count, any batch ...});
//   resumed.load_state(LoaderState::from_json(saved, "trainer_state.json"));
//   // the next unseen sequences: nothing repeated, nothing skipped
//
// The order. Every shard is cut into windows of seq_len + 1 tokens that start seq_len tokens
// apart (a window's last token is the next one's first; no window crosses a shard). The windows,
// numbered shard by shard, are split: the last V = min(floor(W * val_fraction),
// max_val_sequences) are the validation part, the first T = W - V the training part. Epoch e
// visits the T training windows in the order of a seeded pseudo-random permutation (a Feistel
// network with cycle walking, keyed by seed and e: no table, O(1) per lookup), so global
// training sequence g is window perm_{g / T}(g % T).
//
// Ranks. A step of the whole job consumes world_size * batch_size global sequences: rank r reads
// sequences P + r * batch_size + b (b < batch_size), then every rank advances P by
// world_size * batch_size. The position P (global sequences consumed) is the whole state, so a
// resume with another world_size or batch_size goes on at P: no sequence is read twice and none
// is skipped. State also records what P is a position in (the seed, seq_len, the number of
// training windows and a fingerprint of the shards); load_state refuses a state of other data.
//
// Pitfalls:
// - Errors are kiln::Error "[loader] ..." naming the files and numbers (a shard set too short for
//   one window, shards of different tokenizers, a state of other data).
// - Tokens after a shard's last full window (fewer than seq_len of them) are never read.
// - A ShardLoader is not thread-safe; the ShardSet it shares is (read-only).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pretrain/shard.h"
#include "tensor/tensor.h"

namespace kiln::nn {
class JsonReader;
}

namespace kiln::pretrain {

// Shards of one tokenizer, in order.
class ShardSet {
 public:
  // Each path is a shard file or a directory (its *.tokens files in name order). Errors on a
  // missing path, a directory without shards, or shards that disagree on the tokenizer
  // (fingerprint, vocab_size, eos_id). verify: ShardFile::open's full check of every shard.
  static ShardSet open(const std::vector<std::string>& paths, bool verify = true);
  // `spec`: one path, or several separated by commas.
  static ShardSet open(const std::string& spec, bool verify = true);

  size_t size() const { return shards_.size(); }
  const ShardFile& operator[](size_t i) const { return shards_[i]; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const;
  int64_t vocab_size() const { return shards_.front().meta().vocab_size; }
  int64_t eos_id() const { return shards_.front().meta().eos_id; }
  uint64_t tokenizer_fingerprint() const { return shards_.front().meta().tokenizer_fingerprint; }
  // A hash of every shard's checksum and size, in order: which data a loader state belongs to.
  uint64_t data_fingerprint() const { return data_fingerprint_; }
  // "3 shards, 1234567 tokens (first: dir/shard-00000.tokens)".
  std::string describe() const;

 private:
  std::vector<ShardFile> shards_;
  int64_t num_tokens_ = 0;
  uint64_t data_fingerprint_ = 0;
};

struct LoaderOptions {
  int64_t seq_len = 0;
  int64_t batch_size = 1;  // sequences per rank and step
  int64_t rank = 0;
  int64_t world_size = 1;
  uint64_t seed = 0;
  double val_fraction = 0.1;         // of the windows, held out (the last ones)
  int64_t max_val_sequences = 1024;  // ... but at most this many
};

// The loader's position and what it is a position in.
struct LoaderState {
  uint64_t position = 0;  // global training sequences consumed, by all ranks together
  uint64_t seed = 0;
  int64_t seq_len = 0;
  int64_t train_sequences = 0;  // T, the training windows per epoch
  uint64_t data_fingerprint = 0;

  // {"position": 96, "seed": 1337, "seq_len": 128, "train_sequences": 8130,
  //  "data_fingerprint": "0123456789abcdef"}
  std::string to_json() const;
  // Errors "[loader] <where>: ..." on a malformed state (missing or unknown fields, bad ranges).
  static LoaderState from_json(std::string_view json, const std::string& where);
  // The same from inside a larger document (the reader stands before the object).
  static LoaderState read_json(nn::JsonReader& r, const std::string& where);
  bool operator==(const LoaderState&) const = default;
};

// A seeded bijection of [0, n) (Feistel network over the next even power of two, cycle walking).
class Permutation {
 public:
  Permutation(uint64_t n, uint64_t seed);
  uint64_t operator()(uint64_t i) const;
  uint64_t size() const { return n_; }

 private:
  uint64_t n_;
  int half_bits_;
  uint64_t mask_;
  uint64_t keys_[6];
};

class ShardLoader {
 public:
  ShardLoader(std::shared_ptr<const ShardSet> shards, const LoaderOptions& options);

  const ShardSet& shards() const { return *shards_; }
  const LoaderOptions& options() const { return o_; }
  int64_t num_train_sequences() const { return train_windows_; }
  int64_t num_val_sequences() const { return val_windows_; }
  uint64_t position() const { return position_; }
  int64_t epoch() const { return static_cast<int64_t>(position_ / train_windows_); }

  // This rank's next batch, (inputs, targets) int64 [batch_size, seq_len] on `device`; advances
  // the position by world_size * batch_size.
  std::pair<Tensor, Tensor> next(Device device = kCPU);
  // The same into caller memory (batch_size * seq_len each).
  void next_into(int64_t* inputs, int64_t* targets);
  // The global sequence numbers this rank's next batch reads (for tests and logs).
  std::vector<uint64_t> next_sequence_ids() const;

  // Validation batch `index`: rows are validation windows (index * batch + b) mod V.
  // Errors when there is no validation part.
  std::pair<Tensor, Tensor> validation_batch(int64_t index, int64_t batch,
                                             Device device = kCPU) const;

  // Global training sequence g -> its window; a window -> its seq_len + 1 tokens.
  int64_t window_of(uint64_t g) const;
  void read_window(int64_t window, int64_t* tokens) const;

  LoaderState state() const;
  // Continues at the state's position. Errors when the state belongs to other data (seed,
  // seq_len, training windows or shard fingerprint differ) unless allow_other_data, which takes
  // the position as a count of sequences in this loader's order.
  void load_state(const LoaderState& s, bool allow_other_data = false);
  void set_position(uint64_t position) { position_ = position; }

 private:
  void fill_rows(const std::vector<int64_t>& windows, int64_t* x, int64_t* y) const;

  std::shared_ptr<const ShardSet> shards_;
  LoaderOptions o_;
  std::vector<int64_t> first_window_;  // per shard, then the total W
  int64_t train_windows_ = 0;
  int64_t val_windows_ = 0;
  uint64_t position_ = 0;
  mutable int64_t perm_epoch_ = -1;
  mutable std::unique_ptr<Permutation> perm_;
};

}  // namespace kiln::pretrain
