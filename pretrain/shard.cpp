// Token shards: the header, the checksum, the atomic writer and the validating pread reader.
// Format: pretrain/shard.h and docs/data.md. Tests: tests/pretrain/shard_test.cpp.
#include "pretrain/shard.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <random>
#include <vector>

#include "tensor/error.h"

namespace kiln::pretrain {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token shards are little-endian; a big-endian host would need byte swaps");

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;

uint64_t load_u64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t load_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
// Bytes [offset, offset + n) of the open shard `fd` into `dst`, with pread: a shard truncated
// in place since it was opened (`opened` bytes then) is an error naming it. The reader used to
// map shards, and a read past the new end killed the process with SIGBUS.
void read_exact(int fd, const std::string& path, uint64_t opened, uint64_t offset, void* dst,
                uint64_t n) {
  auto* out = static_cast<char*>(dst);
  for (uint64_t done = 0; done < n;) {
    const ssize_t got =
        ::pread(fd, out + done, static_cast<size_t>(n - done), static_cast<off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    KILN_CHECK(got >= 0, "[shard] ", path, ": cannot read bytes ", offset, " to ", offset + n, " (",
               std::strerror(errno), ")");
    if (got == 0) {
      struct stat st {};
      const int64_t now = ::fstat(fd, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      KILN_FAIL("[shard] ", path, ": truncated to ", now, " bytes since it was opened (", opened,
                " bytes): cannot read bytes ", offset, " to ", offset + n);
    }
    done += static_cast<uint64_t>(got);
  }
}

template <typename T>
int64_t max_token(const unsigned char* p, uint64_t n) {
  T m = 0;
  for (uint64_t i = 0; i + sizeof(T) <= n; i += sizeof(T)) {
    T v;
    std::memcpy(&v, p + i, sizeof(T));
    m = std::max(m, v);
  }
  return static_cast<int64_t>(m);
}

template <typename T>
void widen(const unsigned char* p, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    out[i] = v;
  }
}

template <typename T>
void store(std::string& out, size_t offset, T v) {
  std::memcpy(out.data() + offset, &v, sizeof(T));
}

uint64_t mix_word(uint64_t h, uint64_t w) { return std::rotl((h ^ w) * kMul, 31); }

std::string serialize_header(const ShardMeta& m) {
  std::string h(kShardHeaderBytes, '\0');
  std::memcpy(h.data(), kShardMagic, 8);
  store<uint32_t>(h, 8, kShardVersion);
  store<uint32_t>(h, 12, static_cast<uint32_t>(m.token_bytes));
  store<uint64_t>(h, 16, static_cast<uint64_t>(m.num_tokens));
  store<uint64_t>(h, 24, static_cast<uint64_t>(m.num_documents));
  store<uint64_t>(h, 32, static_cast<uint64_t>(m.vocab_size));
  store<int64_t>(h, 40, m.eos_id);
  store<uint64_t>(h, 48, m.tokenizer_fingerprint);
  store<uint64_t>(h, 56, m.checksum);
  return h;
}

}  // namespace

int token_bytes_for_vocab(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

void ShardChecksum::update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  bytes_ += n;
  if (carry_n_ > 0) {
    const size_t take = std::min(n, 8 - carry_n_);
    std::memcpy(carry_ + carry_n_, p, take);
    carry_n_ += take;
    p += take;
    n -= take;
    if (carry_n_ < 8) return;
    h_ = mix_word(h_, load_u64(carry_));
    carry_n_ = 0;
  }
  uint64_t h = h_;
  for (; n >= 8; p += 8, n -= 8) h = mix_word(h, load_u64(p));
  h_ = h;
  std::memcpy(carry_, p, n);
  carry_n_ = n;
}

uint64_t ShardChecksum::value() const {
  uint64_t h = h_;
  if (carry_n_ > 0) {
    unsigned char last[8] = {};
    std::memcpy(last, carry_, carry_n_);
    h = mix_word(h, load_u64(last));
  }
  // The byte count, then a final avalanche (murmur3's fmix64).
  h ^= bytes_;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  return h;
}

uint64_t shard_checksum(const void* data, size_t n) {
  ShardChecksum c;
  c.update(data, n);
  return c.value();
}

uint64_t shard_header_checksum(std::string_view header, uint64_t token_checksum) {
  KILN_CHECK(header.size() >= 56, "[shard] shard_header_checksum needs the 56 header bytes");
  ShardChecksum c;
  c.update(header.data(), 56);
  c.update(&token_checksum, 8);
  return c.value();
}

uint64_t tokenizer_fingerprint(std::string_view tokenizer_json) {
  return shard_checksum(tokenizer_json.data(), tokenizer_json.size());
}

// --- writer -----------------------------------------------------------------------------------

ShardWriter::ShardWriter(std::string path, const ShardMeta& meta)
    : path_(std::move(path)), meta_(meta) {
  KILN_CHECK(meta.vocab_size > 0 && meta.vocab_size <= (int64_t{1} << 32), "[shard] ", path_,
             ": vocab_size must be in [1, 2^32], got ", meta.vocab_size);
  KILN_CHECK(meta.eos_id >= -1 && meta.eos_id < meta.vocab_size, "[shard] ", path_, ": eos_id ",
             meta.eos_id, " is outside the vocabulary of ", meta.vocab_size);
  meta_.token_bytes = token_bytes_for_vocab(meta.vocab_size);
  meta_.num_tokens = 0;
  meta_.num_documents = 0;
  std::random_device rd;
  char suffix[48];
  std::snprintf(suffix, sizeof(suffix), ".tmp.%d.%08x", static_cast<int>(::getpid()), rd());
  tmp_ = path_ + suffix;
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create the temporary file " + tmp_);
  // The header is written last, at offset 0; reserve its bytes.
  buffer_.assign(kShardHeaderBytes, '\0');
}

ShardWriter::~ShardWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!done_) ::unlink(tmp_.c_str());
}

void ShardWriter::fail(const std::string& what) const {
  const int err = errno;
  KILN_FAIL("[shard] ", path_, ": ", what, err != 0 ? std::string(": ") + std::strerror(err) : "");
}

void ShardWriter::flush() {
  const char* p = buffer_.data();
  size_t n = buffer_.size();
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("cannot write");
    p += w;
    n -= static_cast<size_t>(w);
  }
  buffer_.clear();
}

void ShardWriter::write_tokens(std::span<const int64_t> ids) {
  const size_t at = buffer_.size();
  buffer_.resize(at + ids.size() * static_cast<size_t>(meta_.token_bytes));
  unsigned char* out = reinterpret_cast<unsigned char*>(buffer_.data()) + at;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i];
    if (id < 0 || id >= meta_.vocab_size) {
      buffer_.resize(at);
      errno = 0;
      fail("token id " + std::to_string(id) + " is outside the vocabulary of " +
           std::to_string(meta_.vocab_size));
    }
    if (meta_.token_bytes == 2) {
      const auto v = static_cast<uint16_t>(id);
      std::memcpy(out + 2 * i, &v, 2);
    } else {
      const auto v = static_cast<uint32_t>(id);
      std::memcpy(out + 4 * i, &v, 4);
    }
  }
  checksum_.update(out, ids.size() * static_cast<size_t>(meta_.token_bytes));
  meta_.num_tokens += static_cast<int64_t>(ids.size());
  if (buffer_.size() >= (size_t{1} << 22)) flush();
}

void ShardWriter::append_document(std::span<const int64_t> ids) {
  KILN_CHECK(!done_, "[shard] ", path_, ": append_document after finish()");
  write_tokens(ids);
  if (meta_.eos_id >= 0) {
    const int64_t eos = meta_.eos_id;
    write_tokens({&eos, 1});
  }
  ++meta_.num_documents;
}

ShardMeta ShardWriter::finish() {
  KILN_CHECK(!done_, "[shard] ", path_, ": finish() called twice");
  flush();
  meta_.checksum = 0;
  meta_.checksum = shard_header_checksum(serialize_header(meta_), checksum_.value());
  const std::string header = serialize_header(meta_);
  errno = 0;
  if (::pwrite(fd_, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size())) {
    fail("cannot write the header");
  }
  if (::fsync(fd_) != 0) fail("cannot fsync");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot close");
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail("cannot rename " + tmp_ + " over it");
  done_ = true;
  std::string dir = std::filesystem::path(path_).parent_path().string();
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // some file systems cannot fsync a directory; the rename is done either way
    ::close(dfd);
  }
  return meta_;
}

// --- reader -----------------------------------------------------------------------------------

ShardMeta parse_shard_header(std::string_view bytes, uint64_t file_bytes, const std::string& name) {
  KILN_CHECK(bytes.size() >= kShardHeaderBytes && file_bytes >= kShardHeaderBytes, "[shard] ", name,
             ": ", file_bytes, " bytes is shorter than the ", kShardHeaderBytes,
             "-byte header (truncated, or not a token shard)");
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  KILN_CHECK(std::memcmp(p, kShardMagic, 8) == 0, "[shard] ", name,
             ": bad magic (not a kiln token shard; `kiln prepare` writes them)");
  const uint32_t version = load_u32(p + 8);
  KILN_CHECK(version == kShardVersion, "[shard] ", name, ": format version ", version,
             ", this kiln reads version ", kShardVersion);
  ShardMeta m;
  const uint32_t token_bytes = load_u32(p + 12);
  KILN_CHECK(token_bytes == 2 || token_bytes == 4, "[shard] ", name, ": token size ", token_bytes,
             " bytes, expected 2 (u16) or 4 (u32)");
  m.token_bytes = static_cast<int>(token_bytes);
  const uint64_t num_tokens = load_u64(p + 16);
  const uint64_t num_documents = load_u64(p + 24);
  const uint64_t vocab_size = load_u64(p + 32);
  int64_t eos;
  std::memcpy(&eos, p + 40, 8);
  m.tokenizer_fingerprint = load_u64(p + 48);
  m.checksum = load_u64(p + 56);
  KILN_CHECK(vocab_size >= 1 && vocab_size <= (uint64_t{1} << 32), "[shard] ", name,
             ": vocab_size ", vocab_size, " is outside [1, 2^32]");
  KILN_CHECK(
      static_cast<int>(token_bytes) == token_bytes_for_vocab(static_cast<int64_t>(vocab_size)),
      "[shard] ", name, ": token size ", token_bytes, " does not match vocab_size ", vocab_size);
  KILN_CHECK(eos >= -1 && eos < static_cast<int64_t>(vocab_size), "[shard] ", name, ": eos_id ",
             eos, " is outside the vocabulary of ", vocab_size);
  const uint64_t payload = file_bytes - kShardHeaderBytes;
  KILN_CHECK(num_tokens <= payload / token_bytes && payload == num_tokens * token_bytes, "[shard] ",
             name, ": the header announces ", num_tokens, " tokens (", num_tokens * token_bytes,
             " bytes) but the file holds ", payload, " bytes after the header",
             payload < num_tokens * token_bytes ? " (truncated)" : " (trailing bytes)");
  KILN_CHECK(num_documents <= num_tokens || (eos == -1 && num_tokens == 0), "[shard] ", name, ": ",
             num_documents, " documents in ", num_tokens, " tokens");
  m.num_tokens = static_cast<int64_t>(num_tokens);
  m.num_documents = static_cast<int64_t>(num_documents);
  m.vocab_size = static_cast<int64_t>(vocab_size);
  m.eos_id = eos;
  return m;
}

ShardFile ShardFile::open(const std::string& path, bool verify) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  KILN_CHECK(
      fd >= 0, "[shard] ", path, ": cannot open (", std::strerror(errno), ")",
      errno == EMFILE ? ": every open shard holds a file descriptor; raise `ulimit -n`" : "");
  // Closed with the last copy of the ShardFile, or right away if a check below fails.
  const std::shared_ptr<const int> handle(new int(fd), [](const int* p) {
    ::close(*p);
    delete p;
  });
  struct stat st {};
  KILN_CHECK(::fstat(fd, &st) == 0 && S_ISREG(st.st_mode), "[shard] ", path,
             ": not a regular file");
  const auto size = static_cast<uint64_t>(st.st_size);
  KILN_CHECK(size >= kShardHeaderBytes, "[shard] ", path, ": ", size, " bytes is shorter than the ",
             kShardHeaderBytes, "-byte header (truncated, or not a token shard)");
  char header[kShardHeaderBytes];
  read_exact(fd, path, size, 0, header, kShardHeaderBytes);
  ShardFile f;
  f.path_ = path;
  f.fd_ = handle;
  f.meta_ = parse_shard_header({header, kShardHeaderBytes}, size, path);
  if (verify) {
    // One pass in pieces of 1 MiB (a multiple of both token sizes): the checksum and the largest
    // id.
    const uint64_t n = static_cast<uint64_t>(f.meta_.num_tokens) * f.meta_.token_bytes;
    std::vector<unsigned char> buf(std::min<uint64_t>(n, uint64_t{1} << 20));
    ShardChecksum sum;
    int64_t max_id = 0;
    for (uint64_t at = 0; at < n;) {
      const uint64_t m = std::min<uint64_t>(buf.size(), n - at);
      read_exact(fd, path, size, kShardHeaderBytes + at, buf.data(), m);
      sum.update(buf.data(), m);
      max_id = std::max(max_id, f.meta_.token_bytes == 2 ? max_token<uint16_t>(buf.data(), m)
                                                         : max_token<uint32_t>(buf.data(), m));
      at += m;
    }
    const uint64_t want = shard_header_checksum({header, kShardHeaderBytes}, sum.value());
    KILN_CHECK(want == f.meta_.checksum, "[shard] ", path, ": checksum mismatch (the header says ",
               f.meta_.checksum, ", the header and tokens hash to ", want,
               "): the file is corrupt");
    KILN_CHECK(f.meta_.num_tokens == 0 || max_id < f.meta_.vocab_size, "[shard] ", path,
               ": token id ", max_id, " is outside the vocabulary of ", f.meta_.vocab_size);
  }
  return f;
}

void ShardFile::read(int64_t begin, int64_t n, int64_t* out) const {
  KILN_CHECK(begin >= 0 && n >= 0 && begin <= meta_.num_tokens - n, "[shard] ", path_, ": tokens [",
             begin, ", ", begin + n, ") are outside [0, ", meta_.num_tokens, ")");
  const int tb = meta_.token_bytes;
  const uint64_t opened = kShardHeaderBytes + static_cast<uint64_t>(meta_.num_tokens) * tb;
  // Through a buffer on the stack, widened forwards (the compiler vectorises this loop): one
  // pread per window up to 16 K tokens.
  constexpr int64_t kBufferBytes = 32 << 10;
  unsigned char buf[kBufferBytes];
  for (int64_t done = 0; done < n;) {
    const int64_t m = std::min<int64_t>(n - done, kBufferBytes / tb);
    read_exact(*fd_, path_, opened, kShardHeaderBytes + static_cast<uint64_t>(begin + done) * tb,
               buf, static_cast<uint64_t>(m) * tb);
    if (tb == 2) {
      widen<uint16_t>(buf, m, out + done);
    } else {
      widen<uint32_t>(buf, m, out + done);
    }
    done += m;
  }
}

int64_t ShardFile::token(int64_t i) const {
  int64_t v;
  read(i, 1, &v);
  return v;
}

}  // namespace kiln::pretrain
