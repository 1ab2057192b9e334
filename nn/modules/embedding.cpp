// Embedding.
#include "nn/modules/embedding.h"

#include "autograd/grad_mode.h"
#include "nn/init.h"
#include "tensor/ops.h"

namespace kiln::nn {

EmbeddingImpl::EmbeddingImpl(EmbeddingOptions options_) : options(std::move(options_)) {
  const int64_t n = options.num_embeddings();
  KILN_CHECK(n >= 0 && options.embedding_dim() >= 0,
             "[Embedding] num_embeddings and embedding_dim must be non-negative, got ", n, " and ",
             options.embedding_dim());
  if (auto& p = options.padding_idx()) {
    KILN_CHECK(*p >= -n && *p < n, "[Embedding] padding_idx must be within [", -n, ", ", n,
               "), got ", *p);
    if (*p < 0) *p += n;
  }
  if (options._weight().defined()) {
    const Tensor& w = options._weight();
    KILN_CHECK(w.dim() == 2 && w.size(0) == n && w.size(1) == options.embedding_dim(),
               "[Embedding] _weight must have shape [", n, ", ", options.embedding_dim(), "], got ",
               shape_str(w.sizes()));
    weight = register_parameter("weight", w.detach());
  } else {
    weight = register_parameter("weight", kiln::empty({n, options.embedding_dim()}));
    reset_parameters();
  }
}

void EmbeddingImpl::reset_parameters() {
  init::normal_(weight);
  if (options.padding_idx()) {
    NoGradGuard no_grad;
    weight[*options.padding_idx()].fill_(0);
  }
}

Tensor EmbeddingImpl::forward(const Tensor& input) {
  return functional::embedding(
      input, weight, functional::EmbeddingFuncOptions().padding_idx(options.padding_idx()));
}

void EmbeddingImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::Embedding(num_embeddings=" << options.num_embeddings()
         << ", embedding_dim=" << options.embedding_dim();
  if (options.padding_idx()) stream << ", padding_idx=" << *options.padding_idx();
  stream << ")";
}

// Built from the same options, then given this module's values (nn/module.h, clone_layer).
std::shared_ptr<Module> EmbeddingImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<EmbeddingImpl>(options), device);
}

}  // namespace kiln::nn
