// Rendezvous from the environment, in torchrun's conventions: the launcher (`kiln run`, see
// dist/launcher.h) or the user sets
//
//   RANK         this process's rank in [0, WORLD_SIZE)
//   WORLD_SIZE   the number of processes of the job (all nodes)
//   LOCAL_RANK   the rank on this node (picks the GPU); defaults to RANK
//   LOCAL_WORLD_SIZE  processes on this node; defaults to WORLD_SIZE
//   MASTER_ADDR  the host of rank 0 (which serves the TCP store); defaults to 127.0.0.1
//   MASTER_PORT  its port; defaults to 29500
//
//   auto info = kiln::dist::rendezvous_info_from_env();
//   auto store = kiln::dist::rendezvous(info, std::chrono::seconds(60));
//
// rendezvous() makes rank 0 the store's server, connects every rank and returns once all
// WORLD_SIZE ranks have joined; a rank that is missing after the timeout, a rank claimed twice
// or ranks disagreeing on WORLD_SIZE end in a kiln::Error that says so.
#pragma once

#include <memory>
#include <string>

#include "dist/store.h"

namespace kiln::dist {

struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
};

// Reads the variables above; a missing RANK or WORLD_SIZE, a value that is not an integer or a
// rank outside [0, WORLD_SIZE) is an error naming the variable.
RendezvousInfo rendezvous_info_from_env();

// Connects to (rank 0: serves) the TCP store at master_addr:master_port and waits until every
// rank has joined. The returned store's timeout is `timeout`.
std::shared_ptr<Store> rendezvous(const RendezvousInfo& info,
                                  Milliseconds timeout = kDefaultStoreTimeout);

// Joins the ranks of `store` (a store already shared by the job): every rank registers, and the
// call returns once all world_size have. Called by rendezvous(); usable with any store.
void join_ranks(Store& store, int rank, int world_size, Milliseconds timeout);

}  // namespace kiln::dist
