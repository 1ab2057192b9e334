// kiln::models::TokenDataset: the tokens of a pretraining corpus, split into a training and a
// held-out validation part, and seeded random batches of windows from either.
//
//   auto ds = kiln::models::TokenDataset::from_file("data/tinyshakespeare.txt");  // byte tokens
//   auto [x, y] = ds.batch(kiln::models::Split::kTrain, /*batch=*/8, /*seq_len=*/128,
//                          kiln::kCPU, /*seed=*/0, /*index=*/step);
//   // x, y: int64 [8, 128]; y is x shifted left by one (each row is one [129] window)
//
// Files: a text file is read as bytes (token = byte, the ByteTokenizer's ids); a binary token
// file holds little-endian uint16 (".bin", ".u16": the nanoGPT convention) or uint32 (".u32")
// ids back to back. TokenFormat::kAuto picks by the extension as just said, else text.
//
// Split: the last `val_fraction` (default 10%) of the tokens are the validation part, the rest
// the training part; windows never cross from one into the other.
//
// Token shards (pretrain/shard.h, written by `kiln prepare`) are not read here: pretrain streams
// them through kiln::pretrain::ShardLoader (pretrain/loader.h); is_shard_data tells which a
// --data value names.
//
// Batches are a pure function of (seed, index): row b of batch `index` starts at a position
// drawn from Philox block (index * batch + b) keyed by `seed`, uniformly over every window that
// fits in the split. So a resumed run sees exactly the batches an uninterrupted one would, and
// the global RNG (kiln::manual_seed) is neither read nor advanced.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "tensor/tensor.h"

namespace kiln::models {

enum class TokenFormat { kAuto, kText, kUint16, kUint32 };
enum class Split { kTrain, kValidation };

// Whether `path` names token shards: a directory, or shard files (*.tokens) separated by commas.
// Anything else is a file for TokenDataset.
bool is_shard_data(const std::string& path);
// What kAuto reads `path` as (by its extension, as said above); other formats are returned as is.
TokenFormat resolve_token_format(const std::string& path, TokenFormat format = TokenFormat::kAuto);

class TokenDataset {
 public:
  // Errors "[TokenDataset] <path>: ..." for a missing or unreadable file, a binary file whose
  // size is not a multiple of the token size, an empty file or a bad val_fraction.
  static TokenDataset from_file(const std::string& path, TokenFormat format = TokenFormat::kAuto,
                                double val_fraction = 0.1);
  static TokenDataset from_tokens(std::vector<uint32_t> tokens, double val_fraction = 0.1,
                                  std::string name = "<tokens>");

  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t size(Split split) const;
  // The largest token id in the file (for checking it against a model's vocabulary).
  int64_t max_token() const { return max_token_; }
  const std::string& name() const { return name_; }
  const std::vector<uint32_t>& tokens() const { return tokens_; }

  // (inputs, targets), each int64 [batch, seq_len] on `device`. Errors when the split has fewer
  // than seq_len + 1 tokens, naming both numbers.
  std::pair<Tensor, Tensor> batch(Split split, int64_t batch, int64_t seq_len, Device device,
                                  uint64_t seed, uint64_t index) const;

 private:
  std::string name_;
  std::vector<uint32_t> tokens_;
  int64_t train_size_ = 0;  // tokens [0, train_size_) train, [train_size_, size()) validation
  int64_t max_token_ = 0;
};

}  // namespace kiln::models
