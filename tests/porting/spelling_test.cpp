// libtorch spellings that a ported program uses (issue 22, point 3). Each test is a snippet
// written the way libtorch code is written, with `using namespace kiln;` where libtorch code
// says `using namespace torch;`, and checks what it computes.
#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

using namespace kiln;  // as `using namespace torch;`

namespace {

namespace fs = std::filesystem;

std::string temp_file(const std::string& name) {
  return (fs::temp_directory_path() / ("kiln_porting_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

TEST(SpellingTest, SliceTakesNoneAsABound) {
  using namespace indexing;
  Tensor t = arange(12).view({3, 4});
  EXPECT_TRUE(equal(t.index({Slice(1, None)}), t.slice(0, 1)));                       // t[1:]
  EXPECT_TRUE(equal(t.index({Slice(None, 2)}), t.slice(0, 0, 2)));                    // t[:2]
  EXPECT_TRUE(equal(t.index({Slice(), Slice(None, None, 2)}), t.slice(1, 0, 4, 2)));  // t[:, ::2]
  EXPECT_TRUE(equal(t.index({Slice(-2, None), 0}), tensor({4, 8})));                  // t[-2:, 0]
  t.index_put_({Slice(None, 1)}, 0);
  EXPECT_EQ(t.sum().item<int64_t>(), 66 - 6);
}

TEST(SpellingTest, InPlaceOnAConstHandle) {
  Tensor w = ones({3}, requires_grad());
  (w * 2).sum().backward();
  EXPECT_TRUE(equal(w.grad(), full({3}, 2.0)));
  w.grad().zero_();  // grad() is a const Tensor&
  EXPECT_TRUE(equal(w.grad(), zeros({3})));
  const Tensor& g = w.grad();
  g.add_(1).mul_(3);
  EXPECT_TRUE(equal(w.grad(), full({3}, 3.0)));
  const Tensor c = zeros({2});
  c.fill_(4).sub_(1);
  EXPECT_TRUE(equal(c, full({2}, 3.0)));
}

TEST(SpellingTest, DtypeShortNames) {
  EXPECT_EQ(zeros({1}, kF32).dtype(), kFloat32);
  EXPECT_EQ(zeros({1}, kF16).dtype(), kFloat16);
  EXPECT_EQ(zeros({1}, kF64).dtype(), kFloat64);
  EXPECT_EQ(zeros({1}, kI64).dtype(), kInt64);
  EXPECT_EQ(zeros({1}, kI32).dtype(), kInt32);
  EXPECT_EQ(zeros({1}, kU8).dtype(), kByte);
  auto t = randn({2, 2}).to(kF64);
  EXPECT_EQ(t.dtype(), kDouble);
}

TEST(SpellingTest, ByteImages) {
  std::vector<uint8_t> image_bytes = {0, 255, 51, 102, 0, 0};  // 1 x 2 pixels, RGB
  auto img = from_blob(image_bytes.data(), {1, 2, 3}, kByte).to(kFloat).div(255);
  EXPECT_FLOAT_EQ(img[0][0][1].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(img[0][1][0].item<float>(), 0.4f);
  auto back = img.mul(255).round().to(kUInt8);
  EXPECT_EQ(back[0][0][2].item<uint8_t>(), 51);
  EXPECT_EQ(*back.data_ptr<uint8_t>(), 0);
  EXPECT_EQ(back.sum().item<int64_t>(), 408);  // uint8 sums into int64
}

TEST(SpellingTest, OptionalStrReshapeAndReduction) {
  optional<int64_t> dim = nullopt;
  EXPECT_FALSE(dim.has_value());
  EXPECT_EQ(str("got ", 3, " items, dtype ", kF32), "got 3 items, dtype float32");
  Tensor x = arange(6);
  EXPECT_EQ(reshape(x, {2, 3}).sizes(), (IntArrayRef{2, 3}));
  EXPECT_EQ(flatten(reshape(x, {2, 3})).sizes(), (IntArrayRef{6}));
  // nll_loss with a summed reduction, as in libtorch's MNIST test loop.
  Tensor logp = log_softmax(tensor({{1.0, 2.0, 3.0}, {1.0, 0.0, -1.0}}), 1);
  Tensor target = tensor({2, 0});
  const double sum = nll_loss(logp, target, {}, Reduction::Sum).item<double>();
  const double want = -(logp[0][2].item<double>() + logp[1][0].item<double>());
  EXPECT_NEAR(sum, want, 1e-6);
  EXPECT_NEAR(nll_loss(logp, target).item<double>(), want / 2, 1e-6);
}

TEST(SpellingTest, InPlaceComparisons) {
  Tensor pred = tensor({1, 2, 3, 4});
  pred.eq_(tensor({1, 0, 3, 0}));
  EXPECT_TRUE(equal(pred, tensor({1, 0, 1, 0})));
  EXPECT_EQ(pred.dtype(), kInt64);  // stays in its dtype
  Tensor f = tensor({0.5, 1.5, 2.5});
  f.gt_(1.0);
  EXPECT_TRUE(equal(f, tensor({0.0, 1.0, 1.0})));
  Tensor g = tensor({0.5, 1.5, 2.5});
  g.le_(1.5).ne_(0);
  EXPECT_TRUE(equal(g, tensor({1.0, 1.0, 0.0})));
  Tensor h = tensor({1, 2, 3});
  h.lt_(2);
  EXPECT_TRUE(equal(h, tensor({1, 0, 0})));
  Tensor k = tensor({1, 2, 3});
  k.ge_(tensor({2, 2, 2}));
  EXPECT_TRUE(equal(k, tensor({0, 1, 1})));
}

TEST(SpellingTest, DataAndAccessor) {
  Tensor t = arange(6, kF32).view({2, 3});
  float* p = t.data<float>();
  EXPECT_EQ(p[4], 4.0f);
  auto a = t.accessor<float, 2>();
  EXPECT_EQ(a.size(0), 2);
  EXPECT_EQ(a[1][2], 5.0f);
  a[0][1] = 10;
  EXPECT_EQ(t[0][1].item<float>(), 10.0f);
  // Strided: the transpose's accessor follows its strides.
  Tensor tt = t.t();
  auto at = tt.accessor<float, 2>();
  EXPECT_EQ(at[2][1], 5.0f);
  EXPECT_EQ(at[1][0], 10.0f);
  Tensor row = t[1];
  auto a1 = row.accessor<float, 1>();
  EXPECT_EQ(a1[2], 5.0f);
  EXPECT_KILN_ERROR((t.accessor<float, 3>()),
                    "[accessor] expected a 3-D tensor, got one of shape [2, 3]");
  EXPECT_KILN_ERROR((t.accessor<double, 2>()), "[data_ptr] expected dtype float64");
}

TEST(SpellingTest, SizesPrintAsAList) {
  std::ostringstream os;
  os << zeros({2, 3}).sizes() << " " << zeros({}).sizes();
  EXPECT_EQ(os.str(), "[2, 3] []");
}

TEST(SpellingTest, SaveAndLoadTensorsAndOptimizers) {
  const std::string tf = temp_file("t.safetensors");
  const std::string vf = temp_file("v.safetensors");
  const std::string of = temp_file("opt.safetensors");
  Tensor t = randn({3, 4});
  save(t, tf);
  Tensor back;
  load(back, tf);
  EXPECT_TRUE(equal(back, t));

  std::vector<Tensor> list;
  for (int i = 0; i < 12; ++i) list.push_back(full({i + 1}, static_cast<double>(i)));
  save(list, vf);
  std::vector<Tensor> list_back;
  load(list_back, vf);
  ASSERT_EQ(list_back.size(), 12u);  // "10" and "11" sort before "2" in the file: order kept
  for (int i = 0; i < 12; ++i) EXPECT_TRUE(equal(list_back[i], list[i])) << i;
  EXPECT_KILN_ERROR(load(back, vf), "expected a file of one tensor");
  EXPECT_KILN_ERROR(load(list_back, tf), "expected a list of tensors");

  auto net = nn::Linear(4, 2);
  optim::Adam opt(net->parameters(), optim::AdamOptions(1e-2));
  net(randn({8, 4})).sum().backward();
  opt.step();
  save(opt, of);
  optim::Adam opt2(net->parameters(), optim::AdamOptions(1e-2));
  load(opt2, of);
  // The same next step from both: the state came back.
  std::vector<Tensor> before;
  for (auto& p : net->parameters()) before.push_back(p.detach().clone());
  opt.step();
  std::vector<Tensor> after1;
  for (auto& p : net->parameters()) after1.push_back(p.detach().clone());
  {
    NoGradGuard guard;
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) params[i].copy_(before[i]);
  }
  opt2.step();
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(equal(params[i], after1[i])) << i;
  fs::remove(tf);
  fs::remove(vf);
  fs::remove(of);
}

// A module written as libtorch's Cloneable modules are: reset() builds the layers.
struct TwoLayerImpl : nn::Cloneable<TwoLayerImpl> {
  explicit TwoLayerImpl(int64_t width) : width(width) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", nn::Linear(4, width));
    norm = register_module("norm", nn::BatchNorm2d(width));
    fc2 = register_module("fc2", nn::Linear(width, 2));
  }
  Tensor forward(const Tensor& x) {
    return fc2(norm(fc1(x).view({x.size(0), width, 1, 1})).view({x.size(0), width}));
  }
  int64_t width;
  nn::Linear fc1{nullptr}, fc2{nullptr};
  nn::BatchNorm2d norm{nullptr};
};
KILN_MODULE(TwoLayer);

struct PlainNetImpl : nn::Module {};

TEST(SpellingTest, ModuleClone) {
  manual_seed(5);
  TwoLayer net(8);
  net(randn({16, 4})).sum().backward();  // running statistics and gradients move on
  net->fc2->weight.requires_grad_(false);
  net->to(kF64);
  net->eval();
  std::shared_ptr<nn::Module> copy_base = net->clone();
  auto copy = std::dynamic_pointer_cast<TwoLayerImpl>(copy_base);
  ASSERT_NE(copy, nullptr);
  EXPECT_FALSE(copy->is_training());
  EXPECT_EQ(copy->width, 8);
  const auto mine = net->state_dict(), theirs = copy->state_dict();
  ASSERT_EQ(mine.size(), theirs.size());
  for (const auto& [name, t] : mine) {
    ASSERT_TRUE(theirs.count(name)) << name;
    EXPECT_TRUE(equal(theirs.at(name), t)) << name;
    EXPECT_EQ(theirs.at(name).dtype(), t.dtype()) << name;
    EXPECT_FALSE(theirs.at(name).is_same(t)) << name;
  }
  EXPECT_FALSE(copy->fc2->weight.requires_grad());
  EXPECT_TRUE(copy->fc1->weight.requires_grad());
  EXPECT_FALSE(copy->fc1->weight.grad().defined());
  // The same function, and independent storage.
  const Tensor x = randn({3, 4}, kF64);
  EXPECT_TRUE(equal(copy->forward(x), net(x)));
  {
    NoGradGuard guard;
    copy->fc1->weight.add_(1);
  }
  EXPECT_FALSE(equal(copy->fc1->weight, net->fc1->weight));
  // Built-in layers clone as in libtorch (tests/nn/module_clone_test.cpp checks each).
  nn::Linear fc(2, 2);
  auto fc_copy = std::dynamic_pointer_cast<nn::LinearImpl>(fc->clone());
  ASSERT_NE(fc_copy, nullptr);
  EXPECT_TRUE(equal(fc_copy->weight, fc->weight));
  EXPECT_NE(fc_copy->weight.data_ptr(), fc->weight.data_ptr());
  // A module derived from plain Module says what to do.
  EXPECT_KILN_ERROR(std::make_shared<PlainNetImpl>()->clone(),
                    "[clone] PlainNetImpl does not support clone(): derive it from "
                    "kiln::nn::Cloneable<PlainNetImpl>");
}

// Recurrent cells and packed sequences, spelled as libtorch code spells them.
TEST(SpellingTest, RecurrentCellsAndPackedSequences) {
  manual_seed(9);
  nn::LSTMCell cell(nn::LSTMCellOptions(4, 8).bias(true));
  auto [h, c] = cell(randn({2, 4}));
  std::tie(h, c) = cell(randn({2, 4}), std::make_tuple(h, c));
  EXPECT_EQ(c.sizes(), Shape({2, 8}));
  nn::GRUCell gru_cell(nn::GRUCellOptions(4, 8));
  EXPECT_EQ(gru_cell(randn({4}), zeros({8})).sizes(), Shape({8}));
  nn::GRU gru(nn::GRUOptions(4, 8).batch_first(true));
  const Tensor lengths = tensor({5, 2, 4}, kLong);
  auto packed = nn::utils::rnn::pack_padded_sequence(randn({3, 5, 4}), lengths,
                                                     /*batch_first=*/true,
                                                     /*enforce_sorted=*/false);
  auto [out, h_n] = gru->forward_with_packed_input(packed);
  auto [padded, out_lengths] = nn::utils::rnn::pad_packed_sequence(out, /*batch_first=*/true);
  EXPECT_EQ(padded.sizes(), Shape({3, 5, 8}));
  EXPECT_EQ(h_n.sizes(), Shape({1, 3, 8}));
  EXPECT_TRUE(equal(out_lengths, lengths));
  EXPECT_TRUE(equal(padded[1].narrow(0, 2, 3), zeros({3, 8})));
}

}  // namespace
