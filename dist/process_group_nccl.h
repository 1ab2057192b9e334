// ProcessGroupNCCL: the ProcessGroup for CUDA tensors, over NCCL, as c10d's ProcessGroupNCCL.
// Built when kiln has CUDA and NCCL (CMake's KILN_HAVE_NCCL); without them its constructor
// fails with an error saying so.
//
//   kiln::cuda::set_device(info.local_rank);
//   auto pg = std::make_shared<kiln::dist::ProcessGroupNCCL>(store, rank, world_size,
//       kiln::dist::ProcessGroupNCCL::Options{.device_index = info.local_rank});
//   auto work = pg->all_reduce(grad);   // queued on the group's stream after the current one
//   work->wait();                       // the current stream waits; the host does not
//
// Every collective runs on the group's own stream (one per group), after the work queued so far
// on the caller's current stream, so communication overlaps the compute queued afterwards.
// wait() orders the caller's current stream after the collective without blocking the host
// (barrier() blocks the host, as PyTorch's); wait(timeout) also blocks the host, aborting the
// communicator when the collective has not finished in time. Keep the Work until wait(): the
// tensors stay alive through it. send/recv match in call order (NCCL has no tags: the tag is
// checked to be >= 0 and otherwise ignored).
#pragma once

#include <memory>

#include "dist/process_group.h"

namespace kiln::dist {

// Whether this build of kiln has the NCCL backend.
bool nccl_available();

struct ProcessGroupNCCLOptions {
  Milliseconds timeout = kDefaultStoreTimeout;
  int device_index = 0;  // the GPU of this rank (usually LOCAL_RANK)
};

class ProcessGroupNCCL final : public ProcessGroup {
 public:
  using Options = ProcessGroupNCCLOptions;

  ProcessGroupNCCL(std::shared_ptr<Store> store, int rank, int size, Options options = {});
  ~ProcessGroupNCCL() override;

  std::string backend_name() const override { return "nccl"; }
  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> broadcast(Tensor& tensor, int root = 0) override;
  std::shared_ptr<Work> all_gather_into_tensor(Tensor& output, const Tensor& input) override;
  std::shared_ptr<Work> all_gather_into_tensor_coalesced(
      std::vector<Tensor>& outputs, const std::vector<Tensor>& inputs) override;
  std::shared_ptr<Work> reduce_scatter_tensor_coalesced(std::vector<Tensor>& outputs,
                                                        const std::vector<Tensor>& inputs,
                                                        ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override;
  std::shared_ptr<Work> reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                              ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> barrier() override;
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag = 0) override;
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag = 0) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::dist
