// DCGAN on MNIST through kiln::data: a generator of transposed convolutions and a convolutional
// discriminator, trained against each other with binary cross-entropy and Adam.
//
//   build/examples/dcgan [root] [epochs] [out_dir]
//
// With `root` holding the MNIST idx files it trains on the training digits (64 base channels);
// without, on a small synthetic set made in memory by a user Dataset (16 base channels), so
// that a few steps run in seconds. Each epoch ends with a checkpoint of both networks and both
// optimizers, and a sample of generated images, in out_dir (a temporary folder by default). The
// run fails (exit status 1) if a loss is not finite or a checkpoint does not load back to the
// same generator.
#include <kiln/kiln.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace nn = kiln::nn;

constexpr int64_t kNoiseSize = 100;
constexpr int64_t kBatchSize = 64;

// [B, kNoiseSize, 1, 1] -> [B, 1, 28, 28] in (-1, 1): 1 -> 4 -> 7 -> 14 -> 28.
struct GeneratorImpl : nn::Module {
  explicit GeneratorImpl(int64_t c)
      : conv1(nn::ConvTranspose2dOptions(kNoiseSize, 4 * c, 4).bias(false)),
        batch_norm1(4 * c),
        conv2(nn::ConvTranspose2dOptions(4 * c, 2 * c, 3).stride(2).padding(1).bias(false)),
        batch_norm2(2 * c),
        conv3(nn::ConvTranspose2dOptions(2 * c, c, 4).stride(2).padding(1).bias(false)),
        batch_norm3(c),
        conv4(nn::ConvTranspose2dOptions(c, 1, 4).stride(2).padding(1).bias(false)) {
    register_module("conv1", conv1);
    register_module("batch_norm1", batch_norm1);
    register_module("conv2", conv2);
    register_module("batch_norm2", batch_norm2);
    register_module("conv3", conv3);
    register_module("batch_norm3", batch_norm3);
    register_module("conv4", conv4);
  }

  kiln::Tensor forward(kiln::Tensor x) {
    x = kiln::relu(batch_norm1(conv1(x)));
    x = kiln::relu(batch_norm2(conv2(x)));
    x = kiln::relu(batch_norm3(conv3(x)));
    return kiln::tanh(conv4(x));
  }

  nn::ConvTranspose2d conv1;
  nn::BatchNorm2d batch_norm1;
  nn::ConvTranspose2d conv2;
  nn::BatchNorm2d batch_norm2;
  nn::ConvTranspose2d conv3;
  nn::BatchNorm2d batch_norm3;
  nn::ConvTranspose2d conv4;
};
KILN_MODULE(Generator);

// [B, 1, 28, 28] -> probability that each image is real, [B, 1, 1, 1]: 28 -> 14 -> 7 -> 3 -> 1.
nn::Sequential make_discriminator(int64_t c) {
  return nn::Sequential(
      nn::Conv2d(nn::Conv2dOptions(1, c, 4).stride(2).padding(1).bias(false)),
      nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(c, 2 * c, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(2 * c), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(2 * c, 4 * c, 4).stride(2).padding(1).bias(false)),
      nn::BatchNorm2d(4 * c), nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)),
      nn::Conv2d(nn::Conv2dOptions(4 * c, 1, 3).stride(1).padding(0).bias(false)), nn::Sigmoid());
}

// Synthetic "digits": a bright bar across a dark 28x28 image, at a random place and
// orientation, in [0, 1] like MNIST's pixels after datasets::MNIST.
class SyntheticDigits : public kiln::data::datasets::Dataset<SyntheticDigits> {
 public:
  explicit SyntheticDigits(int64_t n) : images_(kiln::zeros({n, 1, 28, 28})) {
    auto px = images_.accessor<float, 4>();
    auto where = kiln::randint(4, 24, {n, 2});
    auto vertical = kiln::randint(2, {n});
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = where[i][0].item<int64_t>(), from = where[i][1].item<int64_t>() - 4;
      for (int64_t k = 0; k < 12; ++k)
        for (int64_t w = -1; w <= 1; ++w) {
          if (vertical[i].item<int64_t>() != 0) {
            px[i][0][from + k][at + w] = 1.0f;
          } else {
            px[i][0][at + w][from + k] = 1.0f;
          }
        }
    }
  }
  kiln::data::Example<> get(size_t index) override {
    return {images_[static_cast<int64_t>(index)], kiln::zeros({}, kiln::kInt64)};
  }
  kiln::optional<size_t> size() const override { return static_cast<size_t>(images_.size(0)); }

 private:
  kiln::Tensor images_;
};

bool has_mnist(const std::string& root) {
  return !root.empty() && fs::is_regular_file(fs::path(root) / "train-images-idx3-ubyte") &&
         fs::is_regular_file(fs::path(root) / "train-labels-idx1-ubyte");
}

template <typename Dataset>
bool train(Dataset dataset, int64_t channels, size_t epochs, const fs::path& out) {
  using namespace kiln::data;
  const size_t batches_per_epoch = dataset.size().value() / kBatchSize;
  auto loader = make_data_loader(
      std::move(dataset), DataLoaderOptions().batch_size(kBatchSize).workers(2).drop_last(true));

  Generator generator(channels);
  nn::Sequential discriminator = make_discriminator(channels);
  kiln::optim::Adam generator_optimizer(generator->parameters(),
                                        kiln::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  kiln::optim::Adam discriminator_optimizer(discriminator->parameters(),
                                            kiln::optim::AdamOptions(2e-4).betas({0.5, 0.999}));

  for (size_t epoch = 1; epoch <= epochs; ++epoch) {
    size_t batch_index = 0;
    for (auto& batch : *loader) {
      // Discriminator: real images towards 1 (smoothed to 0.9), generated ones towards 0.
      discriminator->zero_grad();
      kiln::Tensor real_images = batch.data;
      auto real_labels = kiln::full({real_images.size(0)}, 0.9);
      auto real_output = discriminator->forward(real_images).view({-1});
      auto d_loss_real = kiln::binary_cross_entropy(real_output, real_labels);
      d_loss_real.backward();

      auto noise = kiln::randn({real_images.size(0), kNoiseSize, 1, 1});
      auto fake_images = generator(noise);
      auto fake_labels = kiln::zeros({real_images.size(0)});
      auto fake_output = discriminator->forward(fake_images.detach()).view({-1});
      auto d_loss_fake = kiln::binary_cross_entropy(fake_output, fake_labels);
      d_loss_fake.backward();
      kiln::Tensor d_loss = d_loss_real + d_loss_fake;
      discriminator_optimizer.step();

      // Generator: make the discriminator call its images real.
      generator->zero_grad();
      fake_labels.fill_(1);
      fake_output = discriminator->forward(fake_images).view({-1});
      kiln::Tensor g_loss = kiln::binary_cross_entropy(fake_output, fake_labels);
      g_loss.backward();
      generator_optimizer.step();

      const float d = d_loss.item<float>(), g = g_loss.item<float>();
      std::printf("[%2zu/%2zu][%3zu/%3zu] D_loss: %.4f | G_loss: %.4f\n", epoch, epochs,
                  ++batch_index, batches_per_epoch, d, g);
      if (!std::isfinite(d) || !std::isfinite(g)) {
        std::fprintf(stderr, "a loss is not finite\n");
        return false;
      }
    }
    kiln::save(generator, (out / "generator-checkpoint.safetensors").string());
    kiln::save(generator_optimizer, (out / "generator-optimizer-checkpoint.safetensors").string());
    kiln::save(discriminator, (out / "discriminator-checkpoint.safetensors").string());
    kiln::save(discriminator_optimizer,
               (out / "discriminator-optimizer-checkpoint.safetensors").string());
    kiln::NoGradGuard no_grad;
    generator->eval();
    auto samples = generator(kiln::randn({8, kNoiseSize, 1, 1}));
    generator->train();
    kiln::save((samples + 1) / 2, (out / "dcgan-sample.safetensors").string());
    std::printf("-> epoch %zu: checkpoint and 8 samples in %s\n", epoch, out.c_str());
  }

  // The checkpoint restores the same generator.
  Generator restored(channels);
  kiln::load(restored, (out / "generator-checkpoint.safetensors").string());
  kiln::NoGradGuard no_grad;
  generator->eval();
  restored->eval();
  auto noise = kiln::randn({4, kNoiseSize, 1, 1});
  auto a = generator(noise), b = restored(noise);
  const bool same = kiln::equal(a, b);
  const bool in_range = a.abs().max().item<float>() <= 1.0f;
  std::printf("checkpoint restores the generator: %s; samples in [-1, 1]: %s\n",
              same ? "yes" : "NO", in_range ? "yes" : "NO");
  return same && in_range;
}

}  // namespace

int main(int argc, char** argv) {
  kiln::manual_seed(0);
  const std::string root = argc > 1 ? argv[1] : "";
  const size_t epochs = argc > 2 ? std::strtoul(argv[2], nullptr, 10) : has_mnist(root) ? 30 : 2;
  fs::path out =
      argc > 3 ? fs::path(argv[3])
               : fs::temp_directory_path() / ("kiln_dcgan_example_" + std::to_string(::getpid()));
  fs::create_directories(out);

  using namespace kiln::data;
  bool ok;
  if (has_mnist(root)) {
    // Pixels in [0, 1] -> [-1, 1], the generator's tanh range.
    ok = train(
        datasets::MNIST(root).map(transforms::Normalize<>(0.5, 0.5)).map(transforms::Stack<>()),
        /*channels=*/64, epochs, out);
  } else {
    std::printf("No MNIST files%s%s: training on synthetic images\n", root.empty() ? "" : " in ",
                root.c_str());
    ok = train(
        SyntheticDigits(256).map(transforms::Normalize<>(0.5, 0.5)).map(transforms::Stack<>()),
        /*channels=*/16, epochs, out);
  }
  if (argc <= 3) fs::remove_all(out);
  return ok ? 0 : 1;
}
