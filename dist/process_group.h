// kiln::dist::ProcessGroup: collectives and point-to-point messages between the ranks of a job,
// as c10d's ProcessGroup. Two backends implement it: Gloo for CPU tensors
// (dist/process_group_gloo.h) and NCCL for CUDA tensors (dist/process_group_nccl.h).
//
//   auto pg = kiln::dist::init_process_group("gloo");      // RANK, WORLD_SIZE, ... from the env
//   kiln::Tensor t = kiln::ones({4}) * (pg->rank() + 1);
//   pg->all_reduce(t)->wait();                             // t = 1 + 2 + ... + world_size
//   auto work = pg->all_reduce(g, kiln::dist::ReduceOp::kAvg);  // runs in the background
//   ...                                                    // other work meanwhile
//   work->wait();                                          // rethrows the collective's error
//
// Every call returns a Work at once; the operation runs in the background, in the order the
// calls were made (every rank must issue the same collectives in the same order). wait() blocks
// until it is done (Gloo) or makes the current CUDA stream wait for it (NCCL), and rethrows its
// error. Collectives write their results in place into the tensors given; those tensors must
// stay alive and untouched until the work is done (the Work holds references to them).
//
// Errors: a collective that does not complete within the group's timeout (a rank died, or the
// ranks issued different collectives) fails with a kiln::Error naming the op, the rank and the
// timeout; so does a peer that exits mid-collective.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dist/store.h"
#include "tensor/tensor.h"

namespace kiln::dist {

// c10d's ReduceOp::SUM, AVG, PRODUCT, MIN, MAX.
enum class ReduceOp { kSum, kAvg, kProduct, kMin, kMax };
std::string_view reduce_op_name(ReduceOp op);

// A handle on an operation in flight.
class Work {
 public:
  explicit Work(std::string op) : op_(std::move(op)) {}
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Whether the operation has finished (successfully or not).
  virtual bool is_completed();
  bool is_success();
  // Blocks until done and rethrows the operation's error. A `timeout` bounds this wait (the
  // operation itself is bounded by the group's timeout): exceeding it is an error too.
  // NCCL: does not block the host; the current CUDA stream waits for the collective.
  virtual bool wait(std::optional<Milliseconds> timeout = std::nullopt);
  // The error the operation ended with (null while running or on success).
  std::exception_ptr exception();
  // The tensors the operation wrote (its outputs).
  std::vector<Tensor> result();
  const std::string& op() const { return op_; }

  // For backends: marks the work finished, with its error if any.
  void finish(std::exception_ptr error = nullptr);
  void set_result(std::vector<Tensor> result);

 protected:
  std::string op_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  std::vector<Tensor> result_;
};

class ProcessGroup {
 public:
  ProcessGroup(int rank, int size) : rank_(rank), size_(size) {}
  virtual ~ProcessGroup() = default;
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  virtual std::string backend_name() const = 0;

  // tensor = op over the ranks' tensors (same shape and dtype everywhere). kAvg divides the
  // sum by size() (floating-point tensors only).
  virtual std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) = 0;
  // all_reduce for a collective that runs beside compute it does not hold up (DDP's gradient
  // buckets during the backward): a backend may take longer over it to leave the GPU's SMs to
  // that compute (NCCL: the copy engines between the GPUs of one host, dist/peer_all_reduce.h).
  // Every rank must make the same call. Default: all_reduce.
  virtual std::shared_ptr<Work> all_reduce_beside_compute(Tensor& tensor,
                                                          ReduceOp op = ReduceOp::kSum) {
    return all_reduce(tensor, op);
  }
  // tensor = root's tensor on every rank.
  virtual std::shared_ptr<Work> broadcast(Tensor& tensor, int root = 0) = 0;
  // output = cat of every rank's input along dim 0: output has size() * input.numel() elements
  // (shape [size() * d0, ...] or [size(), ...]).
  virtual std::shared_ptr<Work> all_gather_into_tensor(Tensor& output, const Tensor& input) = 0;
  // outputs[i] = all_gather_into_tensor of inputs[i], for every i, as one operation (torch's
  // allgather_into_tensor_coalesced): NCCL launches them as one group; the default runs them one
  // after another. One Work for all of them.
  virtual std::shared_ptr<Work> all_gather_into_tensor_coalesced(std::vector<Tensor>& outputs,
                                                                 const std::vector<Tensor>& inputs);
  // outputs[r] = rank r's input; outputs has size() tensors shaped like input.
  virtual std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) = 0;
  // output = chunk rank() of (op over the ranks' inputs), input split evenly along dim 0 into
  // size() chunks of output's shape.
  virtual std::shared_ptr<Work> reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                                      ReduceOp op = ReduceOp::kSum) = 0;
  // outputs[i] = reduce_scatter_tensor of inputs[i], for every i, as one operation (torch's
  // reduce_scatter_tensor_coalesced), as all_gather_into_tensor_coalesced.
  virtual std::shared_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<Tensor>& outputs,
                                                                const std::vector<Tensor>& inputs,
                                                                ReduceOp op = ReduceOp::kSum);
  // output = op over the ranks of their inputs[rank()]; inputs has size() tensors shaped like
  // output.
  virtual std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                               ReduceOp op = ReduceOp::kSum) = 0;
  // Returns once every rank has reached the barrier.
  virtual std::shared_ptr<Work> barrier() = 0;
  // Point to point: a send to `dst` is matched by a recv from this rank with the same tag.
  virtual std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag = 0) = 0;
  virtual std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag = 0) = 0;

  Milliseconds timeout() const { return timeout_; }
  // The store the group was made with; the group keeps it alive (on rank 0 it serves the
  // others' rendezvous).
  const std::shared_ptr<Store>& store() const { return store_; }

 protected:
  int rank_;
  int size_;
  std::shared_ptr<Store> store_;
  Milliseconds timeout_{kDefaultStoreTimeout};
};

struct InitOptions {
  // Bounds the rendezvous and every collective of the group (c10d's default is 30 minutes for
  // Gloo, 10 for NCCL; kiln uses 5 for both).
  Milliseconds timeout = kDefaultStoreTimeout;
  // NCCL: all_reduce_beside_compute between the GPUs of one host through the copy engines
  // (ProcessGroupNCCLOptions::peer_all_reduce).
  bool peer_all_reduce = true;
};

// Rendezvous from the environment (dist/rendezvous.h) and a group of the named backend over all
// ranks: "gloo" (CPU tensors) or "nccl" (CUDA tensors on device LOCAL_RANK; needs a build with
// NCCL). The group is also kept as the default one (default_process_group()).
std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const InitOptions& options = {});
// The group made by the last init_process_group (fails when there is none).
std::shared_ptr<ProcessGroup> default_process_group();
bool is_initialized();
// Forgets the default group (its resources go when the last reference does).
void destroy_process_group();

namespace internal {
// Shared argument checks of the backends; `op` names the collective in errors.
void check_same_shape_dtype(const char* op, const Tensor& a, const Tensor& b, const char* what);
void check_rank(const char* op, int r, int size, const char* what);
}  // namespace internal

}  // namespace kiln::dist
