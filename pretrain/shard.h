// kiln::pretrain token shards: the binary files `kiln prepare` writes and the pretraining loader
// (pretrain/loader.h) reads. docs/data.md describes the format byte by byte.
//
//   ShardWriter w("out/shard-00000.tokens", {.vocab_size = 32000, .eos_id = 2, ...});
//   w.append_document(ids);          // the ids, then eos_id (when the tokenizer has one)
//   w.finish();                      // header, fsync, rename: the file appears whole or not at all
//
//   ShardFile f = ShardFile::open("out/shard-00000.tokens");   // validated, kept open
//   f.num_tokens(); f.token(i);       // u16 or u32 ids, widened
//
// Layout (little-endian): a 64-byte header, then num_tokens ids of token_bytes bytes each.
//   0  magic "KILNTOKS"        8  version (u32, 1)        12 token_bytes (u32: 2 or 4)
//   16 num_tokens (u64)       24 num_documents (u64)     32 vocab_size (u64)
//   40 eos_id (i64, -1: none) 48 tokenizer fingerprint (u64)
//   56 checksum (u64, shard_header_checksum: of header bytes 0-55 and the tokens' checksum)
// token_bytes is 2 when every id fits in 16 bits (vocab_size <= 65536), else 4.
//
// Pitfalls:
// - ShardFile::open checks the magic, version, dtype, sizes (the file must hold exactly the
//   tokens the header announces) and, with verify, the checksum and that every id is below
//   vocab_size; errors are kiln::Error "[shard] <path>: ...".
// - A ShardFile keeps its file open and reads windows with pread (one system call per window,
//   from the page cache): a shard truncated in place while open is an error naming it, where a
//   mapping would kill the process with SIGBUS. Each open shard holds a file descriptor.
// - The tokenizer fingerprint identifies the tokenizer that wrote the shard
//   (tokenizer_fingerprint of its tokenizer.json bytes), so that shards of two tokenizers are
//   never mixed and a run can check its tokenizer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace kiln::pretrain {

inline constexpr char kShardMagic[8] = {'K', 'I', 'L', 'N', 'T', 'O', 'K', 'S'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;
inline constexpr const char* kShardExtension = ".tokens";

// What the header says besides the magic and version.
struct ShardMeta {
  int64_t vocab_size = 0;
  int64_t eos_id = -1;  // -1: documents are joined without a separator
  uint64_t tokenizer_fingerprint = 0;
  int64_t num_tokens = 0;
  int64_t num_documents = 0;
  uint64_t checksum = 0;
  int token_bytes = 2;
};

// 2 when ids below vocab_size fit in 16 bits, else 4.
int token_bytes_for_vocab(int64_t vocab_size);

// The checksum of the token bytes (docs/data.md gives the exact definition): 64 bits, a
// multiply-rotate hash of the bytes read as little-endian u64 words, the last one zero-padded,
// seeded with the byte count. Streams: update() any number of times, then value().
class ShardChecksum {
 public:
  void update(const void* data, size_t n);
  uint64_t value() const;

 private:
  uint64_t h_ = 0;
  uint64_t bytes_ = 0;
  unsigned char carry_[8] = {};
  size_t carry_n_ = 0;
};
uint64_t shard_checksum(const void* data, size_t n);
// The header's checksum field: shard_checksum of the header's bytes 0-55 followed by the
// 8 little-endian bytes of token_checksum (shard_checksum of the token bytes), so that a damaged
// header field (a count, eos_id, the fingerprint) is caught as surely as a damaged token.
uint64_t shard_header_checksum(std::string_view header, uint64_t token_checksum);

// A 64-bit hash of a tokenizer.json's bytes (the same hash as shard_checksum); the byte
// tokenizer's is kByteTokenizerFingerprint.
uint64_t tokenizer_fingerprint(std::string_view tokenizer_json);
inline constexpr uint64_t kByteTokenizerFingerprint = 0x6b696c6e2d627974ull;  // "kiln-byt"

// Writes one shard atomically: the tokens go to a temporary file beside `path`, finish() writes
// the header, fsyncs and renames it into place. Destroyed without finish(), nothing is left.
class ShardWriter {
 public:
  // meta.vocab_size, eos_id and tokenizer_fingerprint are used; the counts are filled in.
  ShardWriter(std::string path, const ShardMeta& meta);
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  ~ShardWriter();

  // The ids of one document, then eos_id when there is one. Errors on an id outside
  // [0, vocab_size).
  void append_document(std::span<const int64_t> ids);
  int64_t num_tokens() const { return meta_.num_tokens; }
  // Returns the header as written.
  ShardMeta finish();

 private:
  void write_tokens(std::span<const int64_t> ids);
  void flush();
  [[noreturn]] void fail(const std::string& what) const;

  std::string path_, tmp_;
  ShardMeta meta_;
  int fd_ = -1;
  bool done_ = false;
  ShardChecksum checksum_;
  std::string buffer_;
};

// A validated shard, open for reading (read-only; copies share the open file).
class ShardFile {
 public:
  // verify: also recompute the checksum and check every id against vocab_size (reads the whole
  // file once).
  static ShardFile open(const std::string& path, bool verify = true);

  const std::string& path() const { return path_; }
  const ShardMeta& meta() const { return meta_; }
  int64_t num_tokens() const { return meta_.num_tokens; }
  int64_t token(int64_t i) const;
  // tokens [begin, begin + n) widened into out[0, n). Errors name the file: a range outside
  // [0, num_tokens()), a file truncated since it was opened.
  void read(int64_t begin, int64_t n, int64_t* out) const;

 private:
  std::string path_;
  ShardMeta meta_;
  std::shared_ptr<const int> fd_;  // the open file, closed with the last copy
};

// The header of `bytes` (at least kShardHeaderBytes) parsed and range-checked; `file_bytes` is
// the file's size, checked against the announced token count. `name` goes into errors.
ShardMeta parse_shard_header(std::string_view bytes, uint64_t file_bytes, const std::string& name);

}  // namespace kiln::pretrain
