// Token shards (pretrain/shard.h): round trip in both dtypes, the header bytes as documented,
// the checksum's streaming, atomic writing, and a clear error for every kind of damage.
#include "pretrain/shard.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "pretrain_test_util.h"
#include "test_util.h"

namespace kiln::pretrain {
namespace {

namespace fs = std::filesystem;

class ShardTest : public test::TempDirTest {};

TEST_F(ShardTest, RoundTripU16WithEosBetweenDocuments) {
  const std::string path = file("a.tokens");
  ShardWriter w(path, {.vocab_size = 1000, .eos_id = 7, .tokenizer_fingerprint = 42});
  w.append_document(std::vector<int64_t>{1, 2, 3});
  w.append_document(std::vector<int64_t>{999});
  w.append_document(std::vector<int64_t>{});
  const ShardMeta written = w.finish();
  EXPECT_EQ(written.num_tokens, 7);
  EXPECT_EQ(written.num_documents, 3);
  EXPECT_EQ(written.token_bytes, 2);
  EXPECT_EQ(fs::file_size(path), kShardHeaderBytes + 7 * 2);

  const ShardFile f = ShardFile::open(path);
  EXPECT_EQ(f.meta().num_tokens, 7);
  EXPECT_EQ(f.meta().num_documents, 3);
  EXPECT_EQ(f.meta().vocab_size, 1000);
  EXPECT_EQ(f.meta().eos_id, 7);
  EXPECT_EQ(f.meta().tokenizer_fingerprint, 42u);
  EXPECT_EQ(f.meta().checksum, written.checksum);
  std::vector<int64_t> got(7);
  f.read(0, 7, got.data());
  EXPECT_EQ(got, (std::vector<int64_t>{1, 2, 3, 7, 999, 7, 7}));
  EXPECT_EQ(f.token(4), 999);
}

TEST_F(ShardTest, LargeVocabulariesUseU32AndTheHeaderIsAsDocumented) {
  const std::string path = file("b.tokens");
  ShardWriter w(path, {.vocab_size = 128256, .eos_id = -1, .tokenizer_fingerprint = 5});
  w.append_document(std::vector<int64_t>{128255, 0, 70000});
  w.finish();
  const std::string bytes = test::read_bytes(path);
  ASSERT_EQ(bytes.size(), kShardHeaderBytes + 3 * 4);
  auto u32 = [&](size_t at) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + at, 4);
    return v;
  };
  auto u64 = [&](size_t at) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + at, 8);
    return v;
  };
  EXPECT_EQ(bytes.substr(0, 8), "KILNTOKS");
  EXPECT_EQ(u32(8), 1u);                         // version
  EXPECT_EQ(u32(12), 4u);                        // token bytes
  EXPECT_EQ(u64(16), 3u);                        // tokens
  EXPECT_EQ(u64(24), 1u);                        // documents
  EXPECT_EQ(u64(32), 128256u);                   // vocab
  EXPECT_EQ(static_cast<int64_t>(u64(40)), -1);  // no eos
  EXPECT_EQ(u64(48), 5u);
  EXPECT_EQ(u64(56),
            shard_header_checksum(bytes.substr(0, 56), shard_checksum(bytes.data() + 64, 12)));
  EXPECT_EQ(u32(64), 128255u);
  EXPECT_EQ(u32(72), 70000u);
  const ShardFile f = ShardFile::open(path);
  EXPECT_EQ(f.token(0), 128255);
  EXPECT_EQ(f.token(2), 70000);
}

TEST_F(ShardTest, ChecksumStreamsInAnyPieces) {
  std::string data;
  for (int i = 0; i < 1000; ++i) data.push_back(static_cast<char>(i * 37 + 11));
  const uint64_t whole = shard_checksum(data.data(), data.size());
  for (size_t piece : {1, 3, 7, 8, 13, 64}) {
    ShardChecksum c;
    for (size_t at = 0; at < data.size(); at += piece) {
      c.update(data.data() + at, std::min(piece, data.size() - at));
    }
    EXPECT_EQ(c.value(), whole) << "pieces of " << piece;
  }
  // One flipped bit, a dropped trailing zero byte, a swap of two words: all change it.
  std::string flipped = data;
  flipped[500] ^= 4;
  EXPECT_NE(shard_checksum(flipped.data(), flipped.size()), whole);
  const std::string z(16, '\0');
  EXPECT_NE(shard_checksum(z.data(), 16), shard_checksum(z.data(), 15));
  std::string swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + 8, swapped.begin() + 8);
  EXPECT_NE(shard_checksum(swapped.data(), swapped.size()), whole);
}

TEST_F(ShardTest, AnUnfinishedWriterLeavesNothing) {
  const std::string path = file("c.tokens");
  {
    ShardWriter w(path, {.vocab_size = 256});
    w.append_document(std::vector<int64_t>{1, 2});
  }
  EXPECT_TRUE(fs::is_empty(dir()));
  ShardWriter w(path, {.vocab_size = 256});
  EXPECT_KILN_ERROR(w.append_document(std::vector<int64_t>{1, 256}),
                    "token id 256 is outside the vocabulary of 256");
  EXPECT_KILN_ERROR(ShardWriter(file("d.tokens"), {.vocab_size = 256, .eos_id = 256}),
                    "eos_id 256 is outside");
}

TEST_F(ShardTest, DamagedFilesGetErrorsNamingTheFile) {
  const std::string path = file("good.tokens");
  ShardWriter w(path, {.vocab_size = 300, .eos_id = 1});
  w.append_document(std::vector<int64_t>{5, 6, 7, 8});
  w.finish();
  const std::string good = test::read_bytes(path);
  auto variant = [&](const std::string& name, std::string bytes) {
    const std::string p = file(name);
    test::write_bytes(p, bytes);
    return p;
  };
  auto patched = [&](size_t at, const void* v, size_t n) {
    std::string b = good;
    std::memcpy(b.data() + at, v, n);
    return b;
  };

  EXPECT_KILN_ERROR(ShardFile::open(file("missing.tokens")), "missing.tokens: cannot open");
  EXPECT_KILN_ERROR(ShardFile::open(variant("short.tokens", good.substr(0, 20))),
                    "short.tokens: 20 bytes is shorter than the 64-byte header");
  EXPECT_KILN_ERROR(ShardFile::open(variant("magic.tokens", "XILNTOKS" + good.substr(8))),
                    "magic.tokens: bad magic");
  const uint32_t v2 = 2;
  EXPECT_KILN_ERROR(ShardFile::open(variant("version.tokens", patched(8, &v2, 4))),
                    "version.tokens: format version 2, this kiln reads version 1");
  const uint32_t three = 3;
  EXPECT_KILN_ERROR(ShardFile::open(variant("dtype.tokens", patched(12, &three, 4))),
                    "token size 3 bytes");
  const uint32_t four = 4;
  EXPECT_KILN_ERROR(ShardFile::open(variant("dtype4.tokens", patched(12, &four, 4))),
                    "token size 4 does not match vocab_size 300");
  EXPECT_KILN_ERROR(ShardFile::open(variant("trunc.tokens", good.substr(0, good.size() - 1))),
                    "trunc.tokens: the header announces 5 tokens (10 bytes) but the file holds 9 "
                    "bytes after the header (truncated)");
  EXPECT_KILN_ERROR(ShardFile::open(variant("long.tokens", good + "xx")), "(trailing bytes)");
  const uint64_t huge = uint64_t{1} << 62;
  EXPECT_KILN_ERROR(ShardFile::open(variant("count.tokens", patched(16, &huge, 8))),
                    "count.tokens: the header announces 4611686018427387904 tokens");
  std::string corrupt = good;
  corrupt[64] ^= 1;
  EXPECT_KILN_ERROR(ShardFile::open(variant("corrupt.tokens", corrupt)),
                    "corrupt.tokens: checksum mismatch");
  // Without verification the damage to the tokens goes unseen; the header is still checked.
  EXPECT_NO_THROW(ShardFile::open(file("corrupt.tokens"), /*verify=*/false));
  const int64_t eos = 300;
  EXPECT_KILN_ERROR(ShardFile::open(variant("eos.tokens", patched(40, &eos, 8))),
                    "eos_id 300 is outside the vocabulary of 300");
  fs::create_directories(dir() / "adir.tokens");
  EXPECT_KILN_ERROR(ShardFile::open(file("adir.tokens")), "adir.tokens: not a regular file");
}

TEST_F(ShardTest, IdsAtOrAboveTheVocabularyAreCaughtByVerification) {
  // A consistent header and checksum over an id the vocabulary does not have (a writer bug or a
  // crafted file).
  std::string bytes = test::read_bytes([&] {
    ShardWriter w(file("ok.tokens"), {.vocab_size = 300});
    w.append_document(std::vector<int64_t>{1, 2});
    w.finish();
    return file("ok.tokens");
  }());
  const uint16_t bad = 300;
  std::memcpy(bytes.data() + 64, &bad, 2);
  const uint64_t sum =
      shard_header_checksum(bytes.substr(0, 56), shard_checksum(bytes.data() + 64, 4));
  std::memcpy(bytes.data() + 56, &sum, 8);
  test::write_bytes(file("bad.tokens"), bytes);
  EXPECT_KILN_ERROR(ShardFile::open(file("bad.tokens")),
                    "bad.tokens: token id 300 is outside the vocabulary of 300");
}

TEST_F(ShardTest, TheTokenSizeFollowsTheVocabulary) {
  EXPECT_EQ(token_bytes_for_vocab(256), 2);
  EXPECT_EQ(token_bytes_for_vocab(65536), 2);  // ids up to 65535
  EXPECT_EQ(token_bytes_for_vocab(65537), 4);
  ShardWriter w(file("edge.tokens"), {.vocab_size = 65536});
  w.append_document(std::vector<int64_t>{65535, 0});
  EXPECT_EQ(w.finish().token_bytes, 2);
  EXPECT_EQ(ShardFile::open(file("edge.tokens")).token(0), 65535);
}

// Damage anywhere in a shard, a byte at a time (header fields included) or a truncation
// anywhere: the verifying reader throws kiln::Error naming the file; it never crashes, reads past
// the end or loads a damaged file.
TEST_F(ShardTest, RandomDamageIsAlwaysCaught) {
  ShardWriter w(file("base.tokens"), {.vocab_size = 70000, .eos_id = 3});
  for (int d = 0; d < 5; ++d) w.append_document(std::vector<int64_t>{d, 69999, 1000 + d});
  w.finish();
  const std::string good = test::read_bytes(file("base.tokens"));
  uint64_t x = 12345;
  auto next = [&] { return x ^= x << 13, x ^= x >> 7, x ^= x << 17; };
  int caught = 0;
  for (int trial = 0; trial < 400; ++trial) {
    std::string bad = good;
    if (trial % 4 == 0) {
      bad.resize(next() % good.size());
    } else {
      const size_t at = next() % good.size();
      bad[at] = static_cast<char>(bad[at] ^ (1 + next() % 255));
    }
    test::write_bytes(file("bad.tokens"), bad);
    try {
      ShardFile::open(file("bad.tokens"));
      ADD_FAILURE() << "trial " << trial << ": a damaged shard loaded";
    } catch (const Error& e) {
      ++caught;
      EXPECT_NE(std::string(e.what()).find("bad.tokens"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(caught, 400);
}

// A shard truncated in place after it was opened (a copy over it, `> file`): reading a window
// beyond the new end is an error naming the file. The reader used to map the file, and touching
// a page past the end killed the process with SIGBUS.
TEST_F(ShardTest, TruncatedAfterOpeningIsAnErrorNotACrash) {
  const std::string path = file("shrinks.tokens");
  ShardWriter w(path, {.vocab_size = 1000});
  std::vector<int64_t> ids(100'000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i % 1000);
  w.append_document(ids);
  w.finish();
  const ShardFile f = ShardFile::open(path);
  std::vector<int64_t> got(2049);
  f.read(50'000, 2049, got.data());
  EXPECT_EQ(got[0], 0);  // 50'000 % 1000
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  EXPECT_KILN_ERROR(f.read(50'000, 2049, got.data()), "[shard] " + path + ": ");
  EXPECT_KILN_ERROR(f.read(50'000, 2049, got.data()), "truncated to 4096 bytes");
  EXPECT_KILN_ERROR(f.token(99'999), "[shard] " + path + ": ");
  // What is still there reads as before.
  f.read(10, 3, got.data());
  EXPECT_EQ(got[2], 12);
}

}  // namespace
}  // namespace kiln::pretrain
