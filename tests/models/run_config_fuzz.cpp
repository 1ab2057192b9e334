// libFuzzer target for run configuration files (parse_run_config, models/run_config.cpp):
// arbitrary bytes must be rejected with a kiln::Error naming the file ("[run_config] fuzz.toml")
// or give options whose to_toml reads back to the same text (the writer and the reader agree on
// every value that the reader accepts; a min_lr above the lr is accepted from a file that sets
// only one of them, for a flag to complete, and is left out). Any crash, over-read
// (AddressSanitizer), other exception or mismatch (abort) is a finding.
//
//   D=tests/models/data F=build-fuzz/run_config_fuzz
//   $F -max_total_time=60 -dict=$D/run_config.dict $D/run_config_fuzz
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "models/run_config.h"
#include "tensor/error.h"

namespace {

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "run_config_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kiln::models::RunConfig rc;
  try {
    rc = kiln::models::parse_run_config(text, "fuzz.toml");
  } catch (const kiln::Error& e) {
    const std::string message = e.what();
    check(message.rfind("[run_config] fuzz.toml:", 0) == 0, "an error without the file's name",
          message);
    return 0;
  }
  // A file with both rejects this; PretrainOptions::validate rejects what the flags leave so.
  if (rc.options.min_lr > rc.options.lr) return 0;
  const std::string written = kiln::models::to_toml(rc.options);
  std::string again;
  try {
    again = kiln::models::to_toml(kiln::models::parse_run_config(written, "run.toml").options);
  } catch (const kiln::Error& e) {
    check(false, "to_toml wrote a file that does not read back", written + "\n" + e.what());
  }
  check(again == written, "to_toml does not read back to the same options", written + "\n" + again);
  return 0;
}
