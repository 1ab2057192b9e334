// kiln::models::TokenDataset and ByteTokenizer: file formats, the split, batches (windows of the
// right split, targets shifted, a pure function of seed and index), errors.
#include "models/data.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "models/tokenizer.h"
#include "tensor/ops.h"
#include "tensor/random.h"
#include "test_util.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("kiln_data_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  fs::path dir_;
};

TEST_F(DataTest, TextFileIsBytesWithTheLastTenPercentHeldOut) {
  std::string text;
  for (int i = 0; i < 100; ++i) text.push_back(static_cast<char>(i * 2 + 30));
  text.push_back(static_cast<char>(0xE9));  // not ASCII: still one byte token
  const auto ds = TokenDataset::from_file(write("a.txt", text));
  ASSERT_EQ(ds.size(), 101);
  EXPECT_EQ(ds.size(Split::kValidation), 10);  // floor(101 * 0.1)
  EXPECT_EQ(ds.size(Split::kTrain), 91);
  EXPECT_EQ(ds.tokens()[3], 36u);
  EXPECT_EQ(ds.tokens()[100], 0xE9u);
  EXPECT_EQ(ds.max_token(), 0xE9);
}

TEST_F(DataTest, BinaryTokenFilesAreLittleEndian) {
  const std::string u16("\x01\x02\xff\xff\x00\x00", 6);
  auto ds = TokenDataset::from_file(write("t.bin", u16));
  EXPECT_EQ(ds.tokens(), (std::vector<uint32_t>{0x0201, 0xffff, 0}));
  ds = TokenDataset::from_file(write("t.u16", u16));
  EXPECT_EQ(ds.size(), 3);
  const std::string u32("\x01\x02\x03\x04\xff\xff\xff\xff", 8);
  ds = TokenDataset::from_file(write("t.u32", u32));
  EXPECT_EQ(ds.tokens(), (std::vector<uint32_t>{0x04030201u, 0xffffffffu}));
  // The format can be forced whatever the extension.
  ds = TokenDataset::from_file(write("t.dat", u32), TokenFormat::kUint32);
  EXPECT_EQ(ds.size(), 2);
  ds = TokenDataset::from_file(write("t2.bin", u32), TokenFormat::kText);
  EXPECT_EQ(ds.size(), 8);
}

TEST_F(DataTest, BatchesAreShiftedWindowsOfTheirSplit) {
  std::vector<uint32_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i);  // token = pos
  const auto ds = TokenDataset::from_tokens(tokens);
  manual_seed(3);
  const RngState before = get_rng_state();
  for (Split split : {Split::kTrain, Split::kValidation}) {
    auto [x, y] = ds.batch(split, 16, 20, kCPU, 42, 5);
    EXPECT_EQ(x.sizes(), (Shape{16, 20}));
    EXPECT_EQ(y.sizes(), (Shape{16, 20}));
    EXPECT_EQ(x.dtype(), kInt64);
    EXPECT_EQ(y.dtype(), kInt64);
    const auto xv = x.to_vector<int64_t>(), yv = y.to_vector<int64_t>();
    std::set<int64_t> starts;
    for (int b = 0; b < 16; ++b) {
      const int64_t start = xv[b * 20];
      starts.insert(start);
      if (split == Split::kTrain) {
        EXPECT_GE(start, 0);
        EXPECT_LE(start + 20, 899);  // the window's last target is inside [0, 900)
      } else {
        EXPECT_GE(start, 900);
        EXPECT_LE(start + 20, 999);
      }
      for (int t = 0; t < 20; ++t) {
        EXPECT_EQ(xv[b * 20 + t], start + t);
        EXPECT_EQ(yv[b * 20 + t], start + t + 1);
      }
    }
    EXPECT_GT(starts.size(), 8u);  // random starts, not one window repeated
  }
  EXPECT_EQ(get_rng_state().offset, before.offset);  // the global stream is not used
  // A pure function of (seed, index).
  auto [a, _a] = ds.batch(Split::kTrain, 4, 8, kCPU, 1, 7);
  auto [b, _b] = ds.batch(Split::kTrain, 4, 8, kCPU, 1, 7);
  auto [c, _c] = ds.batch(Split::kTrain, 4, 8, kCPU, 1, 8);
  auto [d, _d] = ds.batch(Split::kTrain, 4, 8, kCPU, 2, 7);
  EXPECT_EQ(a.to_vector<int64_t>(), b.to_vector<int64_t>());
  EXPECT_NE(a.to_vector<int64_t>(), c.to_vector<int64_t>());
  EXPECT_NE(a.to_vector<int64_t>(), d.to_vector<int64_t>());
}

TEST_F(DataTest, WindowsCoverTheWholeSplit) {
  // A split of exactly seq_len + 1 tokens has one window; larger ones reach both ends.
  std::vector<uint32_t> tokens(110);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i);
  const auto ds = TokenDataset::from_tokens(tokens);  // 99 train, 11 validation
  auto [vx, vy] = ds.batch(Split::kValidation, 3, 10, kCPU, 0, 0);
  EXPECT_EQ(vx.select(1, 0).to_vector<int64_t>(), (std::vector<int64_t>{99, 99, 99}));
  std::set<int64_t> starts;
  for (uint64_t i = 0; i < 50; ++i) {
    for (int64_t s :
         ds.batch(Split::kTrain, 8, 90, kCPU, 0, i).first.select(1, 0).to_vector<int64_t>()) {
      starts.insert(s);
    }
  }
  EXPECT_EQ(starts, (std::set<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8}));
}

TEST_F(DataTest, Errors) {
  EXPECT_KILN_ERROR(TokenDataset::from_file((dir_ / "missing.txt").string()),
                    "cannot open the file");
  EXPECT_KILN_ERROR(TokenDataset::from_file(write("empty.txt", "")), "the file is empty");
  EXPECT_KILN_ERROR(TokenDataset::from_file(write("odd.bin", "abc")),
                    "3 bytes is not a whole number of uint16 tokens");
  EXPECT_KILN_ERROR(TokenDataset::from_file(write("odd.u32", "abcdef")), "uint32");
  EXPECT_KILN_ERROR(TokenDataset::from_file(write("a.txt", "abc"), TokenFormat::kText, 1.0),
                    "val_fraction");
  const auto ds = TokenDataset::from_file(write("short.txt", std::string(50, 'x')));
  EXPECT_KILN_ERROR(ds.batch(Split::kTrain, 2, 45, kCPU, 0, 0),
                    "the training split has 45 tokens, too short for a window of seq_len + 1 = 46");
  EXPECT_KILN_ERROR(ds.batch(Split::kValidation, 2, 5, kCPU, 0, 0), "validation split has 5");
  EXPECT_KILN_ERROR(ds.batch(Split::kTrain, 0, 5, kCPU, 0, 0), "must be positive");
}

TEST(ByteTokenizerTest, RoundTripsAnyBytes) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_EQ(tok.encode("To be"), (std::vector<int64_t>{84, 111, 32, 98, 101}));
  std::string all;
  for (int i = 0; i < 256; ++i) all.push_back(static_cast<char>(i));
  const auto ids = tok.encode(all);
  for (int i = 0; i < 256; ++i) EXPECT_EQ(ids[i], i);
  EXPECT_EQ(tok.decode(ids), all);
  EXPECT_EQ(tok.decode(tok.encode("caf\xC3\xA9")), "caf\xC3\xA9");
  EXPECT_KILN_ERROR(tok.decode({65, 256}), "[ByteTokenizer] id 256 at position 1");
  EXPECT_KILN_ERROR(tok.decode({-1}), "not a byte");
  EXPECT_EQ(tok.decode_lossy({72, 300, 105}), "H\xEF\xBF\xBDi");
}

}  // namespace
}  // namespace kiln::models
