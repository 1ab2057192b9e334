// A kernel timeline of any CUDA program, where Nsight Systems is not installed (the lent GPU
// machines have no nsys): a CUDA injection library that records every kernel and memcpy through
// CUPTI's activity API and writes them as CSV when the program exits. No change to the program,
// and no CUDA events around its launches (kiln::profiler's, which inflate a step by 15-18%).
//
//   export CUDA_INJECTION64_PATH=build/benchmarks/libkiln_kernel_timeline.so
//   KILN_TIMELINE_OUT=/tmp/tl kiln bench --config llama-3.2-1b
//   python3 benchmarks/gpu/timeline_report.py /tmp/tl.<pid>.csv            # one profile
//   python3 benchmarks/gpu/timeline_report.py one_gpu.csv ddp_rank0.csv   # what differs
//
// Each process writes <KILN_TIMELINE_OUT>.<pid>.csv: kind,start_ns,end_ns,device,stream,name
// (kind: kernel or memcpy; a kernel's name ends with " grid=XxYxZ", its launch grid). With
// KILN_TIMELINE_API_US=T, the host's CUDA runtime and driver calls that took T microseconds or
// more are rows too (kind api, device 4294967295, stream the calling thread's id, name the
// call's: where the host blocks, e.g. a synchronisation between steps; timeline_report.py
// --api). Under `kiln run` set KILN_TIMELINE_OUT for every rank: each process writes its own
// file. CUPTI adds about a microsecond per launch on the host (more with host calls recorded);
// kernel times are the GPU's own.
#include <cupti.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include <unistd.h>

namespace {

constexpr size_t kBufferBytes = 8 << 20;

struct Row {
  bool kernel;
  uint64_t start, end;
  uint32_t device, stream;
  std::string name;
};

std::mutex g_mu;
std::vector<Row>* g_rows = nullptr;  // leaked on purpose: written from the exit handler
uint64_t g_api_ns = 0;  // KILN_TIMELINE_API_US in ns (host calls are recorded only when it is set)
constexpr uint32_t kHost = 0xffffffffu;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "[kernel_timeline] %s failed: %s\n", what, msg ? msg : "?");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Row> rows;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      // The grid tells launches of one kernel apart by problem size (a GEMM's shape).
      rows.push_back({true, k->start, k->end, k->deviceId, k->streamId,
                      std::string(k->name ? k->name : "?") + " grid=" + std::to_string(k->gridX) +
                          "x" + std::to_string(k->gridY) + "x" + std::to_string(k->gridZ)});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ||
               record->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      if (a->end - a->start < g_api_ns) continue;
      const char* name = nullptr;
      cuptiGetCallbackName(record->kind == CUPTI_ACTIVITY_KIND_RUNTIME ? CUPTI_CB_DOMAIN_RUNTIME_API
                                                                       : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      rows.push_back(
          {false, a->start, a->end, kHost, a->threadId, std::string("api ") + (name ? name : "?")});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      rows.push_back({false, m->start, m->end, m->deviceId, m->streamId,
                      "memcpy kind " + std::to_string(m->copyKind) + " " +
                          std::to_string(m->bytes) + " B"});
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mu);
  g_rows->insert(g_rows->end(), rows.begin(), rows.end());
}

void write_csv() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  const char* out = std::getenv("KILN_TIMELINE_OUT");
  const std::string path =
      std::string(out && *out ? out : "kernel_timeline") + "." + std::to_string(getpid()) + ".csv";
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "[kernel_timeline] cannot write %s\n", tmp.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(f, "kind,start_ns,end_ns,device,stream,name\n");
  for (const Row& r : *g_rows) {
    std::string name = r.name;
    for (char& c : name) {
      if (c == ',' || c == '\n') c = ' ';
    }
    const char* kind = r.kernel ? "kernel" : r.device == kHost ? "api" : "memcpy";
    std::fprintf(f, "%s,%llu,%llu,%u,%u,%s\n", kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.device, r.stream, name.c_str());
  }
  const bool ok = std::fclose(f) == 0 && std::rename(tmp.c_str(), path.c_str()) == 0;
  std::fprintf(stderr, "[kernel_timeline] %zu records %s %s\n", g_rows->size(),
               ok ? "written to" : "NOT written to", path.c_str());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  g_rows = new std::vector<Row>();
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  if (const char* us = std::getenv("KILN_TIMELINE_API_US"); us != nullptr && *us != '\0') {
    char* end = nullptr;
    const double v = std::strtod(us, &end);
    if (end == us || *end != '\0' || !(v >= 0)) {
      std::fprintf(stderr,
                   "[kernel_timeline] KILN_TIMELINE_API_US=%s is not a number of "
                   "microseconds; no api rows\n",
                   us);
    } else {
      g_api_ns = static_cast<uint64_t>(v * 1e3);
      check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime api");
      check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver api");
    }
  }
  std::atexit(write_csv);
  return 1;
}
