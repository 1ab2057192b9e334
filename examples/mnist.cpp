// MNIST classifier through kiln::data: a small convolutional net trained with a data loader
// (datasets::MNIST -> Normalize -> Stack, two worker threads), then evaluated on the test split.
//
//   build/examples/mnist [root] [epochs]
//
// With `root` holding the four uncompressed MNIST idx files (train-images-idx3-ubyte, ...), it
// trains on the real digits. Without (or when they are absent) it writes a synthetic set in the
// same idx format to a temporary folder and reads that back through the same datasets::MNIST
// path: ten classes, each a bright 6x6 square at its own place on a noisy 28x28 image, shifted by
// up to a pixel. Exit status 0 when the test accuracy reaches 90%.
#include <kiln/kiln.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

struct NetImpl : kiln::nn::Module {
  NetImpl()
      : conv1(kiln::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(kiln::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  // [B, 1, 28, 28] -> log-probabilities [B, 10].
  kiln::Tensor forward(kiln::Tensor x) {
    x = kiln::relu(kiln::max_pool2d(conv1->forward(x), 2));                       // [B, 10, 12, 12]
    x = kiln::relu(kiln::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));  // [B, 20, 4, 4]
    x = x.view({-1, 320});
    x = kiln::relu(fc1->forward(x));
    x = kiln::dropout(x, /*p=*/0.5, /*train=*/is_training());
    return kiln::log_softmax(fc2->forward(x), /*dim=*/1);
  }

  kiln::nn::Conv2d conv1;
  kiln::nn::Conv2d conv2;
  kiln::nn::Dropout2d conv2_drop;
  kiln::nn::Linear fc1;
  kiln::nn::Linear fc2;
};
KILN_MODULE(Net);

bool has_mnist(const std::string& root) {
  for (const char* f : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                        "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    if (!fs::is_regular_file(fs::path(root) / f)) return false;
  }
  return true;
}

void put_be32(std::ofstream& out, uint32_t v) {
  const char b[4] = {static_cast<char>(v >> 24), static_cast<char>(v >> 16),
                     static_cast<char>(v >> 8), static_cast<char>(v)};
  out.write(b, 4);
}

// Writes `n` synthetic digits as <prefix>-images-idx3-ubyte and <prefix>-labels-idx1-ubyte.
void write_synthetic_split(const fs::path& dir, const std::string& prefix, int64_t n) {
  constexpr int64_t kSide = 28, kSquare = 6;
  auto noise = (kiln::randn({n, kSide, kSide}) * 0.15 + 0.1).clamp(0, 1);
  auto labels = kiln::randint(10, {n});
  auto shifts = kiln::randint(-1, 2, {n, 2});
  auto px = noise.accessor<float, 3>();
  auto lab = labels.accessor<int64_t, 1>();
  auto sh = shifts.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = lab[i];
    const int64_t top = 4 + (c / 5) * 12 + sh[i][0], left = 1 + (c % 5) * 5 + sh[i][1];
    for (int64_t r = top; r < top + kSquare; ++r)
      for (int64_t q = std::max<int64_t>(left, 0); q < std::min(left + kSquare, kSide); ++q)
        px[i][r][q] = 1.0f;
  }
  std::ofstream images(dir / (prefix + "-images-idx3-ubyte"), std::ios::binary);
  put_be32(images, 0x803);
  for (int64_t d : {n, kSide, kSide}) put_be32(images, static_cast<uint32_t>(d));
  for (float v : noise.to_vector<float>()) images.put(static_cast<char>(std::lround(v * 255)));
  std::ofstream targets(dir / (prefix + "-labels-idx1-ubyte"), std::ios::binary);
  put_be32(targets, 0x801);
  put_be32(targets, static_cast<uint32_t>(n));
  for (int64_t v : labels.to_vector<int64_t>()) targets.put(static_cast<char>(v));
}

template <typename Loader>
void train(size_t epoch, Net& model, Loader& loader, kiln::optim::Optimizer& optimizer,
           size_t dataset_size) {
  model->train();
  size_t batch_idx = 0, seen = 0;
  for (auto& batch : loader) {
    optimizer.zero_grad();
    auto output = model->forward(batch.data);
    auto loss = kiln::nll_loss(output, batch.target);
    loss.backward();
    optimizer.step();
    seen += static_cast<size_t>(batch.data.size(0));
    if (batch_idx++ % 10 == 0) {
      std::printf("Train epoch %zu [%5zu/%5zu] loss %.4f\n", epoch, seen, dataset_size,
                  loss.template item<float>());
    }
  }
}

template <typename Loader>
double test(Net& model, Loader& loader, size_t dataset_size) {
  kiln::NoGradGuard no_grad;
  model->eval();
  double loss = 0;
  int64_t correct = 0;
  for (const auto& batch : loader) {
    auto output = model->forward(batch.data);
    loss += kiln::nll_loss(output, batch.target, {}, kiln::Reduction::Sum).template item<double>();
    auto pred = output.argmax(1);
    correct += pred.eq(batch.target).sum().template item<int64_t>();
  }
  const double accuracy = static_cast<double>(correct) / static_cast<double>(dataset_size);
  std::printf("Test: average loss %.4f, accuracy %.3f\n", loss / static_cast<double>(dataset_size),
              accuracy);
  return accuracy;
}

}  // namespace

int main(int argc, char** argv) {
  kiln::manual_seed(1);
  std::string root = argc > 1 ? argv[1] : "";
  fs::path synthetic;
  if (root.empty() || !has_mnist(root)) {
    synthetic = fs::temp_directory_path() / ("kiln_mnist_example_" + std::to_string(::getpid()));
    fs::create_directories(synthetic);
    write_synthetic_split(synthetic, "train", 640);
    write_synthetic_split(synthetic, "t10k", 200);
    std::printf("No MNIST files%s%s: using synthetic digits in %s\n", root.empty() ? "" : " in ",
                root.c_str(), synthetic.c_str());
    root = synthetic.string();
  }
  // One epoch of real MNIST gets past 90%; the small synthetic set needs a few.
  const size_t epochs = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : synthetic.empty() ? 1 : 4;

  using namespace kiln::data;
  auto train_set =
      datasets::MNIST(root).map(transforms::Normalize<>(0.1307, 0.3081)).map(transforms::Stack<>());
  const size_t train_size = train_set.size().value();
  auto train_loader = make_data_loader<samplers::RandomSampler>(
      std::move(train_set), DataLoaderOptions().batch_size(64).workers(2));
  auto test_set = datasets::MNIST(root, datasets::MNIST::Mode::kTest)
                      .map(transforms::Normalize<>(0.1307, 0.3081))
                      .map(transforms::Stack<>());
  const size_t test_size = test_set.size().value();
  auto test_loader = make_data_loader(std::move(test_set), 1000);

  Net model;
  kiln::optim::SGD optimizer(model->parameters(), kiln::optim::SGDOptions(0.05).momentum(0.9));
  double accuracy = 0;
  for (size_t epoch = 1; epoch <= epochs; ++epoch) {
    train(epoch, model, *train_loader, optimizer, train_size);
    accuracy = test(model, *test_loader, test_size);
  }
  if (!synthetic.empty()) fs::remove_all(synthetic);
  return accuracy >= 0.9 ? 0 : 1;
}
