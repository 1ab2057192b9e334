// safetensors reading (validated header, pread copies, zero-copy views of a mapping) and atomic
// writing.
//
// Validation follows the reference implementation (huggingface/safetensors): the tensors'
// byte ranges, sorted, must tile the data buffer exactly (no overlap, no hole, nothing left
// over), and each range must hold numel * element size bytes. Beyond it, duplicate keys are
// errors rather than silently overwritten, and BOOL bytes must be 0 or 1.
#include "nn/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>

#include "nn/json.h"
#include "tensor/edit_distance.h"
#include "tensor/ops.h"

static_assert(std::endian::native == std::endian::little,
              "safetensors stores little-endian data; kiln reads it in place");

namespace kiln {
namespace {

using nn::append_json_string;
using nn::is_valid_utf8;
using nn::JsonError;
using nn::JsonReader;

// The header is JSON that the reader keeps in memory while validating; the reference
// implementation caps it at 100 MB as well.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kMaxDims = 64;

struct DtypeName {
  std::string_view name;
  ScalarType dtype;
};
constexpr DtypeName kDtypes[] = {{"F64", kDouble},    {"F32", kFloat}, {"F16", kHalf},
                                 {"BF16", kBFloat16}, {"I64", kInt64}, {"I32", kInt32},
                                 {"U8", kUInt8},      {"BOOL", kBool}};
// Valid safetensors dtypes that kiln has no tensor type for.
constexpr std::string_view kUnsupportedDtypes[] = {"I8",  "U16",     "I16",     "U32",
                                                   "U64", "F8_E4M3", "F8_E5M2", "F8_E8M0",
                                                   "F4",  "F6_E2M3", "F6_E3M2", "C64"};

std::string_view safetensors_dtype_name(ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.dtype == t) return d.name;
  }
  KILN_FAIL("[save_safetensors] dtype ", t, " has no safetensors name");
}

// A name quoted for an error message; hostile names can be megabytes long.
std::string quote_name(std::string_view s) {
  constexpr size_t kMax = 120;
  if (s.size() <= kMax) return "\"" + std::string(s) + "\"";
  return "\"" + std::string(s.substr(0, kMax)) + "\"... (" + std::to_string(s.size()) + " bytes)";
}

}  // namespace

// --- The open file ----------------------------------------------------------------------------

struct SafetensorsFile::Impl {
  std::string name;
  char* bytes = nullptr;    // the whole file: mapped, or owned (`owned`)
  uint64_t size = 0;        // when opened
  uint64_t data_start = 0;  // 8 + header length
  bool mapped = false;
  int fd = -1;  // open while mapped: read_at and the size checks of get() use it
  std::unique_ptr<char, decltype(&std::free)> owned{nullptr, &std::free};
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::vector<std::string> keys;
  SafetensorsMetadata metadata;

  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() {
    if (mapped) munmap(bytes, size);
    if (fd >= 0) ::close(fd);
  }

  template <typename... Args>
  [[noreturn]] void fail(const Args&... args) const {
    KILN_FAIL("[load_safetensors] ", name, ": ", args...);
  }

  // The header length from the file's first 8 bytes (fewer when the file is shorter), checked
  // against the file's size.
  uint64_t header_length(std::string_view first) const;
  // The JSON header (the `header_length` bytes after the length).
  void parse_header(std::string_view text);
  void parse_tensor(JsonReader& r, const std::string& key);
  void parse_metadata(JsonReader& r);
  void check_layout() const;

  // The file's size now: it may have shrunk since it was opened.
  uint64_t current_size() const;
  // Copies bytes [offset, offset + n) of the file (or of the owned buffer) into `dst`, with
  // pread rather than through the mapping, so that a file truncated since it was opened gives
  // an error naming `what` instead of SIGBUS.
  void read_at(uint64_t offset, void* dst, uint64_t n, const std::string& what) const;
  // Fails unless the file still holds bytes [offset, offset + n): checked before get() touches
  // the mapping.
  void check_still_holds(uint64_t offset, uint64_t n, const std::string& what) const;
  [[noreturn]] void fail_truncated(uint64_t offset, uint64_t n, uint64_t now,
                                   const std::string& what) const {
    fail("truncated to ", now, " bytes since it was opened (", size, " bytes): ", what,
         " needs bytes ", offset, " to ", offset + n);
  }
  void check_bools(const std::string& key, const char* data, uint64_t n) const;
};

uint64_t SafetensorsFile::Impl::current_size() const {
  if (fd < 0) return size;
  struct stat st;
  if (::fstat(fd, &st) != 0) fail("cannot stat: ", std::strerror(errno));
  return static_cast<uint64_t>(st.st_size);
}

void SafetensorsFile::Impl::read_at(uint64_t offset, void* dst, uint64_t n,
                                    const std::string& what) const {
  if (fd < 0) {  // from_bytes: the owned copy holds every byte the header promises
    if (n > 0) std::memcpy(dst, bytes + offset, n);
    return;
  }
  auto* out = static_cast<char*>(dst);
  uint64_t done = 0;
  while (done < n) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n - done, uint64_t{1} << 30));
    const ssize_t got = ::pread(fd, out + done, chunk, static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("cannot read ", what, " (byte ", offset + done, "): ", std::strerror(errno));
    if (got == 0) fail_truncated(offset, n, current_size(), what);
    done += static_cast<uint64_t>(got);
  }
}

void SafetensorsFile::Impl::check_still_holds(uint64_t offset, uint64_t n,
                                              const std::string& what) const {
  if (fd < 0) return;
  const uint64_t now = current_size();
  if (now < offset + n) fail_truncated(offset, n, now, what);
}

void SafetensorsFile::Impl::check_bools(const std::string& key, const char* data,
                                        uint64_t n) const {
  for (uint64_t i = 0; i < n; ++i) {
    if (static_cast<unsigned char>(data[i]) > 1) {
      fail("tensor ", quote_name(key), " of dtype BOOL holds byte ",
           static_cast<int>(static_cast<unsigned char>(data[i])), " at element ", i,
           " (expected 0 or 1)");
    }
  }
}

uint64_t SafetensorsFile::Impl::header_length(std::string_view first) const {
  if (size < 8 || first.size() < 8) {
    fail("file too small (", size, " bytes) to hold the 8-byte header length");
  }
  uint64_t n;
  std::memcpy(&n, first.data(), 8);
  if (n < 2) fail("header length ", n, " is too small for a JSON object");
  if (n > kMaxHeaderBytes) fail("header length ", n, " exceeds the limit of ", kMaxHeaderBytes);
  if (n > size - 8) {
    fail("header length ", n, " runs past the end of the file (", size, " bytes in all)");
  }
  return n;
}

void SafetensorsFile::Impl::parse_header(std::string_view text) {
  data_start = 8 + text.size();
  if (text[0] != '{') fail("header does not start with '{'");
  if (!is_valid_utf8(text)) fail("header is not valid UTF-8");
  try {
    JsonReader r(text);
    r.begin_object();
    bool seen_metadata = false;
    while (std::optional<std::string> key = r.next_key()) {
      if (*key == "__metadata__") {
        if (seen_metadata) r.fail("duplicate key \"__metadata__\"");
        seen_metadata = true;
        parse_metadata(r);
      } else {
        if (tensors.contains(*key)) r.fail("duplicate tensor name " + quote_name(*key));
        parse_tensor(r, *key);
      }
    }
    r.end_document();
  } catch (const JsonError& e) {
    fail("bad header: ", e.what());
  }
  keys.reserve(tensors.size());
  for (const auto& [key, info] : tensors) keys.push_back(key);
  check_layout();
}

void SafetensorsFile::Impl::parse_metadata(JsonReader& r) {
  if (r.peek_kind() == 'z') {  // Option<HashMap> in the reference: null means none
    r.read_null();
    return;
  }
  if (r.peek_kind() != '{') r.fail("\"__metadata__\" must be an object of strings");
  r.begin_object();
  while (std::optional<std::string> key = r.next_key()) {
    if (metadata.contains(*key)) r.fail("duplicate metadata key " + quote_name(*key));
    if (r.peek_kind() != '"') r.fail("metadata value of " + quote_name(*key) + " is not a string");
    metadata.emplace(std::move(*key), r.read_string());
  }
}

void SafetensorsFile::Impl::parse_tensor(JsonReader& r, const std::string& key) {
  const std::string what = "tensor " + quote_name(key);
  if (r.peek_kind() != '{') r.fail(what + " must be an object");
  std::optional<ScalarType> dtype;
  std::optional<Shape> shape;
  std::optional<std::pair<uint64_t, uint64_t>> offsets;
  r.begin_object();
  while (std::optional<std::string> field = r.next_key()) {
    if (*field == "dtype") {
      if (dtype) r.fail(what + ": duplicate \"dtype\"");
      if (r.peek_kind() != '"') r.fail(what + ": \"dtype\" must be a string");
      const std::string name = r.read_string();
      for (const auto& d : kDtypes) {
        if (d.name == name) dtype = d.dtype;
      }
      if (!dtype) {
        const bool known = std::find(std::begin(kUnsupportedDtypes), std::end(kUnsupportedDtypes),
                                     name) != std::end(kUnsupportedDtypes);
        r.fail(what +
               (known ? ": dtype " + quote_name(name) + " is not supported by kiln"
                      : ": unknown dtype " + quote_name(name)) +
               " (supported: F64, F32, F16, BF16, I64, I32, U8, BOOL)");
      }
    } else if (*field == "shape") {
      if (shape) r.fail(what + ": duplicate \"shape\"");
      if (r.peek_kind() != '[') r.fail(what + ": \"shape\" must be an array of integers");
      shape.emplace();
      r.begin_array();
      while (r.next_element()) {
        if (shape->size() == kMaxDims) r.fail(what + " has more than 64 dimensions");
        const uint64_t d = r.read_uint64(what + ": shape entry");
        if (d > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
          r.fail(what + ": shape entry " + std::to_string(d) + " is too large");
        }
        shape->push_back(static_cast<int64_t>(d));
      }
    } else if (*field == "data_offsets") {
      if (offsets) r.fail(what + ": duplicate \"data_offsets\"");
      if (r.peek_kind() != '[') r.fail(what + ": \"data_offsets\" must be [begin, end]");
      r.begin_array();
      uint64_t v[2];
      for (uint64_t& x : v) {
        if (!r.next_element()) r.fail(what + ": \"data_offsets\" must have two entries");
        x = r.read_uint64(what + ": data offset");
      }
      if (r.next_element()) r.fail(what + ": \"data_offsets\" must have two entries");
      offsets.emplace(v[0], v[1]);
    } else {
      r.skip_value(1);  // the reference ignores unknown fields too
    }
  }
  if (!dtype) r.fail(what + " has no \"dtype\"");
  if (!shape) r.fail(what + " has no \"shape\"");
  if (!offsets) r.fail(what + " has no \"data_offsets\"");
  tensors.emplace(
      key, SafetensorsTensorInfo{*dtype, std::move(*shape), offsets->first, offsets->second});
}

void SafetensorsFile::Impl::check_layout() const {
  const uint64_t buffer = size - data_start;
  std::vector<std::pair<const std::string*, const SafetensorsTensorInfo*>> order;
  for (const auto& [key, info] : tensors) {
    const std::string what = "tensor " + quote_name(key);
    // The product of the non-zero sizes must fit, or strides would overflow even when empty.
    uint64_t numel = 1;
    bool zero = false;
    for (const int64_t d : info.shape) {
      if (d == 0) {
        zero = true;
      } else if (numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                             static_cast<uint64_t>(d)) {
        fail(what, " has shape ", shape_str(info.shape), " whose element count overflows");
      } else {
        numel *= static_cast<uint64_t>(d);
      }
    }
    if (zero) numel = 0;
    if (info.data_begin > info.data_end) {
      fail(what, " has data_offsets [", info.data_begin, ", ", info.data_end,
           "] with begin after end");
    }
    if (info.data_end > buffer) {
      fail(what, " has data_offsets [", info.data_begin, ", ", info.data_end,
           "] beyond the data buffer of ", buffer, " bytes");
    }
    const uint64_t elem = element_size(info.dtype);
    if (numel > buffer / elem || info.data_end - info.data_begin != numel * elem) {
      fail(what, " of dtype ", safetensors_dtype_name(info.dtype), " and shape ",
           shape_str(info.shape), " needs ", numel, " x ", elem, " bytes but data_offsets [",
           info.data_begin, ", ", info.data_end, "] hold ", info.data_end - info.data_begin);
    }
    order.emplace_back(&key, &info);
  }
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return std::pair(a.second->data_begin, a.second->data_end) <
           std::pair(b.second->data_begin, b.second->data_end);
  });
  uint64_t covered = 0;
  const std::string* previous = nullptr;
  for (const auto& [key, info] : order) {
    if (info->data_begin < covered) {
      fail("tensor ", quote_name(*key), " (bytes ", info->data_begin, " to ", info->data_end,
           ") overlaps tensor ", quote_name(*previous));
    }
    if (info->data_begin > covered) {
      fail("hole of ", info->data_begin - covered, " bytes in the data buffer before tensor ",
           quote_name(*key), " (tensors must be stored back to back)");
    }
    covered = info->data_end;
    previous = key;
  }
  if (covered != buffer) {
    fail("the last ", buffer - covered, " bytes of the data buffer belong to no tensor");
  }
}

SafetensorsFile::SafetensorsFile(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->name = path;
  // O_NONBLOCK: opening a FIFO for reading would wait for a writer; it has no effect on the
  // reads of a regular file, the only kind accepted below.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) impl->fail("cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    impl->fail("cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    impl->fail(S_ISDIR(st.st_mode)    ? "is a directory, not a regular file"
               : S_ISFIFO(st.st_mode) ? "is a FIFO, not a regular file"
                                      : "not a regular file");
  }
  impl->size = static_cast<uint64_t>(st.st_size);
  impl->fd = fd;  // closed by ~Impl from here on
  // The header is read with pread, not through the mapping (see read_at).
  char first[8];
  if (impl->size >= 8) impl->read_at(0, first, 8, "the header length");
  const uint64_t n = impl->header_length({first, impl->size >= 8 ? size_t{8} : size_t{0}});
  std::string text(n, '\0');
  impl->read_at(8, text.data(), n, "the header");
  impl->parse_header(text);
  // Private and writable: in-place ops on tensors from get() copy the touched pages instead of
  // faulting, and never reach the file (PyTorch maps safetensors the same way). The file holds
  // at least the 8-byte length here, and mmap refuses only empty files.
  void* p = ::mmap(nullptr, impl->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) impl->fail("cannot map: ", std::strerror(errno));
  impl->bytes = static_cast<char*>(p);
  impl->mapped = true;
  impl_ = std::move(impl);
}

SafetensorsFile SafetensorsFile::from_bytes(std::string_view bytes, std::string name) {
  auto impl = std::make_shared<Impl>();
  impl->name = std::move(name);
  // 64-byte aligned like kiln's CPU allocator, so aligned data can be aliased.
  const size_t rounded = (bytes.size() / 64 + 1) * 64;
  impl->owned.reset(static_cast<char*>(std::aligned_alloc(64, rounded)));
  KILN_CHECK(impl->owned, "[load_safetensors] ", impl->name, ": out of memory copying ",
             bytes.size(), " bytes");
  if (!bytes.empty()) std::memcpy(impl->owned.get(), bytes.data(), bytes.size());
  impl->bytes = impl->owned.get();
  impl->size = bytes.size();
  const uint64_t n = impl->header_length(bytes.substr(0, 8));
  impl->parse_header(bytes.substr(8, n));
  return SafetensorsFile(std::move(impl));
}

const std::string& SafetensorsFile::name() const { return impl_->name; }
const std::vector<std::string>& SafetensorsFile::keys() const { return impl_->keys; }
bool SafetensorsFile::contains(const std::string& key) const {
  return impl_->tensors.contains(key);
}
const SafetensorsMetadata& SafetensorsFile::metadata() const { return impl_->metadata; }
std::string_view SafetensorsFile::bytes() const { return {impl_->bytes, impl_->size}; }

const SafetensorsTensorInfo& SafetensorsFile::info(const std::string& key) const {
  const auto it = impl_->tensors.find(key);
  if (it != impl_->tensors.end()) return it->second;
  std::vector<std::pair<size_t, const std::string*>> near;
  for (const std::string& k : impl_->keys) near.emplace_back(internal::edit_distance(key, k), &k);
  const size_t shown = std::min<size_t>(near.size(), 5);
  std::partial_sort(near.begin(), near.begin() + shown, near.end());
  std::string list;
  for (size_t i = 0; i < shown; ++i) list += (i ? ", " : "") + quote_name(*near[i].second);
  impl_->fail("no tensor named ", quote_name(key), " among its ", near.size(), " tensors",
              near.empty() ? "" : "; nearest: ", list);
}

Tensor SafetensorsFile::get(const std::string& key, Device device) const {
  const SafetensorsTensorInfo& info = this->info(key);
  const uint64_t offset = impl_->data_start + info.data_begin;
  char* data = impl_->bytes + offset;
  const uint64_t nbytes = info.data_end - info.data_begin;
  if (nbytes == 0 || reinterpret_cast<uintptr_t>(data) % element_size(info.dtype) != 0) {
    return read(key, device);
  }
  // Touching a page the file no longer holds raises SIGBUS: check first. A truncation after
  // this check cannot be caught (the header's pitfall).
  impl_->check_still_holds(offset, nbytes, "tensor " + quote_name(key));
  if (info.dtype == kBool) impl_->check_bools(key, data, nbytes);
  // The deleter owns a reference to the mapping: it lives as long as any tensor uses it.
  const Tensor t = from_blob(
      data, info.shape, [keep = impl_](void*) {}, dtype(info.dtype));
  return device.is_cpu() ? t : t.to(device);
}

Tensor SafetensorsFile::read(const std::string& key, Device device) const {
  const SafetensorsTensorInfo& info = this->info(key);
  const uint64_t nbytes = info.data_end - info.data_begin;
  Tensor t = empty(info.shape, dtype(info.dtype));
  impl_->read_at(impl_->data_start + info.data_begin, t.data_ptr(), nbytes,
                 "tensor " + quote_name(key));
  if (info.dtype == kBool) impl_->check_bools(key, static_cast<const char*>(t.data_ptr()), nbytes);
  return device.is_cpu() ? t : t.to(device);
}

TensorMap SafetensorsFile::get_all(Device device) const {
  TensorMap out;
  for (const std::string& key : impl_->keys) out.emplace(key, get(key, device));
  return out;
}

TensorMap SafetensorsFile::read_all(Device device) const {
  TensorMap out;
  for (const std::string& key : impl_->keys) out.emplace(key, read(key, device));
  return out;
}

TensorMap load_safetensors(const std::string& path, SafetensorsMetadata* metadata, Device device) {
  const SafetensorsFile f(path);
  if (metadata) *metadata = f.metadata();
  return f.read_all(device);
}

TensorMap load_safetensors_from_bytes(std::string_view bytes, SafetensorsMetadata* metadata,
                                      Device device) {
  const SafetensorsFile f = SafetensorsFile::from_bytes(bytes);
  if (metadata) *metadata = f.metadata();
  return f.get_all(device);
}

// --- Writing ------------------------------------------------------------------------------

namespace {

struct Planned {
  const std::string* name;
  const Tensor* tensor;
  uint64_t begin, end;
};

// The reference writer orders tensors by its Dtype enum, descending, then by name: larger
// elements first, so every tensor stays aligned to its element size once the header is padded
// to 8. Following it exactly makes kiln's files byte-identical to the library's.
int writer_rank(ScalarType t) {
  switch (t) {
    case kInt64:
      return 7;
    case kDouble:
      return 6;
    case kFloat:
      return 5;
    case kInt32:
      return 4;
    case kBFloat16:
      return 3;
    case kHalf:
      return 2;
    case kUInt8:
      return 1;
    case kBool:
      return 0;
  }
  return 0;
}

std::vector<Planned> plan_layout(const TensorMap& tensors, const SafetensorsMetadata& metadata,
                                 const std::string& where) {
  for (const auto& [k, v] : metadata) {
    KILN_CHECK(is_valid_utf8(k) && is_valid_utf8(v), "[save_safetensors] ", where,
               "metadata entry ", quote_name(k), " is not valid UTF-8");
  }
  std::vector<Planned> plan;
  for (const auto& [name, t] : tensors) {
    KILN_CHECK(name != "__metadata__", "[save_safetensors] ", where,
               "\"__metadata__\" is reserved and cannot name a tensor");
    KILN_CHECK(is_valid_utf8(name), "[save_safetensors] ", where, "tensor name ", quote_name(name),
               " is not valid UTF-8");
    KILN_CHECK(t.defined(), "[save_safetensors] ", where, "tensor ", quote_name(name),
               " is undefined");
    KILN_CHECK(!t.is_meta(), "[save_safetensors] ", where, "tensor ", quote_name(name),
               " is on the meta device and has no data");
    plan.push_back({&name, &t, 0, 0});
  }
  std::stable_sort(plan.begin(), plan.end(), [](const Planned& a, const Planned& b) {
    return writer_rank(a.tensor->dtype()) > writer_rank(b.tensor->dtype());
  });
  uint64_t offset = 0;
  for (Planned& p : plan) {
    p.begin = offset;
    offset += p.tensor->nbytes();
    p.end = offset;
  }
  return plan;
}

// The 8-byte length and the JSON header, padded with spaces so the data starts 8-aligned.
std::string build_header(const std::vector<Planned>& plan, const SafetensorsMetadata& metadata) {
  std::string json = "{";
  if (!metadata.empty()) {
    json += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) json.push_back(',');
      first = false;
      append_json_string(json, k);
      json.push_back(':');
      append_json_string(json, v);
    }
    json.push_back('}');
  }
  for (const Planned& p : plan) {
    if (json.size() > 1) json.push_back(',');
    append_json_string(json, *p.name);
    json += ":{\"dtype\":\"";
    json += safetensors_dtype_name(p.tensor->dtype());
    json += "\",\"shape\":[";
    for (int64_t d = 0; d < p.tensor->dim(); ++d) {
      if (d) json.push_back(',');
      json += std::to_string(p.tensor->size(d));
    }
    json += "],\"data_offsets\":[" + std::to_string(p.begin) + "," + std::to_string(p.end) + "]}";
  }
  json.push_back('}');
  json.resize((json.size() + 7) / 8 * 8, ' ');
  const uint64_t n = json.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

// Streams the header and each tensor's bytes (row-major, on the CPU) into `sink`, converting
// one tensor at a time so that a model on the GPU is never copied whole to host memory.
template <typename Sink>
void write_safetensors(const std::vector<Planned>& plan, const SafetensorsMetadata& metadata,
                       Sink&& sink) {
  const std::string header = build_header(plan, metadata);
  sink(header.data(), header.size());
  for (const Planned& p : plan) {
    if (p.end == p.begin) continue;
    const Tensor c = p.tensor->contiguous().cpu();
    sink(c.data_ptr(), p.end - p.begin);
  }
}

// A temporary file beside the target, removed unless commit() renamed it into place.
class AtomicFile {
 public:
  explicit AtomicFile(const std::string& path, std::string op = "save_safetensors")
      : path_(path), op_(std::move(op)) {
    std::random_device rd;
    const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
    char suffix[40];
    std::snprintf(suffix, sizeof(suffix), ".tmp.%d.%016llx", static_cast<int>(::getpid()),
                  static_cast<unsigned long long>(r));
    tmp_ = path + suffix;
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create temporary file " + tmp_);
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0) fail("cannot write");
      p += w;
      n -= static_cast<size_t>(w);
    }
  }

  void commit() {
    if (::fsync(fd_) != 0) fail("cannot fsync");
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close");
    if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename " + tmp_ + " over it");
    committed_ = true;
    // Make the rename itself durable. Some file systems cannot fsync a directory (EINVAL).
    std::string dir = std::filesystem::path(path_).parent_path().string();
    if (dir.empty()) dir = ".";
    const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) fail("cannot open directory " + dir + " to fsync it");
    const bool ok = ::fsync(dfd) == 0 || errno == EINVAL;
    const int err = errno;
    ::close(dfd);
    errno = err;
    if (!ok) fail("cannot fsync directory " + dir);
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    const int err = errno;
    KILN_FAIL("[", op_, "] ", path_, ": ", what, ": ", std::strerror(err));
  }

  std::string path_;
  std::string op_;
  std::string tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

}  // namespace

void save_safetensors(const TensorMap& tensors, const std::string& path,
                      const SafetensorsMetadata& metadata) {
  const std::vector<Planned> plan = plan_layout(tensors, metadata, path + ": ");
  AtomicFile file(path);
  write_safetensors(plan, metadata, [&](const void* p, size_t n) { file.write(p, n); });
  file.commit();
}

std::string read_file(const std::string& path, const std::string& op) {
  std::ifstream in(path, std::ios::binary);
  KILN_CHECK(in.good(), "[", op, "] ", path, ": cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  KILN_CHECK(!in.bad(), "[", op, "] ", path, ": cannot read the file");
  return ss.str();
}

void write_file_atomically(const std::string& path, std::string_view bytes, const std::string& op) {
  AtomicFile file(path, op);
  file.write(bytes.data(), bytes.size());
  file.commit();
}

std::string save_safetensors_to_bytes(const TensorMap& tensors,
                                      const SafetensorsMetadata& metadata) {
  const std::vector<Planned> plan = plan_layout(tensors, metadata, "");
  std::string out;
  write_safetensors(plan, metadata,
                    [&](const void* p, size_t n) { out.append(static_cast<const char*>(p), n); });
  return out;
}

}  // namespace kiln
