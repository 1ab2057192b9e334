#include "dist/process_group_nccl.h"

#include "tensor/error.h"

#if KILN_WITH_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "autograd/grad_mode.h"
#include "dist/peer_all_reduce.h"
#include "kernels/cuda.h"
#include "tensor/ops.h"
#endif

namespace kiln::dist {

#if !KILN_WITH_NCCL

bool nccl_available() { return false; }

struct ProcessGroupNCCL::Impl {};

namespace {
[[noreturn]] void unavailable() {
  KILN_FAIL("[ProcessGroupNCCL] this build of kiln has no NCCL backend (it needs a CUDA build "
            "with NCCL installed); use the \"gloo\" backend for CPU tensors");
}
}  // namespace

ProcessGroupNCCL::ProcessGroupNCCL(std::shared_ptr<Store>, int rank, int size, Options)
    : ProcessGroup(rank, size) {
  unavailable();
}
ProcessGroupNCCL::~ProcessGroupNCCL() = default;
std::shared_ptr<Work> ProcessGroupNCCL::all_reduce(Tensor&, ReduceOp) { unavailable(); }
std::shared_ptr<Work> ProcessGroupNCCL::all_reduce_beside_compute(Tensor&, ReduceOp) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::broadcast(Tensor&, int) { unavailable(); }
std::shared_ptr<Work> ProcessGroupNCCL::all_gather_into_tensor(Tensor&, const Tensor&) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::all_gather_into_tensor_coalesced(
    std::vector<Tensor>&, const std::vector<Tensor>&) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter_tensor_coalesced(std::vector<Tensor>&,
                                                                        const std::vector<Tensor>&,
                                                                        ReduceOp) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::all_gather(std::vector<Tensor>&, const Tensor&) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter_tensor(Tensor&, const Tensor&, ReduceOp) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter(Tensor&, const std::vector<Tensor>&,
                                                       ReduceOp) {
  unavailable();
}
std::shared_ptr<Work> ProcessGroupNCCL::barrier() { unavailable(); }
std::shared_ptr<Work> ProcessGroupNCCL::send(const Tensor&, int, int) { unavailable(); }
std::shared_ptr<Work> ProcessGroupNCCL::recv(Tensor&, int, int) { unavailable(); }
std::string ProcessGroupNCCL::large_all_reduce_path() const { unavailable(); }

#else  // KILN_WITH_NCCL

bool nccl_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(const char* op, ScalarType t) {
  switch (t) {
    case kFloat: return ncclFloat32;
    case kDouble: return ncclFloat64;
    case kHalf: return ncclFloat16;
    case kBFloat16: return ncclBfloat16;
    case kUInt8: return ncclUint8;
    case kInt32: return ncclInt32;
    case kInt64: return ncclInt64;
    case kBool: return ncclUint8;
  }
  KILN_FAIL("[", op, "] unsupported dtype ", t);
}

ncclRedOp_t nccl_op(ReduceOp op, ScalarType t) {
  if (t == kBool) {  // or / and on 0-1 bytes
    return (op == ReduceOp::kSum || op == ReduceOp::kMax) ? ncclMax : ncclMin;
  }
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
  }
  return ncclSum;
}

}  // namespace

// The communicator is a blocking one, as PyTorch's: a non-blocking NCCL communicator hands every
// collective to a new host thread (a pthread_create per call) and returns ncclInProgress, which
// the caller polls. Under a CUDA profiler that host cost left the GPU idle for 15 ms of a DDP
// llama-3.2-1b step; without one, the two modes measured the same (benchmarks/RESULTS.md,
// session 18). A blocking call can still hang on the host (connecting to a peer that died), so
// a watchdog thread aborts the communicator when a call has run longer than the timeout, which
// makes the call return with an error; the setup runs on its own thread and is abandoned after
// the timeout.
struct ProcessGroupNCCL::Impl {
  int rank = 0;
  int size = 1;
  int device = 0;
  Milliseconds timeout{kDefaultStoreTimeout};
  ncclComm_t comm = nullptr;
  cuda::Stream stream;
  std::atomic<bool> aborted{false};
  std::atomic<bool> timed_out{false};  // the watchdog aborted a call
  std::string key;                     // the group's prefix in the store
  // The copy-engine all-reduce: peer_pending until the first all_reduce_beside_compute it takes
  // sets it up (or fails to: peer stays null).
  bool peer_pending = false;
  std::unique_ptr<internal::PeerAllReduce> peer;
  std::string peer_why = "not set up yet";

  // The watchdog: the deadline of the NCCL call in progress (steady-clock ns; 0: none).
  std::atomic<int64_t> call_deadline_ns{0};
  std::mutex watchdog_mu;
  std::condition_variable watchdog_cv;
  bool watchdog_stop = false;
  std::thread watchdog;

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  }

  void start_watchdog() {
    watchdog = std::thread([this] {
      std::unique_lock<std::mutex> lock(watchdog_mu);
      while (!watchdog_stop) {
        watchdog_cv.wait_for(lock, std::chrono::milliseconds(50));
        const int64_t deadline = call_deadline_ns.load();
        if (deadline != 0 && now_ns() > deadline) {
          timed_out = true;
          abort();
        }
      }
    });
  }

  void stop_watchdog() {
    if (!watchdog.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(watchdog_mu);
      watchdog_stop = true;
    }
    watchdog_cv.notify_all();
    watchdog.join();
  }

  // Marks the NCCL calls of one operation, so that the watchdog can end them.
  struct Call {
    explicit Call(Impl& p) : p_(p) {
      p_.call_deadline_ns = now_ns() + std::chrono::nanoseconds(p_.timeout).count();
    }
    ~Call() { p_.call_deadline_ns = 0; }
    Impl& p_;
  };

  // Checks an NCCL call's result. ncclInProgress (a call that NCCL finishes on its own thread)
  // is waited for within the timeout.
  void settle(const char* op, ncclResult_t r) {
    const auto deadline = Clock::now() + timeout;
    while (r == ncclInProgress && !aborted.load()) {
      if (Clock::now() > deadline) {
        timed_out = true;
        abort();
        break;
      }
      std::this_thread::yield();
      ncclCommGetAsyncError(comm, &r);
    }
    if (timed_out.load() && r != ncclSuccess) {
      KILN_FAIL("[", op, "] rank ", rank, " of ", size, ": NCCL did not finish within ",
                timeout.count(), " ms (a rank died or issued a different collective); the "
                "communicator was aborted");
    }
    check(op, r);
  }

  void check(const char* op, ncclResult_t r) {
    if (r == ncclSuccess) return;
    KILN_FAIL("[", op, "] rank ", rank, " of ", size, ": NCCL error: ", ncclGetErrorString(r),
              " (", ncclGetLastError(comm), ")");
  }

  void abort() {
    if (!aborted.exchange(true) && comm != nullptr) ncclCommAbort(comm);
    if (peer != nullptr) peer->release();
  }

  void check_tensor(const char* op, const Tensor& t, const char* what) const {
    KILN_CHECK(t.defined(), "[", op, "] ", what, " is undefined");
    KILN_CHECK(t.is_cuda(), "[", op, "] the NCCL backend takes CUDA tensors, but ", what,
               " is on ", t.device(), " (use the \"gloo\" backend for CPU tensors)");
    const int idx = t.device().index() < 0 ? cuda::current_device() : t.device().index();
    KILN_CHECK(idx == device, "[", op, "] ", what, " is on cuda:", idx,
               " but this rank's group uses cuda:", device);
    KILN_CHECK(!aborted.load(), "[", op, "] the NCCL communicator of rank ", rank,
               " was aborted after an earlier timeout");
  }
};

namespace {

// A collective queued on the group's stream: `done` is recorded after it.
class NCCLWork final : public Work {
 public:
  NCCLWork(const char* op, ProcessGroupNCCL::Impl* pg, std::vector<Tensor> keep, bool blocking)
      : Work(op), pg_(pg), keep_(std::move(keep)), blocking_(blocking) {
    done_event_.record(pg->stream);
    set_result(keep_);
  }
  ~NCCLWork() override {
    // Memory is freed in the order of the stream that allocated it (usually the current one):
    // make that stream wait for the collective before the tensors can be released.
    if (!waited_) {
      try {
        cuda::current_stream(pg_->device).wait(done_event_);
      } catch (...) {
      }
    }
  }
  bool is_completed() override { return done_event_.query(); }
  bool wait(std::optional<Milliseconds> timeout) override {
    if (timeout || blocking_) {
      const auto deadline = Clock::now() + timeout.value_or(pg_->timeout);
      while (!done_event_.query()) {
        if (Clock::now() > deadline) {
          pg_->abort();
          KILN_FAIL("[", op_, "] rank ", pg_->rank, " of ", pg_->size,
                    ": the collective did not finish within ",
                    timeout.value_or(pg_->timeout).count(),
                    " ms (a rank died or issued a different collective); the NCCL communicator "
                    "was aborted");
        }
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
      ncclResult_t r = ncclSuccess;
      ncclCommGetAsyncError(pg_->comm, &r);
      pg_->check(op_.c_str(), r);
    }
    cuda::current_stream(pg_->device).wait(done_event_);
    waited_ = true;
    finish();
    return true;
  }

 private:
  ProcessGroupNCCL::Impl* pg_;
  std::vector<Tensor> keep_;
  bool blocking_;
  bool waited_ = false;
  cuda::Event done_event_;
};

// Runs `enqueue` (the NCCL calls) on the group's stream after the caller's current stream.
template <typename F>
std::shared_ptr<Work> launch(ProcessGroupNCCL::Impl& pg, const char* op, std::vector<Tensor> keep,
                             F&& enqueue, bool blocking = false) {
  pg.stream.wait_stream(cuda::current_stream(pg.device));
  {
    cuda::StreamGuard guard(pg.stream);
    NoGradGuard no_grad;
    ProcessGroupNCCL::Impl::Call call(pg);
    enqueue();
  }
  return std::make_shared<NCCLWork>(op, &pg, std::move(keep), blocking);
}

// A group of one rank: a reduction's result is the rank's own tensor and a broadcast leaves it as
// it is, so there is nothing to run. NCCL would still run a kernel over the tensor (with kAvg, a
// pass that scales by 1): on a DDP step of one rank, a pass over every gradient, 2-3% of the
// step of llama-160m and llama-3.2-1b on an H200 (benchmarks/RESULTS.md, session 41).
std::shared_ptr<Work> nothing_to_do(const char* op, const Tensor& tensor) {
  auto work = std::make_shared<Work>(op);
  work->set_result({tensor});
  work->finish();
  return work;
}

}  // namespace

ProcessGroupNCCL::ProcessGroupNCCL(std::shared_ptr<Store> store, int rank, int size,
                                   Options options)
    : ProcessGroup(rank, size), impl_(std::make_unique<Impl>()) {
  KILN_CHECK(store != nullptr, "[ProcessGroupNCCL] the store is null");
  KILN_CHECK(size >= 1 && rank >= 0 && rank < size, "[ProcessGroupNCCL] rank ", rank,
             " is outside [0, ", size, ")");
  KILN_CHECK(cuda::is_available(), "[ProcessGroupNCCL] no usable GPU: ",
             cuda::unavailable_reason());
  KILN_CHECK(options.device_index >= 0 && options.device_index < cuda::device_count(),
             "[ProcessGroupNCCL] device_index ", options.device_index, " but there are ",
             cuda::device_count(), " GPUs (is LOCAL_RANK or --nproc-per-node too large?)");
  timeout_ = options.timeout;
  store_ = store;
  Impl& p = *impl_;
  p.rank = rank;
  p.size = size;
  p.device = options.device_index;
  p.timeout = options.timeout;
  cuda::set_device(p.device);
  p.stream = cuda::Stream::create(p.device);

  // Rank 0 makes the communicator's id and shares it through the store.
  // Each group its key: every rank counts its own groups in the store (see ProcessGroupGloo).
  const int64_t group = store->add("kiln/nccl/groups_of_rank/" + std::to_string(rank), 1);
  p.key = "kiln/nccl/" + std::to_string(group);
  p.peer_pending = options.peer_all_reduce;
  if (!options.peer_all_reduce) p.peer_why = "Options::peer_all_reduce is off";
  const std::string key = p.key + "/id";
  ncclUniqueId id;
  if (rank == 0) {
    p.check("ProcessGroupNCCL", ncclGetUniqueId(&id));
    store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                         reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
  } else {
    const auto bytes = store->get(key);
    KILN_CHECK(bytes.size() == sizeof(id), "[ProcessGroupNCCL] malformed communicator id");
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  // The setup on its own thread, abandoned (and its communicator aborted when it comes) after
  // the timeout: a rank that died after the rendezvous would otherwise hang the others here.
  struct Setup {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool abandoned = false;
    ncclResult_t result = ncclInternalError;
    ncclComm_t comm = nullptr;
  };
  auto setup = std::make_shared<Setup>();
  std::thread([setup, size, id, rank, device = p.device] {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 1;
    ncclComm_t comm = nullptr;
    ncclResult_t r = cudaSetDevice(device) == cudaSuccess
                         ? ncclCommInitRankConfig(&comm, size, id, rank, &config)
                         : ncclUnhandledCudaError;
    std::lock_guard<std::mutex> lock(setup->mu);
    if (setup->abandoned) {
      if (comm != nullptr) ncclCommAbort(comm);
      return;
    }
    setup->result = r;
    setup->comm = comm;
    setup->done = true;
    setup->cv.notify_all();
  }).detach();
  {
    std::unique_lock<std::mutex> lock(setup->mu);
    if (!setup->cv.wait_for(lock, p.timeout, [&] { return setup->done; })) {
      setup->abandoned = true;
      KILN_FAIL("[ProcessGroupNCCL] rank ", rank, " of ", size,
                ": NCCL's communicator was not set up within ", p.timeout.count(),
                " ms (did every rank start, and on its own GPU?)");
    }
    p.comm = setup->comm;
  }
  // ncclInProgress when NCCL_COMM_BLOCKING=0 in the environment makes the communicator a
  // non-blocking one: settle() waits for such results.
  p.settle("ProcessGroupNCCL", setup->result);
  p.start_watchdog();
}

ProcessGroupNCCL::~ProcessGroupNCCL() {
  if (impl_->comm == nullptr) return;
  impl_->peer.reset();
  try {
    impl_->stream.synchronize();
  } catch (...) {
  }
  if (!impl_->aborted.load()) {
    ncclResult_t r = ncclInternalError;
    {
      Impl::Call call(*impl_);  // the watchdog ends a finalize that waits for a dead peer
      r = ncclCommFinalize(impl_->comm);
    }
    if (r == ncclSuccess && !impl_->aborted.load()) {
      ncclCommDestroy(impl_->comm);
    } else {
      impl_->abort();
    }
  }
  impl_->stop_watchdog();
}

std::shared_ptr<Work> ProcessGroupNCCL::all_reduce(Tensor& tensor, ReduceOp op) {
  Impl& p = *impl_;
  p.check_tensor("all_reduce", tensor, "the tensor");
  KILN_CHECK(op != ReduceOp::kAvg || tensor.is_floating_point(),
             "[all_reduce] ReduceOp::kAvg needs a floating-point tensor, got ", tensor.dtype());
  if (size_ == 1) return nothing_to_do("all_reduce", tensor);
  Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  return launch(p, "all_reduce", {tensor, work}, [&] {
    p.settle("all_reduce", ncclAllReduce(work.data_ptr(), work.data_ptr(), work.numel(),
                                         nccl_type("all_reduce", work.dtype()),
                                         nccl_op(op, work.dtype()), p.comm, p.stream));
    if (!work.is_same(tensor)) tensor.copy_(work);
  });
}

std::shared_ptr<Work> ProcessGroupNCCL::all_reduce_beside_compute(Tensor& tensor, ReduceOp op) {
  Impl& p = *impl_;
  p.check_tensor("all_reduce", tensor, "the tensor");
  if (size_ == 1) return all_reduce(tensor, op);  // nothing to run (and no peers)
  if ((p.peer_pending || p.peer != nullptr) && internal::PeerAllReduce::takes(tensor, op)) {
    if (p.peer_pending) {
      // Every rank reaches this at the same all-reduce: the rule of takes() is the same on all.
      p.peer = internal::PeerAllReduce::create(
          store_, p.key + "/peer", rank_, size_, p.device, p.timeout,
          [this](bool ok) {
            Tensor t =
                full({1}, ok ? 1 : 0, TensorOptions(kInt32).device(Device(kCUDA, impl_->device)));
            all_reduce(t, ReduceOp::kMin)->wait();
            return t.item<int32_t>() == 1;
          },
          &p.peer_why);
      p.peer_pending = false;
    }
    if (p.peer != nullptr) {
      NoGradGuard no_grad;
      return p.peer->run(tensor, op);
    }
  }
  return all_reduce(tensor, op);
}

std::string ProcessGroupNCCL::large_all_reduce_path() const {
  const Impl& p = *impl_;
  if (p.peer != nullptr) return "copy engines";
  if (p.peer_pending) return "not set up yet";
  return "nccl: " + p.peer_why;
}

std::shared_ptr<Work> ProcessGroupNCCL::broadcast(Tensor& tensor, int root) {
  Impl& p = *impl_;
  p.check_tensor("broadcast", tensor, "the tensor");
  internal::check_rank("broadcast", root, size_, "root");
  if (size_ == 1) return nothing_to_do("broadcast", tensor);
  Tensor work = tensor.is_contiguous() ? tensor : tensor.contiguous();
  return launch(p, "broadcast", {tensor, work}, [&] {
    p.settle("broadcast", ncclBroadcast(work.data_ptr(), work.data_ptr(), work.numel(),
                                        nccl_type("broadcast", work.dtype()), root, p.comm,
                                        p.stream));
    if (!work.is_same(tensor)) tensor.copy_(work);
  });
}

std::shared_ptr<Work> ProcessGroupNCCL::all_gather_into_tensor(Tensor& output,
                                                               const Tensor& input) {
  Impl& p = *impl_;
  p.check_tensor("all_gather_into_tensor", input, "the input");
  p.check_tensor("all_gather_into_tensor", output, "the output");
  KILN_CHECK(output.dtype() == input.dtype(), "[all_gather_into_tensor] the output has dtype ",
             output.dtype(), " but the input has ", input.dtype());
  KILN_CHECK(output.numel() == input.numel() * size_, "[all_gather_into_tensor] the output has ",
             output.numel(), " elements but needs world size (", size_, ") x the input's ",
             input.numel());
  Tensor src = input.contiguous();
  Tensor out = output.is_contiguous() ? output : output.contiguous();
  return launch(p, "all_gather_into_tensor", {output, out, src}, [&] {
    p.settle("all_gather_into_tensor",
             ncclAllGather(src.data_ptr(), out.data_ptr(), src.numel(),
                           nccl_type("all_gather_into_tensor", src.dtype()), p.comm, p.stream));
    if (!out.is_same(output)) output.copy_(out);
  });
}

namespace {

// A coalesced collective: one NCCL group of a call per (output, input) pair. `check(i, out, in)`
// validates pair i before anything is queued (and may throw); `call(src, out)` issues one pair's
// NCCL call on contiguous tensors and must not throw. The group is closed even when a call in it
// fails, before the error is raised.
template <typename Check, typename Call>
std::shared_ptr<Work> launch_coalesced(ProcessGroupNCCL::Impl& p, const char* op,
                                       std::vector<Tensor>& outputs,
                                       const std::vector<Tensor>& inputs, Check&& check,
                                       Call&& call) {
  KILN_CHECK(outputs.size() == inputs.size(), "[", op, "] ", outputs.size(), " outputs for ",
             inputs.size(), " inputs");
  std::vector<Tensor> srcs, outs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    p.check_tensor(op, inputs[i], "an input");
    p.check_tensor(op, outputs[i], "an output");
    KILN_CHECK(outputs[i].dtype() == inputs[i].dtype(), "[", op, "] output ", i, " has dtype ",
               outputs[i].dtype(), " but its input has ", inputs[i].dtype());
    nccl_type(op, inputs[i].dtype());  // an unsupported dtype fails here, not inside the group
    check(i, outputs[i], inputs[i]);
    srcs.push_back(inputs[i].contiguous());
    outs.push_back(outputs[i].is_contiguous() ? outputs[i] : outputs[i].contiguous());
  }
  std::vector<Tensor> keep = outputs;
  keep.insert(keep.end(), srcs.begin(), srcs.end());
  keep.insert(keep.end(), outs.begin(), outs.end());
  return launch(p, op, std::move(keep), [&] {
    p.check(op, ncclGroupStart());
    ncclResult_t r = ncclSuccess;
    for (size_t i = 0; i < srcs.size() && (r == ncclSuccess || r == ncclInProgress); ++i) {
      r = call(srcs[i], outs[i]);
    }
    const ncclResult_t end = ncclGroupEnd();
    p.settle(op, r != ncclSuccess && r != ncclInProgress ? r : end);
    for (size_t i = 0; i < outs.size(); ++i) {
      if (!outs[i].is_same(outputs[i])) outputs[i].copy_(outs[i]);
    }
  });
}

}  // namespace

std::shared_ptr<Work> ProcessGroupNCCL::all_gather_into_tensor_coalesced(
    std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) {
  Impl& p = *impl_;
  const char* op = "all_gather_into_tensor_coalesced";
  return launch_coalesced(
      p, op, outputs, inputs,
      [&](size_t i, const Tensor& out, const Tensor& in) {
        KILN_CHECK(out.numel() == in.numel() * size_, "[", op, "] output ", i, " has ", out.numel(),
                   " elements but needs world size (", size_, ") x its input's ", in.numel());
      },
      [&](const Tensor& src, Tensor& out) {
        return ncclAllGather(src.data_ptr(), out.data_ptr(), src.numel(),
                             nccl_type(op, src.dtype()), p.comm, p.stream);
      });
}

std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter_tensor_coalesced(
    std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs, ReduceOp reduce) {
  Impl& p = *impl_;
  const char* op = "reduce_scatter_tensor_coalesced";
  return launch_coalesced(
      p, op, outputs, inputs,
      [&](size_t i, const Tensor& out, const Tensor& in) {
        KILN_CHECK(in.numel() == out.numel() * size_, "[", op, "] input ", i, " has ", in.numel(),
                   " elements but needs world size (", size_, ") x its output's ", out.numel());
        KILN_CHECK(reduce != ReduceOp::kAvg || in.is_floating_point(), "[", op,
                   "] ReduceOp::kAvg needs a floating-point tensor, got ", in.dtype());
      },
      [&](const Tensor& src, Tensor& out) {
        return ncclReduceScatter(src.data_ptr(), out.data_ptr(), out.numel(),
                                 nccl_type(op, src.dtype()), nccl_op(reduce, src.dtype()), p.comm,
                                 p.stream);
      });
}

std::shared_ptr<Work> ProcessGroupNCCL::all_gather(std::vector<Tensor>& outputs,
                                                   const Tensor& input) {
  Impl& p = *impl_;
  p.check_tensor("all_gather", input, "the input");
  KILN_CHECK(static_cast<int>(outputs.size()) == size_, "[all_gather] expected ", size_,
             " output tensors (the world size), got ", outputs.size());
  for (const auto& o : outputs) {
    internal::check_same_shape_dtype("all_gather", input, o, "an output tensor");
  }
  Tensor src = input.contiguous();
  std::vector<int64_t> shape{size_};
  for (int64_t s : input.sizes()) shape.push_back(s);
  Tensor flat = empty(shape, input.options());
  std::vector<Tensor> keep = outputs;
  keep.push_back(src);
  keep.push_back(flat);
  return launch(p, "all_gather", keep, [&] {
    p.settle("all_gather", ncclAllGather(src.data_ptr(), flat.data_ptr(), src.numel(),
                                         nccl_type("all_gather", src.dtype()), p.comm, p.stream));
    for (int r = 0; r < size_; ++r) outputs[r].copy_(flat[r]);
  });
}

std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                              ReduceOp op) {
  Impl& p = *impl_;
  p.check_tensor("reduce_scatter_tensor", input, "the input");
  p.check_tensor("reduce_scatter_tensor", output, "the output");
  KILN_CHECK(output.dtype() == input.dtype(), "[reduce_scatter_tensor] the output has dtype ",
             output.dtype(), " but the input has ", input.dtype());
  KILN_CHECK(input.numel() == output.numel() * size_, "[reduce_scatter_tensor] the input has ",
             input.numel(), " elements but needs world size (", size_, ") x the output's ",
             output.numel());
  KILN_CHECK(op != ReduceOp::kAvg || input.is_floating_point(),
             "[reduce_scatter_tensor] ReduceOp::kAvg needs a floating-point tensor, got ",
             input.dtype());
  Tensor src = input.contiguous();
  Tensor out = output.is_contiguous() ? output : output.contiguous();
  return launch(p, "reduce_scatter_tensor", {output, out, src}, [&] {
    p.settle("reduce_scatter_tensor",
             ncclReduceScatter(src.data_ptr(), out.data_ptr(), out.numel(),
                               nccl_type("reduce_scatter_tensor", src.dtype()),
                               nccl_op(op, src.dtype()), p.comm, p.stream));
    if (!out.is_same(output)) output.copy_(out);
  });
}

std::shared_ptr<Work> ProcessGroupNCCL::reduce_scatter(Tensor& output,
                                                       const std::vector<Tensor>& inputs,
                                                       ReduceOp op) {
  impl_->check_tensor("reduce_scatter", output, "the output");
  KILN_CHECK(static_cast<int>(inputs.size()) == size_, "[reduce_scatter] expected ", size_,
             " input tensors (the world size), got ", inputs.size());
  for (const auto& i : inputs) {
    internal::check_same_shape_dtype("reduce_scatter", output, i, "an input tensor");
  }
  Tensor flat = stack(inputs, 0);
  return reduce_scatter_tensor(output, flat, op);
}

std::shared_ptr<Work> ProcessGroupNCCL::barrier() {
  Impl& p = *impl_;
  cuda::set_device(p.device);
  Tensor one = ones({1}, TensorOptions().dtype(kFloat).device(Device(kCUDA, p.device)));
  return launch(
      p, "barrier", {one},
      [&] {
        p.settle("barrier", ncclAllReduce(one.data_ptr(), one.data_ptr(), 1, ncclFloat32, ncclSum,
                                          p.comm, p.stream));
      },
      /*blocking=*/true);
}

std::shared_ptr<Work> ProcessGroupNCCL::send(const Tensor& tensor, int dst, int tag) {
  Impl& p = *impl_;
  p.check_tensor("send", tensor, "the tensor");
  internal::check_rank("send", dst, size_, "destination rank");
  KILN_CHECK(dst != rank_, "[send] rank ", rank_, " cannot send to itself");
  KILN_CHECK(tag >= 0, "[send] the tag must be >= 0, got ", tag);
  Tensor src = tensor.contiguous();
  return launch(p, "send", {tensor, src}, [&] {
    p.settle("send", ncclSend(src.data_ptr(), src.numel(), nccl_type("send", src.dtype()), dst,
                              p.comm, p.stream));
  });
}

std::shared_ptr<Work> ProcessGroupNCCL::recv(Tensor& tensor, int src, int tag) {
  Impl& p = *impl_;
  p.check_tensor("recv", tensor, "the tensor");
  internal::check_rank("recv", src, size_, "source rank");
  KILN_CHECK(src != rank_, "[recv] rank ", rank_, " cannot receive from itself");
  KILN_CHECK(tag >= 0, "[recv] the tag must be >= 0, got ", tag);
  Tensor buf = tensor.is_contiguous() ? tensor : tensor.contiguous();
  return launch(p, "recv", {tensor, buf}, [&] {
    p.settle("recv", ncclRecv(buf.data_ptr(), buf.numel(), nccl_type("recv", buf.dtype()), src,
                              p.comm, p.stream));
    if (!buf.is_same(tensor)) tensor.copy_(buf);
  });
}

#endif  // KILN_WITH_NCCL

}  // namespace kiln::dist
