// "fused_cuda": generated CUDA kernels for pointwise fusion regions (compiler/fuse.h), compiled
// at run time with NVRTC (docs/compiler.md, "Generated CUDA kernels").
//
// A region such as silu(x * w + b).to(bf16) runs as one kernel: one thread per element of the
// region's largest shape (a grid-stride loop), every input read through its strides with
// broadcasting, each member computed in registers, and only the region's outputs (the values
// read after it, returned or assigned to grads) written to memory. Where every operand is
// contiguous and 16-byte aligned, a thread moves 16 bytes of the narrowest one per load or store
// (the vector entry, chosen at each launch).
//
// Same bits as eager, by construction: each member computes in the type eager's CUDA kernel
// computes in (opmath: float for bf16/f16), with the formulas of kernels/scalar_fn.h (the header
// itself, given to NVRTC by name), and rounds its result to its traced dtype before the next
// member reads it. An
// inline-asm barrier after each float result (its bits xor-ed with a zero the compilers cannot
// see) keeps NVVM and ptxas from contracting a multiply of one member with an add of the next
// into an FMA (eager rounds in between).
//
//   auto f = kiln::compile(fn);                    // fused_cuda is a default executor
//   f(x, w, b);                                    // compiles each region (NVRTC), cached
//   kiln::compiler::fused_cuda_stats().disk_hits;  // kernels found in the disk cache
//
// Kernels are cached in memory (per source and device) and on disk, in KILN_KERNEL_CACHE, else
// $XDG_CACHE_HOME/kiln/kernels, else ~/.cache/kiln/kernels: one file per kernel, named by a hash
// of the source, the GPU architecture and the NVRTC version; written atomically and checked when
// read (a file that does not hold what its name promises is ignored and rebuilt).
//
// Pitfalls: only values on CUDA are claimed, and nothing at all without a usable GPU and NVRTC
// (CPU programs behave as before). Row ops (reductions, softmax) are not generated yet.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "compiler/trace.h"
#include "kernels/disk_cache.h"

namespace kiln::compiler {

struct FusedCudaStats {
  int64_t regions = 0;         // regions lowered to a generated kernel
  int64_t nvrtc_compiles = 0;  // kernels compiled by NVRTC
  int64_t memory_hits = 0;     // kernels found in the in-memory cache
  int64_t disk_hits = 0;       // kernels read from the disk cache
  int64_t disk_rejected = 0;   // cache files ignored (corrupt, truncated, another key)
  int64_t disk_writes = 0;     // cache files written
  int64_t fallbacks = 0;       // regions run op by op (the generator declined them)
  // Launches of each entry (internal::choose_fused_entry picks one per run of a region).
  int64_t strided_launches = 0, dense_launches = 0, vector_launches = 0, rowvec_launches = 0;
  int64_t row_regions = 0;    // of `regions`, those with reductions (row kernels)
  int64_t row_fallbacks = 0;  // runs of a row kernel's region op by op (rows not contiguous)
  int64_t tiled_launches = 0;  // launches of the tiled entry (FusedKernel::tiled), in packs or not
  int64_t tiled_pack_launches = 0;  // of those, in packs (FusedKernel::tiled_pack)
  int64_t tiled_half_launches = 0;  // of those, of half-width tiles (internal::choose_tile_width)
  // Row kernels built again at two blocks a multiprocessor: at three their registers spilled.
  int64_t row_two_block_builds = 0;
};
FusedCudaStats fused_cuda_stats();
void reset_fused_cuda_stats();
// Forgets the in-memory kernels (the next compilation reads the disk cache).
void clear_fused_cuda_memory_cache();

// The disk cache's directory: set_kernel_cache_dir's, else KILN_KERNEL_CACHE, else
// $XDG_CACHE_HOME/kiln/kernels, else $HOME/.cache/kiln/kernels. An empty string restores the
// default; "none" turns the disk cache off.
std::string kernel_cache_dir();
void set_kernel_cache_dir(std::string dir);

// The CUDA source generated for the region trace.ops[begin, end), or nullopt (with `why`) when
// the generator does not handle it. Deterministic: the same region gives the same text.
std::optional<std::string> fused_cuda_source(const Trace& trace, size_t begin, size_t end,
                                             std::string* why = nullptr);

namespace internal {

// Whether the generator writes `op` (by name, dtypes and attributes; devices not checked).
bool fused_cuda_generates(const Trace& trace, const BoundOp& op);

// A generated kernel and how to call it. Its one parameter is `struct { long long v[slots]; }`:
// per tensor input a pointer and a stride per dim of `sizes`, per 0-d CPU input its value's
// bits, per output a pointer and strides, then the op constants (alpha, clamp bounds, ...).
struct FusedKernel {
  std::string source;
  Shape sizes;             // the iteration domain (the broadcast of the members' shapes)
  bool has_dense = false;  // kiln_fused_dense exists (every operand may be dense)
  // Elements per thread of kiln_fused_vector (0: no such entry): 16 / the smallest element size
  // among the tensor operands, so that the narrowest one moves 16 bytes per load or store (a
  // wider one several). It runs where the dense entry may and every tensor operand of the
  // domain's shape starts 16-byte aligned; a scalar tail handles the last numel % width elements.
  int vector_width = 0;
  // Elements per thread of kiln_fused_rowvec (0: no such entry), for kernels without a dense
  // entry (a broadcast row, a per-row column): 16 / the smallest element size among the operands
  // that vary along the domain's last dim, which it divides; every output has the domain's
  // shape. It runs where those operands are 16-byte aligned, with stride 1 along the last dim
  // and their other strides multiples of the width (choose_fused_entry).
  int rowvec_width = 0;
  // kiln_fused_tiled (empty: no such entry), per input: whether the entry reads it through a
  // 32 x 32 tile of shared memory. The domain's last two dims are taken 32 x 32 at a time by a
  // block of 32 x 8 threads; an input the trace records transposed in them (stride 1 along the
  // second-to-last dim, not along the last) is read along its contiguous dim into the tile, and
  // every operand is then read or written along the last dim from it. It runs where the dense
  // entries may not and each such input is still transposed (choose_fused_entry); row kernels
  // have none.
  std::vector<bool> tiled;
  // Elements a thread of kiln_fused_tiled_packs moves at once (0: no such entry): the tiled entry
  // in packs, where the domain's last two dims are multiples of the pack and every output has the
  // domain's shape. Tiles of 32 x 32 packs (kiln_fused_tiled_packs) or 32 x 16
  // (kiln_fused_tiled_packs_half, choose_tile_width); a thread reads a pack of neighbours of a
  // tiled input along its contiguous dim at once (P of them, transposed in registers into the
  // tile), and a pack of the last dim of each other operand varying along it: 8 bytes of the
  // narrowest operand (4 elements of 16 bits, 2 of 32), or 2 elements where the tiles of 4 would
  // take more than 40 KiB. It runs where the tiled entry may and those packs are aligned
  // (choose_fused_entry).
  int tiled_pack = 0;
  struct Operand {
    int value = -1;
    ScalarType dtype = kFloat;
    bool host_scalar = false;  // a 0-d CPU tensor, passed by value
    Shape sizes;
    int slot = 0;  // its first parameter slot
    // Its dims are the domain's leading ones (a reduction's output without keepdim), not its
    // trailing ones as broadcasting aligns them.
    bool leading = false;
    // A row kernel's input that varies along the rows as the domain does but is not of its
    // shape (RMSNorm's weight): the vector entry reads it in packs of vector_width elements.
    bool row_packed = false;
  };
  std::vector<Operand> inputs, outputs;
  std::vector<std::pair<int, uint64_t>> constants;  // (slot, bits)
  int zero_slot = 0;  // holds 0, which the compilers cannot know (the barrier between members)
  int slots = 0;
  // A row kernel (a region with reductions, fused_cuda_rows.cpp): the domain is `rows` rows of
  // `cols` elements (the reduced dims are its trailing ones), each row reduced by a group of
  // row_threads threads (a multiple of 32), rows_per_block groups per block of threads.
  // kiln_rows_dense reads a row one element per thread at a time, kiln_rows_vector (where
  // vector_width > 0) 16 bytes of the narrowest operand; both need every operand of the
  // domain's shape contiguous (choose_row_entry), the vector one 16-byte aligned as well.
  bool row_kernel = false;
  int64_t rows = 0, cols = 0;
  int row_threads = 0, rows_per_block = 0;
  // Bytes of dynamic shared memory a block of the row entries takes (0: none): the shared-memory
  // row cache of long multi-pass rows (fused_cuda_rows.cpp), which the launch must allow above
  // 48 KiB (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
  int64_t row_shared_bytes = 0;
};
// The dynamic shared memory a block may opt in to where the device is not known (the generator's
// tests): H100's and H200's 227 KiB. fused_cuda passes its device's
// (cudaDevAttrMaxSharedMemoryPerBlockOptin).
inline constexpr int64_t kDefaultSharedLimit = 227 * 1024;
// The row planner's choices, which the kernel lab varies (benchmarks/lab/fused_rows_lab.cu); the
// defaults are the library's. A row of `accesses` accesses (16-byte packs in the vector entry)
// gets ceil(accesses / accesses_per_thread) threads, rounded up to warps (32 to 1024); groups of
// fewer than `block_threads` threads share a block, block_threads / row_threads rows to it.
struct RowPlanOptions {
  int accesses_per_thread = 4;
  int block_threads = 256;
};
std::optional<FusedKernel> generate_fused_kernel(const Trace& trace, size_t begin, size_t end,
                                                 std::string* why,
                                                 int64_t shared_limit = kDefaultSharedLimit,
                                                 const RowPlanOptions& rows = {});

// Which entry of a generated kernel a launch runs, from its operands' actual layouts: vector
// where every tensor operand is contiguous, of the domain's shape or 0-d, and those of the
// domain's shape start 16-byte aligned (and there is at least one whole vector); dense where they
// are contiguous; else row-vector where the kernel has that entry and its operands allow it
// (FusedKernel::rowvec_width); else tiled where it has that entry and each input it tiles has
// stride 1 along the domain's second-to-last dim (FusedKernel::tiled), in packs where it has that
// entry and the packs are aligned (FusedKernel::tiled_pack); strided otherwise. One layout per
// entry of k.inputs (host scalars' ignored), then one per entry of k.outputs.
enum class FusedEntry { kStrided, kDense, kVector, kRowVector, kTiled, kTiledPacks };
struct OperandLayout {
  bool contiguous = true;
  uint64_t address = 0;          // the first element's
  std::vector<int64_t> strides;  // the operand's own (for kRowVector; empty: unknown)
};
FusedEntry choose_fused_entry(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                              const std::vector<OperandLayout>& outputs);
// The tiled entry in packs comes in two widths: tiles of 32 x 32 packs (kiln_fused_tiled_packs)
// and of 32 x 16 (kiln_fused_tiled_packs_half, half the shared memory: more blocks a
// multiprocessor). A launch takes the one whose tiles fill the GPU's last wave better: `tiles`
// blocks over `slots` resident at once (blocks a multiprocessor times multiprocessors) fill
// tiles / (ceil(tiles / slots) * slots) of the waves they take; the half tiles where the two are
// equal (more blocks in flight). On an H200, (x.t() + y) * 0.5 over bf16 [8192, 2048] took 1024
// full tiles over 792 slots (65% filled) and ran at 69% of a copy of its bytes; half tiles (2048
// over 1056, 97%) at 87%. Over [16384, 768] the full tiles (768 over 792) ran at 84%, the half
// (1536 over 1056) at 80%; in f32 (both 97% filled) the half tiles were 2% faster
// (benchmarks/RESULTS.md, session 38; the kernel lab's fused_tiled).
enum class TileWidth { kAuto, kFull, kHalf };
TileWidth choose_tile_width(int64_t full_tiles, int64_t full_slots, int64_t half_tiles,
                            int64_t half_slots);
// Tests only: choose_tile_width returns `w` (kAuto: it chooses again).
void set_tile_width_for_testing(TileWidth w);
// The entry of a row kernel: kVector where every operand of the domain's shape is contiguous
// and 16-byte aligned and every row-packed input's columns are contiguous with each row 16-byte
// aligned, kDense where the operands of the domain's shape are contiguous, else kStrided, which
// a row kernel does not have: the region then runs op by op (eager kernels).
FusedEntry choose_row_entry(const FusedKernel& k, const std::vector<OperandLayout>& inputs,
                            const std::vector<OperandLayout>& outputs);

// Runs `k` once on `inputs` (one per entry of k.inputs, in order; those not host scalars on one
// GPU) and returns its outputs (one per entry of k.outputs, contiguous), as the executor runs a
// region: the same caches, NVRTC options and launch. For the kernel lab
// (benchmarks/lab/fused_rows_lab.cu), whose variants are `k` with its source edited (the same
// entries, parameters and launch geometry). Throws where CUDA or NVRTC is not usable, or where a
// row kernel's operands are not contiguous (the executor runs that region op by op).
std::vector<Tensor> run_fused_kernel(const FusedKernel& k, const std::vector<Tensor>& inputs);

// A generated kernel's entry in the disk cache (kernels/disk_cache.h: CPU code, testable without
// a GPU).
struct KernelKey {
  std::string source;
  std::string arch;               // "sm_90"
  std::string nvrtc;              // "13.0"
  disk_cache::Key disk_key() const;
  std::string file_name() const;  // a hash of the three, in hex, + ".cubin"
};
// The payload stored under `key` in `dir`, or nullopt (missing, or rejected: `rejected` is set).
std::optional<std::string> read_cached_kernel(const std::string& dir, const KernelKey& key,
                                              bool* rejected = nullptr);
// Writes atomically (a temporary file renamed); false when the directory is not writable.
bool write_cached_kernel(const std::string& dir, const KernelKey& key, const std::string& payload);

}  // namespace internal
}  // namespace kiln::compiler
