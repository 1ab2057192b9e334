// "fused_cuda": the executor of pointwise regions on CUDA (compiler/fused_cuda.h). The source
// comes from compiler/fused_cuda_codegen.cpp; this file compiles it with NVRTC, caches the cubin
// in memory and on disk, loads it through the CUDA driver API and launches it on kiln's current
// stream. The CUDA parts compile only in CUDA builds; a CPU-only build has the disk cache (plain
// files) and an executor that never fuses anything.
//
// The driver API is reached through the runtime's cudaGetDriverEntryPointByVersion rather than by
// linking libcuda, so that a CUDA build still loads (and runs on the CPU) where no driver is
// installed; there the executor claims nothing.
#include "compiler/fused_cuda.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <future>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <semaphore>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_format.h"
#include "compiler/executor.h"
#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"
#include "kernels/disk_cache.h"
#include "tensor/ops.h"

#if defined(KILN_WITH_CUDA)
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include "kernels/cuda/check.h"
#endif

namespace kiln::compiler {
namespace {

struct Counters {
  std::atomic<int64_t> regions{0}, nvrtc_compiles{0}, memory_hits{0}, disk_hits{0},
      disk_rejected{0}, disk_writes{0}, fallbacks{0}, strided_launches{0}, dense_launches{0},
      vector_launches{0}, rowvec_launches{0}, row_regions{0}, row_fallbacks{0}, tiled_launches{0},
      tiled_pack_launches{0}, tiled_half_launches{0}, row_two_block_builds{0};
};
Counters& counters() {
  static Counters c;
  return c;
}

// Runs the members one after the other with their eager kernels: for a region the generator
// declines (the fuse pass asked about each op, not about the region as a whole).
Step eager_region(const Trace& t, size_t begin, size_t end) {
  std::vector<const BoundOp*> members;
  for (size_t i = begin; i < end; ++i) members.push_back(&t.ops[i]);
  return [members](Frame& frame) {
    const AutocastScope no_autocast(BoundOp::Autocast{});
    for (const BoundOp* op : members) {
      OpCall call = bind_call(*op, frame);
      dispatch_after(call, DispatchKey::Trace);
      store_outputs(*op, call, frame);
    }
  };
}

}  // namespace

// --- Statistics and the cache directory
// ------------------------------------------------------------

FusedCudaStats fused_cuda_stats() {
  const Counters& c = counters();
  return {c.regions.load(),
          c.nvrtc_compiles.load(),
          c.memory_hits.load(),
          c.disk_hits.load(),
          c.disk_rejected.load(),
          c.disk_writes.load(),
          c.fallbacks.load(),
          c.strided_launches.load(),
          c.dense_launches.load(),
          c.vector_launches.load(),
          c.rowvec_launches.load(),
          c.row_regions.load(),
          c.row_fallbacks.load(),
          c.tiled_launches.load(),
          c.tiled_pack_launches.load(),
          c.tiled_half_launches.load(),
          c.row_two_block_builds.load()};
}

void reset_fused_cuda_stats() {
  Counters& c = counters();
  for (auto* a :
       {&c.regions, &c.nvrtc_compiles, &c.memory_hits, &c.disk_hits, &c.disk_rejected,
        &c.disk_writes, &c.fallbacks, &c.strided_launches, &c.dense_launches, &c.vector_launches,
        &c.rowvec_launches, &c.row_regions, &c.row_fallbacks, &c.tiled_launches,
        &c.tiled_pack_launches, &c.tiled_half_launches, &c.row_two_block_builds}) {
    a->store(0);
  }
}

std::string kernel_cache_dir() { return disk_cache::dir(); }
void set_kernel_cache_dir(std::string dir) { disk_cache::set_dir(std::move(dir)); }

namespace internal {

disk_cache::Key KernelKey::disk_key() const { return {{source, arch, nvrtc}, ".cubin"}; }
std::string KernelKey::file_name() const { return disk_key().file_name(); }

std::optional<std::string> read_cached_kernel(const std::string& dir, const KernelKey& key,
                                              bool* rejected) {
  return disk_cache::read(dir, key.disk_key(), rejected);
}

bool write_cached_kernel(const std::string& dir, const KernelKey& key, const std::string& payload) {
  return disk_cache::write(dir, key.disk_key(), payload);
}

}  // namespace internal

namespace {

#if defined(KILN_WITH_CUDA)

// --- The driver API, through the runtime's entry points ---------------------------------------

struct Driver {
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*device_get)(CUdevice*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*func_set_attribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*func_get_attribute)(int*, CUfunction_attribute, CUfunction) = nullptr;
  CUresult (*occupancy_max_active_blocks)(int*, CUfunction, int, size_t) = nullptr;
  bool ok = false;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver r;
    bool ok = true;
    auto get = [&](const char* name, auto& fn) {
      ok = cuda::internal::driver_entry_point(name, fn) && ok;
    };
    get("cuModuleLoadData", r.module_load_data);
    get("cuModuleGetFunction", r.module_get_function);
    get("cuLaunchKernel", r.launch_kernel);
    get("cuCtxGetCurrent", r.ctx_get_current);
    get("cuCtxSetCurrent", r.ctx_set_current);
    get("cuDeviceGet", r.device_get);
    get("cuDevicePrimaryCtxRetain", r.primary_ctx_retain);
    get("cuGetErrorString", r.get_error_string);
    get("cuFuncSetAttribute", r.func_set_attribute);
    get("cuFuncGetAttribute", r.func_get_attribute);
    get("cuOccupancyMaxActiveBlocksPerMultiprocessor", r.occupancy_max_active_blocks);
    r.ok = ok;
    return r;
  }();
  return d;
}

void check_cu(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().get_error_string != nullptr) driver().get_error_string(r, &msg);
  KILN_FAIL("[fused_cuda] ", call, " failed: ", msg != nullptr ? msg : "unknown error", " (",
            static_cast<int>(r), ")");
}

void check_nvrtc(nvrtcResult r, const char* call) {
  KILN_CHECK(r == NVRTC_SUCCESS, "[fused_cuda] ", call, " failed: ", nvrtcGetErrorString(r));
}

// The device's primary context (the one the runtime uses), retained once and held for good.
CUcontext primary_context(int device) {
  static std::mutex mu;
  static absl::flat_hash_map<int, CUcontext> contexts;
  std::lock_guard<std::mutex> lock(mu);
  CUcontext& ctx = contexts[device];
  if (ctx == nullptr) {
    CUdevice dev = 0;
    check_cu(driver().device_get(&dev, device), "cuDeviceGet");
    check_cu(driver().primary_ctx_retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
  }
  return ctx;
}

// Makes the device's primary context current on this thread (module loads and launches go to
// the current context).
void use_primary_context(int device) {
  const CUcontext want = primary_context(device);
  CUcontext now = nullptr;
  check_cu(driver().ctx_get_current(&now), "cuCtxGetCurrent");
  if (now != want) check_cu(driver().ctx_set_current(want), "cuCtxSetCurrent");
}

// The dynamic shared memory a block may opt in to on `device` (the row kernels' cache).
int64_t shared_limit(int device) {
  static std::mutex mu;
  static absl::flat_hash_map<int, int64_t> limits;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, added] = limits.try_emplace(device, 0);
  if (added) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess)
      it->second = v;
    else
      (void)cudaGetLastError();
  }
  return it->second;
}

bool usable() {
  static const bool ok = [] {
    if (!cuda::is_available() || !driver().ok) return false;
    int major = 0, minor = 0;
    return nvrtcVersion(&major, &minor) == NVRTC_SUCCESS;
  }();
  return ok;
}

std::string nvrtc_version() {
  int major = 0, minor = 0;
  nvrtcVersion(&major, &minor);
  return absl::StrFormat("%d.%d", major, minor);
}

// The newest architecture NVRTC compiles for that the device runs: "sm_90".
std::string arch_of(int device) {
  int major = 0, minor = 0;
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  KILN_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const int cc = major * 10 + minor;
  int n = 0;
  check_nvrtc(nvrtcGetNumSupportedArchs(&n), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(static_cast<size_t>(n));
  check_nvrtc(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  int best = -1;
  for (int a : archs) {
    if (a <= cc) best = std::max(best, a);
  }
  KILN_CHECK(best > 0, "[fused_cuda] NVRTC ", nvrtc_version(),
             " compiles for no architecture the device (compute capability ", major, ".", minor,
             ") runs");
  return "sm_" + std::to_string(best);
}

std::string compile_with_nvrtc(const std::string& source, const std::string& arch) {
  nvrtcProgram prog = nullptr;
  // kernels/scalar_fn.h (eager's formulas) and its stand-ins for the C++ library, by name.
  std::vector<const char*> names, texts;
  for (const internal::RtcHeader& h : internal::rtc_headers()) {
    names.push_back(h.name);
    texts.push_back(h.text);
  }
  check_nvrtc(nvrtcCreateProgram(&prog, source.c_str(), "kiln_fused.cu",
                                 static_cast<int>(names.size()), texts.data(), names.data()),
              "nvrtcCreateProgram");
  struct Destroy {
    nvrtcProgram* p;
    ~Destroy() { nvrtcDestroyProgram(p); }
  } destroy{&prog};
  const std::string arch_flag = "--gpu-architecture=" + arch;
  // nvcc's defaults for the eager kernels: IEEE division and square root, no flush to zero,
  // multiply-adds contracted within an expression.
  const char* options[] = {arch_flag.c_str(), "--std=c++17",      "-default-device", "--fmad=true",
                           "--prec-div=true", "--prec-sqrt=true", "--ftz=false"};
  const nvrtcResult r = nvrtcCompileProgram(prog, static_cast<int>(std::size(options)), options);
  if (r != NVRTC_SUCCESS) {
    size_t log_size = 0;
    nvrtcGetProgramLogSize(prog, &log_size);
    std::string log(log_size, '\0');
    if (log_size > 0) nvrtcGetProgramLog(prog, log.data());
    KILN_FAIL("[fused_cuda] NVRTC could not compile a generated kernel (", nvrtcGetErrorString(r),
              "):\n", log, "\nsource:\n", source);
  }
  size_t size = 0;
  check_nvrtc(nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize");
  std::string cubin(size, '\0');
  check_nvrtc(nvrtcGetCUBIN(prog, cubin.data()), "nvrtcGetCUBIN");
  return cubin;
}

// A kernel loaded on one device.
struct Loaded {
  CUfunction strided = nullptr;
  CUfunction dense = nullptr;   // null when the source has no dense entry
  CUfunction vector = nullptr;  // null when it has no vector entry
  CUfunction rowvec = nullptr;  // null when it has no row-vector entry
  CUfunction tiled = nullptr;   // null when it has no tiled entry
  CUfunction tiled_packs = nullptr;  // null when it has no tiled entry in packs
  CUfunction tiled_packs_half = nullptr;  // its half-width tiles, null likewise
  // With tiled_packs: the blocks of 256 threads a multiprocessor holds of each, times the
  // device's multiprocessors (choose_tile_width).
  int64_t tiled_packs_slots = 0, tiled_packs_half_slots = 0;
};
// The entries a kernel's source has, and the row entries' dynamic shared memory
// (FusedKernel::row_shared_bytes).
struct Entries {
  bool dense = false, vector = false, rows = false, rowvec = false, tiled = false,
       tiled_packs = false;
  int64_t shared_bytes = 0;
};
Entries entries_of(const internal::FusedKernel& k) {
  return {k.has_dense,      k.vector_width > 0, k.row_kernel,      k.rowvec_width > 0,
          !k.tiled.empty(), k.tiled_pack > 0,   k.row_shared_bytes};
}
using LoadedFuture = std::shared_future<std::shared_ptr<const Loaded>>;

// Whether any of the functions takes local memory (spilled registers, or a stack).
bool takes_local_memory(std::initializer_list<CUfunction> functions) {
  for (CUfunction f : functions) {
    if (f == nullptr) continue;
    int local = 0;
    check_cu(driver().func_get_attribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f),
             "cuFuncGetAttribute");
    if (local > 0) return true;
  }
  return false;
}

// The cubin of `source` for `device`: from the disk cache, else NVRTC (stored on disk after).
std::shared_ptr<const Loaded> build(int device, const std::string& source, const Entries& e) {
  cuda::DeviceGuard guard(device);
  internal::KernelKey key{source, arch_of(device), nvrtc_version()};
  const std::string dir = kernel_cache_dir();
  std::optional<std::string> cubin;
  if (dir != "none") {
    bool rejected = false;
    cubin = internal::read_cached_kernel(dir, key, &rejected);
    if (cubin) ++counters().disk_hits;
    if (rejected) ++counters().disk_rejected;
  }
  if (!cubin) {
    cubin = compile_with_nvrtc(source, key.arch);
    ++counters().nvrtc_compiles;
    if (dir != "none" && internal::write_cached_kernel(dir, key, *cubin)) ++counters().disk_writes;
  }
  use_primary_context(device);
  CUmodule module = nullptr;  // kept for the life of the process, as the memory cache's entry
  check_cu(driver().module_load_data(&module, cubin->data()), "cuModuleLoadData");
  auto loaded = std::make_shared<Loaded>();
  // A row kernel has no strided entry (a region whose rows are not contiguous runs op by op).
  auto get = [&](bool has, CUfunction* f, const char* name) {
    if (has) check_cu(driver().module_get_function(f, module, name), "cuModuleGetFunction");
  };
  get(!e.rows, &loaded->strided, "kiln_fused_strided");
  get(e.dense, &loaded->dense, e.rows ? "kiln_rows_dense" : "kiln_fused_dense");
  get(e.vector, &loaded->vector, e.rows ? "kiln_rows_vector" : "kiln_fused_vector");
  get(e.rowvec, &loaded->rowvec, "kiln_fused_rowvec");
  get(e.tiled, &loaded->tiled, "kiln_fused_tiled");
  get(e.tiled_packs, &loaded->tiled_packs, "kiln_fused_tiled_packs");
  get(e.tiled_packs, &loaded->tiled_packs_half, "kiln_fused_tiled_packs_half");
  if (e.tiled_packs) {
    int sms = 0;
    KILN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    auto slots = [&](CUfunction f) {
      int blocks = 0;
      check_cu(driver().occupancy_max_active_blocks(&blocks, f, 256, 0),
               "cuOccupancyMaxActiveBlocksPerMultiprocessor");
      return int64_t{blocks} * sms;
    };
    loaded->tiled_packs_slots = slots(loaded->tiled_packs);
    loaded->tiled_packs_half_slots = slots(loaded->tiled_packs_half);
  }
  // A row kernel caching its rows in shared memory and writing only per-row results runs three
  // blocks a multiprocessor where three rows fit: 42 registers a thread at most. One whose entries
  // then take local memory (spilled registers) is built again at two blocks, 64 registers:
  // log_softmax over 8192 x 32000 bf16, then planned at three, spilled 40 bytes and ran 11% faster
  // so; the kernels that did not spill ran 0-8% slower at two (the kernel lab, session 37, H200).
  if (e.rows && e.shared_bytes > 0 && takes_local_memory({loaded->dense, loaded->vector})) {
    if (std::optional<std::string> two = internal::row_source_at_two_blocks(source)) {
      ++counters().row_two_block_builds;
      return build(device, *two, e);
    }
  }
  // More than the default 48 KiB of dynamic shared memory is allowed per function.
  for (CUfunction f : {loaded->dense, loaded->vector}) {
    if (f == nullptr || e.shared_bytes <= 0) continue;
    check_cu(driver().func_set_attribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                         static_cast<int>(e.shared_bytes)),
             "cuFuncSetAttribute");
  }
  return loaded;
}

// At most this many NVRTC compilations run at once.
std::counting_semaphore<64>& compile_slots() {
  static std::counting_semaphore<64> s(
      static_cast<std::ptrdiff_t>(std::clamp(std::thread::hardware_concurrency(), 1u, 16u)));
  return s;
}

// The kernel of `source` on `device`: from memory, else built on a thread of its own (regions
// of one program compile in parallel; the program's first run waits for them).
struct KernelCache {
  std::mutex mu;
  absl::flat_hash_map<std::string, LoadedFuture> kernels;  // by device and source
};
KernelCache& kernel_cache() {
  static auto* c = new KernelCache();  // never destroyed: a compiling thread may outlive main
  return *c;
}

LoadedFuture kernel_for(int device, const std::string& source, const Entries& entries) {
  KernelCache& c = kernel_cache();
  const std::string key = std::to_string(device) + "\n" + source;
  std::lock_guard<std::mutex> lock(c.mu);
  if (auto it = c.kernels.find(key); it != c.kernels.end()) {
    ++counters().memory_hits;
    return it->second;
  }
  LoadedFuture f = std::async(std::launch::async, [device, source, entries] {
                     compile_slots().acquire();
                     struct Release {
                       ~Release() { compile_slots().release(); }
                     } release;
                     return build(device, source, entries);
                   }).share();
  c.kernels[key] = f;
  return f;
}

void clear_memory_cache_impl() {
  KernelCache& c = kernel_cache();
  std::lock_guard<std::mutex> lock(c.mu);
  c.kernels.clear();  // the modules stay loaded: running programs still launch their kernels
}

// An uninitialised tensor with the spec's sizes and strides (eager's output layout).
Tensor empty_as(const TensorSpec& spec) {
  const TensorOptions options = TensorOptions().dtype(spec.dtype).device(spec.device);
  if (spec.strides.size() != spec.sizes.size()) return empty(spec.sizes, options);
  int64_t extent = 1;
  for (size_t d = 0; d < spec.sizes.size(); ++d) {
    if (spec.sizes[d] == 0) return empty(spec.sizes, options);
    extent += (spec.sizes[d] - 1) * spec.strides[d];
  }
  return empty({extent}, options).as_strided(spec.sizes, spec.strides, 0);
}

// One run of a lowered region (`eager`: the region op by op, for a row kernel whose operands
// are not contiguous).
void launch(const internal::FusedKernel& k, const std::vector<TensorSpec>& output_specs,
            const Loaded& fn, int device, Frame& frame, const Step& eager) {
  cuda::DeviceGuard guard(device);
  std::vector<int64_t> params(static_cast<size_t>(std::max(k.slots, 1)), 0);
  const size_t rank = k.sizes.size();
  std::vector<internal::OperandLayout> in_layouts(k.inputs.size());
  std::vector<internal::OperandLayout> out_layouts(k.outputs.size());
  auto strides = [&](const Tensor& x, const internal::FusedKernel::Operand& o,
                     internal::OperandLayout& layout) {
    layout = {x.is_contiguous(), reinterpret_cast<uint64_t>(x.data_ptr()),
              std::vector<int64_t>(x.strides().begin(), x.strides().end())};
    KILN_CHECK(x.sizes() == IntArrayRef(o.sizes), "[fused_cuda] internal: a value of shape ",
               shape_str(x.sizes()), " where the trace has ", shape_str(o.sizes));
    if (o.sizes.empty()) return;
    if (o.leading) {  // a reduction's output without keepdim: the domain's leading dims
      for (size_t d = 0; d < rank; ++d) {
        const bool broadcast = d >= o.sizes.size() || o.sizes[d] == 1;
        params[static_cast<size_t>(o.slot) + 1 + d] = broadcast ? 0 : x.strides()[d];
      }
      return;
    }
    const size_t lead = rank - o.sizes.size();
    for (size_t d = 0; d < rank; ++d) {
      const bool broadcast = d < lead || o.sizes[d - lead] == 1;
      params[static_cast<size_t>(o.slot) + 1 + d] = broadcast ? 0 : x.strides()[d - lead];
    }
  };
  for (size_t j = 0; j < k.inputs.size(); ++j) {
    const auto& o = k.inputs[j];
    const Tensor& x = frame.slots[static_cast<size_t>(o.value)];
    if (o.host_scalar) {
      uint64_t bits = 0;
      std::memcpy(&bits, x.data_ptr(), x.element_size());
      params[static_cast<size_t>(o.slot)] = static_cast<int64_t>(bits);
      continue;
    }
    params[static_cast<size_t>(o.slot)] = reinterpret_cast<int64_t>(x.data_ptr());
    strides(x, o, in_layouts[j]);
  }
  for (size_t j = 0; j < k.outputs.size(); ++j) {
    const auto& o = k.outputs[j];
    const auto v = static_cast<size_t>(o.value);
    Tensor out = !frame.placed.empty() && frame.placed[v].defined() ? frame.placed[v]
                                                                    : empty_as(output_specs[j]);
    params[static_cast<size_t>(o.slot)] = reinterpret_cast<int64_t>(out.data_ptr());
    strides(out, o, out_layouts[j]);
    frame.slots[v] = std::move(out);
  }
  params[static_cast<size_t>(k.zero_slot)] = 0;  // the barrier's zero (compiler/fused_cuda.h)
  for (const auto& [slot, bits] : k.constants) {
    params[static_cast<size_t>(slot)] = static_cast<int64_t>(bits);
  }
  const int64_t n = numel_of(k.sizes);
  if (n == 0) return;
  use_primary_context(device);
  if (k.row_kernel) {
    const internal::FusedEntry entry = internal::choose_row_entry(k, in_layouts, out_layouts);
    if (entry == internal::FusedEntry::kStrided) {
      counters().row_fallbacks.fetch_add(1, std::memory_order_relaxed);
      eager(frame);  // writes every output again (the placed ones in place)
      return;
    }
    const bool vector = entry == internal::FusedEntry::kVector;
    (vector ? counters().vector_launches : counters().dense_launches)
        .fetch_add(1, std::memory_order_relaxed);
    const int64_t groups = k.rows_per_block;
    const auto blocks = static_cast<unsigned>(
        std::clamp<int64_t>((k.rows + groups - 1) / groups, 1, int64_t{1} << 20));
    void* args[] = {params.data()};
    CUstream stream = cuda::current_stream(device).handle();
    check_cu(
        driver().launch_kernel(vector ? fn.vector : fn.dense, blocks, 1, 1,
                               static_cast<unsigned>(k.row_threads * k.rows_per_block), 1, 1,
                               static_cast<unsigned>(k.row_shared_bytes), stream, args, nullptr),
        "cuLaunchKernel");
    cuda::internal::check_launch("kiln_rows (fused_cuda)", __FILE__, __LINE__);
    return;
  }
  const internal::FusedEntry entry = internal::choose_fused_entry(k, in_layouts, out_layouts);
  CUfunction f = fn.strided;
  int64_t threads_needed = n;  // one element per thread (a grid-stride loop beyond 2^24)
  if (entry == internal::FusedEntry::kVector) {
    f = fn.vector;
    threads_needed = n / k.vector_width;  // the first threads also do the n % width tail
    counters().vector_launches.fetch_add(1, std::memory_order_relaxed);
  } else if (entry == internal::FusedEntry::kRowVector) {
    f = fn.rowvec;
    threads_needed = n / k.rowvec_width;  // whole packs: the last dim is a multiple of them
    counters().rowvec_launches.fetch_add(1, std::memory_order_relaxed);
  } else if (entry == internal::FusedEntry::kDense) {
    f = fn.dense;
    counters().dense_launches.fetch_add(1, std::memory_order_relaxed);
  } else if (entry == internal::FusedEntry::kTiled || entry == internal::FusedEntry::kTiledPacks) {
    // A block of 32 x 8 threads per tile of the domain's last two dims: 32 x 32 elements, or
    // packs.
    const bool packs = entry == internal::FusedEntry::kTiledPacks;
    const int64_t e = packs ? 32 * k.tiled_pack : 32;
    const size_t r = k.sizes.size();
    const int64_t m = k.sizes[r - 2], cols = k.sizes[r - 1];
    auto tiles = [&](int64_t tile_cols) {
      return n / (m * cols) * ((m + e - 1) / e) * ((cols + tile_cols - 1) / tile_cols);
    };
    f = packs ? fn.tiled_packs : fn.tiled;
    int64_t blocks_needed = tiles(e);
    if (packs &&
        internal::choose_tile_width(tiles(e), fn.tiled_packs_slots, tiles(e / 2),
                                    fn.tiled_packs_half_slots) == internal::TileWidth::kHalf) {
      f = fn.tiled_packs_half;
      blocks_needed = tiles(e / 2);
      counters().tiled_half_launches.fetch_add(1, std::memory_order_relaxed);
    }
    threads_needed = blocks_needed * 256;
    counters().tiled_launches.fetch_add(1, std::memory_order_relaxed);
    if (packs) counters().tiled_pack_launches.fetch_add(1, std::memory_order_relaxed);
  } else {
    counters().strided_launches.fetch_add(1, std::memory_order_relaxed);
  }
  constexpr int64_t kThreads = 256;
  const auto blocks = static_cast<unsigned>(
      std::clamp<int64_t>((threads_needed + kThreads - 1) / kThreads, 1, int64_t{1} << 16));
  void* args[] = {params.data()};
  CUstream stream = cuda::current_stream(device).handle();
  check_cu(driver().launch_kernel(f, blocks, 1, 1, kThreads, 1, 1, 0, stream, args, nullptr),
           "cuLaunchKernel");
  cuda::internal::check_launch("kiln_fused (fused_cuda)", __FILE__, __LINE__);
}

#endif  // KILN_WITH_CUDA

class FusedCudaExecutor final : public Executor {
 public:
  const std::string& name() const override {
    static const std::string n = "fused_cuda";
    return n;
  }
  bool claims(const Trace&, const BoundOp&) const override { return false; }
  Step lower(const Trace&, const BoundOp& op) const override {
    KILN_FAIL("[compile] fused_cuda runs fusion regions only, not the single op ", op.name());
  }

  bool fuses(const Trace& t, const BoundOp& op) const override {
#if defined(KILN_WITH_CUDA)
    if (fuse_kind(op) == FuseKind::kNone || op.outputs.size() != 1 || op.outputs[0] < 0) {
      return false;
    }
    const Device out = t.value(op.outputs[0]).spec.device;
    if (!out.is_cuda()) return false;
    for (int v : op.inputs) {
      if (v < 0) return false;
      const TensorSpec& s = t.value(v).spec;
      if (!(s.device == out) && !(s.device.is_cpu() && s.sizes.empty())) return false;
    }
    return internal::fused_cuda_generates(t, op) && usable();
#else
    (void)t;
    (void)op;
    return false;
#endif
  }

  Step lower_region(const Trace& t, size_t begin, size_t end) const override {
#if defined(KILN_WITH_CUDA)
    const int device_index = [&] {
      for (size_t i = begin; i < end; ++i) {
        for (int v : t.ops[i].outputs) {
          if (v >= 0 && t.value(v).spec.device.is_cuda()) return t.value(v).spec.device.index();
        }
      }
      return 0;
    }();
    std::optional<internal::FusedKernel> k = internal::generate_fused_kernel(
        t, begin, end, nullptr, usable() ? shared_limit(std::max(device_index, 0)) : 0);
    if (k && usable()) {
      ++counters().regions;
      if (k->row_kernel) ++counters().row_regions;
      const int device = std::max(t.value(k->outputs[0].value).spec.device.index(), 0);
      std::vector<TensorSpec> specs;
      for (const auto& o : k->outputs) specs.push_back(t.value(o.value).spec);
      LoadedFuture kernel = kernel_for(device, k->source, entries_of(*k));
      auto plan = std::make_shared<const internal::FusedKernel>(std::move(*k));
      Step eager = plan->row_kernel ? eager_region(t, begin, end) : Step();
      return [plan, specs = std::move(specs), kernel, device, eager](Frame& frame) {
        launch(*plan, specs, *kernel.get(), device, frame, eager);
      };
    }
#endif
    ++counters().fallbacks;
    return eager_region(t, begin, end);
  }
};

}  // namespace

std::vector<Tensor> internal::run_fused_kernel(const FusedKernel& k,
                                               const std::vector<Tensor>& inputs) {
  KILN_CHECK(inputs.size() == k.inputs.size(), "[run_fused_kernel] the kernel has ",
             k.inputs.size(), " inputs, given ", inputs.size());
#if defined(KILN_WITH_CUDA)
  KILN_CHECK(
      usable(), "[run_fused_kernel] needs a CUDA device and NVRTC: ",
      cuda::is_available() ? "the driver or NVRTC did not load" : cuda::unavailable_reason());
  int device = -1;
  size_t values = 0;
  for (size_t j = 0; j < inputs.size(); ++j) {
    const Tensor& x = inputs[j];
    KILN_CHECK(x.defined(), "[run_fused_kernel] input ", j, " is undefined");
    KILN_CHECK(x.dtype() == k.inputs[j].dtype, "[run_fused_kernel] input ", j, " is ",
               dtype_name(x.dtype()), ", the kernel reads ", dtype_name(k.inputs[j].dtype));
    if (k.inputs[j].host_scalar) {
      KILN_CHECK(x.device().is_cpu() && x.dim() == 0, "[run_fused_kernel] input ", j,
                 " must be a 0-d CPU tensor (the kernel takes it by value)");
    } else {
      KILN_CHECK(x.device().is_cuda() && (device < 0 || x.device().index() == device),
                 "[run_fused_kernel] input ", j, " is on ", x.device().str(),
                 ": the kernel's inputs are on one GPU");
      device = x.device().index();
    }
    values = std::max(values, static_cast<size_t>(k.inputs[j].value) + 1);
  }
  KILN_CHECK(device >= 0, "[run_fused_kernel] no input on a GPU");
  Frame frame;
  for (const auto& o : k.outputs) values = std::max(values, static_cast<size_t>(o.value) + 1);
  frame.slots.resize(values);
  for (size_t j = 0; j < inputs.size(); ++j) {
    frame.slots[static_cast<size_t>(k.inputs[j].value)] = inputs[j];
  }
  std::vector<TensorSpec> specs;
  for (const auto& o : k.outputs) specs.push_back({o.sizes, o.dtype, Device(kCUDA, device)});
  LoadedFuture kernel = kernel_for(device, k.source, entries_of(k));
  const Step op_by_op = [](Frame&) {
    KILN_FAIL(
        "[run_fused_kernel] a row kernel's operands are not contiguous (the executor runs "
        "such a region op by op)");
  };
  launch(k, specs, *kernel.get(), device, frame, op_by_op);
  std::vector<Tensor> out;
  for (const auto& o : k.outputs) out.push_back(frame.slots[static_cast<size_t>(o.value)]);
  return out;
#else
  KILN_FAIL("[run_fused_kernel] needs a build with CUDA (KILN_CUDA=ON)");
#endif
}

void clear_fused_cuda_memory_cache() {
#if defined(KILN_WITH_CUDA)
  clear_memory_cache_impl();
#endif
}

std::shared_ptr<const Executor> make_fused_cuda_executor() {
  return std::make_shared<FusedCudaExecutor>();
}

}  // namespace kiln::compiler
