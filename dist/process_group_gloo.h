// ProcessGroupGloo: the ProcessGroup for CPU tensors, over Gloo's TCP transport (Debian's
// libgloo-dev), as c10d's ProcessGroupGloo.
//
//   auto store = kiln::dist::rendezvous(kiln::dist::rendezvous_info_from_env());
//   auto pg = std::make_shared<kiln::dist::ProcessGroupGloo>(store, rank, world_size);
//
// Collectives run, in call order, on one background thread per group; send and recv are posted
// at once and complete in wait(). The ranks connect to each other through the address of this
// host's name; set GLOO_SOCKET_IFNAME (as for PyTorch) to choose the network interface on
// machines whose host name does not resolve to a reachable address.
//
// SIGPIPE: the constructor sets it to be ignored (unless the program handles it), so that a
// peer that died fails the collective with an error instead of killing this process.
//
// Supported: float32, float64, float16, bfloat16, int32, int64 and bool tensors (bool: sum and
// max are "or", product and min are "and"). Half-precision sums accumulate in their own dtype,
// as PyTorch's Gloo backend. reduce_scatter runs as an all-reduce of the whole input keeping
// this rank's chunk (Gloo has no reduce-scatter of arbitrary types).
#pragma once

#include <memory>
#include <string>

#include "dist/process_group.h"

namespace kiln::dist {

struct ProcessGroupGlooOptions {
  Milliseconds timeout = kDefaultStoreTimeout;
  // The address or host name other ranks reach this one on; empty: GLOO_SOCKET_IFNAME's
  // interface when set, else this host's name (127.0.0.1 when it does not resolve).
  std::string hostname;
};

class ProcessGroupGloo final : public ProcessGroup {
 public:
  using Options = ProcessGroupGlooOptions;

  ProcessGroupGloo(std::shared_ptr<Store> store, int rank, int size, Options options = {});
  ~ProcessGroupGloo() override;

  std::string backend_name() const override { return "gloo"; }
  std::shared_ptr<Work> all_reduce(Tensor& tensor, ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> broadcast(Tensor& tensor, int root = 0) override;
  std::shared_ptr<Work> all_gather_into_tensor(Tensor& output, const Tensor& input) override;
  std::shared_ptr<Work> all_gather(std::vector<Tensor>& outputs, const Tensor& input) override;
  std::shared_ptr<Work> reduce_scatter_tensor(Tensor& output, const Tensor& input,
                                              ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> reduce_scatter(Tensor& output, const std::vector<Tensor>& inputs,
                                       ReduceOp op = ReduceOp::kSum) override;
  std::shared_ptr<Work> barrier() override;
  std::shared_ptr<Work> send(const Tensor& tensor, int dst, int tag = 0) override;
  std::shared_ptr<Work> recv(Tensor& tensor, int src, int tag = 0) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::dist
