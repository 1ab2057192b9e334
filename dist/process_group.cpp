#include "dist/process_group.h"

#include "dist/process_group_gloo.h"
#include "dist/process_group_nccl.h"
#include "dist/rendezvous.h"
#include "tensor/error.h"

namespace kiln::dist {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool Work::is_success() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && !error_;
}

bool Work::wait(std::optional<Milliseconds> timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout) {
    const bool done = cv_.wait_for(lock, *timeout, [this] { return done_; });
    KILN_CHECK(done, "[", op_, "] Work::wait timed out after ", timeout->count(),
               " ms (the operation is still running)");
  } else {
    cv_.wait(lock, [this] { return done_; });
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

std::exception_ptr Work::exception() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::vector<Tensor> Work::result() {
  std::lock_guard<std::mutex> lock(mu_);
  return result_;
}

void Work::set_result(std::vector<Tensor> result) {
  std::lock_guard<std::mutex> lock(mu_);
  result_ = std::move(result);
}

void Work::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    done_ = true;
  }
  cv_.notify_all();
}

namespace {

// The Works of several operations as one: done when all are, waited for one after another.
class WorkList final : public Work {
 public:
  WorkList(std::string op, std::vector<std::shared_ptr<Work>> works)
      : Work(std::move(op)), works_(std::move(works)) {}
  bool is_completed() override {
    for (const auto& w : works_) {
      if (!w->is_completed()) return false;
    }
    return true;
  }
  bool wait(std::optional<Milliseconds> timeout) override {
    for (const auto& w : works_) w->wait(timeout);
    finish();
    return true;
  }

 private:
  std::vector<std::shared_ptr<Work>> works_;
};

// The coalesced collectives' default: pair i's collective, launched by `one(i)`, one after
// another.
template <typename F>
std::shared_ptr<Work> one_by_one(const char* op, size_t outputs, size_t inputs,
                                 std::vector<Tensor>& results, F&& one) {
  KILN_CHECK(outputs == inputs, "[", op, "] ", outputs, " outputs for ", inputs, " inputs");
  std::vector<std::shared_ptr<Work>> works;
  for (size_t i = 0; i < inputs; ++i) works.push_back(one(i));
  auto work = std::make_shared<WorkList>(op, std::move(works));
  work->set_result(results);
  return work;
}

}  // namespace

std::shared_ptr<Work> ProcessGroup::all_gather_into_tensor_coalesced(
    std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) {
  return one_by_one("all_gather_into_tensor_coalesced", outputs.size(), inputs.size(), outputs,
                    [&](size_t i) { return all_gather_into_tensor(outputs[i], inputs[i]); });
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor_coalesced(
    std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs, ReduceOp op) {
  return one_by_one("reduce_scatter_tensor_coalesced", outputs.size(), inputs.size(), outputs,
                    [&](size_t i) { return reduce_scatter_tensor(outputs[i], inputs[i], op); });
}

namespace {
std::mutex default_mu;
std::shared_ptr<ProcessGroup> default_group;
}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const std::string& backend,
                                                 const InitOptions& options) {
  KILN_CHECK(backend == "gloo" || backend == "nccl", "[init_process_group] unknown backend '",
             backend, "' (expected \"gloo\" or \"nccl\")");
  const RendezvousInfo info = rendezvous_info_from_env();
  std::shared_ptr<Store> store = rendezvous(info, options.timeout);
  std::shared_ptr<ProcessGroup> pg;
  if (backend == "gloo") {
    ProcessGroupGloo::Options o;
    o.timeout = options.timeout;
    pg = std::make_shared<ProcessGroupGloo>(store, info.rank, info.world_size, o);
  } else {
    ProcessGroupNCCL::Options o;
    o.timeout = options.timeout;
    o.device_index = info.local_rank;
    o.peer_all_reduce = options.peer_all_reduce;
    pg = std::make_shared<ProcessGroupNCCL>(store, info.rank, info.world_size, o);
  }
  std::lock_guard<std::mutex> lock(default_mu);
  default_group = pg;
  return pg;
}

std::shared_ptr<ProcessGroup> default_process_group() {
  std::lock_guard<std::mutex> lock(default_mu);
  KILN_CHECK(default_group != nullptr,
             "[default_process_group] no process group: call kiln::dist::init_process_group first");
  return default_group;
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(default_mu);
  return default_group != nullptr;
}

void destroy_process_group() {
  std::lock_guard<std::mutex> lock(default_mu);
  default_group.reset();
}

namespace internal {

void check_same_shape_dtype(const char* op, const Tensor& a, const Tensor& b, const char* what) {
  KILN_CHECK(a.defined() && b.defined(), "[", op, "] ", what, " is undefined");
  KILN_CHECK(a.sizes() == b.sizes(), "[", op, "] ", what, " has shape ", shape_str(b.sizes()),
             " but expected ", shape_str(a.sizes()));
  KILN_CHECK(a.dtype() == b.dtype(), "[", op, "] ", what, " has dtype ", b.dtype(),
             " but expected ", a.dtype());
  KILN_CHECK(a.device() == b.device(), "[", op, "] ", what, " is on ", b.device(),
             " but expected ", a.device());
}

void check_rank(const char* op, int r, int size, const char* what) {
  KILN_CHECK(r >= 0 && r < size, "[", op, "] ", what, " ", r, " is outside [0, ", size, ")");
}

}  // namespace internal

}  // namespace kiln::dist
