// What the FSDP tests share on both sides (fsdp_test.cpp in the test's process, fsdp_worker.cpp
// in each rank's): sharding a GPT as kiln pretrain does, and the model of the memory checks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "dist/fsdp.h"
#include "models/gpt.h"
#include "models/gpt_hooks.h"

namespace kiln::dist::testing {

// Shards `m` over `pg` as kiln pretrain does: a unit per block (appended to `blocks`) and the
// root, each block gathered as the forward reaches it (set_gather_per_unit and GPT's block hook,
// which holds the blocks' units). Returns the root.
inline std::shared_ptr<FSDPModule> shard_per_block(
    models::GPT& m, const std::shared_ptr<ProcessGroup>& pg, const FSDPOptions& o,
    std::vector<std::shared_ptr<FSDPModule>>& blocks) {
  for (size_t l = 0; l < m->h->size(); ++l) blocks.push_back(fully_shard(m->h[l], pg, o));
  auto root = fully_shard(m, pg, o);
  root->set_gather_per_unit(true);
  models::set_block_hook(*m, [blocks](int64_t layer, bool before) {
    auto& unit = *blocks.at(static_cast<size_t>(layer));
    before ? unit.before_forward() : unit.after_forward();
  });
  return root;
}

// The memory checks' model: the tiny Llama made 16 blocks deep and 256 wide, so that its
// parameters, not its activations (16 tokens), dominate what a step holds.
inline models::ModelConfig deep_tiny_llama() {
  models::ModelConfig c = models::ModelConfig::from_name("tiny-llama");
  c.n_layer = 16;
  c.n_embd = 256;
  c.n_head = 4;
  c.head_size = 64;
  c.intermediate_size = 688;
  return c;
}

// The bytes of the shards (this rank's) of `root` and `blocks`, `element` bytes each: the shards'
// gradients after a backward.
inline int64_t shard_bytes(const FSDPModule& root,
                           const std::vector<std::shared_ptr<FSDPModule>>& blocks,
                           int64_t element) {
  int64_t n = root.sharded_numel();
  for (const auto& b : blocks) n += b->sharded_numel();
  return n * element;
}

}  // namespace kiln::dist::testing
