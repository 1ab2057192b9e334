// kiln::data::datasets::MNIST: the MNIST digits from the standard idx files, as
// torch::data::datasets::MNIST.
//
//   auto train = kiln::data::datasets::MNIST("data/mnist");                     // 60000 images
//   auto test = kiln::data::datasets::MNIST("data/mnist", MNIST::Mode::kTest);  // 10000
//   auto e = train.get(0);   // e.data float32 [1, 28, 28] in [0, 1], e.target int64 0-d
//
// `root` holds the four files under their usual names, uncompressed (gunzip the downloads):
// train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
// t10k-labels-idx1-ubyte. images() is float32 [N, 1, rows, cols] (pixels / 255), targets() int64
// [N]. Any N, rows and cols are read (not only 60000 x 28 x 28), so that small files work too.
//
// The files are checked before use; each error names the file: a missing file (with a hint when
// a .gz of it is there), a header that is not the idx header of unsigned bytes in 3 (images) or
// 1 (labels) dimensions, a file whose length differs from what its header announces, image and
// label counts that differ, and labels outside 0-9.
#pragma once

#include <cstddef>
#include <string>

#include "datasets/dataset.h"

namespace kiln::data::datasets {

class MNIST : public Dataset<MNIST> {
 public:
  enum class Mode { kTrain, kTest };

  explicit MNIST(const std::string& root, Mode mode = Mode::kTrain);

  Example<> get(size_t index) override;
  optional<size_t> size() const override;

  bool is_train() const noexcept { return is_train_; }
  const Tensor& images() const { return images_; }
  const Tensor& targets() const { return targets_; }

 private:
  Tensor images_, targets_;
  bool is_train_;
};

}  // namespace kiln::data::datasets
