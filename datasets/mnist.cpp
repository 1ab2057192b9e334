// The MNIST reader of datasets/mnist.h.
#include "datasets/mnist.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string_view>
#include <vector>

#include "nn/safetensors.h"  // read_file
#include "tensor/ops.h"

namespace kiln::data::datasets {
namespace {

constexpr uint32_t kImagesMagic = 0x00000803;  // unsigned bytes, 3 dimensions
constexpr uint32_t kLabelsMagic = 0x00000801;  // unsigned bytes, 1 dimension

uint32_t read_be32(std::string_view bytes, size_t offset) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data()) + offset;
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// The file's bytes, after checking that it exists.
std::string read_idx_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    KILN_CHECK(!fs::exists(path + ".gz", ec), "[MNIST] ", path, ": no such file, but ", path,
               ".gz is there: decompress it first (gunzip)");
    KILN_FAIL("[MNIST] ", path, ": no such file (expected the uncompressed idx files of MNIST)");
  }
  return read_file(path, "MNIST");
}

// The dims of the idx file `bytes` of unsigned bytes in `ndim` dimensions (magic `magic`), after
// checking that its length is the header's plus the product of its dims.
std::vector<int64_t> idx_dims(std::string_view bytes, const std::string& path, uint32_t magic,
                              size_t ndim) {
  const size_t header = 4 + 4 * ndim;
  KILN_CHECK(bytes.size() >= 4, "[MNIST] ", path, ": the file has ", bytes.size(),
             " bytes, too few for an idx header");
  const uint32_t got = read_be32(bytes, 0);
  KILN_CHECK(got == magic, "[MNIST] ", path, ": magic number ", hex(got), " is not that of an idx",
             ndim, " file of unsigned bytes (", hex(magic), ")");
  KILN_CHECK(bytes.size() >= header, "[MNIST] ", path, ": the file has ", bytes.size(),
             " bytes, too few for an idx header of ", ndim, " dimensions (", header, " bytes)");
  std::vector<int64_t> dims;
  uint64_t body = 1;
  for (size_t d = 0; d < ndim; ++d) {
    dims.push_back(read_be32(bytes, 4 + 4 * d));
    body *= static_cast<uint64_t>(dims.back());
  }
  KILN_CHECK(bytes.size() - header == body, "[MNIST] ", path, ": the header announces ",
             shape_str(dims), " = ", body, " bytes of data, but the file holds ",
             bytes.size() - header);
  return dims;
}

}  // namespace

MNIST::MNIST(const std::string& root, Mode mode) : is_train_(mode == Mode::kTrain) {
  const std::string prefix = root + "/" + (is_train_ ? "train" : "t10k");
  const std::string images_path = prefix + "-images-idx3-ubyte";
  const std::string labels_path = prefix + "-labels-idx1-ubyte";
  const std::string image_bytes = read_idx_file(images_path);
  const std::string label_bytes = read_idx_file(labels_path);
  const std::vector<int64_t> idims = idx_dims(image_bytes, images_path, kImagesMagic, 3);
  const std::vector<int64_t> ldims = idx_dims(label_bytes, labels_path, kLabelsMagic, 1);
  KILN_CHECK(idims[0] == ldims[0], "[MNIST] ", images_path, " holds ", idims[0], " images but ",
             labels_path, " holds ", ldims[0], " labels");

  const int64_t n = idims[0];
  // As libtorch's loader: the pixel bytes as a uint8 tensor (borrowed, only read), scaled to
  // [0, 1] in float32.
  void* pixels = const_cast<char*>(image_bytes.data()) + 16;
  images_ = kiln::from_blob(pixels, {n, 1, idims[1], idims[2]}, kUInt8).to(kFloat32).div(255);

  targets_ = kiln::empty({n}, kInt64);
  int64_t* lab = targets_.data_ptr<int64_t>();
  const auto* lsrc = reinterpret_cast<const unsigned char*>(label_bytes.data()) + 8;
  for (int64_t i = 0; i < n; ++i) {
    KILN_CHECK(lsrc[i] <= 9, "[MNIST] ", labels_path, ": label ", int{lsrc[i]}, " of example ", i,
               " is not a digit (0-9)");
    lab[i] = lsrc[i];
  }
}

Example<> MNIST::get(size_t index) {
  KILN_CHECK(index < static_cast<size_t>(images_.size(0)), "[MNIST] index ", index,
             " is out of range for a dataset of ", images_.size(0), " examples");
  const auto i = static_cast<int64_t>(index);
  return {images_[i], targets_[i]};
}

optional<size_t> MNIST::size() const { return static_cast<size_t>(images_.size(0)); }

}  // namespace kiln::data::datasets
