// datasets::MNIST on small idx files written here: the pixels and labels read back, both modes,
// a loader over it, and a clear error for every malformed file.
#include "datasets/mnist.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using kiln::data::datasets::MNIST;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("kiln_mnist_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string str() const { return path_.string(); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

void put_be32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>((v >> shift) & 0xff));
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string idx(uint32_t magic, const std::vector<uint32_t>& dims,
                const std::vector<uint8_t>& body) {
  std::string s;
  put_be32(s, magic);
  for (uint32_t d : dims) put_be32(s, d);
  s.append(body.begin(), body.end());
  return s;
}

// n images of rows x cols whose pixel j of image i is (i * 7 + j * 3) % 256, labels (i * 3) % 10.
std::vector<uint8_t> pixels(uint32_t n, uint32_t rows, uint32_t cols) {
  std::vector<uint8_t> p;
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j < rows * cols; ++j)
      p.push_back(static_cast<uint8_t>((i * 7 + j * 3) % 256));
  return p;
}
std::vector<uint8_t> labels(uint32_t n) {
  std::vector<uint8_t> l;
  for (uint32_t i = 0; i < n; ++i) l.push_back(static_cast<uint8_t>((i * 3) % 10));
  return l;
}

void write_split(const TempDir& dir, const std::string& prefix, uint32_t n, uint32_t rows,
                 uint32_t cols) {
  write(dir.file(prefix + "-images-idx3-ubyte"),
        idx(0x803, {n, rows, cols}, pixels(n, rows, cols)));
  write(dir.file(prefix + "-labels-idx1-ubyte"), idx(0x801, {n}, labels(n)));
}

TEST(MnistTest, ReadsPixelsAndLabels) {
  TempDir dir;
  write_split(dir, "train", 5, 4, 3);
  write_split(dir, "t10k", 2, 4, 3);
  MNIST train(dir.str());
  EXPECT_TRUE(train.is_train());
  EXPECT_EQ(train.size().value(), 5u);
  EXPECT_EQ(train.images().sizes(), (IntArrayRef{5, 1, 4, 3}));
  EXPECT_EQ(train.images().dtype(), kFloat32);
  EXPECT_EQ(train.targets().dtype(), kInt64);
  const auto px = pixels(5, 4, 3);
  const auto got = train.images().to_vector<float>();
  ASSERT_EQ(got.size(), px.size());
  for (size_t i = 0; i < px.size(); ++i) EXPECT_FLOAT_EQ(got[i], px[i] / 255.0f) << i;
  EXPECT_EQ(train.targets().to_vector<int64_t>(), (std::vector<int64_t>{0, 3, 6, 9, 2}));
  const auto e = train.get(3);
  EXPECT_EQ(e.data.sizes(), (IntArrayRef{1, 4, 3}));
  EXPECT_EQ(e.target.item<int64_t>(), 9);
  EXPECT_KILN_ERROR(train.get(5), "[MNIST] index 5 is out of range for a dataset of 5 examples");

  MNIST test(dir.str(), MNIST::Mode::kTest);
  EXPECT_FALSE(test.is_train());
  EXPECT_EQ(test.size().value(), 2u);
}

TEST(MnistTest, LoaderOverMnist) {
  TempDir dir;
  write_split(dir, "train", 10, 28, 28);
  auto ds = MNIST(dir.str())
                .map(kiln::data::transforms::Normalize<>(0.1307, 0.3081))
                .map(kiln::data::transforms::Stack<>());
  auto loader = kiln::data::make_data_loader<kiln::data::samplers::SequentialSampler>(
      std::move(ds), kiln::data::DataLoaderOptions().batch_size(4).workers(2));
  std::vector<int64_t> targets;
  int batches = 0;
  for (auto& batch : *loader) {
    EXPECT_EQ(batch.data.sizes()[1], 1);
    EXPECT_EQ(batch.data.sizes()[2], 28);
    for (int64_t t : batch.target.to_vector<int64_t>()) targets.push_back(t);
    if (batches++ == 0) {
      const float want = (pixels(1, 28, 28)[5] / 255.0f - 0.1307f) / 0.3081f;
      EXPECT_NEAR(batch.data.flatten()[5].item<float>(), want, 1e-5);
    }
  }
  EXPECT_EQ(batches, 3);
  EXPECT_EQ(targets, (std::vector<int64_t>{0, 3, 6, 9, 2, 5, 8, 1, 4, 7}));
}

TEST(MnistTest, MissingFiles) {
  TempDir dir;
  EXPECT_KILN_ERROR(MNIST(dir.str()), "train-images-idx3-ubyte: no such file");
  write(dir.file("train-images-idx3-ubyte.gz"), "x");
  EXPECT_KILN_ERROR(MNIST(dir.str()), "decompress it first");
  write_split(dir, "train", 1, 2, 2);
  fs::remove(dir.file("train-labels-idx1-ubyte"));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "train-labels-idx1-ubyte: no such file");
}

TEST(MnistTest, MalformedFiles) {
  TempDir dir;
  const std::string images = dir.file("train-images-idx3-ubyte");
  const std::string lbls = dir.file("train-labels-idx1-ubyte");
  write(lbls, idx(0x801, {2}, labels(2)));

  write(images, "ab");
  EXPECT_KILN_ERROR(MNIST(dir.str()), "too few for an idx header");
  // The label file given as the image file.
  write(images, idx(0x801, {2}, labels(2)));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "magic number 0x00000801 is not that of an idx3 file");
  write(images, idx(0x803, {2}, {}));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "too few for an idx header of 3 dimensions");
  // Truncated pixels and trailing bytes.
  auto short_px = pixels(2, 3, 3);
  short_px.pop_back();
  write(images, idx(0x803, {2, 3, 3}, short_px));
  EXPECT_KILN_ERROR(MNIST(dir.str()),
                    "the header announces [2, 3, 3] = 18 bytes of data, but the file holds 17");
  auto long_px = pixels(2, 3, 3);
  long_px.push_back(0);
  write(images, idx(0x803, {2, 3, 3}, long_px));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "but the file holds 19");
  // Counts that differ, labels that are not digits.
  write(images, idx(0x803, {3, 3, 3}, pixels(3, 3, 3)));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "holds 3 images but");
  write(images, idx(0x803, {2, 3, 3}, pixels(2, 3, 3)));
  write(lbls, idx(0x801, {2}, {1, 12}));
  EXPECT_KILN_ERROR(MNIST(dir.str()), "label 12 of example 1 is not a digit");
  write(lbls, idx(0x801, {2}, {1, 2}));
  EXPECT_EQ(MNIST(dir.str()).size().value(), 2u);
}

}  // namespace
}  // namespace kiln
