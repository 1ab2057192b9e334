// Embedding: a lookup table of num_embeddings rows of embedding_dim values.
//
//   kiln::nn::Embedding emb(kiln::nn::EmbeddingOptions(32000, 512).padding_idx(0));
//   auto h = emb(tokens);            // int64 tokens [B, T] -> [B, T, 512]
//
// The weight starts N(0, 1) as PyTorch; the padding_idx row starts at zero and gets no
// gradient.
#pragma once

#include <cstdint>
#include <optional>
#include <ostream>

#include "nn/functional.h"
#include "nn/module.h"

namespace kiln::nn {

struct EmbeddingOptions {
  EmbeddingOptions(int64_t num_embeddings, int64_t embedding_dim)
      : num_embeddings_(num_embeddings), embedding_dim_(embedding_dim) {}
  KILN_ARG(int64_t, num_embeddings);
  KILN_ARG(int64_t, embedding_dim);
  // Negative values count from the end; stored normalised to [0, num_embeddings).
  KILN_ARG(std::optional<int64_t>, padding_idx) = std::nullopt;
  // A [num_embeddings, embedding_dim] tensor to start from instead of the random draw.
  KILN_ARG(Tensor, _weight) = Tensor();
};

class EmbeddingImpl : public Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t embedding_dim)
      : EmbeddingImpl(EmbeddingOptions(num_embeddings, embedding_dim)) {}
  explicit EmbeddingImpl(EmbeddingOptions options);

  void reset_parameters();
  Tensor forward(const Tensor& input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

  EmbeddingOptions options;
  Tensor weight;  // [num_embeddings, embedding_dim]
};
KILN_MODULE(Embedding);

}  // namespace kiln::nn
