// libFuzzer target for the trainer's state file (read_checkpoint_info, models/trainer.cpp, with
// the loader state of pretrain/loader.cpp inside): arbitrary bytes as <dir>/trainer_state.json
// must be rejected with a kiln::Error that names the file, or read as a state whose file names
// stay inside the directory and whose numbers are in range. Any crash, over-read
// (AddressSanitizer), other exception or violated invariant (abort) is a finding.
//
// read_checkpoint_info reads a file, so each input is written to a directory under /dev/shm
// (or $TMPDIR), removed at exit.
//
//   D=tests/models/data F=build-fuzz/trainer_state_fuzz
//   $F -max_total_time=60 -dict=$D/trainer_state.dict $D/trainer_state_fuzz
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "models/trainer.h"

namespace {

namespace fs = std::filesystem;

fs::path g_dir;

void remove_dir() {
  std::error_code ec;
  fs::remove_all(g_dir, ec);
}

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "trainer_state_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

bool plain_name(const std::string& n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string::npos &&
         n.find('\\') == std::string::npos && n.find('\0') == std::string::npos;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm")
                        : tmp                        ? fs::path(tmp)
                                                     : fs::temp_directory_path();
  std::string templ = (base / "kiln_trainer_state_fuzz_XXXXXX").string();
  check(::mkdtemp(templ.data()) != nullptr, "cannot create a directory", templ);
  g_dir = templ;
  std::atexit(remove_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const fs::path file = g_dir / "trainer_state.json";
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  }
  std::optional<kiln::models::CheckpointInfo> info;
  try {
    info = kiln::models::read_checkpoint_info(g_dir.string());
  } catch (const kiln::Error& e) {
    const std::string what = e.what();
    check((what.starts_with("[checkpoint] ") || what.starts_with("[loader] ")) &&
              what.find(file.string()) != std::string::npos,
          "an error that does not name the file", what);
    return 0;
  }
  check(info.has_value(), "an existing state file read as none", "");
  const std::string text(reinterpret_cast<const char*>(data), size);
  check(info->step >= 0, "a negative step", text);
  check(!info->config.empty() && !info->precision.empty(), "an empty config or precision", text);
  check(plain_name(info->model_file) && plain_name(info->optimizer_file),
        "a file name outside the checkpoint directory", text);
  if (const auto& sc = info->schedule) {
    check(std::isfinite(sc->lr) && sc->lr > 0 && sc->min_lr >= 0 && sc->min_lr <= sc->lr &&
              sc->warmup_steps >= 0 && sc->warmup_steps <= sc->lr_decay_steps,
          "a schedule out of range", text);
  }
  if (const auto& l = info->loader) {
    check(l->seq_len > 0 && l->train_sequences > 0, "a loader state out of range", text);
  }
  return 0;
}
