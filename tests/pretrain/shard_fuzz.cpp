// libFuzzer target for the token shard reader (ShardFile::open and parse_shard_header,
// pretrain/shard.cpp): arbitrary bytes as a shard file must be rejected with a kiln::Error that
// names the file ("[shard] <path>: ...") or open as a shard whose size matches its header and
// whose tokens read back as the file's bytes, below vocab_size when verified. Each input is
// opened twice: as it is (most fail the checksum) and with the header's checksum recomputed, so
// that mutated counts and ids get past it. Any crash, over-read (AddressSanitizer), other
// exception or violated invariant (abort) is a finding.
//
// ShardFile::open reads a file, so each input is written to a directory under /dev/shm (or
// $TMPDIR), removed at exit.
//
//   D=tests/pretrain/data
//   build-fuzz/shard_fuzz -max_total_time=60 -dict=$D/shard.dict $D/shard_fuzz
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "pretrain/shard.h"
#include "tensor/error.h"

namespace {

namespace fs = std::filesystem;
using kiln::pretrain::kShardHeaderBytes;
using kiln::pretrain::ShardFile;

fs::path g_dir;

void remove_dir() {
  std::error_code ec;
  fs::remove_all(g_dir, ec);
}

void check(bool ok, const char* what, const std::string& detail) {
  if (!ok) {
    std::fprintf(stderr, "shard_fuzz: %s\n%s\n", what, detail.c_str());
    std::abort();
  }
}

void open_shard(const std::string& bytes) {
  const std::string path = (g_dir / "fuzz.tokens").string();
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  for (const bool verify : {true, false}) {
    std::optional<ShardFile> f;
    try {
      f.emplace(ShardFile::open(path, verify));
    } catch (const kiln::Error& e) {
      check(std::string(e.what()).starts_with("[shard] " + path + ": "),
            "an error that does not name the file", e.what());
      continue;
    }
    const auto& m = f->meta();
    check(m.token_bytes == 2 || m.token_bytes == 4, "a token size other than 2 or 4", "");
    check(kShardHeaderBytes + static_cast<uint64_t>(m.num_tokens) * m.token_bytes == bytes.size(),
          "the size does not match the header", std::to_string(bytes.size()));
    std::vector<int64_t> ids(static_cast<size_t>(m.num_tokens));
    f->read(0, m.num_tokens, ids.data());
    for (int64_t i = 0; i < m.num_tokens; ++i) {
      uint32_t raw = 0;
      std::memcpy(&raw, bytes.data() + kShardHeaderBytes + i * m.token_bytes,
                  static_cast<size_t>(m.token_bytes));
      check(ids[i] == static_cast<int64_t>(raw) && f->token(i) == ids[i],
            "a token reads back other than its bytes", std::to_string(i));
      check(!verify || ids[i] < m.vocab_size, "a verified shard holds an id >= vocab_size",
            std::to_string(ids[i]));
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* tmp = std::getenv("TMPDIR");
  const fs::path base = fs::is_directory("/dev/shm") ? fs::path("/dev/shm")
                        : tmp                        ? fs::path(tmp)
                                                     : fs::temp_directory_path();
  std::string templ = (base / "kiln_shard_fuzz_XXXXXX").string();
  check(::mkdtemp(templ.data()) != nullptr, "cannot create a directory", templ);
  g_dir = templ;
  std::atexit(remove_dir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string bytes(reinterpret_cast<const char*>(data), size);
  open_shard(bytes);
  if (size < kShardHeaderBytes) return 0;
  const uint64_t sum = kiln::pretrain::shard_header_checksum(
      std::string_view(bytes).substr(0, 56),
      kiln::pretrain::shard_checksum(bytes.data() + kShardHeaderBytes, size - kShardHeaderBytes));
  std::memcpy(bytes.data() + 56, &sum, 8);  // little-endian, as the format
  open_shard(bytes);
  return 0;
}
