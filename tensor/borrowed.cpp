#include "tensor/borrowed.h"

#include <memory>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "tensor/traced_factories.h"

namespace kiln::internal {
namespace {

struct Borrowed {
  std::mutex mu;
  absl::flat_hash_map<const StorageImpl*, std::weak_ptr<StorageImpl>> storages;
  size_t prune_at = 64;
};

Borrowed& borrowed() {
  static Borrowed b;
  return b;
}

}  // namespace

void note_borrowed(const Storage& storage) {
  Borrowed& b = borrowed();
  std::lock_guard<std::mutex> lock(b.mu);
  if (b.storages.size() >= b.prune_at) {  // forget storages that are gone
    absl::erase_if(b.storages, [](const auto& kv) { return kv.second.expired(); });
    b.prune_at = 2 * b.storages.size() + 64;
  }
  b.storages[storage.get()] = storage;
}

bool is_borrowed(const StorageImpl* storage) {
  Borrowed& b = borrowed();
  std::lock_guard<std::mutex> lock(b.mu);
  auto it = b.storages.find(storage);
  if (it == b.storages.end()) return false;
  const std::shared_ptr<StorageImpl> alive = it->second.lock();
  return alive.get() == storage;
}

namespace {
thread_local bool t_factories_traced = false;
}  // namespace

bool factories_traced() { return t_factories_traced; }
TracedFactoriesScope::TracedFactoriesScope() : previous_(t_factories_traced) {
  t_factories_traced = true;
}
TracedFactoriesScope::~TracedFactoriesScope() { t_factories_traced = previous_; }

}  // namespace kiln::internal
