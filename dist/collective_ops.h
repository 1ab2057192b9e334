// Collectives as ops of the registry, so that kiln::compile records them: a compiled training
// step under DDP holds its gradient all-reduces in its trace, where the backward launched them,
// and replays them there, overlapping the backward's remaining kernels as in eager code
// (Thunder's ddp transform puts its collectives into the trace the same way).
//
//   std::shared_ptr<Work> w = dist::all_reduce_op(pg, bucket, ReduceOp::kAvg);  // starts it
//   ...                                                                         // more backward
//   w->wait();                                                                  // then reads
//
// FSDP's gathers and gradient reductions are ops the same way (all_gather_op, reduce_scatter_op),
// so that a compiled FSDP step holds each unit's all-gather and reduce-scatter where eager code
// starts them (dist/fsdp.h, docs/distributed.md "Compiled FSDP").
//
// Each call is two ops on the tensor, both in place:
//   dist_all_reduce_(t; group, op, beside_compute) / dist_broadcast_(t; group, root): starts the
//     collective (ProcessGroup::all_reduce or all_reduce_beside_compute / broadcast) and files
//     its Work under t's data pointer;
//   dist_all_gather_(out, in; group, world) / dist_reduce_scatter_(out, in; group, world, op):
//     the same for all_gather_into_tensor / reduce_scatter_tensor, writing `out` (the key) and
//     keeping `in` alive until the wait (a compiled program may let go of it before);
//   dist_all_gather_coalesced_(out, in; group, world, parts) / dist_reduce_scatter_coalesced_(out,
//     in_0, ..., in_k; group, world, op, offsets): several all-gathers or reduce-scatters as one
//     collective of the group (all_gather_into_tensor_coalesced / reduce_scatter_tensor_coalesced)
//     between parts of one output (the key) and parts of the inputs: FSDP's gathers of a unit's
//     parameters straight into their places, and its reduce-scatters straight from the full
//     gradients, as eager FSDP runs them;
//   dist_wait_(t): the returned Work's wait() — takes the filed Work and waits for it (NCCL: the
//     current stream waits; Gloo: the host).
// Traced, they are recorded in program order like any in-place op; the program's replay runs
// their kernels, so the collective starts and is waited for where the trace says. The group is
// an attribute: the id under which the op first saw it (a registry of weak references).
#pragma once

#include <memory>
#include <vector>

#include "dist/process_group.h"

namespace kiln::dist {

// `beside_compute`: ProcessGroup::all_reduce_beside_compute rather than all_reduce.
std::shared_ptr<Work> all_reduce_op(const std::shared_ptr<ProcessGroup>& group, Tensor& tensor,
                                    ReduceOp op = ReduceOp::kSum, bool beside_compute = false);
std::shared_ptr<Work> broadcast_op(const std::shared_ptr<ProcessGroup>& group, Tensor& tensor,
                                   int root = 0);
// ProcessGroup::all_gather_into_tensor / reduce_scatter_tensor as ops. Keep `output` untouched
// until the returned Work's wait() (the dist_wait_ op on `output`).
std::shared_ptr<Work> all_gather_op(const std::shared_ptr<ProcessGroup>& group, Tensor& output,
                                    const Tensor& input);
std::shared_ptr<Work> reduce_scatter_op(const std::shared_ptr<ProcessGroup>& group, Tensor& output,
                                        const Tensor& input, ReduceOp op = ReduceOp::kSum);

// One part of all_gather_coalesced_op: input.narrow(0, in_offset, numel) of every rank, gathered
// in rank order into output.narrow(0, out_offset, world * numel).
struct GatherPart {
  int64_t in_offset = 0;
  int64_t numel = 0;
  int64_t out_offset = 0;
};
// The parts' all-gathers as one collective (ProcessGroup::all_gather_into_tensor_coalesced); 1-d
// contiguous output and input of one dtype and device. Keep `output` untouched until the Work's
// wait().
std::shared_ptr<Work> all_gather_coalesced_op(const std::shared_ptr<ProcessGroup>& group,
                                              Tensor& output, const Tensor& input,
                                              const std::vector<GatherPart>& parts);
// inputs[i] (world * n_i elements, contiguous) reduced over the ranks, this rank's chunk written
// to output.narrow(0, offsets[i], n_i) (1-d, contiguous), as one collective
// (ProcessGroup::reduce_scatter_tensor_coalesced). The inputs are kept until the Work's wait().
std::shared_ptr<Work> reduce_scatter_coalesced_op(const std::shared_ptr<ProcessGroup>& group,
                                                  Tensor& output, const std::vector<Tensor>& inputs,
                                                  const std::vector<int64_t>& offsets,
                                                  ReduceOp op = ReduceOp::kSum);

}  // namespace kiln::dist
