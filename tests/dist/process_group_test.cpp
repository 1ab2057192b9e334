// ProcessGroup (dist/process_group.h) with the Gloo backend: every collective across 2 and 4
// processes (tests/dist/dist_worker.cpp checks the values), timeouts and a dead peer ending in
// clear errors; in this process: a group of one, argument errors, the environment's errors and a
// wrong MASTER_PORT.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "dist/collective_ops.h"
#include "dist/dist.h"
#include "spawn.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::dist {
namespace {

using std::chrono::milliseconds;
using testing::run_workers;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Sets environment variables for the scope and restores them after.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (auto [k, v] : vars) {
      const char* old = std::getenv(k);
      saved_.push_back({k, old ? std::optional<std::string>(old) : std::nullopt});
      if (v) {
        ::setenv(k, v, 1);
      } else {
        ::unsetenv(k);
      }
    }
  }
  ~ScopedEnv() {
    for (auto& [k, v] : saved_) {
      if (v) {
        ::setenv(k.c_str(), v->c_str(), 1);
      } else {
        ::unsetenv(k.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(ProcessGroupGlooTest, CollectivesAcrossTwoProcesses) {
  auto job = run_workers("collectives", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(ProcessGroupGlooTest, CollectivesAcrossFourProcesses) {
  auto job = run_workers("collectives", 4);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(ProcessGroupGlooTest, CollectiveTimeoutIsAClearError) {
  auto job = run_workers("collective_timeout", 2);
  EXPECT_TRUE(job.all_ok()) << job.describe();
}

TEST(ProcessGroupGlooTest, PeerExitIsAClearError) {
  auto job = run_workers("peer_exits", 2, std::chrono::seconds(20));
  ASSERT_FALSE(job.timed_out) << job.describe();
  EXPECT_EQ(job.ranks[0].exit_code, 0) << job.describe();
  EXPECT_EQ(job.ranks[1].exit_code, 3) << job.describe();
}

// A Gloo group of this process alone, its store a TCPStore server on a free port.
std::shared_ptr<ProcessGroupGloo> gloo_group_of_one() {
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = milliseconds(5000);
  auto store = std::make_shared<TCPStore>("127.0.0.1", o);
  return std::make_shared<ProcessGroupGloo>(
      store, 0, 1, ProcessGroupGloo::Options{milliseconds(5000), "127.0.0.1"});
}

TEST(ProcessGroupGlooTest, GroupOfOne) {
  const auto group = gloo_group_of_one();
  ProcessGroupGloo& pg = *group;
  EXPECT_EQ(pg.backend_name(), "gloo");
  Tensor t = arange(0, 4, kFloat);
  pg.all_reduce(t, ReduceOp::kAvg)->wait();
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 1, 2, 3}));
  Tensor out = empty({4}, kFloat);
  pg.all_gather_into_tensor(out, t)->wait();
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{0, 1, 2, 3}));
  pg.barrier()->wait();
  // Argument errors are raised by the call, naming the op.
  EXPECT_NE(error_of([&] { pg.send(t, 0); }).find("[send] rank 0 cannot send to itself"),
            std::string::npos);
  EXPECT_NE(error_of([&] { pg.recv(t, 1); }).find("[recv] source rank 1 is outside [0, 1)"),
            std::string::npos);
  std::vector<Tensor> two{empty({4}), empty({4})};
  EXPECT_NE(error_of([&] { pg.all_gather(two, t); })
                .find("[all_gather] expected 1 output tensors (the world size), got 2"),
            std::string::npos);
  Tensor meta = empty({2}, TensorOptions().device(kMeta));
  EXPECT_NE(error_of([&] { pg.all_reduce(meta); }).find("the Gloo backend takes CPU tensors"),
            std::string::npos);
}

// FSDP's coalesced collectives as ops (dist/collective_ops.h), at one rank: each part lands in
// its place of the one output, the Works' waits are the dist_wait_ op, and bad parts, offsets
// and dtypes are errors that name the op. The ranks' sums and gathers across processes: the
// compiled FSDP scenarios (fsdp_worker's fsdp_compiled, 2 and 4 ranks).
TEST(CollectiveOpsTest, CoalescedGathersAndReduceScattersAtOneRank) {
  auto pg = gloo_group_of_one();
  Tensor in = arange(0, 6, kFloat);
  Tensor out = full({8}, -1.0);
  // Parts (in_offset, numel, out_offset): [0, 2) -> [5, 7), [2, 6) -> [0, 4).
  all_gather_coalesced_op(pg, out, in, {{0, 2, 5}, {2, 4, 0}})->wait();
  EXPECT_EQ(out.to_vector<float>(), (std::vector<float>{2, 3, 4, 5, -1, 0, 1, -1}));

  Tensor sums = full({7}, -1.0);
  std::vector<Tensor> grads{full({3}, 2.0), arange(0, 2, kFloat)};
  reduce_scatter_coalesced_op(pg, sums, grads, {4, 0}, ReduceOp::kAvg)->wait();
  EXPECT_EQ(sums.to_vector<float>(), (std::vector<float>{0, 1, -1, -1, 2, 2, 2}));

  EXPECT_NE(error_of([&] {
              all_gather_coalesced_op(pg, out, in, {{4, 3, 0}});
            })
                .find("[dist_all_gather_coalesced_] part 0 (input [4, 7), output [0, 3)) is "
                      "outside the input of 6 or the output of 8 elements (world size 1)"),
            std::string::npos);
  Tensor halves = empty({8}, kBFloat16);
  EXPECT_NE(error_of([&] {
              all_gather_coalesced_op(pg, halves, in, {{0, 2, 0}});
            }).find("[dist_all_gather_coalesced_] the output is bfloat16"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              reduce_scatter_coalesced_op(pg, sums, grads, {0});
            }).find("[dist_reduce_scatter_coalesced_] 2 inputs but 1 offsets"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              reduce_scatter_coalesced_op(pg, sums, grads, {5, 0});
            })
                .find("input 0 of 3 elements (world size 1) does not fit the output of 7 at "
                      "offset 5"),
            std::string::npos);
}

// Ranks may be threads of one process, and a rank may make several groups on one store.
TEST(ProcessGroupGlooTest, TwoRanksAsThreadsWithTwoGroupsEach) {
  TCPStoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = milliseconds(10000);
  auto server = std::make_shared<TCPStore>("127.0.0.1", o);
  std::vector<std::vector<float>> results(2);
  auto rank_main = [&](int rank) {
    TCPStoreOptions c = o;
    c.is_server = false;
    c.port = server->port();
    auto store = rank == 0 ? std::static_pointer_cast<Store>(server)
                           : std::make_shared<TCPStore>("127.0.0.1", c);
    ProcessGroupGloo a(store, rank, 2, {milliseconds(10000), "127.0.0.1"});
    ProcessGroupGloo b(store, rank, 2, {milliseconds(10000), "127.0.0.1"});
    Tensor x = full({3}, rank + 1, kFloat), y = full({3}, 10 * (rank + 1), kFloat);
    auto wb = b.all_reduce(y);  // the groups are independent: b before a
    a.all_reduce(x)->wait();
    wb->wait();
    results[rank] = (x + y).to_vector<float>();
  };
  std::thread t1(rank_main, 1);
  rank_main(0);
  t1.join();
  EXPECT_EQ(results[0], (std::vector<float>{33, 33, 33}));
  EXPECT_EQ(results[1], (std::vector<float>{33, 33, 33}));
}

TEST(RendezvousTest, EnvironmentErrorsNameTheVariable) {
  {
    ScopedEnv env({{"RANK", nullptr}, {"WORLD_SIZE", "2"}});
    EXPECT_NE(error_of([] { rendezvous_info_from_env(); })
                  .find("[rendezvous] the environment variable RANK is not set"),
              std::string::npos);
  }
  {
    ScopedEnv env({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
    EXPECT_NE(error_of([] { rendezvous_info_from_env(); })
                  .find("RANK=2 is outside [0, WORLD_SIZE=2)"),
              std::string::npos);
  }
  {
    ScopedEnv env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "12x"}});
    EXPECT_NE(error_of([] { rendezvous_info_from_env(); }).find("MASTER_PORT='12x' is not an integer"),
              std::string::npos);
  }
  {
    ScopedEnv env({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}});
    const RendezvousInfo info = rendezvous_info_from_env();
    EXPECT_EQ(info.rank, 1);
    EXPECT_EQ(info.world_size, 4);
    EXPECT_EQ(info.local_rank, 1);
    EXPECT_EQ(info.local_world_size, 2);
    EXPECT_EQ(info.master_addr, "node0");
    EXPECT_EQ(info.master_port, 1234);
  }
}

TEST(RendezvousTest, WrongMasterPortIsAClearError) {
  // Rank 1 of 2 whose MASTER_PORT has no rank 0 behind it.
  RendezvousInfo info;
  info.rank = 1;
  info.world_size = 2;
  info.master_port = testing::free_port();
  const std::string e = error_of([&] { rendezvous(info, milliseconds(500)); });
  EXPECT_NE(e.find("[TCPStore] could not connect to 127.0.0.1:" + std::to_string(info.master_port) +
                   " within 500 ms"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("are MASTER_ADDR and MASTER_PORT the ones it uses?"), std::string::npos) << e;
}

TEST(RendezvousTest, MissingRankTimesOut) {
  RendezvousInfo info;  // rank 0 of 2; rank 1 never comes
  info.world_size = 2;
  info.master_port = 0;
  const std::string e = error_of([&] { rendezvous(info, milliseconds(300)); });
  EXPECT_NE(e.find("[rendezvous] only 1 of WORLD_SIZE=2 ranks joined within 300 ms"),
            std::string::npos)
      << e;
}

TEST(InitProcessGroupTest, UnknownBackendAndNoNccl) {
  EXPECT_NE(error_of([] { init_process_group("mpi"); }).find("unknown backend 'mpi'"),
            std::string::npos);
  if (!nccl_available()) {
    TCPStoreOptions o;
    o.port = 0;
    o.is_server = true;
    auto store = std::make_shared<TCPStore>("127.0.0.1", o);
    EXPECT_NE(error_of([&] { ProcessGroupNCCL(store, 0, 1); }).find("no NCCL backend"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace kiln::dist
