// Storages over memory kiln does not own: from_blob without a deleter. kiln::compile's tracer
// copies such a tensor when it captures it, because the memory may be gone (or hold other
// values) when the compiled program runs. Internal to kiln.
#pragma once

#include "tensor/storage.h"

namespace kiln::internal {

// Records that `storage` borrows its memory (called by from_blob).
void note_borrowed(const Storage& storage);
// Whether `storage` was made over borrowed memory.
bool is_borrowed(const StorageImpl* storage);

}  // namespace kiln::internal
