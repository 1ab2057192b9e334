// kiln::dist: distributed training. One header for all of it:
//
//   store.h              TCPStore, PrefixStore: the key-value store the ranks meet through
//   rendezvous.h         RANK, WORLD_SIZE, MASTER_ADDR, ... -> a joined store
//   process_group.h      ProcessGroup, Work, ReduceOp, init_process_group
//   process_group_gloo.h the CPU backend (Gloo)
//   process_group_nccl.h the CUDA backend (NCCL)
//   launcher.h           `kiln run`: starts the ranks of a job
//   ddp.h                DistributedDataParallel
//   fsdp.h               fully_shard, FSDPModule (ZeRO-3 / ZeRO-2)
//
// docs/distributed.md is the guide.
#pragma once

#include "dist/collective_ops.h"
#include "dist/ddp.h"
#include "dist/fsdp.h"
#include "dist/launcher.h"
#include "dist/process_group.h"
#include "dist/process_group_gloo.h"
#include "dist/process_group_nccl.h"
#include "dist/rendezvous.h"
#include "dist/store.h"
