// The process that tests/models/hf_publish_test.cpp kills in the middle of a save: saves Hugging
// Face checkpoints of tiny-llama into one directory, one after the other, until it is killed.
//
//   hf_publish_worker <dir> <seed>:<max_shard_bytes>[,<seed>:<max_shard_bytes>...]
//                     [--die-at <step>] [--two-renames]
//
// Each seed's model is GPT(tiny-llama) created after manual_seed(seed), so the test rebuilds the
// same weights to compare with. The models are saved in turn, forever; "ready" goes to stdout
// before the first save, once the models exist. --die-at raises SIGKILL at that publishing step
// of the first save (kiln::models::internal::HfPublishHooks); --two-renames publishes the way of
// file systems that cannot exchange two directories.
#include <signal.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "models/gpt.h"
#include "models/hf.h"
#include "tensor/ops.h"

namespace {

std::string g_die_at;

void die_at(const char* step) {
  if (g_die_at == step) ::raise(SIGKILL);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kiln;
  using namespace kiln::models;
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s <dir> <seed>:<max_shard_bytes>[,...] [--die-at <step>] "
                 "[--two-renames]\n",
                 argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  models::internal::HfPublishHooks hooks;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--die-at" && i + 1 < argc) {
      g_die_at = argv[++i];
      hooks.at_step = die_at;
    } else if (a == "--two-renames") {
      hooks.two_renames = true;
    } else {
      std::fprintf(stderr, "hf_publish_worker: unknown argument '%s'\n", a.c_str());
      return 2;
    }
  }
  try {
    struct Save {
      GPT model;
      int64_t max_shard_bytes;
    };
    std::vector<Save> saves;
    std::stringstream list(argv[2]);
    std::string item;
    while (std::getline(list, item, ',')) {
      const size_t colon = item.find(':');
      const uint64_t seed = std::stoull(item.substr(0, colon));
      manual_seed(seed);
      saves.push_back({GPT(ModelConfig::from_name("tiny-llama")),
                       colon == std::string::npos ? int64_t{5'000'000'000}
                                                  : std::stoll(item.substr(colon + 1))});
    }
    models::internal::set_hf_publish_hooks(hooks);
    std::printf("ready\n");
    std::fflush(stdout);
    for (size_t i = 0;; i = (i + 1) % saves.size()) {
      save_hf_checkpoint(*saves[i].model, dir, saves[i].max_shard_bytes);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_publish_worker: %s\n", e.what());
    return 1;
  }
}
