// Hooks of a GPT, for data parallelism (models/trainer_dist.cpp), in place of the forward pre-
// and post-hooks that kiln's modules do not have. One hook of each kind per model; an empty
// function removes it. Setting one while the model runs a forward on another thread is a race.
//
// - Block hooks: a function called around each block's forward with the block's index, before
//   (before = true) and after (false) it. FSDP's per-block gather uses them (dist/fsdp.h's
//   before_forward / after_forward).
// - Embedding hooks: the token embedding's lookup, in place of kiln::embedding(table, idx). DDP's
//   gathered_embedding uses it for a table tied to the LM head (dist/ddp.h).
#pragma once

#include <cstdint>
#include <functional>

#include "models/gpt.h"

namespace kiln::models {

using BlockHook = std::function<void(int64_t layer, bool before)>;
void set_block_hook(const GPTImpl& model, BlockHook hook);

using EmbeddingHook = std::function<Tensor(const Tensor& table, const Tensor& idx)>;
void set_embedding_hook(const GPTImpl& model, EmbeddingHook hook);

}  // namespace kiln::models
