// Block hooks of a GPT: a function called around each block's forward with the block's index,
// before (before = true) and after (false) it. FSDP's per-block gather uses them
// (models/trainer_dist.cpp, dist/fsdp.h's before_forward / after_forward) in place of the forward
// pre- and post-hooks that kiln's modules do not have. One hook per model; an empty function
// removes it. Setting it while the model runs a forward on another thread is a race.
#pragma once

#include <cstdint>
#include <functional>

#include "models/gpt.h"

namespace kiln::models {

using BlockHook = std::function<void(int64_t layer, bool before)>;
void set_block_hook(const GPTImpl& model, BlockHook hook);

}  // namespace kiln::models
