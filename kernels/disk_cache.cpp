#include "kernels/disk_cache.h"

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string_view>

#include "absl/strings/str_format.h"

namespace kiln::disk_cache {
namespace {

std::mutex& dir_mutex() {
  static std::mutex mu;
  return mu;
}
std::string& dir_override() {
  static std::string dir;
  return dir;
}

// FNV-1a, 64 bits: stable across processes and builds (absl::Hash is seeded per process).
uint64_t fnv1a(std::string_view s, uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

constexpr char kMagic[8] = {'K', 'I', 'L', 'N', 'K', 'R', 'N', '\n'};
// 2: a key of any number of parts (1 held a generated kernel's source, arch and NVRTC version).
constexpr uint32_t kFormat = 2;

template <typename T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// A file's bytes, or nullopt when it cannot be read.
std::optional<std::string> slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

std::string dir() {
  {
    std::lock_guard<std::mutex> lock(dir_mutex());
    if (!dir_override().empty()) return dir_override();
  }
  if (const char* d = std::getenv("KILN_KERNEL_CACHE"); d != nullptr && *d != '\0') return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    return std::string(x) + "/kiln/kernels";
  }
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    return std::string(h) + "/.cache/kiln/kernels";
  }
  return "none";
}

void set_dir(std::string dir) {
  std::lock_guard<std::mutex> lock(dir_mutex());
  dir_override() = std::move(dir);
}

std::string Key::file_name() const {
  std::string all;
  for (const std::string& p : parts) {
    all += p;
    all += '\0';
  }
  return absl::StrFormat("%016x%016x%s", fnv1a(all), fnv1a(all, 0x84222325cbf29ce4ull ^ all.size()),
                         suffix);
}

std::optional<std::string> read(const std::string& dir, const Key& key, bool* rejected) {
  if (rejected != nullptr) *rejected = false;
  if (dir == "none") return std::nullopt;
  const std::optional<std::string> data = slurp(dir + "/" + key.file_name());
  if (!data) return std::nullopt;
  size_t at = 0;
  auto take = [&](size_t n) -> std::optional<std::string_view> {
    if (n > data->size() - at) return std::nullopt;
    std::string_view s(data->data() + at, n);
    at += n;
    return s;
  };
  auto number = [&]<typename T>(T& v) {
    const auto s = take(sizeof(T));
    if (s) std::memcpy(&v, s->data(), sizeof(T));
    return s.has_value();
  };
  uint32_t format = 0, count = 0;
  uint64_t size = 0, checksum = 0;
  const auto magic = take(sizeof(kMagic));
  bool ok = magic && *magic == std::string_view(kMagic, sizeof(kMagic)) && number(format) &&
            format == kFormat && number(count) && count == key.parts.size();
  for (size_t i = 0; ok && i < key.parts.size(); ++i) {
    uint64_t len = 0;
    ok = number(len) && len == key.parts[i].size();
    if (ok) {
      const auto s = take(len);
      ok = s && *s == key.parts[i];
    }
  }
  ok = ok && number(size) && number(checksum) && size == data->size() - at &&
       fnv1a(std::string_view(data->data() + at, size)) == checksum;
  if (!ok) {
    if (rejected != nullptr) *rejected = true;
    return std::nullopt;
  }
  return data->substr(at);
}

bool write(const std::string& dir, const Key& key, const std::string& payload) {
  if (dir == "none") return false;
  std::string out(kMagic, sizeof(kMagic));
  put(out, kFormat);
  put(out, static_cast<uint32_t>(key.parts.size()));
  for (const std::string& p : key.parts) {
    put(out, static_cast<uint64_t>(p.size()));
    out += p;
  }
  put(out, static_cast<uint64_t>(payload.size()));
  put(out, fnv1a(payload));
  out += payload;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return false;
  static std::atomic<uint64_t> serial{0};
  const std::string path = dir + "/" + key.file_name();
  const std::string tmp =
      absl::StrFormat("%s.tmp.%d.%d", path, static_cast<int>(getpid()), serial.fetch_add(1));
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    f.close();
    if (!f) {
      std::filesystem::remove(tmp, ec);
      return false;
    }
  }
  std::filesystem::rename(tmp, path, ec);  // readers see a whole file or none
  if (ec) {
    std::filesystem::remove(tmp, ec);
    return false;
  }
  return true;
}

}  // namespace kiln::disk_cache
