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
  // all_reduce_beside_compute of floating-point tensors (sum or average, 4 MiB or more) between
  // the GPUs of one host moves the data with the copy engines instead of NCCL's kernels
  // (dist/peer_all_reduce.h): slower on its own (about 150 against 350 GB/s of bus bandwidth on
  // 4 H200s), but it leaves the SMs to the compute it overlaps. Set up at the first such call,
  // where every rank must agree; the group keeps NCCL's where a rank cannot take part. false:
  // NCCL for all.
  bool peer_all_reduce = true;
};

class ProcessGroupNCCL final : public ProcessGroup {
 public:
  using Options = ProcessGroupNCCLOptions;

  ProcessGroupNCCL(std::shared_ptr<Store> store, int rank, int size, Options options = {});
  ~ProcessGroupNCCL() override;

  std::string backend_name() const override { return "nccl"; }
  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) override;
  // Through the copy engines where Options::peer_all_reduce allows and PeerAllReduce::takes the
  // tensor, else all_reduce.
  std::shared_ptr<Work> all_reduce_beside_compute(Tensor& tensor,
                                                  ReduceOp op = ReduceOp::kSum) override;
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

  // How the large floating-point all-reduces run: "copy engines", "nccl: <why>", or "not set up
  // yet" before the first one (Options::peer_all_reduce).
  std::string large_all_reduce_path() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::dist
