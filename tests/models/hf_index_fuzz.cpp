// libFuzzer target for the sharded checkpoint index (model.safetensors.index.json, read by
// load_hf_weights in models/hf_weights.cpp): next to the shards of a tiny-llama checkpoint, an
// arbitrary index must be rejected with a kiln::Error that names the op
// ("[load_hf_weights] ...") or load exactly the saved weights; it must never name a file outside
// the directory or load a tensor from a shard that lacks it. Any crash, over-read
// (AddressSanitizer), other exception or wrong weight (abort) is a finding.
//
// The shards are written once, under /dev/shm (or $TMPDIR), and removed at exit; the seed is
// the index that save_hf_checkpoint writes for them (tiny-llama, seed 0, 100000-byte shards).
//
//   D=tests/models/data F=build-fuzz/hf_index_fuzz
//   $F -max_total_time=60 -dict=$D/hf_index.dict $D/hf_index_fuzz
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include "autograd/grad_mode.h"
#include "models/gpt.h"
#include "models/hf.h"
#include "tensor/ops.h"

namespace {

namespace fs = std::filesystem;
using kiln::models::GPT;

fs::path g_dir;
std::optional<GPT> g_model;  // loaded into by every input
std::map<std::string, kiln::Tensor> g_saved;

void remove_dir() {
  std::error_code ec;
  fs::remove_all(g_dir.parent_path(), ec);  // the mkdtemp directory around the checkpoint
}

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "hf_index_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm")
                        : tmp                        ? fs::path(tmp)
                                                     : fs::temp_directory_path();
  std::string templ = (base / "kiln_hf_index_fuzz_XXXXXX").string();
  check(::mkdtemp(templ.data()) != nullptr, "cannot create a directory", templ);
  std::atexit(remove_dir);
  g_dir = fs::path(templ) / "ckpt";
  kiln::manual_seed(0);
  const auto cfg = kiln::models::ModelConfig::from_name("tiny-llama");
  GPT saved(cfg);
  kiln::models::save_hf_checkpoint(*saved, g_dir.string(), 100'000);
  for (const auto& [name, t] : saved->state_dict()) g_saved.emplace(name, t.clone());
  g_model.emplace(cfg);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  {
    std::ofstream out(g_dir / "model.safetensors.index.json", std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  {
    kiln::NoGradGuard no_grad;
    kiln::manual_seed(1);
    for (auto& [name, t] : (*g_model)->state_dict()) t.normal_();  // nothing left from before
  }
  try {
    kiln::models::load_hf_weights(**g_model, g_dir.string());
  } catch (const kiln::Error& e) {
    check(std::string(e.what()).starts_with("[load_hf_weights] "),
          "an error that does not name the op", e.what());
    return 0;
  }
  for (const auto& [name, t] : (*g_model)->state_dict()) {
    check(kiln::equal(t, g_saved.at(name)), "an accepted index loaded other weights", name);
  }
  return 0;
}
