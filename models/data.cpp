#include "models/data.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "pretrain/shard.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/random.h"

namespace kiln::models {
TokenFormat resolve_token_format(const std::string& path, TokenFormat format) {
  if (format != TokenFormat::kAuto) return format;
  auto ends_with = [&](const char* ext) {
    const size_t n = std::strlen(ext);
    return path.size() >= n && path.compare(path.size() - n, n, ext) == 0;
  };
  if (ends_with(".bin") || ends_with(".u16")) return TokenFormat::kUint16;
  if (ends_with(".u32")) return TokenFormat::kUint32;
  return TokenFormat::kText;
}

bool is_shard_data(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return true;
  if (path.empty()) return false;
  std::stringstream parts(path);
  for (std::string part; std::getline(parts, part, ',');) {
    const std::string ext = pretrain::kShardExtension;
    if (part.size() < ext.size() || part.compare(part.size() - ext.size(), ext.size(), ext) != 0) {
      return false;
    }
  }
  return true;
}

TokenDataset TokenDataset::from_file(const std::string& path, TokenFormat format,
                                     double val_fraction) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "[TokenDataset] ", path, ": cannot open the file (missing or unreadable)");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  KILN_CHECK(!in.bad(), "[TokenDataset] ", path, ": read error");
  KILN_CHECK(!bytes.empty(), "[TokenDataset] ", path, ": the file is empty");
  std::vector<uint32_t> tokens;
  switch (resolve_token_format(path, format)) {
    case TokenFormat::kText:
    case TokenFormat::kAuto:
      tokens.reserve(bytes.size());
      for (char c : bytes) tokens.push_back(static_cast<unsigned char>(c));
      break;
    case TokenFormat::kUint16: {
      KILN_CHECK(bytes.size() % 2 == 0, "[TokenDataset] ", path, ": ", bytes.size(),
                 " bytes is not a whole number of uint16 tokens");
      tokens.resize(bytes.size() / 2);
      const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = p[2 * i] | (p[2 * i + 1] << 8);
      break;
    }
    case TokenFormat::kUint32: {
      KILN_CHECK(bytes.size() % 4 == 0, "[TokenDataset] ", path, ": ", bytes.size(),
                 " bytes is not a whole number of uint32 tokens");
      tokens.resize(bytes.size() / 4);
      const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
      for (size_t i = 0; i < tokens.size(); ++i) {
        tokens[i] = static_cast<uint32_t>(p[4 * i]) | static_cast<uint32_t>(p[4 * i + 1]) << 8 |
                    static_cast<uint32_t>(p[4 * i + 2]) << 16 |
                    static_cast<uint32_t>(p[4 * i + 3]) << 24;
      }
      break;
    }
  }
  return from_tokens(std::move(tokens), val_fraction, path);
}

TokenDataset TokenDataset::from_tokens(std::vector<uint32_t> tokens, double val_fraction,
                                       std::string name) {
  KILN_CHECK(val_fraction >= 0.0 && val_fraction < 1.0, "[TokenDataset] ", name,
             ": val_fraction must be in [0, 1), got ", val_fraction);
  KILN_CHECK(!tokens.empty(), "[TokenDataset] ", name, ": no tokens");
  TokenDataset ds;
  ds.name_ = std::move(name);
  const auto n = static_cast<int64_t>(tokens.size());
  ds.train_size_ = n - static_cast<int64_t>(std::floor(static_cast<double>(n) * val_fraction));
  ds.max_token_ = *std::max_element(tokens.begin(), tokens.end());
  ds.tokens_ = std::move(tokens);
  return ds;
}

int64_t TokenDataset::size(Split split) const {
  return split == Split::kTrain ? train_size_ : size() - train_size_;
}

std::pair<Tensor, Tensor> TokenDataset::batch(Split split, int64_t batch, int64_t seq_len,
                                              Device device, uint64_t seed, uint64_t index) const {
  const char* split_name = split == Split::kTrain ? "training" : "validation";
  KILN_CHECK(batch > 0 && seq_len > 0, "[TokenDataset] batch and seq_len must be positive, got ",
             batch, " and ", seq_len);
  const int64_t n = size(split);
  KILN_CHECK(n >= seq_len + 1, "[TokenDataset] ", name_, ": the ", split_name, " split has ", n,
             " tokens, too short for a window of seq_len + 1 = ", seq_len + 1);
  const int64_t begin = split == Split::kTrain ? 0 : train_size_;
  const auto windows = static_cast<uint64_t>(n - seq_len);  // start positions that fit
  Tensor x = empty({batch, seq_len}, kInt64);
  Tensor y = empty({batch, seq_len}, kInt64);
  int64_t* px = x.data_ptr<int64_t>();
  int64_t* py = y.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const philox::Words w = philox::block(seed, index * static_cast<uint64_t>(batch) + b);
    const uint64_t start = begin + philox::bits64(w.w[0], w.w[1]) % windows;
    for (int64_t t = 0; t < seq_len; ++t) {
      px[b * seq_len + t] = tokens_[start + t];
      py[b * seq_len + t] = tokens_[start + t + 1];
    }
  }
  if (!device.is_cpu()) return {x.to(device), y.to(device)};
  return {x, y};
}

}  // namespace kiln::models
