#include "dist/collective_ops.h"

#include <deque>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/cuda/runtime.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::dist {
namespace {

// Groups by id: an op's attribute names its group, and the kernel finds it here. Ids are handed
// out in the order groups are first used, and never reused.
struct GroupTable {
  std::mutex mu;
  std::map<const ProcessGroup*, int64_t> ids;
  std::map<int64_t, std::weak_ptr<ProcessGroup>> groups;
  int64_t next = 0;
};
GroupTable& group_table() {
  static auto* t = new GroupTable;  // never destroyed: kernels may run during exit
  return *t;
}

int64_t group_id(const std::shared_ptr<ProcessGroup>& group) {
  GroupTable& t = group_table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.ids.find(group.get());
  if (it != t.ids.end()) {
    auto g = t.groups.find(it->second);
    if (g != t.groups.end() && !g->second.expired()) return it->second;
    t.ids.erase(it);  // a dead group's address, reused by a new one
  }
  const int64_t id = t.next++;
  t.ids[group.get()] = id;
  t.groups[id] = group;
  return id;
}

std::shared_ptr<ProcessGroup> group_of(const OpCall& c) {
  const int64_t id = c.attr<int64_t>(0);
  GroupTable& t = group_table();
  std::lock_guard<std::mutex> lock(t.mu);
  auto it = t.groups.find(id);
  std::shared_ptr<ProcessGroup> g = it == t.groups.end() ? nullptr : it->second.lock();
  KILN_CHECK(g != nullptr, "[", c.name(), "] process group ", id,
             " no longer exists (a compiled program outlived the group it was traced with)");
  return g;
}

// The collectives started and not yet waited for, by the address of the tensor they write. Each
// keeps the tensors it reads and writes until its wait: in a compiled program the executor lets
// go of a value after its last reader, which for an all-gather's input is the op that starts it,
// while the collective still reads it in the background.
struct Pending {
  std::shared_ptr<Work> work;
  std::vector<Tensor> keep;
};
struct PendingTable {
  std::mutex mu;
  std::map<const void*, std::deque<Pending>> works;
};
PendingTable& pending() {
  static auto* t = new PendingTable;
  return *t;
}

void file_work(const Tensor& t, std::shared_ptr<Work> work, std::vector<Tensor> keep = {}) {
  PendingTable& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  p.works[t.data_ptr()].push_back({std::move(work), std::move(keep)});
}

Pending take_work(const OpCall& c) {
  PendingTable& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.works.find(c.input(0).data_ptr());
  KILN_CHECK(it != p.works.end() && !it->second.empty(), "[", c.name(),
             "] no collective was started on this tensor (", dtype_name(c.input(0).dtype()), " ",
             shape_str(c.input(0).sizes()), ")");
  Pending w = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) p.works.erase(it);
  return w;
}

SpecList in_place_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 1 && c.input(0).defined(), "[", c.name(),
             "] expected one defined tensor");
  return {};
}

void start_all_reduce(const std::shared_ptr<ProcessGroup>& group, Tensor& t, ReduceOp op,
                      bool beside_compute) {
  file_work(t, beside_compute ? group->all_reduce_beside_compute(t, op) : group->all_reduce(t, op));
}

// Inside a CUDA graph's capture the all-reduce is not captured: it starts on the host after each
// launch of the graph, once the graph has reached this point (cuda::internal::
// defer_to_each_launch), through the copy engines where they take it, as op by op; its dist_wait_
// runs between graphs (compiler/cuda_graph.cpp). The tensor (graph memory, or a bucket that DDP
// holds) is at the same address on every launch and lives until the graph's next one.
void all_reduce_kernel(OpCall& c) {
  Tensor t = c.input(0);
  const auto op = static_cast<ReduceOp>(c.attr<int64_t>(1));
  const auto group = group_of(c);
  const bool beside_compute = c.attr<int64_t>(2) != 0;
  if (t.is_cuda() && cuda::internal::capturing_graph()) {
    void* data = t.data_ptr();
    const Shape sizes(t.sizes().begin(), t.sizes().end());
    const Shape strides(t.strides().begin(), t.strides().end());
    const TensorOptions options = TensorOptions().dtype(t.dtype()).device(t.device());
    const std::weak_ptr<ProcessGroup> weak = group;
    cuda::internal::defer_to_each_launch([=] {
      std::shared_ptr<ProcessGroup> g = weak.lock();
      KILN_CHECK(g != nullptr,
                 "[dist_all_reduce_] the process group of a CUDA graph's all-reduce "
                 "no longer exists");
      Tensor view = from_blob(data, sizes, strides, options);  // the graph's memory
      start_all_reduce(g, view, op, beside_compute);
    });
    return;
  }
  start_all_reduce(group, t, op, beside_compute);
}

void broadcast_kernel(OpCall& c) {
  Tensor t = c.input(0);
  file_work(t, group_of(c)->broadcast(t, static_cast<int>(c.attr<int64_t>(1))));
}

// An all-gather's or reduce-scatter's output and input: two defined tensors of one dtype and
// device.
void check_output_and_input(const OpCall& c) {
  KILN_CHECK(c.inputs.size() == 2 && c.input(0).defined() && c.input(1).defined(), "[", c.name(),
             "] expected an output and an input tensor");
  const Tensor &out = c.input(0), &in = c.input(1);
  KILN_CHECK(out.dtype() == in.dtype() && out.device() == in.device(), "[", c.name(),
             "] the output is ", dtype_name(out.dtype()), " on ", out.device().str(),
             ", the input ", dtype_name(in.dtype()), " on ", in.device().str());
}

// The output's first element is the key: every rank writes all of it (all-gather) or its chunk
// (reduce-scatter); the input is kept until the wait.
SpecList two_tensor_meta(const OpCall& c, int64_t out_per_in_num, int64_t out_per_in_den) {
  check_output_and_input(c);
  const Tensor &out = c.input(0), &in = c.input(1);
  KILN_CHECK(out.numel() * out_per_in_den == in.numel() * out_per_in_num, "[", c.name(),
             "] the output has ", out.numel(), " elements, the input ", in.numel(), " (world size ",
             c.attr<int64_t>(1), ")");
  return {};
}

SpecList all_gather_meta(const OpCall& c) { return two_tensor_meta(c, c.attr<int64_t>(1), 1); }
SpecList reduce_scatter_meta(const OpCall& c) { return two_tensor_meta(c, 1, c.attr<int64_t>(1)); }

void all_gather_kernel(OpCall& c) {
  Tensor out = c.input(0);
  const Tensor in = c.input(1);
  file_work(out, group_of(c)->all_gather_into_tensor(out, in), {out, in});
}

void reduce_scatter_kernel(OpCall& c) {
  Tensor out = c.input(0);
  const Tensor in = c.input(1);
  file_work(out,
            group_of(c)->reduce_scatter_tensor(out, in, static_cast<ReduceOp>(c.attr<int64_t>(2))),
            {out, in});
}

// dist_all_gather_coalesced_(out, in; group, world, parts): parts holds (in_offset, numel,
// out_offset) triples.
SpecList all_gather_coalesced_meta(const OpCall& c) {
  check_output_and_input(c);
  const Tensor &out = c.input(0), &in = c.input(1);
  KILN_CHECK(out.dim() == 1 && in.dim() == 1 && out.is_contiguous() && in.is_contiguous(), "[",
             c.name(), "] expected 1-d contiguous tensors, got ", shape_str(out.sizes()), " and ",
             shape_str(in.sizes()));
  const int64_t world = c.attr<int64_t>(1);
  const Shape& parts = c.attr<Shape>(2);
  KILN_CHECK(parts.size() % 3 == 0, "[", c.name(), "] parts must be (in_offset, numel, ",
             "out_offset) triples, got ", parts.size(), " numbers");
  for (size_t i = 0; i < parts.size(); i += 3) {
    const int64_t from = parts[i], n = parts[i + 1], to = parts[i + 2];
    KILN_CHECK(
        from >= 0 && n > 0 && to >= 0 && from + n <= in.numel() && to + world * n <= out.numel(),
        "[", c.name(), "] part ", i / 3, " (input [", from, ", ", from + n, "), output [", to, ", ",
        to + world * n, ")) is outside the input of ", in.numel(), " or the output of ",
        out.numel(), " elements (world size ", world, ")");
  }
  return {};
}

void all_gather_coalesced_kernel(OpCall& c) {
  Tensor out = c.input(0);
  const Tensor in = c.input(1);
  const int64_t world = c.attr<int64_t>(1);
  const Shape& parts = c.attr<Shape>(2);
  std::vector<Tensor> outputs, inputs;
  for (size_t i = 0; i < parts.size(); i += 3) {
    inputs.push_back(in.narrow(0, parts[i], parts[i + 1]));
    outputs.push_back(out.narrow(0, parts[i + 2], world * parts[i + 1]));
  }
  file_work(out, group_of(c)->all_gather_into_tensor_coalesced(outputs, inputs), {out, in});
}

// dist_reduce_scatter_coalesced_(out, in_0, ..., in_k; group, world, op, offsets).
SpecList reduce_scatter_coalesced_meta(const OpCall& c) {
  KILN_CHECK(c.inputs.size() >= 2 && c.input(0).defined(), "[", c.name(),
             "] expected an output and at least one input tensor");
  const Tensor& out = c.input(0);
  KILN_CHECK(out.dim() == 1 && out.is_contiguous(), "[", c.name(),
             "] expected a 1-d contiguous output, got ", shape_str(out.sizes()));
  const int64_t world = c.attr<int64_t>(1);
  const Shape& offsets = c.attr<Shape>(3);
  KILN_CHECK(offsets.size() + 1 == c.inputs.size(), "[", c.name(), "] ", c.inputs.size() - 1,
             " inputs but ", offsets.size(), " offsets");
  for (size_t i = 1; i < c.inputs.size(); ++i) {
    const Tensor& in = c.input(i);
    KILN_CHECK(in.defined() && in.dtype() == out.dtype() && in.device() == out.device() &&
                   in.is_contiguous(),
               "[", c.name(), "] input ", i - 1, " must be a contiguous ", dtype_name(out.dtype()),
               " tensor on ", out.device().str());
    const int64_t n = in.numel() / world, at = offsets[i - 1];
    KILN_CHECK(in.numel() % world == 0 && at >= 0 && at + n <= out.numel(), "[", c.name(),
               "] input ", i - 1, " of ", in.numel(), " elements (world size ", world,
               ") does not fit the output of ", out.numel(), " at offset ", at);
  }
  return {};
}

void reduce_scatter_coalesced_kernel(OpCall& c) {
  Tensor out = c.input(0);
  const int64_t world = c.attr<int64_t>(1);
  const Shape& offsets = c.attr<Shape>(3);
  std::vector<Tensor> outputs, inputs, keep{out};
  for (size_t i = 1; i < c.inputs.size(); ++i) {
    inputs.push_back(c.input(i));
    outputs.push_back(out.narrow(0, offsets[i - 1], c.input(i).numel() / world));
  }
  keep.insert(keep.end(), inputs.begin(), inputs.end());
  file_work(out,
            group_of(c)->reduce_scatter_tensor_coalesced(outputs, inputs,
                                                         static_cast<ReduceOp>(c.attr<int64_t>(2))),
            std::move(keep));
}

void wait_kernel(OpCall& c) { take_work(c).work->wait(); }

// The Work the ops' callers get: its wait() is the dist_wait_ op, so that a traced wait is
// recorded where the caller waited.
class OpWork final : public Work {
 public:
  OpWork(std::string op, Tensor tensor) : Work(std::move(op)), tensor_(std::move(tensor)) {}
  bool wait(std::optional<Milliseconds> timeout) override {
    (void)timeout;  // the group's own timeout bounds the collective
    if (waited_) return true;
    waited_ = true;
    static const OpDef& op = KILN_OP(dist_wait_);
    try {
      call_op(op, {tensor_}, {});
    } catch (...) {
      finish(std::current_exception());
      throw;
    }
    finish();
    return true;
  }

 private:
  Tensor tensor_;
  bool waited_ = false;
};

}  // namespace

KILN_DEFINE_OP(dist_all_reduce_, OpKind::kInplace, in_place_meta);
KILN_DEFINE_OP(dist_broadcast_, OpKind::kInplace, in_place_meta);
KILN_DEFINE_OP(dist_wait_, OpKind::kInplace, in_place_meta);
KILN_DEFINE_OP(dist_all_gather_, OpKind::kInplace, all_gather_meta);
KILN_DEFINE_OP(dist_reduce_scatter_, OpKind::kInplace, reduce_scatter_meta);
KILN_DEFINE_OP(dist_all_gather_coalesced_, OpKind::kInplace, all_gather_coalesced_meta);
KILN_DEFINE_OP(dist_reduce_scatter_coalesced_, OpKind::kInplace, reduce_scatter_coalesced_meta);
KILN_REGISTER_KERNEL(dist_all_gather_coalesced_, kCPU, all_gather_coalesced_kernel);
KILN_REGISTER_KERNEL(dist_reduce_scatter_coalesced_, kCPU, reduce_scatter_coalesced_kernel);
KILN_REGISTER_KERNEL(dist_all_reduce_, kCPU, all_reduce_kernel);
KILN_REGISTER_KERNEL(dist_all_gather_, kCPU, all_gather_kernel);
KILN_REGISTER_KERNEL(dist_reduce_scatter_, kCPU, reduce_scatter_kernel);
KILN_REGISTER_KERNEL(dist_broadcast_, kCPU, broadcast_kernel);
KILN_REGISTER_KERNEL(dist_wait_, kCPU, wait_kernel);
#if defined(KILN_WITH_CUDA)
KILN_REGISTER_KERNEL(dist_all_reduce_, kCUDA, all_reduce_kernel);
KILN_REGISTER_KERNEL(dist_broadcast_, kCUDA, broadcast_kernel);
KILN_REGISTER_KERNEL(dist_wait_, kCUDA, wait_kernel);
KILN_REGISTER_KERNEL(dist_all_gather_, kCUDA, all_gather_kernel);
KILN_REGISTER_KERNEL(dist_reduce_scatter_, kCUDA, reduce_scatter_kernel);
KILN_REGISTER_KERNEL(dist_all_gather_coalesced_, kCUDA, all_gather_coalesced_kernel);
KILN_REGISTER_KERNEL(dist_reduce_scatter_coalesced_, kCUDA, reduce_scatter_coalesced_kernel);
#endif

std::shared_ptr<Work> all_reduce_op(const std::shared_ptr<ProcessGroup>& group, Tensor& tensor,
                                    ReduceOp op, bool beside_compute) {
  static const OpDef& def = KILN_OP(dist_all_reduce_);
  call_op(def, {tensor}, {group_id(group), static_cast<int64_t>(op), beside_compute ? 1 : 0});
  return std::make_shared<OpWork>("all_reduce", tensor);
}

std::shared_ptr<Work> broadcast_op(const std::shared_ptr<ProcessGroup>& group, Tensor& tensor,
                                   int root) {
  static const OpDef& def = KILN_OP(dist_broadcast_);
  call_op(def, {tensor}, {group_id(group), static_cast<int64_t>(root)});
  return std::make_shared<OpWork>("broadcast", tensor);
}

std::shared_ptr<Work> all_gather_op(const std::shared_ptr<ProcessGroup>& group, Tensor& output,
                                    const Tensor& input) {
  static const OpDef& def = KILN_OP(dist_all_gather_);
  call_op(def, {output, input}, {group_id(group), static_cast<int64_t>(group->size())});
  return std::make_shared<OpWork>("all_gather_into_tensor", output);
}

std::shared_ptr<Work> reduce_scatter_op(const std::shared_ptr<ProcessGroup>& group, Tensor& output,
                                        const Tensor& input, ReduceOp op) {
  static const OpDef& def = KILN_OP(dist_reduce_scatter_);
  call_op(def, {output, input},
          {group_id(group), static_cast<int64_t>(group->size()), static_cast<int64_t>(op)});
  return std::make_shared<OpWork>("reduce_scatter_tensor", output);
}

std::shared_ptr<Work> all_gather_coalesced_op(const std::shared_ptr<ProcessGroup>& group,
                                              Tensor& output, const Tensor& input,
                                              const std::vector<GatherPart>& parts) {
  static const OpDef& def = KILN_OP(dist_all_gather_coalesced_);
  Shape triples;
  for (const GatherPart& p : parts)
    triples.insert(triples.end(), {p.in_offset, p.numel, p.out_offset});
  call_op(def, {output, input}, {group_id(group), static_cast<int64_t>(group->size()), triples});
  return std::make_shared<OpWork>("all_gather_into_tensor_coalesced", output);
}

std::shared_ptr<Work> reduce_scatter_coalesced_op(const std::shared_ptr<ProcessGroup>& group,
                                                  Tensor& output, const std::vector<Tensor>& inputs,
                                                  const std::vector<int64_t>& offsets,
                                                  ReduceOp op) {
  static const OpDef& def = KILN_OP(dist_reduce_scatter_coalesced_);
  TensorVec args{output};
  args.insert(args.end(), inputs.begin(), inputs.end());
  call_op(def, args,
          {group_id(group), static_cast<int64_t>(group->size()), static_cast<int64_t>(op),
           Shape(offsets.begin(), offsets.end())});
  return std::make_shared<OpWork>("reduce_scatter_tensor_coalesced", output);
}

}  // namespace kiln::dist
