// kiln_dist_collectives: the bandwidth of kiln::dist's collectives between the ranks of a job, in
// nccl-tests' terms, side by side with benchmarks/gpu/torch_collectives.py (torch.distributed,
// same flags, same table and JSON lines).
//
//   kiln run --nproc-per-node 2 build/benchmarks/kiln_dist_collectives [--backend nccl|gloo]
//       [--min-bytes 1M] [--max-bytes 1G] [--dtype f32|bf16] [--iters 20] [--warmup 5]
//       [--ops all_reduce,all_reduce_beside_compute,reduce_scatter,all_gather] [--energy]
//
// For all_reduce (sum, in place), all_reduce_beside_compute, reduce_scatter_tensor and
// all_gather_into_tensor, at sizes from
// --min-bytes to --max-bytes doubling: one checked run (every rank's input is rank + 1; the result
// must be the sum 1 + ... + world, or chunk r = r + 1), `warmup` untimed runs, then `iters` runs
// timed by the wall clock between two device synchronisations. `bytes` is the size of the whole
// buffer as nccl-tests counts it: the all-reduced tensor, reduce_scatter's input, all_gather's
// output (each rank sends or receives a chunk of bytes / world). algbw = bytes / time; busbw =
// algbw * 2(n-1)/n for all_reduce and (n-1)/n for the other two, nccl-tests' factors, which make
// the three comparable with the links' bandwidth.
//
// all_reduce_beside_compute is the all-reduce DDP runs beside the backward (on NCCL between the
// GPUs of one host: the copy engines, dist/peer_all_reduce.h; elsewhere the same as all_reduce).
// --ops picks the collectives (comma-separated; default all four).
//
// --energy (CUDA, where NVML reads the board's energy counter): each size's timed loop runs for
// at least half a second, and the table adds each GPU's energy per GB of the buffer above its
// idle draw (measured for a second at the start), the mean over the ranks: what the collective
// costs a training step that runs beside it at the power limit, where time is energy.
//
// Rank 0 prints the table as it goes, then one JSON line per row
// ({"bench":"collective","impl":"kiln",...}); `grep -o '{"bench".*'` strips the launcher's
// "[rank0]: " prefix. The default backend is nccl (CUDA tensors on cuda:LOCAL_RANK) when this
// build has NCCL and a GPU, gloo (CPU tensors) otherwise.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "dist/dist.h"
#include "kernels/cuda.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: kiln run --nproc-per-node N kiln_dist_collectives [--backend nccl|gloo]\n"
    "           [--min-bytes 1M] [--max-bytes 1G] [--dtype f32|bf16] [--iters 20] [--warmup 5]\n"
    "           [--ops all_reduce,all_reduce_beside_compute,reduce_scatter,all_gather] [--energy]\n"
    "sizes take a K, M or G suffix (powers of 1024)\n";

// A bad command line: main prints the message and the usage and exits with status 2 (--help:
// the usage alone, status 0).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The collectives, in Op's order.
constexpr const char* kOpNames[] = {"all_reduce", "all_reduce_beside_compute", "reduce_scatter",
                                    "all_gather"};

struct Options {
  std::string backend;  // empty: nccl when available, else gloo
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{1} << 30;
  ScalarType dtype = kFloat;
  int iters = 20;
  int warmup = 5;
  std::vector<std::string> ops;  // op_name()s, in the order given; empty: all
  bool energy = false;
};

std::string short_dtype_name(ScalarType t) { return t == kBFloat16 ? "bf16" : "f32"; }

// "4096", "64K", "1M", "1G" (also "1MB", "1MiB"; case-insensitive) -> bytes.
int64_t parse_bytes(std::string_view flag, std::string_view text) {
  int64_t n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  std::string unit(end, text.data() + text.size());
  std::transform(unit.begin(), unit.end(), unit.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  int shift = -1;
  if (unit.empty() || unit == "B") shift = 0;
  if (unit == "K" || unit == "KB" || unit == "KIB") shift = 10;
  if (unit == "M" || unit == "MB" || unit == "MIB") shift = 20;
  if (unit == "G" || unit == "GB" || unit == "GIB") shift = 30;
  if (ec != std::errc() || end == text.data() || shift < 0 || n <= 0 ||
      n > (int64_t{1} << (40 - std::max(shift, 0)))) {
    throw UsageError(std::string(flag) + ": cannot read '" + std::string(text) +
                     "' as a positive number of bytes (such as 4096, 64K, 1M or 1G)");
  }
  return n << shift;
}

int parse_count(std::string_view flag, std::string_view text, int min) {
  int n = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < min) {
    throw UsageError(std::string(flag) + ": expected an integer >= " + std::to_string(min) +
                     ", got '" + std::string(text) + "'");
  }
  return n;
}

Options parse_args(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    std::string flag = arg, value;
    if (flag == "--help" || flag == "-h") throw UsageError("");
    if (flag == "--energy") {  // a switch: takes no value
      o.energy = true;
      continue;
    }
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);  // --flag=value
      flag.resize(eq);
    } else if (flag.rfind("--", 0) == 0) {
      if (i + 1 >= argc) throw UsageError(flag + ": missing its value");
      value = argv[++i];
    }
    if (flag == "--backend") {
      if (value != "nccl" && value != "gloo") {
        throw UsageError("--backend: expected nccl or gloo, got '" + value + "'");
      }
      o.backend = value;
    } else if (flag == "--min-bytes") {
      o.min_bytes = parse_bytes(flag, value);
    } else if (flag == "--max-bytes") {
      o.max_bytes = parse_bytes(flag, value);
    } else if (flag == "--dtype") {
      if (value == "f32" || value == "float32") {
        o.dtype = kFloat;
      } else if (value == "bf16" || value == "bfloat16") {
        o.dtype = kBFloat16;
      } else {
        throw UsageError("--dtype: expected f32 or bf16, got '" + value + "'");
      }
    } else if (flag == "--iters") {
      o.iters = parse_count(flag, value, 1);
    } else if (flag == "--warmup") {
      o.warmup = parse_count(flag, value, 0);
    } else if (flag == "--ops") {
      o.ops.clear();
      std::stringstream list(value);
      for (std::string name; std::getline(list, name, ',');) {
        if (std::find(std::begin(kOpNames), std::end(kOpNames), name) == std::end(kOpNames)) {
          throw UsageError("--ops: unknown collective '" + name +
                           "' (all_reduce, all_reduce_beside_compute, reduce_scatter, all_gather)");
        }
        o.ops.push_back(name);
      }
      if (o.ops.empty()) throw UsageError("--ops: expected at least one collective");
    } else {
      throw UsageError("unknown argument '" + arg + "'");
    }
  }
  if (o.min_bytes > o.max_bytes) {
    throw UsageError("--min-bytes (" + std::to_string(o.min_bytes) + ") is above --max-bytes (" +
                     std::to_string(o.max_bytes) + ")");
  }
  return o;
}

enum class Op { kAllReduce, kAllReduceBesideCompute, kReduceScatter, kAllGather };

const char* op_name(Op op) { return kOpNames[static_cast<int>(op)]; }
bool is_all_reduce(Op op) { return op == Op::kAllReduce || op == Op::kAllReduceBesideCompute; }

// nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md there): the fraction of the buffer that
// crosses each rank's busiest link, so that busbw is comparable with the hardware's bandwidth.
double bus_factor(Op op, int n) {
  return is_all_reduce(op) ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

struct Row {
  Op op;
  int64_t bytes = 0;  // the whole buffer (see the banner)
  double time_us = 0;
  double algbw = 0;  // GB/s (1e9 bytes)
  double busbw = 0;
  bool ok = false;  // the checked run gave the expected values
  int iters = 0;    // timed runs
  // --energy, the ranks' mean: joules per GB of the buffer above the idle draw, and the draw
  // above idle (W) while the collective runs.
  double joules_per_gb = 0;
  double watts = 0;
};

// One process group and the device its tensors live on.
struct Bench {
  std::shared_ptr<dist::ProcessGroup> pg;
  Device device = kCPU;
  Options opts;
  double idle_watts = 0;  // --energy: this GPU's draw with nothing running

  void synchronize() const {
    if (device.is_cuda()) cuda::synchronize(device.index());
  }

  // The collective `op` on the preallocated buffers; `full` is the whole buffer (all_reduce's
  // tensor, reduce_scatter's input, all_gather's output), `chunk` this rank's part.
  void run(Op op, Tensor& full, Tensor& chunk) const {
    switch (op) {
      case Op::kAllReduce:
        pg->all_reduce(full)->wait();
        break;
      case Op::kAllReduceBesideCompute:
        pg->all_reduce_beside_compute(full)->wait();
        break;
      case Op::kReduceScatter:
        pg->reduce_scatter_tensor(chunk, full)->wait();
        break;
      case Op::kAllGather:
        pg->all_gather_into_tensor(full, chunk)->wait();
        break;
    }
  }

  // Whether the result of one run on inputs rank + 1 is right: the min and max of each chunk of
  // the output, compared on the host.
  bool check(Op op, const Tensor& full, const Tensor& chunk) const {
    const int n = pg->size();
    const double sum = n * (n + 1) / 2.0;
    Tensor out = op == Op::kReduceScatter ? chunk.view({1, -1}) : full.view({n, -1});
    Tensor lo = amin(out, {1}).to(kCPU, kFloat), hi = amax(out, {1}).to(kCPU, kFloat);
    for (int64_t r = 0; r < lo.numel(); ++r) {
      const double want = op == Op::kAllGather ? r + 1.0 : sum;
      if (lo.data_ptr<float>()[r] != want || hi.data_ptr<float>()[r] != want) return false;
    }
    return true;
  }

  Row measure(Op op, int64_t bytes) const {
    const int n = pg->size();
    const int64_t elem = opts.dtype == kBFloat16 ? 2 : 4;
    // A whole number of elements per rank, at least one.
    const int64_t per_rank = std::max<int64_t>(1, bytes / elem / n);
    const TensorOptions to = TensorOptions().dtype(opts.dtype).device(device);
    Tensor full, chunk;
    switch (op) {
      case Op::kAllReduce:
      case Op::kAllReduceBesideCompute:
        full = full_like_value(per_rank * n, to);
        break;
      case Op::kReduceScatter:
        full = full_like_value(per_rank * n, to);
        chunk = empty({per_rank}, to);
        break;
      case Op::kAllGather:
        full = empty({per_rank * n}, to);
        chunk = full_like_value(per_rank, to);
        break;
    }
    run(op, full, chunk);
    synchronize();
    Row row{op, per_rank * n * elem};
    row.ok = check(op, full, chunk);
    if (is_all_reduce(op)) full.zero_();  // repeated sums would grow the values to inf

    for (int i = 0; i < opts.warmup; ++i) run(op, full, chunk);
    synchronize();
    row.iters = opts.energy ? energy_iters(op, full, chunk) : opts.iters;
    pg->barrier()->wait();  // the ranks start the timed loop together
    synchronize();
    std::optional<cuda::PowerMonitor> monitor;
    if (opts.energy) monitor.emplace(device.index());
    const auto t0 = Clock::now();
    for (int i = 0; i < row.iters; ++i) run(op, full, chunk);
    synchronize();
    const double total = std::chrono::duration<double>(Clock::now() - t0).count();
    const double seconds = total / row.iters;
    row.time_us = seconds * 1e6;
    row.algbw = row.bytes / seconds / 1e9;
    row.busbw = row.algbw * bus_factor(op, n);
    if (monitor) {
      const cuda::PowerReport p = monitor->stop();
      const double above = mean_over_ranks(p.energy_joules - idle_watts * p.seconds);
      row.joules_per_gb = above / (static_cast<double>(row.bytes) * row.iters / 1e9);
      row.watts = above / total;
    }
    return row;
  }

  // --energy: timed runs enough for half a second (the energy counter's resolution), from one
  // more run's time on rank 0, which every rank takes.
  int energy_iters(Op op, Tensor& buffer, Tensor& chunk) const {
    const auto t0 = Clock::now();
    run(op, buffer, chunk);
    synchronize();
    const double one = std::chrono::duration<double>(Clock::now() - t0).count();
    const double want = std::ceil(0.5 / std::max(one, 1e-6));
    Tensor n = full({1}, std::clamp(want, static_cast<double>(opts.iters), 1e6),
                    TensorOptions().dtype(kFloat).device(device));
    pg->broadcast(n, 0)->wait();
    return static_cast<int>(n.to(kCPU).data_ptr<float>()[0]);
  }

  double mean_over_ranks(double v) const {
    Tensor t = full({1}, v, TensorOptions().dtype(kFloat).device(device));
    pg->all_reduce(t)->wait();
    return t.to(kCPU).data_ptr<float>()[0] / pg->size();
  }

  // --energy: this GPU's draw for a second with nothing running (every rank at once).
  void measure_idle() {
    synchronize();
    pg->barrier()->wait();
    cuda::PowerMonitor monitor(device.index());
    KILN_CHECK(monitor.available(),
               "[kiln_dist_collectives] --energy: ", monitor.unavailable_reason());
    std::this_thread::sleep_for(std::chrono::seconds(1));
    const cuda::PowerReport p = monitor.stop();
    idle_watts = p.energy_joules / p.seconds;
  }

  Tensor full_like_value(int64_t numel, const TensorOptions& to) const {
    return full({numel}, pg->rank() + 1, to);
  }
};

std::string json_line(const Row& r, const Bench& b) {
  char buf[640];
  int len = std::snprintf(
      buf, sizeof(buf),
      "{\"bench\":\"collective\",\"impl\":\"kiln\",\"backend\":\"%s\",\"op\":\"%s\","
      "\"dtype\":\"%s\",\"world\":%d,\"bytes\":%lld,\"iters\":%d,\"time_us\":%.2f,"
      "\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f,\"ok\":%s",
      b.pg->backend_name().c_str(), op_name(r.op), short_dtype_name(b.opts.dtype).c_str(),
      b.pg->size(), static_cast<long long>(r.bytes), r.iters, r.time_us, r.algbw, r.busbw,
      r.ok ? "true" : "false");
  if (b.opts.energy) {
    len += std::snprintf(buf + len, sizeof(buf) - len,
                         ",\"joules_per_gb\":%.4f,\"watts_above_idle\":%.1f,\"idle_watts\":%.1f",
                         r.joules_per_gb, r.watts, b.idle_watts);
  }
  std::snprintf(buf + len, sizeof(buf) - len, "}");
  return buf;
}

std::string table_line(const Row& r, bool energy) {
  char buf[256];
  int len = std::snprintf(buf, sizeof(buf), "%26s %14lld %12.2f %12.2f %12.2f %6s", op_name(r.op),
                          static_cast<long long>(r.bytes), r.time_us, r.algbw, r.busbw,
                          r.ok ? "ok" : "WRONG");
  if (energy) {
    std::snprintf(buf + len, sizeof(buf) - len, " %10.3f %10.1f", r.joules_per_gb, r.watts);
  }
  return buf;
}

int run_bench(const Options& opts) {
  Bench b;
  b.opts = opts;
  std::string backend = opts.backend;
  if (backend.empty()) {
    backend = dist::nccl_available() && cuda::is_available() ? "nccl" : "gloo";
  }
  if (backend == "nccl") {
    const int local_rank = dist::rendezvous_info_from_env().local_rank;
    KILN_CHECK(cuda::is_available(), "[kiln_dist_collectives] --backend nccl needs a GPU (",
               cuda::unavailable_reason(), "); use --backend gloo for CPU tensors");
    KILN_CHECK(local_rank < cuda::device_count(), "[kiln_dist_collectives] LOCAL_RANK=", local_rank,
               " but this node has ", cuda::device_count(), " GPUs");
    cuda::set_device(local_rank);
    b.device = Device(kCUDA, local_rank);
  }
  KILN_CHECK(!opts.energy || b.device.is_cuda(),
             "[kiln_dist_collectives] --energy reads the GPUs' energy counters: it needs "
             "--backend nccl (CUDA tensors), not ",
             backend);
  b.pg = dist::init_process_group(backend);
  const bool lead = b.pg->rank() == 0;
  if (opts.energy) b.measure_idle();
  if (lead) {
    std::cout << "# kiln_dist_collectives: backend " << backend << ", world " << b.pg->size()
              << ", dtype " << short_dtype_name(opts.dtype) << ", iters " << opts.iters
              << ", warmup " << opts.warmup << "\n#\n";
    char head[256];
    int len = std::snprintf(head, sizeof(head), "%26s %14s %12s %12s %12s %6s", "op", "bytes",
                            "time(us)", "algbw(GB/s)", "busbw(GB/s)", "check");
    if (opts.energy) {
      std::snprintf(head + len, sizeof(head) - len, " %10s %10s", "J/GB", "W");
      std::cout << "# energy: each GPU's above its idle draw (rank 0's: " << b.idle_watts
                << " W), the ranks' mean\n";
    }
    std::cout << head << std::endl;
  }
  std::vector<std::string> json;
  bool all_ok = true;
  auto print_json = [&] {
    if (!lead) return;
    std::cout << "\n";
    for (const auto& line : json) std::cout << line << "\n";
    std::cout << std::flush;
  };
  try {
    std::vector<Op> ops;
    for (int k = 0; k < static_cast<int>(std::size(kOpNames)); ++k) {
      if (opts.ops.empty() ||
          std::find(opts.ops.begin(), opts.ops.end(), kOpNames[k]) != opts.ops.end()) {
        ops.push_back(static_cast<Op>(k));
      }
    }
    for (Op op : ops) {
      for (int64_t bytes = opts.min_bytes; bytes <= opts.max_bytes; bytes *= 2) {
        const Row row = b.measure(op, bytes);
        all_ok = all_ok && row.ok;
        json.push_back(json_line(row, b));
        if (lead) std::cout << table_line(row, opts.energy) << std::endl;
      }
    }
  } catch (...) {
    print_json();  // the rows measured so far
    throw;
  }
  print_json();
  b.pg->barrier()->wait();
  dist::destroy_process_group();
  if (!all_ok) {
    std::cerr << "kiln_dist_collectives: some results were WRONG (see the check column)\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options opts;
  try {
    opts = parse_args(argc, argv);
  } catch (const UsageError& e) {
    if (*e.what() == '\0') {
      std::cout << kUsage;
      return 0;
    }
    std::cerr << "kiln_dist_collectives: " << e.what() << "\n" << kUsage;
    return 2;
  }
  try {
    return run_bench(opts);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";  // kiln's errors start with the op's name in brackets
    return 1;
  }
}
