// plan_memory: the intermediates of a program placed in one arena per device, by liveness.
//
// Each value the pass places gets a byte offset in an arena; two values share bytes only when
// their lifetimes (from the step that writes them to the last step that reads them) do not
// overlap. A run makes one allocation per arena, and the placed ops' kernels write into views
// of it instead of allocating their outputs: the arena's size is the program's planned peak of
// placed intermediates, known before it runs (a CUDA graph will need exactly such fixed
// addresses). The listing shows the arenas in its head line and each placed value's offset
// after its spec (`f32[64, 256] cpu @65536`; `@1:4096` for arena 1).
//
// What is placed: CPU outputs of functional ops that the eager executor runs alone (not in a
// fusion region), under no autocast, with elements. CUDA values are not placed yet: with the
// values that views and in-place ops read left outside, a fixed arena held for the whole run
// raised the compiled training step's peak (llama-3.2-1b on an H200: 25.88 GiB eager, 28.31
// GiB compiled), while the CUDA caching allocator already reuses blocks by liveness. They will
// be, with aliases placed too, for CUDA graphs (part 2). What is not: values the program returns or
// assigns to grads (they outlive the run), and values that a view or an in-place op reads (an
// alias would outlive the value's own last use). Views keep the arena alive, so nothing can
// read freed memory even then.
//
// Placement is greedy, largest first, at the lowest offset free for the value's lifetime
// (256-byte aligned), as the static planners of TFLite and XLA do.
#pragma once

#include "compiler/trace.h"

namespace kiln::compiler {

inline constexpr int64_t kArenaAlignment = 256;

// Places the trace's placeable intermediates (after executor assignment; fusion regions are
// contiguous blocks that run at their last op). Returns the trace with ValueInfo::arena and
// arena_offset set and Trace::arenas sized.
Trace plan_memory(const Trace& trace);

// The bytes of the placed values added up (what the arena would need without reuse).
int64_t placed_bytes(const Trace& trace);

}  // namespace kiln::compiler
