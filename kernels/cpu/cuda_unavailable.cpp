// kiln::cuda in a build without CUDA: no device is available, and the functions that need one
// say so. Compiled instead of kernels/cuda/runtime.cpp when KILN_WITH_CUDA is off (CMake
// leaves this file out of CUDA builds). The knobs (launch_sync, matmul_autotune, allow_tf32) are
// kernels/cuda.cpp's in both builds.
#include <string>

#include "kernels/cuda/cublaslt.h"
#include "kernels/cuda/runtime.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace kiln::cuda {
namespace {

constexpr const char* kReason = "kiln was built without CUDA (configure with -DKILN_CUDA=ON)";

[[noreturn]] void unavailable(const char* op) { KILN_FAIL("[", op, "] no CUDA device: ", kReason); }

}  // namespace

bool is_available() { return false; }
int device_count() { return 0; }
std::string unavailable_reason() { return kReason; }

int current_device() { unavailable("current_device"); }
void set_device(int) { unavailable("set_device"); }
void synchronize(int) { unavailable("synchronize"); }
MemoryStats memory_stats(int) { unavailable("memory_stats"); }
void reset_peak_memory_stats(int) { unavailable("reset_peak_memory_stats"); }
void empty_cache(int) { unavailable("empty_cache"); }

struct PowerMonitor::Impl {};
PowerMonitor::PowerMonitor(int) : reason_(kReason) {}
PowerMonitor::~PowerMonitor() = default;
PowerReport PowerMonitor::stop() { return PowerReport{}; }

// Streams and events need a device.
Stream::Stream() { unavailable("Stream"); }
Stream Stream::create(int) { unavailable("Stream::create"); }
Stream Stream::default_stream(int) { unavailable("default_stream"); }
int Stream::device() const { unavailable("Stream::device"); }
void Stream::synchronize() const { unavailable("Stream::synchronize"); }
bool Stream::query() const { unavailable("Stream::query"); }
void Stream::wait(const Event&) const { unavailable("Stream::wait"); }
void Stream::wait_stream(const Stream&) const { unavailable("Stream::wait_stream"); }
Stream current_stream(int) { unavailable("current_stream"); }
StreamGuard::StreamGuard(const Stream& stream) : previous_stream_(stream) {
  unavailable("StreamGuard");
}
StreamGuard::~StreamGuard() = default;
Event::Event(bool enable_timing) : timing_(enable_timing) {}
Event::~Event() = default;
Event::Event(Event&& other) noexcept = default;
Event& Event::operator=(Event&& other) noexcept = default;
void Event::record() { unavailable("Event::record"); }
void Event::record(const Stream&) { unavailable("Event::record"); }
void Event::synchronize() const { unavailable("Event::synchronize"); }
bool Event::query() const { unavailable("Event::query"); }
float Event::elapsed_time(const Event&) const { unavailable("Event::elapsed_time"); }

namespace internal {
Storage allocate_pinned(size_t) { unavailable("pin_memory"); }
void record_pinned_use(const StorageImpl&, CUstream_st*) { unavailable("pin_memory"); }
int64_t pinned_cached_bytes() { return 0; }
void empty_pinned_cache() {}
struct CapturedGraph::Impl {};
CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::launch() { unavailable("cuda_graph"); }
std::shared_ptr<CapturedGraph> capture_graph(int, const std::function<std::vector<Storage>()>&) {
  unavailable("cuda_graph");
}
int64_t* deferred_error_flag(int) { return nullptr; }
DeferredChecksScope::DeferredChecksScope(int) : previous_(-1) {}
DeferredChecksScope::~DeferredChecksScope() = default;
bool capturing_graph() { return false; }
bool defer_to_each_launch(std::function<void()>) { return false; }
void trim_graph_memory(int) { unavailable("trim_graph_memory"); }
const GraphRng* capture_rng() { return nullptr; }
GraphRngScope::GraphRngScope(const GraphRng*) : previous_(nullptr) {}
GraphRngScope::~GraphRngScope() = default;
void write_device_word(int, uint64_t*, uint64_t) { unavailable("cuda_graph"); }
void add_device_word(int, uint64_t*, uint64_t) { unavailable("cuda_graph"); }
void clear_plans() {}  // no cuBLASLt plans without CUDA (kernels/cuda/cublaslt.h)
}  // namespace internal

}  // namespace kiln::cuda

namespace kiln {

// Nothing can be pinned without CUDA.
Tensor Tensor::pin_memory() const { KILN_FAIL("[pin_memory] no CUDA device: ", cuda::kReason); }
bool Tensor::is_pinned() const { return false; }

}  // namespace kiln
