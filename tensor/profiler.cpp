#include "tensor/profiler.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "kernels/cuda.h"
#include "tensor/error.h"

namespace kiln::profiler {

struct Profiler::Impl {
  std::mutex mutex;
  using Key = std::tuple<std::string, std::string, DeviceType, int, std::string>;
  std::map<Key, KernelTime> totals;
  struct Pending {
    Key key;
    cuda::Event begin{true}, end{true};
  };
  std::vector<Pending> pending;  // CUDA kernels whose events have not been read yet
  // Whether stop() has not run since start(): a kernel that began timing before stop() and ends
  // after it is not counted (guarded by `mutex`).
  bool recording = false;

  KernelTime& entry(const Key& key, const OpCall& call, const KernelDef* def, Device device) {
    KernelTime& t = totals[key];
    if (t.calls == 0 && t.ms == 0) {
      t.op = call.op->name;
      t.kernel = def != nullptr ? def->name : "";
      t.device = device;
      t.executor = std::get<4>(key);
    }
    return t;
  }

  // Reads the events of finished CUDA kernels into the totals (waits for them).
  void drain() {
    for (Pending& p : pending) {
      p.end.synchronize();
      KernelTime& t = totals[p.key];
      t.ms += p.begin.elapsed_time(p.end);
    }
    pending.clear();
  }
};

namespace {

// The recording profiler, twice. run_timed copies the shared_ptr, so that a profiler stopped or
// destroyed while another thread is timing a kernel stays alive until that thread has recorded
// into it. The raw pointer is what active() reads: one relaxed load per kernel while nothing
// records. Both change together, under `control`.
struct Current {
  std::atomic<std::shared_ptr<Profiler::Impl>> impl;
  std::mutex control;  // start() and stop()
};
// Never destroyed: a profiler with static storage may stop after this file's statics are gone.
Current& current() {
  static Current* const c = new Current;
  return *c;
}
std::atomic<Profiler::Impl*> g_active{nullptr};

thread_local const std::string* t_executor = nullptr;

}  // namespace

ExecutorLabel::ExecutorLabel(const std::string* name) : previous_(t_executor) {
  t_executor = name;
}
ExecutorLabel::~ExecutorLabel() { t_executor = previous_; }

Profiler::Profiler() : impl_(std::make_shared<Impl>()) {}

Profiler::~Profiler() { stop(); }

void Profiler::start() {
  Current& c = current();
  std::lock_guard<std::mutex> control(c.control);
  const Impl* now = g_active.load();
  KILN_CHECK(now == nullptr || now == impl_.get(),
             "[profiler] another profiler is recording: stop it first");
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->recording = true;
  }
  c.impl.store(impl_);
  g_active.store(impl_.get());
}

void Profiler::stop() {
  {
    Current& c = current();
    std::lock_guard<std::mutex> control(c.control);
    if (g_active.load() == impl_.get()) {
      g_active.store(nullptr);
      c.impl.store(nullptr);
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->recording = false;
}

bool Profiler::recording() const { return g_active.load() == impl_.get(); }

std::vector<KernelTime> Profiler::results() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  impl_->drain();
  std::vector<KernelTime> out;
  for (const auto& [key, t] : impl_->totals) out.push_back(t);
  std::sort(out.begin(), out.end(),
            [](const KernelTime& a, const KernelTime& b) { return a.ms > b.ms; });
  return out;
}

namespace internal {

bool active() { return g_active.load(std::memory_order_relaxed) != nullptr; }

void run_timed(KernelFn kernel, const KernelDef* def, OpCall& call, Device device) {
  // Owned for the whole call: the profiler may be stopped and destroyed while the kernel runs.
  const std::shared_ptr<Profiler::Impl> p = current().impl.load();
  if (p == nullptr) {
    kernel(call);
    return;
  }
  Profiler::Impl::Key key{call.op->name, def != nullptr ? def->name : "", device.type(),
                          device.index(), t_executor != nullptr ? *t_executor : std::string()};
  if (device.is_cuda()) {
    Profiler::Impl::Pending timed{key};
    const cuda::Stream stream = cuda::current_stream(device.index());
    timed.begin.record(stream);
    kernel(call);
    timed.end.record(stream);
    std::lock_guard<std::mutex> lock(p->mutex);
    if (!p->recording) return;
    ++p->entry(key, call, def, device).calls;
    p->pending.push_back(std::move(timed));
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  kernel(call);
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(p->mutex);
  if (!p->recording) return;
  KernelTime& t = p->entry(key, call, def, device);
  ++t.calls;
  t.ms += ms;
}

}  // namespace internal

std::string family_of(const std::string& op) {
  auto has = [&](const char* part) { return op.find(part) != std::string::npos; };
  if (op == "mm" || op == "bmm" || op == "addmm" || op == "matmul" || op == "linear" ||
      has("baddbmm") || has("mm_"))
    return "GEMM";
  if (has("attention")) return "attention";
  if (has("norm")) return "norms";
  if (has("rotary") || has("rope")) return "RoPE";
  if (has("glu")) return "GLU";
  if (has("cross_entropy") || has("nll")) return "cross-entropy";
  if (has("adam") || has("sgd") || has("foreach") || has("optim")) return "optimizer";
  if (has("copy") || op == "contiguous" || op == "cat" || op == "stack" || op == "fill_" ||
      op == "zero_" || op == "zeros" || op == "full")
    return "copies and casts";
  if (has("sum") || has("mean") || has("max") || has("min") || has("softmax") || has("cumsum") ||
      has("prod") || has("var") || has("std"))
    return "reductions";
  if (has("index") || has("gather") || has("scatter") || has("embedding") || has("select") ||
      has("where") || has("masked"))
    return "indexing";
  return "elementwise";
}

void print_report(const std::vector<KernelTime>& results, int64_t steps, double step_ms,
                  std::ostream& out, size_t top) {
  KILN_CHECK(steps > 0, "[profiler] print_report needs a positive number of steps, got ", steps);
  const double n = static_cast<double>(steps);
  double total = 0;
  int64_t calls = 0;
  std::map<std::string, std::pair<double, int64_t>> families;
  for (const KernelTime& t : results) {
    total += t.ms;
    calls += t.calls;
    auto& f = families[family_of(t.op)];
    f.first += t.ms;
    f.second += t.calls;
  }
  std::vector<std::pair<std::string, std::pair<double, int64_t>>> rows(families.begin(),
                                                                       families.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  char line[256];
  std::snprintf(line, sizeof(line),
                "profile: %.2f ms of kernels per step in %.1f launches (%.0f%% of the %.2f ms "
                "step; the rest is time no kernel runs)\n",
                total / n, static_cast<double>(calls) / n,
                step_ms > 0 ? 100.0 * total / n / step_ms : 0.0, step_ms);
  out << line;
  std::snprintf(line, sizeof(line), "  %-18s %10s %8s %8s\n", "family", "ms/step", "share",
                "kernels");
  out << line;
  for (const auto& [name, f] : rows) {
    std::snprintf(line, sizeof(line), "  %-18s %10.3f %7.1f%% %8.1f\n", name.c_str(), f.first / n,
                  total > 0 ? 100.0 * f.first / total : 0.0, static_cast<double>(f.second) / n);
    out << line;
  }
  // Per executor, when compiled programs ran.
  std::map<std::string, std::pair<double, int64_t>> executors;
  for (const KernelTime& t : results) {
    auto& e = executors[t.executor.empty() ? "(eager code)" : t.executor];
    e.first += t.ms;
    e.second += t.calls;
  }
  if (executors.size() > 1 || !executors.contains("(eager code)")) {
    std::snprintf(line, sizeof(line), "  %-18s %10s %8s %8s\n", "executor", "ms/step", "share",
                  "kernels");
    out << line;
    for (const auto& [name, e] : executors) {
      std::snprintf(line, sizeof(line), "  %-18s %10.3f %7.1f%% %8.1f\n", name.c_str(),
                    e.first / n, total > 0 ? 100.0 * e.first / total : 0.0,
                    static_cast<double>(e.second) / n);
      out << line;
    }
  }
  std::snprintf(line, sizeof(line), "  %-40s %10s %8s %8s\n", "slowest kernels (op/kernel)",
                "ms/step", "share", "calls");
  out << line;
  for (size_t i = 0; i < results.size() && i < top; ++i) {
    const KernelTime& t = results[i];
    const std::string name = t.op + (t.kernel.empty() ? "" : "/" + t.kernel) + " " + t.device.str();
    std::snprintf(line, sizeof(line), "  %-40s %10.3f %7.1f%% %8.1f\n", name.c_str(), t.ms / n,
                  total > 0 ? 100.0 * t.ms / total : 0.0, static_cast<double>(t.calls) / n);
    out << line;
  }
}

}  // namespace kiln::profiler
