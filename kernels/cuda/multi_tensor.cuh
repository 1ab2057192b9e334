// The multi-tensor launch shared by the CUDA kernels that update or read a list of tensors in a
// few launches (adam_update_ in kernels/cuda/optim.cu, foreach_norm and foreach_mul_ in
// kernels/cuda/foreach.cu): a table of tensors in the kernel's arguments (no host-to-device copy
// of a pointer list), each tensor cut into chunks of the same number of elements, one block per
// chunk. A block finds its tensor with entry_of (uniform across the block, read from the constant
// bank).
//
//   struct Entry { void* data; int64_t numel; };
//   using Table = multi_tensor::Table<Entry, 160>;
//   __global__ void k(const __grid_constant__ Table table) {
//     const int i = multi_tensor::entry_of(table, blockIdx.x);
//     const int64_t begin = (blockIdx.x - table.block_start[i]) * kChunk;  ...
//   }
//   auto fill = multi_tensor::table_filler<Table>([&](const Table& t, int64_t first_block) {
//     k<<<t.grid(), kThreads, 0, stream>>>(t);
//   });
//   for (...) fill.add({ptr, numel}, multi_tensor::chunks(numel, kChunk));   // numel > 0
//   fill.flush();
//
// A table with its other kernel arguments must stay within the 4 KiB that every CUDA version and
// device accepts (static_assert it beside the kernel). Internal to kernels/cuda/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "tensor/error.h"

namespace kiln::cuda::internal::multi_tensor {

// Kernel arguments are limited to 4 KiB on every device and CUDA version; keep some room.
inline constexpr size_t kMaxArgBytes = 4000;
// The grid of one launch stays below 2^31 blocks.
inline constexpr int64_t kMaxBlocks = (int64_t{1} << 31) - 1;

// N elements of T as one aligned access (16 bytes for the vectorised loops).
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

__host__ __device__ inline bool aligned(const void* ptr, size_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

inline int64_t chunks(int64_t numel, int64_t chunk) { return (numel + chunk - 1) / chunk; }

// The tensors of one launch: entries t[0, count), entry i owning the blocks
// [block_start[i], block_start[i + 1]) (at least one each).
template <typename Entry, int kMax>
struct Table {
  using entry_type = Entry;
  static constexpr int kCapacity = kMax;
  Entry t[kMax];
  int64_t block_start[kMax + 1];  // block_start[count] = the launch's grid size
  int count;
  unsigned grid() const { return static_cast<unsigned>(block_start[count]); }
};

// The entry that block `block` works on: the last i with block_start[i] <= block.
template <typename TableT>
__device__ __forceinline__ int entry_of(const TableT& table, int64_t block) {
  int lo = 0, hi = table.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (block >= table.block_start[mid]) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Packs entries into tables and launches each when it is full (or its grid would reach 2^31
// blocks): launch(table, first_block), first_block counting the blocks of the earlier launches,
// so that a kernel can index a workspace of one slot per block across launches.
template <typename TableT, typename Launch>
class TableFiller {
 public:
  explicit TableFiller(Launch launch) : launch_(std::move(launch)) {}
  TableFiller(const TableFiller&) = delete;
  TableFiller& operator=(const TableFiller&) = delete;

  // Appends an entry of `blocks` blocks (>= 1); returns the index of its first block over all
  // launches.
  int64_t add(const typename TableT::entry_type& e, int64_t blocks) {
    KILN_CHECK(blocks >= 1 && blocks < kMaxBlocks, "[multi_tensor] a tensor of ", blocks,
               " chunks does not fit one launch");
    if (table_.count == TableT::kCapacity ||
        table_.block_start[table_.count] + blocks > kMaxBlocks) {
      flush();
    }
    const int64_t first = launched_ + table_.block_start[table_.count];
    table_.t[table_.count] = e;
    table_.block_start[table_.count + 1] = table_.block_start[table_.count] + blocks;
    ++table_.count;
    return first;
  }

  // Launches the entries added since the last launch (none: nothing).
  void flush() {
    if (table_.count == 0) return;
    launch_(static_cast<const TableT&>(table_), launched_);
    launched_ += table_.block_start[table_.count];
    table_ = TableT{};
  }

  int64_t blocks() const { return launched_ + table_.block_start[table_.count]; }

 private:
  Launch launch_;
  TableT table_{};
  int64_t launched_ = 0;
};

template <typename TableT, typename Launch>
TableFiller<TableT, Launch> table_filler(Launch launch) {
  return TableFiller<TableT, Launch>(std::move(launch));
}

}  // namespace kiln::cuda::internal::multi_tensor
