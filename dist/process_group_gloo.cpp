#include "dist/process_group_gloo.h"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <deque>
#include <functional>
#include <thread>

#include "autograd/grad_mode.h"
#include "tensor/error.h"
#include "tensor/half.h"
#include "tensor/ops.h"

namespace kiln::dist {
namespace {

// Our Store as Gloo's, for connectFullMesh's address exchange.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<dist::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    store_->wait(keys, t);
  }

 private:
  std::shared_ptr<dist::Store> store_;
};

// An element of N bytes: Gloo's typed options take the element size from the pointer type.
template <size_t N>
struct Elem {
  unsigned char b[N];
};

template <typename T, typename F>
void elementwise(void* c, const void* a, const void* b, size_t n, F f) {
  auto* pc = static_cast<T*>(c);
  const auto* pa = static_cast<const T*>(a);
  const auto* pb = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = f(pa[i], pb[i]);
}

template <typename T>
gloo::AllreduceOptions::Func reduce_fn(ReduceOp op) {
  // Half types compute in float and round back.
  using C = std::conditional_t<std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>, float, T>;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return [](void* c, const void* a, const void* b, size_t n) {
        elementwise<T>(c, a, b, n, [](T x, T y) { return T(C(x) + C(y)); });
      };
    case ReduceOp::kProduct:
      return [](void* c, const void* a, const void* b, size_t n) {
        elementwise<T>(c, a, b, n, [](T x, T y) { return T(C(x) * C(y)); });
      };
    case ReduceOp::kMin:
      return [](void* c, const void* a, const void* b, size_t n) {
        elementwise<T>(c, a, b, n, [](T x, T y) { return C(y) < C(x) ? y : x; });
      };
    case ReduceOp::kMax:
      return [](void* c, const void* a, const void* b, size_t n) {
        elementwise<T>(c, a, b, n, [](T x, T y) { return C(y) > C(x) ? y : x; });
      };
  }
  KILN_FAIL("[all_reduce] unknown reduce op");
}

gloo::AllreduceOptions::Func bool_reduce_fn(ReduceOp op) {
  if (op == ReduceOp::kSum || op == ReduceOp::kMax) {
    return [](void* c, const void* a, const void* b, size_t n) {
      elementwise<bool>(c, a, b, n, [](bool x, bool y) { return x || y; });
    };
  }
  return [](void* c, const void* a, const void* b, size_t n) {
    elementwise<bool>(c, a, b, n, [](bool x, bool y) { return x && y; });
  };
}

gloo::AllreduceOptions::Func reduce_fn_for(ScalarType t, ReduceOp op) {
  switch (t) {
    case kFloat: return reduce_fn<float>(op);
    case kDouble: return reduce_fn<double>(op);
    case kHalf: return reduce_fn<Half>(op);
    case kBFloat16: return reduce_fn<BFloat16>(op);
    case kUInt8: return reduce_fn<uint8_t>(op);
    case kInt32: return reduce_fn<int32_t>(op);
    case kInt64: return reduce_fn<int64_t>(op);
    case kBool: return bool_reduce_fn(op);
  }
  KILN_FAIL("[all_reduce] unsupported dtype ", t);
}

void set_allreduce_output(gloo::AllreduceOptions& o, void* p, size_t n, size_t elem) {
  switch (elem) {
    case 1: o.setOutput(static_cast<Elem<1>*>(p), n); return;
    case 2: o.setOutput(static_cast<Elem<2>*>(p), n); return;
    case 4: o.setOutput(static_cast<Elem<4>*>(p), n); return;
    case 8: o.setOutput(static_cast<Elem<8>*>(p), n); return;
  }
  KILN_FAIL("[all_reduce] unsupported element size ", elem);
}

void check_cpu(const char* op, const Tensor& t, const char* what) {
  KILN_CHECK(t.defined(), "[", op, "] ", what, " is undefined");
  KILN_CHECK(t.is_cpu(), "[", op, "] the Gloo backend takes CPU tensors, but ", what, " is on ",
             t.device(), " (use the \"nccl\" backend for CUDA tensors)");
}

// A contiguous tensor to run on, and writing it back into `t` when they differ.
struct Dense {
  Tensor t;
  Tensor work;
  explicit Dense(const Tensor& tensor)
      : t(tensor), work(tensor.is_contiguous() ? tensor : tensor.contiguous()) {}
  void write_back() {
    if (!work.is_same(t)) t.copy_(work);
  }
};

}  // namespace

struct ProcessGroupGloo::Impl {
  int rank;
  int size;
  Milliseconds timeout;
  std::shared_ptr<gloo::rendezvous::Context> context;
  std::thread worker;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> queue;
  bool stop = false;
  uint32_t next_tag = 0;  // only the worker thread uses it

  // Runs `fn` on the worker thread after what is queued; `w` finishes with its outcome.
  std::shared_ptr<Work> enqueue(const char* op, std::function<void(Work&)> fn) {
    auto w = std::make_shared<Work>(op);
    {
      std::lock_guard<std::mutex> lock(mu);
      queue.push_back([this, w, op, fn = std::move(fn)] {
        try {
          fn(*w);
          w->finish();
        } catch (...) {
          w->finish(wrap_error(op, std::current_exception()));
        }
      });
    }
    cv.notify_one();
    return w;
  }

  void run() {
    NoGradGuard no_grad;  // results are written outside autograd, as PyTorch does
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [this] { return stop || !queue.empty(); });
        if (queue.empty()) return;
        task = std::move(queue.front());
        queue.pop_front();
      }
      task();
    }
  }

  std::exception_ptr wrap_error(const char* op, std::exception_ptr e) const {
    try {
      std::rethrow_exception(e);
    } catch (const Error&) {
      return e;  // kiln's own check: already says what is wrong
    } catch (const std::exception& ex) {
      const std::string what = ex.what();
      const bool timed_out = what.find("Timed out") != std::string::npos ||
                             what.find("timed out") != std::string::npos;
      try {
        if (timed_out) {
          KILN_FAIL("[", op, "] rank ", rank, " of ", size, ": timed out after ", timeout.count(),
                    " ms (a rank died, hangs, or issued a different collective); Gloo: ", what);
        }
        KILN_FAIL("[", op, "] rank ", rank, " of ", size,
                  ": Gloo failed (a peer rank may have exited): ", what);
      } catch (...) {
        return std::current_exception();
      }
    }
  }

  uint32_t tag() { return next_tag++; }
};

ProcessGroupGloo::ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size,
                                   Options options)
    : ProcessGroup(rank, size), impl_(std::make_unique<Impl>()) {
  KILN_CHECK(store != nullptr, "[ProcessGroupGloo] the store is null");
  KILN_CHECK(size >= 1 && rank >= 0 && rank < size, "[ProcessGroupGloo] rank ", rank,
             " is outside [0, ", size, ")");
  KILN_CHECK(options.timeout.count() > 0, "[ProcessGroupGloo] the timeout must be positive");
  timeout_ = options.timeout;
  store_ = store;
  impl_->rank = rank;
  impl_->size = size;
  impl_->timeout = options.timeout;

  // Gloo writes to its sockets with writev: a peer that died would kill this process with
  // SIGPIPE instead of failing the collective. Ignore it, as Python (and so PyTorch) does, unless
  // the program installed its own handler.
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }

  gloo::transport::tcp::attr attr;
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  if (!options.hostname.empty()) {
    attr.hostname = options.hostname;
  } else if (iface != nullptr && *iface != '\0') {
    attr.iface = iface;
  } else {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    attr.hostname = name;
  }
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    KILN_CHECK(options.hostname.empty() && attr.iface.empty(),
               "[ProcessGroupGloo] cannot use the address ",
               attr.iface.empty() ? "of host '" + attr.hostname + "'"
                                  : "of interface '" + attr.iface + "' (GLOO_SOCKET_IFNAME)",
               ": ", e.what());
    // The host name does not resolve: loopback, which serves one node.
    device = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
  }

  // Each group gets its own keys: the ranks create their groups in the same order, and each
  // counts its own in the store (so ranks may also be threads of one process).
  const int64_t group = store->add("kiln/gloo/groups_of_rank/" + std::to_string(rank), 1);
  auto prefixed = std::make_shared<PrefixStore>("kiln/gloo/" + std::to_string(group), store);
  GlooStore gloo_store(prefixed);
  impl_->context = std::make_shared<gloo::rendezvous::Context>(rank, size);
  impl_->context->setTimeout(options.timeout);
  try {
    impl_->context->connectFullMesh(gloo_store, device);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    KILN_FAIL("[ProcessGroupGloo] rank ", rank, " of ", size,
              " could not connect to the other ranks: ", e.what());
  }
  // No rank starts a collective before every pair of the mesh is connected on both sides (a
  // pair that a rank uses while its peer is still connecting others can be reset).
  if (prefixed->add("connected", 1) == size) prefixed->set("all_connected", "1");
  prefixed->wait({"all_connected"});
  impl_->worker = std::thread([this] { impl_->run(); });
}

ProcessGroupGloo::~ProcessGroupGloo() {
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_one();
  impl_->worker.join();
}

std::shared_ptr<Work> ProcessGroupGloo::all_reduce(Tensor& tensor, ReduceOp op) {
  check_cpu("all_reduce", tensor, "the tensor");
  KILN_CHECK(op != ReduceOp::kAvg || tensor.is_floating_point(),
             "[all_reduce] ReduceOp::kAvg needs a floating-point tensor, got ", tensor.dtype());
  auto fn = reduce_fn_for(tensor.dtype(), op);
  return impl_->enqueue("all_reduce", [this, t = tensor, op, fn](Work& w) {
    Dense d(t);
    if (d.work.numel() > 0 && impl_->size > 1) {
      gloo::AllreduceOptions o(impl_->context);
      set_allreduce_output(o, d.work.data_ptr(), d.work.numel(), d.work.element_size());
      o.setReduceFunction(fn);
      o.setTag(impl_->tag());
      o.setTimeout(impl_->timeout);
      gloo::allreduce(o);
    }
    if (op == ReduceOp::kAvg) d.work.div_(impl_->size);
    d.write_back();
    w.set_result({t});
  });
}

std::shared_ptr<Work> ProcessGroupGloo::broadcast(Tensor& tensor, int root) {
  check_cpu("broadcast", tensor, "the tensor");
  internal::check_rank("broadcast", root, size_, "root");
  return impl_->enqueue("broadcast", [this, t = tensor, root](Work& w) {
    Dense d(t);
    if (d.work.nbytes() > 0 && impl_->size > 1) {
      gloo::BroadcastOptions o(impl_->context);
      o.setOutput(static_cast<uint8_t*>(d.work.data_ptr()), d.work.nbytes());
      o.setRoot(root);
      o.setTag(impl_->tag());
      o.setTimeout(impl_->timeout);
      gloo::broadcast(o);
    }
    if (impl_->rank != root) d.write_back();
    w.set_result({t});
  });
}

std::shared_ptr<Work> ProcessGroupGloo::all_gather_into_tensor(Tensor& output,
                                                               const Tensor& input) {
  check_cpu("all_gather_into_tensor", input, "the input");
  check_cpu("all_gather_into_tensor", output, "the output");
  KILN_CHECK(output.dtype() == input.dtype(), "[all_gather_into_tensor] the output has dtype ",
             output.dtype(), " but the input has ", input.dtype());
  KILN_CHECK(output.numel() == input.numel() * size_, "[all_gather_into_tensor] the output has ",
             output.numel(), " elements but needs world size (", size_, ") x the input's ",
             input.numel(), " (output ", shape_str(output.sizes()), ", input ",
             shape_str(input.sizes()), ")");
  return impl_->enqueue("all_gather_into_tensor", [this, in = input, out = output](Work& w) mutable {
    const Tensor src = in.contiguous();
    Dense d(out);
    if (impl_->size == 1) {
      d.work.view({-1}).copy_(src.view({-1}));
    } else if (src.nbytes() > 0) {
      gloo::AllgatherOptions o(impl_->context);
      o.setInput(static_cast<uint8_t*>(src.data_ptr()), src.nbytes());
      o.setOutput(static_cast<uint8_t*>(d.work.data_ptr()), d.work.nbytes());
      o.setTag(impl_->tag());
      o.setTimeout(impl_->timeout);
      gloo::allgather(o);
    }
    d.write_back();
    w.set_result({out});
  });
}

std::shared_ptr<Work> ProcessGroupGloo::all_gather(std::vector<Tensor>& outputs,
                                                   const Tensor& input) {
  check_cpu("all_gather", input, "the input");
  KILN_CHECK(static_cast<int>(outputs.size()) == size_, "[all_gather] expected ", size_,
             " output tensors (the world size), got ", outputs.size());
  for (const auto& o : outputs) {
    internal::check_same_shape_dtype("all_gather", input, o, "an output tensor");
  }
  return impl_->enqueue("all_gather", [this, in = input, outs = outputs](Work& w) mutable {
    std::vector<int64_t> shape{impl_->size};
    for (int64_t s : in.sizes()) shape.push_back(s);
    Tensor flat = empty(shape, in.options());
    const Tensor src = in.contiguous();
    if (impl_->size == 1) {
      flat[0].copy_(src);
    } else if (src.nbytes() > 0) {
      gloo::AllgatherOptions o(impl_->context);
      o.setInput(static_cast<uint8_t*>(src.data_ptr()), src.nbytes());
      o.setOutput(static_cast<uint8_t*>(flat.data_ptr()), flat.nbytes());
      o.setTag(impl_->tag());
      o.setTimeout(impl_->timeout);
      gloo::allgather(o);
    }
    for (int r = 0; r < impl_->size; ++r) outs[r].copy_(flat[r]);
    w.set_result(outs);
  });
}

std::shared_ptr<Work> ProcessGroupGloo::reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                              ReduceOp op) {
  check_cpu("reduce_scatter_tensor", input, "the input");
  check_cpu("reduce_scatter_tensor", output, "the output");
  KILN_CHECK(output.dtype() == input.dtype(), "[reduce_scatter_tensor] the output has dtype ",
             output.dtype(), " but the input has ", input.dtype());
  KILN_CHECK(input.numel() == output.numel() * size_, "[reduce_scatter_tensor] the input has ",
             input.numel(), " elements but needs world size (", size_, ") x the output's ",
             output.numel(), " (input ", shape_str(input.sizes()), ", output ",
             shape_str(output.sizes()), ")");
  KILN_CHECK(op != ReduceOp::kAvg || input.is_floating_point(),
             "[reduce_scatter_tensor] ReduceOp::kAvg needs a floating-point tensor, got ",
             input.dtype());
  auto fn = reduce_fn_for(input.dtype(), op);
  return impl_->enqueue("reduce_scatter_tensor", [this, in = input, out = output, op, fn](Work& w) mutable {
    Tensor all = in.contiguous().clone().view({-1});
    if (all.numel() > 0 && impl_->size > 1) {
      gloo::AllreduceOptions o(impl_->context);
      set_allreduce_output(o, all.data_ptr(), all.numel(), all.element_size());
      o.setReduceFunction(fn);
      o.setTag(impl_->tag());
      o.setTimeout(impl_->timeout);
      gloo::allreduce(o);
    }
    const int64_t n = out.numel();
    Tensor mine = all.narrow(0, impl_->rank * n, n);
    if (op == ReduceOp::kAvg) mine = mine / impl_->size;
    out.copy_(mine.view(out.sizes()));
    w.set_result({out});
  });
}

std::shared_ptr<Work> ProcessGroupGloo::reduce_scatter(Tensor& output,
                                                       const std::vector<Tensor>& inputs,
                                                       ReduceOp op) {
  check_cpu("reduce_scatter", output, "the output");
  KILN_CHECK(static_cast<int>(inputs.size()) == size_, "[reduce_scatter] expected ", size_,
             " input tensors (the world size), got ", inputs.size());
  for (const auto& i : inputs) {
    internal::check_same_shape_dtype("reduce_scatter", output, i, "an input tensor");
  }
  Tensor flat = stack(inputs, 0);
  return reduce_scatter_tensor(output, flat, op);
}

std::shared_ptr<Work> ProcessGroupGloo::barrier() {
  return impl_->enqueue("barrier", [this](Work&) {
    if (impl_->size == 1) return;
    gloo::BarrierOptions o(impl_->context);
    o.setTag(impl_->tag());
    o.setTimeout(impl_->timeout);
    gloo::barrier(o);
  });
}

namespace {

// Send and recv are posted on the calling thread (a send waits for the matching recv, so they
// must not queue behind each other) and complete in wait().
class GlooP2PWork final : public Work {
 public:
  GlooP2PWork(const char* op, bool is_send, int peer, Tensor tensor, Tensor buffer,
              std::unique_ptr<gloo::transport::UnboundBuffer> ub, Milliseconds timeout, int rank,
              int size)
      : Work(op),
        is_send_(is_send),
        peer_(peer),
        tensor_(std::move(tensor)),
        buffer_(std::move(buffer)),
        ub_(std::move(ub)),
        timeout_(timeout),
        rank_(rank),
        size_(size) {}

  bool is_completed() override { return Work::is_completed(); }

  bool wait(std::optional<Milliseconds> timeout) override {
    std::lock_guard<std::mutex> lock(wait_mu_);
    if (!Work::is_completed()) {
      const Milliseconds t = timeout.value_or(timeout_);
      try {
        if (is_send_) {
          ub_->waitSend(t);
        } else {
          ub_->waitRecv(t);
          if (!buffer_.is_same(tensor_)) {
            NoGradGuard no_grad;
            tensor_.copy_(buffer_);
          }
        }
        set_result({tensor_});
        finish();
      } catch (const Error&) {
        finish(std::current_exception());
      } catch (const std::exception& e) {
        try {
          KILN_FAIL("[", op_, "] rank ", rank_, " of ", size_, ": the ", op_,
                    is_send_ ? " to rank " : " from rank ", peer_, " did not complete within ",
                    t.count(), " ms (the peer died or did not post the matching ",
                    is_send_ ? "recv" : "send", "); Gloo: ", e.what());
        } catch (...) {
          finish(std::current_exception());
        }
      }
    }
    return Work::wait(std::nullopt);
  }

 private:
  std::mutex wait_mu_;
  bool is_send_;
  int peer_;
  Tensor tensor_;
  Tensor buffer_;
  std::unique_ptr<gloo::transport::UnboundBuffer> ub_;
  Milliseconds timeout_;
  int rank_;
  int size_;
};

// Point-to-point slots live apart from the collectives' (whose slots are built from their tags
// with small prefixes in the top byte).
uint64_t p2p_slot(int tag) { return (uint64_t{0xE0} << 56) | static_cast<uint32_t>(tag); }

}  // namespace

std::shared_ptr<Work> ProcessGroupGloo::send(const Tensor& tensor, int dst, int tag) {
  check_cpu("send", tensor, "the tensor");
  internal::check_rank("send", dst, size_, "destination rank");
  KILN_CHECK(dst != rank_, "[send] rank ", rank_, " cannot send to itself");
  KILN_CHECK(tag >= 0, "[send] the tag must be >= 0, got ", tag);
  Tensor buffer = tensor.contiguous();
  auto ub = impl_->context->createUnboundBuffer(buffer.data_ptr(), buffer.nbytes());
  ub->send(dst, p2p_slot(tag));
  return std::make_shared<GlooP2PWork>("send", true, dst, tensor, buffer, std::move(ub),
                                       timeout_, rank_, size_);
}

std::shared_ptr<Work> ProcessGroupGloo::recv(Tensor& tensor, int src, int tag) {
  check_cpu("recv", tensor, "the tensor");
  internal::check_rank("recv", src, size_, "source rank");
  KILN_CHECK(src != rank_, "[recv] rank ", rank_, " cannot receive from itself");
  KILN_CHECK(tag >= 0, "[recv] the tag must be >= 0, got ", tag);
  Tensor buffer = tensor.is_contiguous() ? tensor : empty(tensor.sizes(), tensor.options());
  auto ub = impl_->context->createUnboundBuffer(buffer.data_ptr(), buffer.nbytes());
  ub->recv(src, p2p_slot(tag));
  return std::make_shared<GlooP2PWork>("recv", false, src, tensor, buffer, std::move(ub),
                                       timeout_, rank_, size_);
}

}  // namespace kiln::dist
