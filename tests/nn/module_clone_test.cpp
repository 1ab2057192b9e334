// Module::clone() (nn/module.h) for every built-in layer and container: the copy has the same
// type, the same values, dtypes and requires_grad, but its own storage (writing into it, or
// training it, leaves the original untouched); its forward gives the original's outputs; containers
// clone their children; CUDA modules stay on CUDA; and modules that cannot be cloned are named.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <typeinfo>

#include "kernels/cuda.h"
#include "test_util.h"

namespace kiln {
namespace {

// Parameters and buffers by name, as detached copies.
std::map<std::string, Tensor> snapshot(const nn::Module& m) {
  std::map<std::string, Tensor> out;
  for (const auto& p : m.named_parameters()) out.emplace(p.key(), p.value().detach().clone());
  for (const auto& b : m.named_buffers()) out.emplace(b.key(), b.value().detach().clone());
  return out;
}

::testing::AssertionResult same_state(const nn::Module& m, const std::map<std::string, Tensor>& s) {
  const auto now = snapshot(m);
  if (now.size() != s.size()) {
    return ::testing::AssertionFailure() << now.size() << " tensors, expected " << s.size();
  }
  for (const auto& [name, t] : s) {
    auto it = now.find(name);
    if (it == now.end()) return ::testing::AssertionFailure() << "no tensor " << name;
    if (it->second.dtype() != t.dtype() || !equal(it->second, t)) {
      return ::testing::AssertionFailure() << name << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

// Clones `layer` and checks the copy: its type, values, dtypes, requires_grad and devices; that
// its forward (`fwd`, run with the same seed for dropout) gives the original's output, and that
// a training step and in-place writes on the copy leave the original as it was.
template <typename Holder, typename Fwd>
void check_clone(const std::string& what, Holder layer, Fwd fwd) {
  SCOPED_TRACE(what);
  using Impl = typename Holder::ContainedType;
  const auto before = snapshot(*layer);
  const std::shared_ptr<nn::Module> base = layer->clone();
  auto copy = std::dynamic_pointer_cast<Impl>(base);
  ASSERT_NE(copy, nullptr) << "the clone of a " << typeid(Impl).name() << " is a "
                           << typeid(*base).name();
  ASSERT_NE(copy.get(), layer.get());
  EXPECT_EQ(copy->is_training(), layer->is_training());
  EXPECT_TRUE(same_state(*copy, before));
  const auto mine = layer->named_parameters(), theirs = copy->named_parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (const auto& p : mine) {
    const Tensor& q = theirs[p.key()];
    EXPECT_FALSE(q.is_same(p.value())) << p.key();
    EXPECT_NE(q.data_ptr(), p.value().data_ptr()) << p.key();
    EXPECT_EQ(q.requires_grad(), p.value().requires_grad()) << p.key();
    EXPECT_EQ(q.device(), p.value().device()) << p.key();
    EXPECT_TRUE(q.is_leaf()) << p.key();
    EXPECT_FALSE(q.grad().defined()) << p.key();
  }
  for (const auto& b : layer->named_buffers()) {
    const Tensor q = copy->named_buffers()[b.key()];
    EXPECT_NE(q.data_ptr(), b.value().data_ptr()) << b.key();
    EXPECT_EQ(q.device(), b.value().device()) << b.key();
  }

  // The copy runs and trains first: nothing of the original may move (BatchNorm's running
  // statistics included).
  manual_seed(123);
  const Tensor y_copy = fwd(*copy);
  EXPECT_TRUE(same_state(*layer, before));
  if (y_copy.requires_grad()) {
    (y_copy.square().sum() + y_copy.sum()).backward();
    NoGradGuard no_grad;
    for (Tensor& p : copy->parameters()) {
      if (p.grad().defined()) p.sub_(p.grad() * 0.5);
    }
  }
  manual_seed(123);
  const Tensor y = fwd(*layer);
  EXPECT_TRUE(equal(y_copy, y));
  EXPECT_TRUE(same_state(*layer, snapshot(*layer)));
  {
    NoGradGuard no_grad;
    for (Tensor& p : copy->parameters()) p.add_(1);
    for (Tensor& b : copy->buffers()) {
      if (b.is_floating_point()) b.add_(1);
    }
  }
  const auto after = snapshot(*layer);
  bool copy_moved = false;
  for (const auto& p : layer->named_parameters()) {
    EXPECT_FALSE(p.value().grad().defined()) << "the original got a gradient: " << p.key();
    copy_moved |= !equal(theirs[p.key()], p.value());
  }
  EXPECT_EQ(copy_moved, !mine.is_empty());
  // The original's forward is what it was before the copy trained.
  manual_seed(123);
  EXPECT_TRUE(equal(fwd(*layer), y));
}

template <typename Holder>
void check_unary(const std::string& what, Holder layer, const Tensor& x) {
  check_clone(what, layer, [x](typename Holder::ContainedType& m) { return m.forward(x); });
}

TEST(ModuleCloneTest, LinearConvEmbedding) {
  manual_seed(1);
  check_unary("Linear", nn::Linear(4, 3), randn({2, 4}));
  check_unary("Linear without bias", nn::Linear(nn::LinearOptions(4, 3).bias(false)),
              randn({2, 4}));
  nn::Linear frozen(4, 3);
  frozen->bias.requires_grad_(false);
  frozen->to(kDouble);
  check_unary("Linear, f64, frozen bias", frozen, randn({2, 4}, kDouble));
  check_unary("Identity", nn::Identity(), randn({2, 4}));
  check_unary("Flatten", nn::Flatten(), randn({2, 3, 4}));
  check_unary("Conv2d", nn::Conv2d(nn::Conv2dOptions(2, 3, 3).padding(1)), randn({2, 2, 5, 5}));
  check_unary("ConvTranspose1d", nn::ConvTranspose1d(nn::ConvTranspose1dOptions(2, 3, 3).stride(2)),
              randn({2, 2, 5}));
  check_unary("ConvTranspose2d", nn::ConvTranspose2d(2, 3, 3), randn({1, 2, 4, 4}));
  check_unary("Embedding", nn::Embedding(nn::EmbeddingOptions(10, 4).padding_idx(0)),
              tensor({0, 3, 9, 3}, kInt64));
  nn::Embedding frozen_table(nn::EmbeddingOptions(5, 2)._weight(randn({5, 2})));
  frozen_table->weight.requires_grad_(false);
  check_unary("Embedding from a given, frozen table", frozen_table, tensor({1, 4}, kInt64));
}

TEST(ModuleCloneTest, NormalizationDropoutActivationsPooling) {
  manual_seed(2);
  const Tensor x = randn({2, 3, 4, 4});
  check_unary("LayerNorm", nn::LayerNorm(nn::LayerNormOptions({4})), x);
  check_unary("RMSNorm", nn::RMSNorm(nn::RMSNormOptions({4})), x);
  nn::BatchNorm2d bn(3);
  bn(randn({4, 3, 2, 2}) * 3 + 1);  // running statistics away from their initial values
  check_unary("BatchNorm2d, training", bn, x);
  nn::BatchNorm2d bn_eval(3);
  bn_eval(randn({4, 3, 2, 2}) + 2);
  bn_eval->eval();
  check_unary("BatchNorm2d, eval", bn_eval, x);
  check_unary("Dropout", nn::Dropout(0.5), x);
  check_unary("Dropout2d", nn::Dropout2d(0.5), x);
  check_unary("ReLU", nn::ReLU(), x);
  check_unary("LeakyReLU", nn::LeakyReLU(nn::LeakyReLUOptions().negative_slope(0.2)), x);
  check_unary("GELU", nn::GELU(nn::GELUOptions().approximate("tanh")), x);
  check_unary("SiLU", nn::SiLU(), x);
  check_unary("Tanh", nn::Tanh(), x);
  check_unary("Sigmoid", nn::Sigmoid(), x);
  check_unary("Softmax", nn::Softmax(1), x);
  check_unary("LogSoftmax", nn::LogSoftmax(1), x);
  check_unary("MaxPool2d", nn::MaxPool2d(2), x);
  check_unary("AvgPool2d", nn::AvgPool2d(2), x);
}

TEST(ModuleCloneTest, Losses) {
  manual_seed(3);
  const Tensor logits = randn({4, 3}), labels = tensor({0, 2, 1, 2}, kInt64);
  const Tensor targets = rand({4, 3});
  const auto with = [](const Tensor& input, const Tensor& target) {
    return [input, target](auto& m) { return m.forward(input, target); };
  };
  check_clone("MSELoss", nn::MSELoss(), with(logits, targets));
  check_clone("L1Loss", nn::L1Loss(), with(logits, targets));
  check_clone("SmoothL1Loss", nn::SmoothL1Loss(), with(logits, targets));
  check_clone("KLDivLoss", nn::KLDivLoss(), with(logits.log_softmax(1), targets));
  check_clone("NLLLoss", nn::NLLLoss(nn::NLLLossOptions().weight(tensor({1.0f, 2.0f, 0.5f}))),
              with(logits.log_softmax(1), labels));
  check_clone(
      "CrossEntropyLoss",
      nn::CrossEntropyLoss(nn::CrossEntropyLossOptions().weight(tensor({1.0f, 2.0f, 3.0f}))),
      with(logits, labels));
  check_clone("BCELoss", nn::BCELoss(), with(logits.sigmoid(), targets));
  check_clone("BCEWithLogitsLoss",
              nn::BCEWithLogitsLoss(nn::BCEWithLogitsLossOptions()
                                        .weight(tensor({1.0f, 0.5f, 2.0f}))
                                        .pos_weight(tensor({3.0f, 1.0f, 1.0f}))),
              with(logits, targets));
  // The weights are buffers of the copy's own, and its options point at them.
  nn::CrossEntropyLoss loss(nn::CrossEntropyLossOptions().weight(tensor({1.0f, 2.0f, 3.0f})));
  auto copy = std::dynamic_pointer_cast<nn::CrossEntropyLossImpl>(loss->clone());
  ASSERT_NE(copy, nullptr);
  copy->options.weight().fill_(1.0f);
  EXPECT_TRUE(equal(loss->options.weight(), tensor({1.0f, 2.0f, 3.0f})));
  EXPECT_TRUE(equal(copy->named_buffers()["weight"], ones({3})));
}

TEST(ModuleCloneTest, RecurrentLayersAndCells) {
  manual_seed(4);
  const Tensor x = randn({5, 2, 3});
  check_clone("LSTM", nn::LSTM(nn::LSTMOptions(3, 4).num_layers(2).bidirectional(true)),
              [x](nn::LSTMImpl& m) { return std::get<0>(m.forward(x)); });
  check_clone("LSTM with proj_size", nn::LSTM(nn::LSTMOptions(3, 4).proj_size(2)),
              [x](nn::LSTMImpl& m) { return std::get<1>(std::get<1>(m.forward(x))); });
  check_clone("GRU", nn::GRU(nn::GRUOptions(3, 4).batch_first(true).dropout(0.5).num_layers(2)),
              [x](nn::GRUImpl& m) { return std::get<0>(m.forward(x)); });
  check_clone("RNN relu", nn::RNN(nn::RNNOptions(3, 4).nonlinearity(kiln::kReLU).bias(false)),
              [x](nn::RNNImpl& m) { return std::get<1>(m.forward(x)); });
  const Tensor xt = randn({2, 3});
  check_unary("RNNCell", nn::RNNCell(3, 4), xt);
  check_unary("GRUCell", nn::GRUCell(3, 4), xt);
  check_clone("LSTMCell", nn::LSTMCell(3, 4),
              [xt](nn::LSTMCellImpl& m) { return std::get<1>(m.forward(xt)); });
}

TEST(ModuleCloneTest, ContainersCloneTheirChildren) {
  manual_seed(5);
  const Tensor x = randn({3, 4});
  nn::Sequential seq(nn::Linear(4, 8), nn::ReLU(), nn::Dropout(0.2), nn::Linear(8, 2),
                     nn::Functional([](Tensor t) { return t * 2; }));
  check_unary("Sequential", seq, x);
  nn::Sequential named({{"fc", nn::Linear(4, 4)}, {"act", nn::Tanh()}});
  auto copy = std::dynamic_pointer_cast<nn::SequentialImpl>(named->clone());
  ASSERT_NE(copy, nullptr);
  EXPECT_EQ(copy->named_children().keys(), (std::vector<std::string>{"fc", "act"}));
  EXPECT_NE(copy->ptr<nn::LinearImpl>(0), named->ptr<nn::LinearImpl>(0));

  nn::ModuleList list(nn::Linear(4, 4), nn::LayerNorm(nn::LayerNormOptions({4})));
  check_clone("ModuleList", list, [x](nn::ModuleListImpl& m) {
    return m.at<nn::LayerNormImpl>(1).forward(m.at<nn::LinearImpl>(0).forward(x));
  });
  nn::ModuleDict dict({{"a", nn::Linear(4, 3).ptr()}, {"b", nn::GELU().ptr()}});
  check_clone("ModuleDict", dict, [x](nn::ModuleDictImpl& m) {
    return m.at<nn::GELUImpl>("b").forward(m.at<nn::LinearImpl>("a").forward(x));
  });
  // Each child keeps its own mode.
  nn::Sequential mixed(nn::Linear(4, 4), nn::Dropout(0.5));
  mixed[1]->eval();
  auto mixed_copy = mixed->clone();
  EXPECT_TRUE(mixed_copy->is_training());
  EXPECT_TRUE(mixed_copy->children()[0]->is_training());
  EXPECT_FALSE(mixed_copy->children()[1]->is_training());
}

// A user module of libtorch's Cloneable kind holding built-in containers: the whole tree is new.
struct TowerImpl : nn::Cloneable<TowerImpl> {
  TowerImpl() { reset(); }
  void reset() override {
    body = register_module("body", nn::Sequential(nn::Linear(4, 6), nn::GELU(), nn::Linear(6, 2)));
    heads = register_module("heads", nn::ModuleList(nn::Linear(2, 1), nn::Linear(2, 3)));
  }
  Tensor forward(const Tensor& x) {
    const Tensor h = body(x);
    return cat({heads->at<nn::LinearImpl>(0).forward(h), heads->at<nn::LinearImpl>(1).forward(h)},
               1);
  }
  nn::Sequential body{nullptr};
  nn::ModuleList heads{nullptr};
};
KILN_MODULE(Tower);

TEST(ModuleCloneTest, UserCloneableModuleOfContainers) {
  manual_seed(6);
  check_unary("Tower", Tower(), randn({3, 4}));
}

// Built-in layers and containers name the module that cannot be cloned.
struct PlainImpl : nn::Module {
  PlainImpl() { w = register_parameter("w", ones({2})); }
  Tensor forward(const Tensor& x) { return x * w; }
  Tensor w;
};
KILN_MODULE(Plain);

struct BadResetImpl : nn::Cloneable<BadResetImpl> {
  BadResetImpl() { reset(); }
  void reset() override { w = register_parameter("w", zeros({++size})); }
  int64_t size = 1;
  Tensor w;
};
KILN_MODULE(BadReset);

TEST(ModuleCloneTest, ModulesThatCannotBeClonedAreNamed) {
  EXPECT_KILN_ERROR(Plain()->clone(), "[clone] kiln::PlainImpl does not support clone()");
  EXPECT_KILN_ERROR(nn::Sequential(nn::Linear(2, 2), Plain())->clone(), "PlainImpl does not");
  nn::ModuleList list(nn::Linear(2, 2));
  list->push_back(Plain());
  EXPECT_KILN_ERROR(list->clone(), "PlainImpl does not support clone()");
  EXPECT_KILN_ERROR(BadReset()->clone(), "parameter 'w' has shape [2] but reset() made [3]");
}

// check_clone itself catches a shallow copy: a clone() that shares the weight's storage.
struct ShallowImpl : nn::Module {
  ShallowImpl() : ShallowImpl(randn({3})) {}
  explicit ShallowImpl(const Tensor& values) { w = register_parameter("w", values.detach()); }
  Tensor forward(const Tensor& x) { return x * w; }
  std::shared_ptr<nn::Module> clone(const std::optional<Device>& = std::nullopt) const override {
    return std::make_shared<ShallowImpl>(w);
  }
  Tensor w;
};
KILN_MODULE(Shallow);

TEST(ModuleCloneTest, TheCheckCatchesSharedStorage) {
  Shallow shallow;
  const Tensor x = randn({3});
  ::testing::TestPartResultArray failures;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    check_unary("shallow", shallow, x);
  }
  std::string all;
  for (int i = 0; i < failures.size(); ++i) all += failures.GetTestPartResult(i).message();
  // The same storage, and the copy's training step showing through the original.
  EXPECT_NE(all.find("q.data_ptr()"), std::string::npos) << all;
  EXPECT_NE(all.find("equal(y_copy, y)"), std::string::npos) << all;
}

TEST(GpuModuleClone, ToAnotherDevice) {
  manual_seed(7);
  nn::LSTM lstm(nn::LSTMOptions(3, 4));
  // clone(device) on the module's own device still copies.
  auto same = lstm->clone(Device(kCPU));
  for (const Tensor& p : same->parameters()) EXPECT_TRUE(p.device().is_cpu());
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  nn::Sequential seq(nn::Linear(3, 4), nn::BatchNorm2d(4));
  seq->to(kCUDA);
  auto copy = seq->clone();
  for (const Tensor& t : copy->parameters()) EXPECT_TRUE(t.is_cuda());
  for (const Tensor& t : copy->buffers()) EXPECT_TRUE(t.is_cuda());
  lstm->to(kCUDA);
  check_clone("LSTM on CUDA", lstm, [](nn::LSTMImpl& m) {
    return std::get<0>(m.forward(randn({4, 2, 3}, TensorOptions().device(kCUDA))));
  });
  auto back = lstm->clone(Device(kCPU));
  for (const Tensor& p : back->parameters()) EXPECT_TRUE(p.device().is_cpu());
}

}  // namespace
}  // namespace kiln
