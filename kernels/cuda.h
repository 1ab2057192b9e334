// kiln::cuda: the CUDA runtime as the user sees it, as libtorch's torch/cuda.h: devices,
// synchronisation, memory statistics, streams and events, and the runtime knobs (synchronous
// debug mode, matmul autotuning, TF32).
//
//   #include "kernels/cuda.h"   // or the umbrella kiln.h
//
//   if (kiln::cuda::is_available()) {
//     kiln::Tensor x = kiln::ones({1024, 1024}, kiln::kCUDA);
//     kiln::cuda::synchronize();
//     std::cout << kiln::cuda::memory_stats().allocated << " bytes in use\n";
//   }
//
// This header includes no CUDA header and compiles in every build: in a CPU-only build (or on a
// machine without a GPU) is_available() is false, device_count() is 0 and unavailable_reason()
// says why; the functions that need a device throw kiln::Error. The knobs work in every build.
//
// CUDA memory comes from each device's stream-ordered pool (cudaMallocAsync) with a release
// threshold so high that freed memory stays reserved for reuse: `reserved` stays above
// `allocated` until empty_cache() gives the unused part back to the driver.
//
// Streams and events, as torch.cuda's:
//
//   kiln::cuda::Stream side = kiln::cuda::Stream::create();
//   side.wait_stream(kiln::cuda::current_stream());   // inputs made on the default stream
//   {
//     kiln::cuda::StreamGuard guard(side);     // kernels, copies and allocations of the scope
//     y = kiln::matmul(a, b);                  // are queued on `side`
//   }
//   kiln::cuda::Event done(/*enable_timing=*/true);
//   done.record(side);
//   kiln::cuda::current_stream().wait(done);   // the default stream waits for `side`
//
//   kiln::Tensor h = kiln::randn({1 << 20}).pin_memory();
//   kiln::Tensor d = h.to(kiln::kCUDA, /*non_blocking=*/true);   // returns at once
//
// Pitfalls:
// - Kernels run asynchronously: an error inside a kernel surfaces at a later synchronisation,
//   from another op. Turn on the synchronous debug mode (set_launch_sync(true) or
//   KILN_CUDA_SYNC=1) to have the op that caused it report it.
// - Streams made by Stream::create() come from a per-device pool of 32 (as PyTorch's stream
//   pool) and live as long as the process, so memory allocated on one is always freed on a live
//   stream. They do not synchronise with the default stream: order work across streams with
//   events (or wait_stream).
// - Memory is freed in the order of the stream that allocated it: a tensor allocated on one
//   stream and used on another must stay alive until that use is done (synchronise first), as
//   with PyTorch without record_stream.
// - Each knob's initial value is read from its environment variable once, at the knob's first
//   use (its getter or setter, or the first launch that consults it); changing the environment
//   later has no effect: call the setter.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

// The CUDA runtime's stream and event handle types (cudaStream_t, cudaEvent_t) without its
// header.
struct CUstream_st;
struct CUevent_st;

namespace kiln::cuda {

// --- Devices -----------------------------------------------------------------------------------

// True when kiln was built with CUDA and at least one GPU can be used.
bool is_available();
// The number of usable GPUs (0 when is_available() is false).
int device_count();
// Why is_available() is false ("kiln was built without CUDA", the driver's error, ...); empty
// when it is true.
std::string unavailable_reason();

// The device that CUDA calls of this thread go to, and setting it (cudaSetDevice).
int current_device();
void set_device(int index);

// Waits for all work queued on `device` (-1: the current device).
void synchronize(int device = -1);

// --- Memory ------------------------------------------------------------------------------------

// Bytes of CUDA memory on one device.
// CUDA graphs (kiln::compile's, docs/compiler.md) keep their intermediates in graph memory, apart
// from the pool: `graph` and `reserved` include it, and `peak` counts it from each graph launch.
struct MemoryStats {
  int64_t allocated = 0;  // held by live tensors
  int64_t reserved = 0;   // held by the device's memory pool and by CUDA graphs
  int64_t peak = 0;       // the highest `allocated` + `graph` since the start or the last reset
                          // (graph as of the last graph launch)
  int64_t graph = 0;      // bytes of graph memory backed for CUDA graphs (cudaGraphMemAttr...)
};
MemoryStats memory_stats(int device = -1);
void reset_peak_memory_stats(int device = -1);
// Returns the pool's unused memory, and graph memory no graph holds, to the driver (after waiting
// for the device).
void empty_cache(int device = -1);

// --- Clocks and power --------------------------------------------------------------------------

// A GPU's clocks, power and energy over an interval, from the driver's NVML library (loaded at
// run time). Training steps on an H100 can draw its whole power limit, and then the card lowers
// its clocks to stay within it: a step's time is its energy over the limit (benchmarks/RESULTS.md,
// session 28), which speed comparisons need to know.
//
//   cuda::PowerMonitor monitor(0);  // samples from now on, every 20 ms, on a thread of its own
//   ... the work ...
//   cuda::PowerReport r = monitor.stop();
//   if (monitor.available()) std::cout << r.energy_joules << " J\n";
struct PowerReport {
  double seconds = 0;            // from the monitor's start to stop()
  double energy_joules = 0;      // the board's energy counter over the interval
  double mean_power_watts = 0;   // energy_joules / seconds
  double power_limit_watts = 0;  // the limit the driver enforces
  double mean_sm_clock_mhz = 0;  // the samples' mean
  double max_sm_clock_mhz = 0;   // the card's highest SM clock
  double power_capped = 0;       // fraction of samples held back by the power limit
  double thermal_capped = 0;     // fraction held back by temperature
  int samples = 0;
};
class PowerMonitor {
 public:
  // Starts sampling `device` (-1: the current one). Where NVML, its counters or a GPU are
  // missing, available() is false, unavailable_reason() says why and stop() reports zeros.
  explicit PowerMonitor(int device = -1);
  ~PowerMonitor();
  PowerMonitor(const PowerMonitor&) = delete;
  PowerMonitor& operator=(const PowerMonitor&) = delete;
  bool available() const { return reason_.empty(); }
  const std::string& unavailable_reason() const { return reason_; }
  // Ends the interval and reports it (again, unchanged, on later calls).
  PowerReport stop();

  struct Impl;  // NVML's handles and the sampling thread (kernels/cuda/power.cpp)

 private:
  std::unique_ptr<Impl> impl_;
  std::string reason_;
  std::optional<PowerReport> report_;
};

// --- Runtime knobs -----------------------------------------------------------------------------

// The synchronous debug mode: every kernel launch and copy is followed by a device
// synchronisation, so that an asynchronous error is reported by the op that caused it (and
// timings become those of serial execution). Initially on when KILN_CUDA_SYNC is set to anything
// but "" and "0".
bool launch_sync();
void set_launch_sync(bool enabled);

// Matmul autotuning: cuBLASLt products pick, per shape, the fastest of the heuristic's (up to 8)
// candidate algorithms by timing them on the real operands at the shape's first call outside
// CUDA graph capture; with it off the heuristic's first is used. The choice is kept in kiln's
// disk cache (docs/cuda.md), where later processes on the machine find it instead of timing
// again. Initially on when KILN_MATMUL_AUTOTUNE is set to anything but "" and "0". Off by default
// because the first call of every shape blocks the host (about 30 runs of the product) and
// because the algorithm then depends on timing noise, so two machines (or a run before the cache
// held the shape and one after) may differ in the last bits (cuDNN's benchmark mode is off in
// PyTorch likewise); ignored while deterministic algorithms are on
// (tensor/deterministic.h). `kiln pretrain` and `kiln bench` turn it on for their run on CUDA
// (PretrainOptions::matmul_autotune): +2.5-3% on llama-160m's step (benchmarks/RESULTS.md).
bool matmul_autotune();
void set_matmul_autotune(bool enabled);

// Counters of the autotuner since start-up (or the last reset), summed over devices.
struct MatmulAutotuneStats {
  int64_t tuned_shapes = 0;        // shapes whose algorithm was chosen (timed when > 1 candidate)
  int64_t cache_hits = 0;          // autotuned calls that reused an already chosen algorithm
  int64_t skipped_in_capture = 0;  // untuned shapes met during graph capture: heuristic's first
  int64_t candidates_timed = 0;    // candidate algorithms timed, over all shapes
};
MatmulAutotuneStats matmul_autotune_stats();
void reset_matmul_autotune_stats();

// What kernels cost the host the first time they meet a shape, since start-up, summed over
// devices and threads: the one-time work that makes a program's first step slower than the next
// (`kiln bench` prints it for its first step). Seconds are host wall time, waits for the device
// included.
struct KernelSetupStats {
  int64_t matmul_shapes_timed = 0;  // cuBLASLt products whose candidate algorithms were timed
  double matmul_timing_s = 0;
  int64_t attention_plans_built = 0;   // cuDNN attention plans made: built and finalized, or
  double attention_build_s = 0;        // restored from the disk cache (failures included)
  int64_t attention_shapes_timed = 0;  // attention calls timed: cuDNN's engines against each
  double attention_timing_s = 0;       // other and against the hand kernel
  // Timed choices read from and written to kiln's disk cache (kernels/disk_cache.h), which
  // spares a later process the timing (and cuDNN the other engines' compilation).
  int64_t choices_read = 0, choices_written = 0;
};
KernelSetupStats kernel_setup_stats();

// Whether f32 matrix products may use TF32 tensor cores (10-bit mantissa products, f32 sums), as
// PyTorch's torch.backends.cuda.matmul.allow_tf32. Off by default (PyTorch's default since 1.12);
// no environment variable.
bool allow_tf32();
void set_allow_tf32(bool enabled);

// SMs that cuBLASLt products leave free for work on other streams, such as NCCL's collectives
// overlapping a backward: products are planned for (multiprocessors - carveout) SMs
// (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), so a persistent kernel does not wait for the SMs that a
// collective holds. 0 (the default) plans for every SM. PyTorch's counterpart is
// torch._C._set_sm_carveout_experimental. DistributedDataParallel sets it while its all-reduces
// may run (DDPOptions::comm_sm_carveout). Process-wide; negative values are an error.
int matmul_sm_carveout();
void set_matmul_sm_carveout(int sms);

// --- Streams and events ------------------------------------------------------------------------

class Event;

// A CUDA stream of one device: the default (legacy) stream or one from the pool. Converts to
// cudaStream_t for kernel launches.
class Stream {
 public:
  // The default stream of the current device.
  Stream();
  // The next stream of `device`'s pool (-1: the current device); created on first use,
  // non-blocking with respect to the default stream.
  static Stream create(int device = -1);
  // The default stream of `device` (-1: the current device).
  static Stream default_stream(int device = -1);

  int device() const;
  bool is_default() const { return handle_ == nullptr; }
  CUstream_st* handle() const { return handle_; }
  operator CUstream_st*() const { return handle_; }  // NOLINT: usable as a cudaStream_t

  // Waits on the host until all work queued on the stream is done.
  void synchronize() const;
  // True when all work queued on the stream is done.
  bool query() const;
  // Work queued on this stream after the call waits until `event` has happened.
  void wait(const Event& event) const;
  // Work queued on this stream after the call waits for the work queued on `other` so far.
  void wait_stream(const Stream& other) const;

  bool operator==(const Stream& o) const { return handle_ == o.handle_ && device() == o.device(); }
  bool operator!=(const Stream& o) const { return !(*this == o); }

 private:
  Stream(CUstream_st* handle, int device) : handle_(handle), device_(device) {}
  friend Stream current_stream(int device);
  CUstream_st* handle_ = nullptr;
  int device_ = -1;  // -1: the current device (the default stream as current_stream() gives it)
};

// The stream this thread's kernels, copies and allocations on `device` (-1: the current
// device) go to: the default stream unless a StreamGuard says otherwise.
Stream current_stream(int device = -1);

// Makes `stream` the current stream of its device, and its device the current device, for the
// scope; both are restored at its end.
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  Stream previous_stream_;
  int previous_device_ = -1;
};

// A CUDA event: a point in a stream's work, to wait for, to order other streams after, or to
// time (enable_timing). The CUDA event is created on the first record(), on its stream's device.
class Event {
 public:
  explicit Event(bool enable_timing = false);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Captures the work queued on `stream` so far (default: the current stream).
  void record();
  void record(const Stream& stream);
  // Waits on the host until the recorded work is done (returns at once if never recorded).
  void synchronize() const;
  // True when the recorded work is done (or nothing was recorded).
  bool query() const;
  // Milliseconds between this event and `end`, both recorded with enable_timing and done.
  float elapsed_time(const Event& end) const;

  bool is_recorded() const { return event_ != nullptr; }
  CUevent_st* handle() const { return event_; }
  int device() const { return device_; }

 private:
  CUevent_st* event_ = nullptr;
  int device_ = -1;
  bool timing_ = false;
};

}  // namespace kiln::cuda
