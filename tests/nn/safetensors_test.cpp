// safetensors: round trips of every dtype, zero-copy mapping, atomic writes, interop with
// Python's safetensors library (a committed fixture, and a script that checks kiln's output),
// and the hostile files the reader must reject without crashing.
#include "nn/safetensors.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>
#include <kiln/kiln.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() / ("kiln_safetensors_test_" + std::to_string(::getpid()) +
                                         "_" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path_)) out.push_back(e.path().filename());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  fs::path path_;
};

std::string bytes_of(const Tensor& t) {
  const Tensor c = t.contiguous().cpu();
  return std::string(static_cast<const char*>(c.data_ptr()), c.nbytes());
}

void expect_same(const Tensor& got, const Tensor& want, const std::string& name) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(got.defined());
  EXPECT_EQ(got.dtype(), want.dtype());
  EXPECT_EQ(shape_str(got.sizes()), shape_str(want.sizes()));
  EXPECT_TRUE(got.is_contiguous());
  EXPECT_EQ(bytes_of(got), bytes_of(want));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
}

// A file made by hand: the 8-byte little-endian length of `json`, `json`, then `data`.
std::string raw_file(const std::string& json, const std::string& data = "") {
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json + data;
}

std::string length_only(uint64_t n, size_t extra_bytes) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + std::string(extra_bytes, '{');
}

// Every rejection names the reader and the file and explains the problem.
#define EXPECT_LOAD_ERROR(bytes, substr)                                                     \
  do {                                                                                       \
    const std::string bytes_ = (bytes);                                                      \
    EXPECT_KILN_ERROR(load_safetensors_from_bytes(bytes_), "[load_safetensors] <memory>: "); \
    EXPECT_KILN_ERROR(load_safetensors_from_bytes(bytes_), substr);                          \
  } while (0)

TensorMap every_dtype() {
  TensorMap m;
  m["f32"] = randn({3, 5});
  m["f64"] = randn({4}, kDouble);
  m["f16"] = randn({2, 3}, kHalf);
  m["bf16"] = randn({3, 1, 2}, kBFloat16);
  m["i64"] = randint(-1000000, 1000000, {7}, kInt64);
  m["i32"] = randint(-1000, 1000, {2, 2}, kInt32);
  m["u8"] = randint(0, 256, {5}, kUInt8);  // 5 bytes: tensors after it would be misaligned
  m["bool"] = randint(0, 2, {9}, kInt32).to(kBool);
  m["scalar"] = full({}, 2.5, kFloat);
  m["scalar_bf16"] = full({}, -3.0, kBFloat16);
  m["empty"] = empty({0, 3});
  m["empty_i64"] = empty({2, 0, 4}, kInt64);
  m["transposed"] = randn({4, 3}).t();  // non-contiguous sources are written row-major
  m["sliced"] = arange(0, 20, kInt64).view({4, 5}).slice(1, 1, 4);
  m["odd_f16"] = randn({3}, kHalf);  // 6 bytes: tensors after it would be misaligned
  return m;
}

TEST(Safetensors, RoundTripsEveryDtypeThroughAFile) {
  TempDir dir;
  const TensorMap m = every_dtype();
  ASSERT_FALSE(m.at("transposed").is_contiguous());
  ASSERT_FALSE(m.at("sliced").is_contiguous());
  const std::string path = dir.file("all.safetensors");
  save_safetensors(m, path);
  SafetensorsMetadata md{{"x", "y"}};
  const TensorMap got = load_safetensors(path, &md);
  EXPECT_TRUE(md.empty());
  ASSERT_EQ(got.size(), m.size());
  for (const auto& [name, t] : m) expect_same(got.at(name), t, name);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"all.safetensors"});
}

TEST(Safetensors, RoundTripsInMemoryAndWritesAlignedPaddedData) {
  const TensorMap m = every_dtype();
  const std::string bytes = save_safetensors_to_bytes(m, {{"format", "pt"}});
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ((8 + n) % 8, 0u) << "data must start 8-aligned";
  const std::string header = bytes.substr(8, n);
  const size_t close = header.find_last_not_of(' ');
  EXPECT_EQ(header.front(), '{');
  EXPECT_EQ(header[close], '}') << "padded with spaces after the JSON";
  EXPECT_LT(n - close - 1, 8u);
  const SafetensorsFile f = SafetensorsFile::from_bytes(bytes);
  for (const auto& [name, t] : m) {
    const SafetensorsTensorInfo& info = f.info(name);
    EXPECT_EQ(info.data_begin % element_size(info.dtype), 0u) << name;
    expect_same(f.get(name), t, name);
  }
  EXPECT_EQ(save_safetensors_to_bytes(f.get_all(), f.metadata()), bytes) << "deterministic";
}

TEST(Safetensors, MetadataRoundTripsWithEscapesAndUnicode) {
  TempDir dir;
  const SafetensorsMetadata md{{"format", "pt"},
                               {"quote\"back\\slash", "line\nbreak\ttab\x01"},
                               {"ünï", "日本語 🙂"},
                               {"", ""}};
  const std::string path = dir.file("md.safetensors");
  save_safetensors({{"w\"eird\nname", ones({2})}}, path, md);
  SafetensorsMetadata got;
  const TensorMap m = load_safetensors(path, &got);
  EXPECT_EQ(got, md);
  EXPECT_EQ(m.count("w\"eird\nname"), 1u);
  EXPECT_EQ(SafetensorsFile(path).metadata(), md);
}

TEST(Safetensors, AliasesTheMappingWhenAlignedAndOutlivesTheFile) {
  TempDir dir;
  const std::string path = dir.file("alias.safetensors");
  const Tensor w = randn({16, 4});
  save_safetensors({{"w", w}, {"b", ones({3}, kHalf)}}, path);
  Tensor t;
  {
    const SafetensorsFile f(path);
    EXPECT_EQ(f.keys(), (std::vector<std::string>{"b", "w"}));
    t = f.get("w");
    const std::string_view mapped = f.bytes();
    const char* p = static_cast<const char*>(t.data_ptr());
    EXPECT_GE(p, mapped.data());
    EXPECT_LE(p + t.nbytes(), mapped.data() + mapped.size());
    EXPECT_EQ(f.get("w").data_ptr(), t.data_ptr());
  }
  // The file object is gone; the tensor's storage keeps the mapping alive.
  expect_same(t, w, "w");
  // In-place writes are private to this process: the file keeps its values.
  t.fill_(0.0);
  expect_same(load_safetensors(path).at("w"), w, "w reloaded");
}

// A file truncated in place while open (a copy over it, `> file`): the mapping's pages past the
// new end raise SIGBUS when touched, which used to kill the process. Every read that copies goes
// through pread and get() checks the size first, so the error names the file instead.
TEST(Safetensors, TruncatedWhileOpenIsAnErrorNotACrash) {
  TempDir dir;
  const std::string path = dir.file("shrinks.safetensors");
  const Tensor w = randn({256, 256});
  save_safetensors({{"w", w}, {"flags", randn({4096}) > 0}}, path);
  const SafetensorsFile f(path);
  const TensorMap loaded = load_safetensors(path);
  const Tensor copied = f.read("w");
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  const std::string where = "[load_safetensors] " + path + ": ";
  EXPECT_KILN_ERROR(f.get("w").sum().item<float>(), where);
  EXPECT_KILN_ERROR(f.read("w"), where + "truncated to 4096 bytes since it was opened");
  EXPECT_KILN_ERROR(f.read("flags"), "tensor \"flags\"");
  EXPECT_KILN_ERROR(f.get_all(), where);
  // Copies own their bytes: load_safetensors and read() do not depend on the file any more.
  expect_same(loaded.at("w"), w, "loaded");
  expect_same(copied, w, "copied");
}

TEST(Safetensors, ReadCopiesAndChecksBools) {
  TempDir dir;
  const std::string path = dir.file("copies.safetensors");
  const Tensor w = randn({16, 4});
  save_safetensors({{"w", w}, {"m", randn({5}) > 0}}, path);
  const SafetensorsFile f(path);
  const Tensor t = f.read("w");
  const std::string_view mapped = f.bytes();
  const char* p = static_cast<const char*>(t.data_ptr());
  EXPECT_TRUE(p < mapped.data() || p >= mapped.data() + mapped.size());
  expect_same(t, w, "w");
  expect_same(f.read("m"), f.get("m"), "m");
  EXPECT_KILN_ERROR(f.read("x"), "no tensor named \"x\"");
}

TEST(Safetensors, CopiesMisalignedData) {
  // A 10-byte header puts the data at byte 18: not a multiple of 4, so F32 must be copied.
  std::string data(8, '\0');
  const float v[2] = {1.5f, -4.0f};
  std::memcpy(data.data(), v, 8);
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string padded = json + std::string((json.size() / 8 + 1) * 8 + 2 - json.size(), ' ');
  const std::string bytes = raw_file(padded, data);
  ASSERT_NE((8 + padded.size()) % 4, 0u);
  const SafetensorsFile f = SafetensorsFile::from_bytes(bytes);
  const Tensor a = f.get("a");
  const std::string_view mapped = f.bytes();
  const char* p = static_cast<const char*>(a.data_ptr());
  EXPECT_TRUE(p < mapped.data() || p >= mapped.data() + mapped.size());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % alignof(float), 0u);
  EXPECT_EQ(a.to_vector<float>(), (std::vector<float>{1.5f, -4.0f}));
}

TEST(Safetensors, MissingKeyListsTheNearestNames) {
  const SafetensorsFile f = SafetensorsFile::from_bytes(save_safetensors_to_bytes(
      {{"layers.0.weight", ones({1})}, {"layers.0.bias", ones({1})}, {"emb", ones({1})}}));
  EXPECT_FALSE(f.contains("layers.0.weigth"));
  EXPECT_KILN_ERROR(f.get("layers.0.weigth"),
                    "no tensor named \"layers.0.weigth\" among its 3 tensors; nearest: "
                    "\"layers.0.weight\", \"layers.0.bias\", \"emb\"");
  EXPECT_KILN_ERROR(SafetensorsFile::from_bytes(save_safetensors_to_bytes({})).get("x"),
                    "no tensor named \"x\" among its 0 tensors");
}

TEST(Safetensors, EmptyMapIsAValidFile) {
  const std::string bytes = save_safetensors_to_bytes({});
  EXPECT_EQ(bytes.size(), 16u);  // length, "{}" and six spaces
  EXPECT_TRUE(load_safetensors_from_bytes(bytes).empty());
}

TEST(Safetensors, RejectsWhatCannotBeWritten) {
  EXPECT_KILN_ERROR(save_safetensors_to_bytes({{"__metadata__", ones({1})}}), "reserved");
  EXPECT_KILN_ERROR(save_safetensors_to_bytes({{"a", Tensor()}}), "undefined");
  EXPECT_KILN_ERROR(save_safetensors_to_bytes({{"bad\xff", ones({1})}}), "not valid UTF-8");
  EXPECT_KILN_ERROR(save_safetensors_to_bytes({{"a", empty({2}, Device(kMeta))}}), "meta");
}

// --- Atomic writes ----------------------------------------------------------------------------

TEST(SafetensorsAtomicWrite, MissingDirectoryFailsAndLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("missing/model.safetensors");
  EXPECT_KILN_ERROR(save_safetensors({{"a", ones({2})}}, path), "[save_safetensors] " + path);
  EXPECT_KILN_ERROR(save_safetensors({{"a", ones({2})}}, path), "No such file or directory");
  EXPECT_TRUE(dir.entries().empty());
}

TEST(SafetensorsAtomicWrite, OverwritesAnExistingFile) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  save_safetensors({{"a", ones({2})}, {"old", ones({1})}}, path);
  const Tensor b = randn({5});
  save_safetensors({{"a", b}}, path);
  const TensorMap m = load_safetensors(path);
  ASSERT_EQ(m.size(), 1u);
  expect_same(m.at("a"), b, "a");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

TEST(SafetensorsAtomicWrite, FailedRenameRemovesTheTemporaryFile) {
  TempDir dir;
  const std::string path = dir.file("is_a_dir");
  fs::create_directories(fs::path(path) / "child");  // rename cannot replace a directory
  EXPECT_KILN_ERROR(save_safetensors({{"a", ones({2})}}, path), "cannot rename");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"is_a_dir"});
}

TEST(SafetensorsAtomicWrite, FailureBeforeWritingKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const Tensor a = randn({3});
  save_safetensors({{"a", a}}, path);
  EXPECT_KILN_ERROR(save_safetensors({{"a", Tensor()}}, path), "[save_safetensors]");
  expect_same(load_safetensors(path).at("a"), a, "a");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
}

// --- Hostile and corrupted files --------------------------------------------------------------

TEST(SafetensorsCorrupt, RejectsBadHeaderLengths) {
  EXPECT_LOAD_ERROR("", "too small (0 bytes)");
  EXPECT_LOAD_ERROR(std::string("\x02\x00\x00", 3), "too small (3 bytes)");
  EXPECT_LOAD_ERROR(length_only(0, 0), "header length 0 is too small");
  EXPECT_LOAD_ERROR(length_only(1, 4), "header length 1 is too small");
  EXPECT_LOAD_ERROR(length_only(1000, 12), "header length 1000 runs past the end of the file");
  EXPECT_LOAD_ERROR(length_only(~uint64_t{0}, 2), "exceeds the limit");
  EXPECT_LOAD_ERROR(length_only(200'000'000, 2), "exceeds the limit");
}

TEST(SafetensorsCorrupt, RejectsTruncatedFiles) {
  const std::string good = save_safetensors_to_bytes({{"a", randn({4})}, {"b", randn({2})}});
  ASSERT_NO_THROW(load_safetensors_from_bytes(good));
  EXPECT_LOAD_ERROR(good.substr(0, good.size() - 1), "beyond the data buffer");
  EXPECT_LOAD_ERROR(good.substr(0, 40), "runs past the end of the file");
  EXPECT_LOAD_ERROR(good.substr(0, 7), "too small");
  // On disk as well, through the mapping.
  TempDir dir;
  write_file(dir.file("t.safetensors"), good.substr(0, good.size() - 5));
  EXPECT_KILN_ERROR(load_safetensors(dir.file("t.safetensors")),
                    "[load_safetensors] " + dir.file("t.safetensors") + ": tensor");
  write_file(dir.file("empty"), "");
  EXPECT_KILN_ERROR(load_safetensors(dir.file("empty")), "too small (0 bytes)");
  EXPECT_KILN_ERROR(load_safetensors(dir.file("nope")), "cannot open: No such file");
  EXPECT_KILN_ERROR(load_safetensors(dir.path().string()), "is a directory, not a regular file");
  // A FIFO in place of a checkpoint: opening it for reading waited for a writer forever.
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  EXPECT_KILN_ERROR(load_safetensors(dir.file("fifo")), "is a FIFO, not a regular file");
}

TEST(SafetensorsCorrupt, RejectsBadJson) {
  EXPECT_LOAD_ERROR(raw_file("[]      "), "does not start with '{'");
  EXPECT_LOAD_ERROR(raw_file("{\"a\" 1}"), "expected ':'");
  EXPECT_LOAD_ERROR(raw_file("{,}"), "expected a string key");
  EXPECT_LOAD_ERROR(raw_file("{}}"), "trailing characters");
  EXPECT_LOAD_ERROR(raw_file(std::string("{}\0\0", 4)), "trailing characters");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"dtype\":\"F32\",}}"), "expected a string key");
  EXPECT_LOAD_ERROR(raw_file("{\"a"), "unterminated string");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{"), "expected a string key");
  EXPECT_LOAD_ERROR(raw_file("{\"a\tb\":1}"), "control character in string");
  EXPECT_LOAD_ERROR(raw_file("{\"\\q\":1}"), "invalid escape");
  EXPECT_LOAD_ERROR(raw_file("{\"\\ud800\":1}"), "surrogate");
  EXPECT_LOAD_ERROR(raw_file("{\"\\u12\"}"), "invalid \\u escape");
  EXPECT_LOAD_ERROR(raw_file("{\"\xff\":1}"), "not valid UTF-8");
  EXPECT_LOAD_ERROR(raw_file("{\"\xc0\xaf\":1}"), "not valid UTF-8");  // overlong '/'
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"x\":tru}}"), "invalid literal");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"x\":01}}"), "leading zero");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"x\":1.}}"), "digits expected after '.'");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"x\":[1 2]}}"), "expected ',' or ']'");
  // Unknown fields are skipped, but only up to a nesting depth.
  EXPECT_LOAD_ERROR(
      raw_file("{\"a\":{\"x\":" + std::string(100, '[') + std::string(100, ']') + "}}"),
      "nested deeper than 64");
  EXPECT_LOAD_ERROR(raw_file("{\"a\":{\"x\":" + std::string(100000, '[')), "nested deeper");
  EXPECT_LOAD_ERROR(raw_file("{\"__metadata__\":{\"k\":1}}"), "metadata value of \"k\"");
  EXPECT_LOAD_ERROR(raw_file("{\"__metadata__\":[]}"), "must be an object of strings");
  // Errors say where: the byte offset in the header.
  EXPECT_LOAD_ERROR(raw_file("{\"a\" 1}"), "at byte 5");
}

constexpr const char* kF32x2 = R"("dtype":"F32","shape":[2],"data_offsets":)";

std::string one_tensor(const std::string& fields, const std::string& data) {
  return raw_file("{\"a\":{" + fields + "}}", data);
}

TEST(SafetensorsCorrupt, RejectsBadTensorEntries) {
  const std::string d8(8, '\0');
  ASSERT_NO_THROW(load_safetensors_from_bytes(one_tensor(kF32x2 + std::string("[0,8]"), d8)));
  // Skipped unknown fields and a null metadata are accepted, as by the reference.
  ASSERT_NO_THROW(load_safetensors_from_bytes(
      raw_file("{\"__metadata__\":null,\"a\":{\"extra\":{\"k\":[1,2.5e3,null,true]}," +
                   std::string(kF32x2) + "[0,8]}}",
               d8)));
  EXPECT_LOAD_ERROR(raw_file("{\"a\":5}", d8), "tensor \"a\" must be an object");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":5,"shape":[2],"data_offsets":[0,8])", d8),
                    "\"dtype\" must be a string");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F33","shape":[2],"data_offsets":[0,8])", d8),
                    "tensor \"a\": unknown dtype \"F33\"");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"I8","shape":[8],"data_offsets":[0,8])", d8),
                    "dtype \"I8\" is not supported by kiln");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8])", d8),
                    "not supported by kiln (supported: F64, F32, F16, BF16, I64, I32, U8, BOOL)");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":"2","data_offsets":[0,8])", d8),
                    "\"shape\" must be an array");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":[-2],"data_offsets":[0,8])", d8),
                    "shape entry is negative (-2)");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":[2.0],"data_offsets":[0,8])", d8),
                    "shape entry is not an integer (2.0)");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":[1e1],"data_offsets":[0,8])", d8),
                    "not an integer");
  EXPECT_LOAD_ERROR(
      one_tensor(R"("dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8])", d8),
      "shape entry is too large");
  EXPECT_LOAD_ERROR(
      one_tensor(R"("dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8])", d8),
      "shape entry 9223372036854775808 is too large");
  EXPECT_LOAD_ERROR(
      one_tensor(R"("dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8])", d8),
      "element count overflows");
  // Even empty: the sizes beside the zero would overflow the strides.
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":[0,4294967296,4294967296],)"
                               R"("data_offsets":[0,0])",
                               ""),
                    "element count overflows");
  // numel fits in int64 but its bytes do not.
  EXPECT_LOAD_ERROR(
      one_tensor(R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8])", d8),
      "needs 4611686018427387904 x 8 bytes");
  std::string dims = "[";
  for (int i = 0; i < 65; ++i) dims += i ? ",1" : "1";
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":)" + dims + R"(],"data_offsets":[0,4])",
                               std::string(4, '\0')),
                    "more than 64 dimensions");
  EXPECT_LOAD_ERROR(one_tensor(R"("shape":[2],"data_offsets":[0,8])", d8), "has no \"dtype\"");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","data_offsets":[0,8])", d8), "has no \"shape\"");
  EXPECT_LOAD_ERROR(one_tensor(R"("dtype":"F32","shape":[2])", d8), "has no \"data_offsets\"");
  EXPECT_LOAD_ERROR(
      one_tensor(R"("dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8])", d8),
      "duplicate key \"dtype\"");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[0]"), d8), "must have two entries");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[0,8,8]"), d8), "must have two entries");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("{}"), d8), "must be [begin, end]");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[-8,0]"), d8), "data offset is negative");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[8,0]"), d8), "begin after end");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[0,16]"), d8),
                    "beyond the data buffer of 8 bytes");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[0,18446744073709551615]"), d8),
                    "beyond the data buffer");
  EXPECT_LOAD_ERROR(one_tensor(kF32x2 + std::string("[0,4]"), d8), "hold 4");
}

// The JSON reader rejects any key twice in one object (nn/json.h), before safetensors' own checks.
TEST(SafetensorsCorrupt, RejectsDuplicateKeys) {
  const std::string t = std::string("{") + kF32x2 + "[0,8]}";
  EXPECT_LOAD_ERROR(raw_file("{\"a\":" + t + ",\"a\":" + t + "}", std::string(8, '\0')),
                    "duplicate key \"a\"");
  EXPECT_LOAD_ERROR(raw_file("{\"__metadata__\":{},\"__metadata__\":{}}"),
                    "duplicate key \"__metadata__\"");
  EXPECT_LOAD_ERROR(raw_file("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}"),
                    "duplicate key \"k\"");
}

TEST(SafetensorsCorrupt, RejectsOverlapsHolesAndUncoveredBytes) {
  const auto two = [](const std::string& a, const std::string& b, size_t data) {
    return raw_file("{\"a\":{" + std::string(kF32x2) + a + "},\"b\":{" + kF32x2 + b + "}}",
                    std::string(data, '\0'));
  };
  ASSERT_NO_THROW(load_safetensors_from_bytes(two("[8,16]", "[0,8]", 16)));
  EXPECT_LOAD_ERROR(two("[0,8]", "[4,12]", 12), "tensor \"b\" (bytes 4 to 12) overlaps");
  EXPECT_LOAD_ERROR(two("[0,8]", "[0,8]", 8), "overlaps tensor \"a\"");
  EXPECT_LOAD_ERROR(two("[0,8]", "[12,20]", 20), "hole of 4 bytes");
  EXPECT_LOAD_ERROR(two("[4,12]", "[12,20]", 20), "hole of 4 bytes in the data buffer before");
  EXPECT_LOAD_ERROR(two("[0,8]", "[8,16]", 20), "the last 4 bytes of the data buffer");
  EXPECT_LOAD_ERROR(raw_file("{}", "x"), "the last 1 bytes");
}

TEST(SafetensorsCorrupt, RejectsBoolBytesOtherThanZeroAndOne) {
  const std::string file = raw_file(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
                                    std::string("\1\0\2", 3));
  const SafetensorsFile f = SafetensorsFile::from_bytes(file);  // the header is fine
  EXPECT_KILN_ERROR(f.get("m"), "BOOL holds byte 2 at element 2");
}

// Every single-byte corruption of a valid file either loads or is rejected with kiln::Error:
// a small deterministic fuzz that runs everywhere (the libFuzzer target runs with clang).
TEST(SafetensorsCorrupt, SurvivesEverySingleByteCorruption) {
  const std::string good = save_safetensors_to_bytes(
      {{"w", randn({2, 2})}, {"m", ones({3}, kBool)}, {"h", randn({1}, kHalf)}}, {{"k", "v"}});
  int loaded = 0, rejected = 0;
  for (size_t i = 0; i < good.size(); ++i) {
    for (const char c : {'\0', '\xff', '9', '"', '[', '-'}) {
      std::string bad = good;
      if (bad[i] == c) continue;
      bad[i] = c;
      try {
        load_safetensors_from_bytes(bad);
        ++loaded;
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()).rfind("[load_safetensors] <memory>: ", 0), 0u) << e.what();
        ++rejected;
      }
    }
  }
  EXPECT_GT(loaded, 0);  // changes inside the data are still valid files
  EXPECT_GT(rejected, 0);
}

// --- Interoperability with Python's safetensors -------------------------------------------------

// The tensors of tests/nn/data/fixture.safetensors, as make_fixture.py writes them.
TensorMap fixture_tensors() {
  TensorMap m;
  // Built transposed, so that writing it exercises the non-contiguous path.
  m["f32"] = tensor({{1.5, 0.1}, {-2.25, 1e-8}, {3.0, -7.75}}, kFloat).t();
  m["f64"] = tensor({1.0 / 3.0, -2.5, 1e300}, kDouble);
  m["f16"] = tensor({{0.5, -1.0}, {65504.0, 0.00006103515625}}, kHalf);
  m["i64"] = tensor({-(int64_t{1} << 40), int64_t{0}, int64_t{1} << 62}, kInt64);
  m["i32"] = tensor({{-7, 2147483647}, {-2147483647 - 1, 42}}, kInt32);
  m["bool"] = tensor({true, false, true, true, false}, kBool);
  m["scalar"] = full({}, 42.5, kFloat);
  m["empty"] = empty({0, 3}, kFloat);
  m["layers.0.\xc3\xbcnicode"] = tensor({7}, kInt32);
  m["bf16"] = tensor({1.0, -2.5, 3.140625, 256.0}, kBFloat16);
  return m;
}

const SafetensorsMetadata kFixtureMetadata{{"format", "np"}, {"producer", "make_fixture.py"}};

TEST(SafetensorsInterop, ReadsTheFixtureWrittenByPython) {
  const std::string path = std::string(KILN_NN_TEST_DATA) + "/fixture.safetensors";
  const SafetensorsFile f(path);
  const TensorMap want = fixture_tensors();
  std::vector<std::string> names;
  for (const auto& [name, t] : want) names.push_back(name);
  EXPECT_EQ(f.keys(), names);
  EXPECT_EQ(f.metadata(), kFixtureMetadata);
  for (const auto& [name, t] : want) expect_same(f.get(name), t, name);
  // Spot-check values through kiln's own conversions, not just bytes.
  EXPECT_EQ(f.get("f32").to_vector<float>(),
            (std::vector<float>{1.5f, -2.25f, 3.0f, 0.1f, 1e-8f, -7.75f}));
  EXPECT_EQ(f.get("i64").to_vector<int64_t>()[2], int64_t{1} << 62);
  EXPECT_EQ(static_cast<float>(f.get("bf16").to_vector<BFloat16>()[2]), 3.140625f);
  EXPECT_EQ(static_cast<float>(f.get("f16").to_vector<Half>()[2]), 65504.0f);
  EXPECT_EQ(f.get("scalar").dim(), 0);
  EXPECT_EQ(f.get("scalar").item<float>(), 42.5f);
  // The library aligns every tensor, so all of them alias the mapping.
  const std::string_view mapped = f.bytes();
  const char* p = static_cast<const char*>(f.get("f64").data_ptr());
  EXPECT_TRUE(p >= mapped.data() && p < mapped.data() + mapped.size());
}

TEST(SafetensorsInterop, WritesTheSameBytesAsThePythonLibrary) {
  // The fixture's header without its "__metadata__" entry (whose key order the library leaves
  // to a hash map), padded again, and the same data: what kiln writes without metadata.
  std::stringstream ss;
  ss << std::ifstream(std::string(KILN_NN_TEST_DATA) + "/fixture.safetensors").rdbuf();
  const std::string fixture = ss.str();
  uint64_t n;
  std::memcpy(&n, fixture.data(), 8);
  std::string json = fixture.substr(8, n);
  const size_t md_end = json.find("},") + 2;
  ASSERT_EQ(json.rfind("{\"__metadata__\":{", 0), 0u);
  json = "{" + json.substr(md_end);
  json.erase(json.find_last_not_of(' ') + 1);
  json.resize((json.size() + 7) / 8 * 8, ' ');
  const std::string expected = raw_file(json, fixture.substr(8 + n));
  EXPECT_EQ(save_safetensors_to_bytes(fixture_tensors()), expected);
}

TEST(SafetensorsInterop, KilnFileLoadsInPython) {
  TempDir dir;
  const std::string path = dir.file("kiln.safetensors");
  save_safetensors(fixture_tensors(), path, kFixtureMetadata);
  for (const auto& [name, t] : fixture_tensors()) {
    expect_same(load_safetensors(path).at(name), t, name);
  }
  if (std::system("python3 -c 'import safetensors, numpy' > /dev/null 2>&1") != 0) {
    GTEST_SKIP() << "python3 with safetensors and numpy is not available; run "
                    "tests/nn/data/check_kiln_file.py on a kiln-written file by hand";
  }
  const std::string cmd = "python3 " + std::string(KILN_NN_TEST_DATA) + "/check_kiln_file.py " +
                          path + " > " + dir.file("out.txt") + " 2>&1";
  const int rc = std::system(cmd.c_str());
  std::stringstream out;
  out << std::ifstream(dir.file("out.txt")).rdbuf();
  EXPECT_EQ(rc, 0) << out.str();
  EXPECT_EQ(out.str(), "OK\n");
}

}  // namespace
}  // namespace kiln
