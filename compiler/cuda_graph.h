// CUDA graphs of compiled programs (CompileOptions::cuda_graphs; docs/compiler.md, "CUDA
// graphs"): the steps of a cached program that run on one GPU are captured into CUDA graphs once
// and replayed with one cudaGraphLaunch each, as torch.compile's "reduce-overhead" mode does.
//
//   GraphedProgram g(program);            // cuda_graph_refusal(*program, false) was ""
//   GraphedProgram::Run r;
//   std::vector<Tensor> out = g.run(args, r);  // captures on the first call, replays after
//
// The program is split into segments: runs of steps whose every tensor is on the program's GPU
// (captured) and steps that read or write a CPU tensor (run on the host between the graphs). A
// copy to the GPU of a captured 0-d CPU tensor that the program never writes and reads only
// through such copies (the learning rate that Adam and AdamW copy to the GPU at every step) is a
// launch input: its op is not run, and each run writes the CPU tensor's current value into a
// static device buffer that the graphs read. So a training step with AdamW on a GPU (its step
// counts on the GPU, nn/optim/adam.h) is one graph, the update included. What a graph reads at
// a fixed address:
// - captured tensors (parameters, optimizer moments and step counts): by identity, as the program
//   reads them; a replay checks their data pointers and captures again when one moved
//   (Run::recaptured);
// - launch inputs: their buffers, written before the run's first launch;
// - arguments and values a host step made: copied before each launch into static buffers the
//   graph was captured with;
// - its own intermediates: graph memory (allocation nodes of kernels/cuda/runtime.h's
//   capture_graph), freed inside the graph.
// Values a graph makes that outlive it (read by a later segment, returned, assigned to a .grad)
// stay in its memory: allocations it does not free, backed by each launch at the same address
// and freed by the next launch (capture_graph's kept storages). A later segment reads them there;
// .grad is set to them (the next replay overwrites it, as a captured training step's gradients
// in PyTorch); returned tensors are copied out after the replay, so a caller keeping the losses
// of several steps keeps their values.
//
// Capture happens on the program's second run (the first, the compiling call, is its warm-up:
// cuDNN plans, measured kernel choices, NVRTC kernels and cuBLASLt workspaces exist by then).
// A capture that fails (an op synchronises with the host) is ended and discarded; the run goes on
// op by op from where it was, and Run::failure says why.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "compiler/program.h"

namespace kiln::compiler {

// Why `program` cannot run as CUDA graphs, or "" when it can: a CPU program, FSDP's
// reduce-scatters (DDP's collectives are captured), a compiled function's backward pair
// (`has_backward`), arenas on the GPU, no step that runs on the GPU alone, or in-place writes that
// a copy into a static buffer would hide (of an argument, of a value a host step made). Random ops
// are captured: their kernels read each replay's Philox base from a device word written before the
// launch (runtime.h, GraphRng), so every replay draws what the program without graphs draws; a new
// seed (manual_seed) captures again.
std::string cuda_graph_refusal(const Program& program, bool has_backward);

class GraphedProgram {
 public:
  // `program` must be accepted by cuda_graph_refusal.
  explicit GraphedProgram(std::shared_ptr<const Program> program);
  ~GraphedProgram();
  GraphedProgram(const GraphedProgram&) = delete;
  GraphedProgram& operator=(const GraphedProgram&) = delete;

  struct Run {
    bool captured = false;   // this run captured the graphs (and launched them)
    std::string recaptured;  // why the graphs were captured again ("" on a plain replay)
    std::string failure;     // why capture failed (this run finished op by op; don't retry)
  };
  // Runs the program as Program::run does (no random ops, so no RngState), through the graphs.
  std::vector<Tensor> run(const std::vector<Tensor>& arguments, Run& run);

  // The GPU it runs on.
  int device() const;
  // The number of captured graphs, and of host steps between them.
  int graphs() const;
  int host_steps() const;
  // Bytes of the inputs' static buffers, and of the values that outlive a graph in its memory
  // (a training step's gradients), for the stats.
  int64_t static_bytes() const;
  int64_t kept_bytes() const;

 private:
  struct Plan;
  std::shared_ptr<const Program> program_;
  std::unique_ptr<Plan> plan_;
};

}  // namespace kiln::compiler
