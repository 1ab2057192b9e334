#include "dist/rendezvous.h"

#include <charconv>
#include <cstdlib>

#include "tensor/error.h"

namespace kiln::dist {
namespace {

std::optional<int> env_int(const char* name, bool required) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    KILN_CHECK(!required, "[rendezvous] the environment variable ", name,
               " is not set: start the program with `kiln run --nproc-per-node N program ...`, "
               "or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself");
    return std::nullopt;
  }
  const std::string s(v);
  int out = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  KILN_CHECK(ec == std::errc() && end == s.data() + s.size(), "[rendezvous] ", name, "='", s,
             "' is not an integer");
  return out;
}

}  // namespace

RendezvousInfo rendezvous_info_from_env() {
  RendezvousInfo info;
  info.rank = *env_int("RANK", true);
  info.world_size = *env_int("WORLD_SIZE", true);
  KILN_CHECK(info.world_size >= 1, "[rendezvous] WORLD_SIZE must be at least 1, got ",
             info.world_size);
  KILN_CHECK(info.rank >= 0 && info.rank < info.world_size, "[rendezvous] RANK=", info.rank,
             " is outside [0, WORLD_SIZE=", info.world_size, ")");
  info.local_rank = env_int("LOCAL_RANK", false).value_or(info.rank);
  info.local_world_size = env_int("LOCAL_WORLD_SIZE", false).value_or(info.world_size);
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') {
    info.master_addr = a;
  }
  info.master_port = env_int("MASTER_PORT", false).value_or(29500);
  KILN_CHECK(info.master_port >= 0 && info.master_port <= 65535, "[rendezvous] MASTER_PORT=",
             info.master_port, " is not a TCP port (0-65535)");
  return info;
}

void join_ranks(Store& store, int rank, int world_size, Milliseconds timeout) {
  // Each rank claims its number once and records the world size it was given.
  const int64_t claims = store.add("kiln/rdzv/rank/" + std::to_string(rank), 1);
  KILN_CHECK(claims == 1, "[rendezvous] rank ", rank,
             " joined twice: two processes were given RANK=", rank);
  store.set("kiln/rdzv/world_size/" + std::to_string(rank), std::to_string(world_size));
  const int64_t joined = store.add("kiln/rdzv/joined", 1);
  if (joined == world_size) store.set("kiln/rdzv/complete", "1");
  try {
    store.wait({"kiln/rdzv/complete"}, timeout);
  } catch (const Error& e) {
    const int64_t now = store.add("kiln/rdzv/joined", 0);
    KILN_FAIL("[rendezvous] only ", now, " of WORLD_SIZE=", world_size, " ranks joined within ",
              timeout.count(), " ms (a rank did not start, or the ranks were given different "
              "WORLD_SIZE values)");
  }
  // All ranks must agree on the world size.
  const std::string ws = store.get_string("kiln/rdzv/world_size/0");
  KILN_CHECK(ws == std::to_string(world_size), "[rendezvous] rank ", rank, " has WORLD_SIZE=",
             world_size, " but rank 0 has WORLD_SIZE=", ws);
}

std::shared_ptr<Store> rendezvous(const RendezvousInfo& info, Milliseconds timeout) {
  TCPStoreOptions o;
  o.port = static_cast<uint16_t>(info.master_port);
  o.is_server = info.rank == 0;
  o.timeout = timeout;
  auto store = std::make_shared<TCPStore>(info.master_addr, o);
  join_ranks(*store, info.rank, info.world_size, timeout);
  return store;
}

}  // namespace kiln::dist
