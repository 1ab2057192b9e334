// What the GTest side of the scenario tests (ddp_test.cpp, fsdp_test.cpp) shares; the ranks' side
// is worker_util.h. A scenario of a worker program runs as a job of separate processes
// (spawn.h), and passes when every rank exits 0; a failure carries each rank's exit code and
// output. The GPU tests that run in the test's own process get a NCCL group of that process alone.
//
//   TEST(DdpTest, EqualsOneProcessAtWorldSizeTwo) {
//     EXPECT_TRUE(scenario_passes(kDistWorker, "ddp_equivalence", 2));
//   }
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "dist/dist.h"
#include "spawn.h"

namespace kiln::dist::testing {

// A worker program and how long one job of it may take before its ranks are killed.
struct Worker {
  const char* program;
  std::chrono::milliseconds deadline;
};
// tests/dist/dist_worker.cpp (DDP and the process groups) and tests/dist/fsdp_worker.cpp.
inline const Worker kDistWorker{KILN_DIST_WORKER, std::chrono::seconds(30)};
inline const Worker kFsdpWorker{KILN_FSDP_WORKER, std::chrono::seconds(50)};

// Runs `scenario` of `worker` as `world` ranks; `extra_env` adds "NAME=value" entries.
inline ::testing::AssertionResult scenario_passes(const Worker& worker, const std::string& scenario,
                                                  int world,
                                                  const std::vector<std::string>& extra_env = {}) {
  const JobResult job = run_job({worker.program, scenario}, world, worker.deadline, extra_env);
  if (job.all_ok()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << job.describe();
}

// A NCCL process group of this process alone (rank 0 of 1, on GPU 0), its store a TCPStore
// server on a free port. For tests that skip themselves without a GPU or NCCL.
inline std::shared_ptr<ProcessGroupNCCL> nccl_group_of_one() {
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  auto store = std::make_shared<TCPStore>("127.0.0.1", o);
  ProcessGroupNCCLOptions po;
  po.device_index = 0;
  return std::make_shared<ProcessGroupNCCL>(store, 0, 1, po);
}

}  // namespace kiln::dist::testing
