// kiln_dist_collectives: the bandwidth of kiln::dist's collectives between the ranks of a job, in
// nccl-tests' terms, side by side with benchmarks/gpu/torch_collectives.py (torch.distributed,
// same flags, same table and JSON lines).
//
//   kiln run --nproc-per-node 2 build/benchmarks/kiln_dist_collectives [--backend nccl|gloo]
//       [--min-bytes 1M] [--max-bytes 1G] [--dtype f32|bf16] [--iters 20] [--warmup 5]
//
// For all_reduce (sum, in place), reduce_scatter_tensor and all_gather_into_tensor, at sizes from
// --min-bytes to --max-bytes doubling: one checked run (every rank's input is rank + 1; the result
// must be the sum 1 + ... + world, or chunk r = r + 1), `warmup` untimed runs, then `iters` runs
// timed by the wall clock between two device synchronisations. `bytes` is the size of the whole
// buffer as nccl-tests counts it: the all-reduced tensor, reduce_scatter's input, all_gather's
// output (each rank sends or receives a chunk of bytes / world). algbw = bytes / time; busbw =
// algbw * 2(n-1)/n for all_reduce and (n-1)/n for the other two, nccl-tests' factors, which make
// the three comparable with the links' bandwidth.
//
// Rank 0 prints the table as it goes, then one JSON line per row
// ({"bench":"collective","impl":"kiln",...}); `grep -o '{"bench".*'` strips the launcher's
// "[rank0]: " prefix. The default backend is nccl (CUDA tensors on cuda:LOCAL_RANK) when this
// build has NCCL and a GPU, gloo (CPU tensors) otherwise.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
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
    "sizes take a K, M or G suffix (powers of 1024)\n";

// A bad command line: main prints the message and the usage and exits with status 2 (--help:
// the usage alone, status 0).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string backend;  // empty: nccl when available, else gloo
  int64_t min_bytes = int64_t{1} << 20;
  int64_t max_bytes = int64_t{1} << 30;
  ScalarType dtype = kFloat;
  int iters = 20;
  int warmup = 5;
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

enum class Op { kAllReduce, kReduceScatter, kAllGather };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduce:
      return "all_reduce";
    case Op::kReduceScatter:
      return "reduce_scatter";
    case Op::kAllGather:
      return "all_gather";
  }
  return "?";
}

// nccl-tests' bus bandwidth factors (doc/PERFORMANCE.md there): the fraction of the buffer that
// crosses each rank's busiest link, so that busbw is comparable with the hardware's bandwidth.
double bus_factor(Op op, int n) {
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
}

struct Row {
  Op op;
  int64_t bytes = 0;  // the whole buffer (see the banner)
  double time_us = 0;
  double algbw = 0;  // GB/s (1e9 bytes)
  double busbw = 0;
  bool ok = false;  // the checked run gave the expected values
};

// One process group and the device its tensors live on.
struct Bench {
  std::shared_ptr<dist::ProcessGroup> pg;
  Device device = kCPU;
  Options opts;

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
    if (op == Op::kAllReduce) full.zero_();  // repeated sums would grow the values to inf

    for (int i = 0; i < opts.warmup; ++i) run(op, full, chunk);
    synchronize();
    pg->barrier()->wait();  // the ranks start the timed loop together
    synchronize();
    const auto t0 = Clock::now();
    for (int i = 0; i < opts.iters; ++i) run(op, full, chunk);
    synchronize();
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count() / opts.iters;
    row.time_us = seconds * 1e6;
    row.algbw = row.bytes / seconds / 1e9;
    row.busbw = row.algbw * bus_factor(op, n);
    return row;
  }

  Tensor full_like_value(int64_t numel, const TensorOptions& to) const {
    return full({numel}, pg->rank() + 1, to);
  }
};

std::string json_line(const Row& r, const Bench& b) {
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "{\"bench\":\"collective\",\"impl\":\"kiln\",\"backend\":\"%s\",\"op\":\"%s\","
                "\"dtype\":\"%s\",\"world\":%d,\"bytes\":%lld,\"iters\":%d,\"time_us\":%.2f,"
                "\"algbw_gbs\":%.3f,\"busbw_gbs\":%.3f,\"ok\":%s}",
                b.pg->backend_name().c_str(), op_name(r.op), short_dtype_name(b.opts.dtype).c_str(),
                b.pg->size(), static_cast<long long>(r.bytes), b.opts.iters, r.time_us, r.algbw,
                r.busbw, r.ok ? "true" : "false");
  return buf;
}

std::string table_line(const Row& r) {
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%16s %14lld %12.2f %12.2f %12.2f %6s", op_name(r.op),
                static_cast<long long>(r.bytes), r.time_us, r.algbw, r.busbw,
                r.ok ? "ok" : "WRONG");
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
  b.pg = dist::init_process_group(backend);
  const bool lead = b.pg->rank() == 0;
  if (lead) {
    std::cout << "# kiln_dist_collectives: backend " << backend << ", world " << b.pg->size()
              << ", dtype " << short_dtype_name(opts.dtype) << ", iters " << opts.iters
              << ", warmup " << opts.warmup << "\n#\n";
    char head[256];
    std::snprintf(head, sizeof(head), "%16s %14s %12s %12s %12s %6s", "op", "bytes", "time(us)",
                  "algbw(GB/s)", "busbw(GB/s)", "check");
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
    for (Op op : {Op::kAllReduce, Op::kReduceScatter, Op::kAllGather}) {
      for (int64_t bytes = opts.min_bytes; bytes <= opts.max_bytes; bytes *= 2) {
        const Row row = b.measure(op, bytes);
        all_ok = all_ok && row.ok;
        json.push_back(json_line(row, b));
        if (lead) std::cout << table_line(row) << std::endl;
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
