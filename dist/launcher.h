// `kiln run`: starts the ranks of a job on this node, in torchrun's conventions.
//
//   kiln run --nproc-per-node 4 ./train --lr 3e-4               # one node, ranks 0..3
//   # on node 0 (ranks 0..7), then on node 1 (ranks 8..15):
//   kiln run --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 ./train
//   kiln run --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr 10.0.0.1 ./train
//
// Each rank is `program args...` with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
// GROUP_RANK (the node rank), MASTER_ADDR and MASTER_PORT set, and OMP_NUM_THREADS=1 unless it
// is set already (several ranks share the node's cores). Their output lines come out prefixed
// with "[rank3]: " (stdout to stdout, stderr to stderr).
//
// - SIGINT and SIGTERM sent to the launcher are forwarded to every rank.
// - When a rank exits with a non-zero status or is killed by a signal, the launcher prints which
//   rank and how, sends SIGTERM to the others and, after a grace period (--term-timeout seconds,
//   default 5), SIGKILL; it exits with the failed rank's status (128 + signal for a signal).
// - The ranks get SIGKILL if the launcher itself dies, so nothing is left behind.
#pragma once

#include <string>
#include <vector>

namespace kiln::dist {

// Runs the launcher with the arguments after "run"; returns the process exit status (2 for
// bad arguments, after printing the usage).
int launcher_main(const std::vector<std::string>& args);

// The usage text of `kiln run`.
const char* launcher_usage();

}  // namespace kiln::dist
