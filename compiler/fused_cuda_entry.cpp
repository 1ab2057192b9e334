// fused_cuda's entry choice (compiler/fused_cuda.h): which entry of a generated kernel a launch
// takes, from its operands' layouts at run time (contiguity, alignment, strides). The executor
// (compiler/fused_cuda.cpp) asks once per run of a region.
#include <atomic>
#include <cstdint>
#include <vector>

#include "compiler/fused_cuda.h"
#include "tensor/error.h"
#include "tensor/shape.h"

namespace kiln::compiler::internal {

namespace {

// Whether operand `o` (its layout `l`) moves in packs of `w` elements along its dim `along`:
// `align`-byte aligned, stride 1 along that dim, and every other stride (of a dim larger than 1)
// a multiple of the pack, so that each pack stays aligned.
bool moves_in_packs(const FusedKernel::Operand& o, const OperandLayout& l, size_t along, int64_t w,
                    int64_t align) {
  if (l.address % static_cast<uint64_t>(align) != 0 || l.strides.size() != o.sizes.size()) {
    return false;
  }
  for (size_t d = 0; d < o.sizes.size(); ++d) {
    if (d == along ? l.strides[d] != 1 : o.sizes[d] != 1 && l.strides[d] % w != 0) return false;
  }
  return true;
}

// Whether the row-vector entry may run: the operands varying along the last dim in 16-byte packs.
bool rowvec_allowed(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                    const std::vector<OperandLayout>& outputs) {
  if (k.rowvec_width == 0 || numel_of(k.sizes) < k.rowvec_width) return false;
  const int64_t d_last = k.sizes.back();
  auto fits = [&](const FusedKernel::Operand& o, const OperandLayout& l) {
    if (o.host_scalar || o.sizes.empty() || o.sizes.back() != d_last) return true;
    return moves_in_packs(o, l, o.sizes.size() - 1, k.rowvec_width, 16);
  };
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (!fits(k.inputs[j], inputs[j])) return false;
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (!fits(k.outputs[j], outputs[j])) return false;
  }
  return true;
}

// Whether the tiled entry may run: each input it tiles still has stride 1 along the domain's
// second-to-last dim (its reads into the tile go along it).
bool tiled_allowed(const FusedKernel& k, const std::vector<OperandLayout>& inputs) {
  if (k.tiled.empty()) return false;
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (!k.tiled[j]) continue;
    const std::vector<int64_t>& s = inputs[j].strides;
    if (s.size() < 2 || s[s.size() - 2] != 1) return false;
  }
  return true;
}

// Whether the tiled entry may run in packs: the tiled inputs' packs along the second-to-last dim,
// the others' (those varying along the last dim, every output) along the last, each aligned to
// its size.
bool tiled_packs_allowed(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                         const std::vector<OperandLayout>& outputs) {
  const int w = k.tiled_pack;
  if (w == 0) return false;
  const int64_t d_last = k.sizes.back();
  auto fits = [&](const FusedKernel::Operand& o, const OperandLayout& l, bool tiled) {
    if (o.host_scalar || o.sizes.empty() || (!tiled && o.sizes.back() != d_last)) return true;
    const size_t r = o.sizes.size();
    return moves_in_packs(o, l, tiled ? r - 2 : r - 1, w,
                          w * static_cast<int64_t>(element_size(o.dtype)));
  };
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (!fits(k.inputs[j], inputs[j], k.tiled[j])) return false;
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (!fits(k.outputs[j], outputs[j], false)) return false;
  }
  return true;
}

}  // namespace

FusedEntry choose_fused_entry(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                              const std::vector<OperandLayout>& outputs) {
  KILN_CHECK(inputs.size() == k.inputs.size() && outputs.size() == k.outputs.size(),
             "[fused_cuda] internal: ", inputs.size(), " + ", outputs.size(),
             " operand layouts for a kernel of ", k.inputs.size(), " + ", k.outputs.size());
  // The entries for operands that are not all contiguous, asked only when they are needed.
  const auto otherwise = [&] {
    if (rowvec_allowed(k, inputs, outputs)) return FusedEntry::kRowVector;
    if (!tiled_allowed(k, inputs)) return FusedEntry::kStrided;
    return tiled_packs_allowed(k, inputs, outputs) ? FusedEntry::kTiledPacks : FusedEntry::kTiled;
  };
  if (!k.has_dense) return otherwise();
  bool aligned = k.vector_width > 0 && numel_of(k.sizes) >= k.vector_width;
  auto check = [&](const FusedKernel::Operand& o, const OperandLayout& l) {
    if (o.host_scalar) return true;
    if (!l.contiguous) return false;
    if (!o.sizes.empty()) aligned = aligned && l.address % 16 == 0;
    return true;
  };
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (!check(k.inputs[j], inputs[j])) return otherwise();
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (!check(k.outputs[j], outputs[j])) return otherwise();
  }
  return aligned ? FusedEntry::kVector : FusedEntry::kDense;
}

FusedEntry choose_row_entry(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                            const std::vector<OperandLayout>& outputs) {
  KILN_CHECK(inputs.size() == k.inputs.size() && outputs.size() == k.outputs.size(),
             "[fused_cuda] internal: ", inputs.size(), " + ", outputs.size(),
             " operand layouts for a kernel of ", k.inputs.size(), " + ", k.outputs.size());
  bool aligned = k.vector_width > 0;
  // A row-packed input: its columns contiguous, every row's start 16-byte aligned.
  auto packs = [&](const FusedKernel::Operand& o, const OperandLayout& l) {
    if (l.address % 16 != 0 || l.strides.size() != o.sizes.size()) return false;
    const size_t lead = k.sizes.size() - o.sizes.size();
    size_t row_dims = k.sizes.size();  // the domain's dims before the trailing (reduced) ones
    for (int64_t c = 1; c < k.cols;) c *= k.sizes[--row_dims];
    int64_t expected = 1;
    for (size_t d = o.sizes.size(); d-- > 0;) {
      if (o.sizes[d] == 1) continue;
      if (d + lead >= row_dims) {
        if (l.strides[d] != expected) return false;
        expected *= o.sizes[d];
      } else if (l.strides[d] % k.vector_width != 0) {
        return false;
      }
    }
    return true;
  };
  auto check = [&](const FusedKernel::Operand& o, const OperandLayout& l) {
    if (o.host_scalar) return true;
    if (o.row_packed) aligned = aligned && packs(o, l);
    if (o.sizes != k.sizes) return true;  // read through its strides
    aligned = aligned && l.address % 16 == 0;
    return l.contiguous;
  };
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (!check(k.inputs[j], inputs[j])) return FusedEntry::kStrided;
  }
  for (size_t j = 0; j < outputs.size(); ++j) {
    if (!check(k.outputs[j], outputs[j])) return FusedEntry::kStrided;
  }
  return aligned ? FusedEntry::kVector : FusedEntry::kDense;
}

namespace {
std::atomic<TileWidth>& tile_width_for_testing() {
  static std::atomic<TileWidth> w{TileWidth::kAuto};
  return w;
}
}  // namespace

TileWidth choose_tile_width(int64_t full_tiles, int64_t full_slots, int64_t half_tiles,
                            int64_t half_slots) {
  if (const TileWidth w = tile_width_for_testing().load(); w != TileWidth::kAuto) return w;
  if (full_slots <= 0 || half_slots <= 0) return TileWidth::kFull;
  // The share of its waves' slots each fills, tiles / (waves * slots), compared exactly.
  auto capacity = [](int64_t tiles, int64_t slots) { return (tiles + slots - 1) / slots * slots; };
  const int64_t full = capacity(full_tiles, full_slots), half = capacity(half_tiles, half_slots);
  return half_tiles * full >= full_tiles * half ? TileWidth::kHalf : TileWidth::kFull;
}

void set_tile_width_for_testing(TileWidth w) { tile_width_for_testing().store(w); }

}  // namespace kiln::compiler::internal
