// kiln::nn::Module: registration, the tree (names, parameters, buffers, children), modes,
// to(), zero_grad, apply, state dicts, holders and printing.
#include "nn/module.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

using nn::Module;

// A block with a parameter, a persistent and a non-persistent buffer, and a Linear child.
struct BlockImpl : nn::Module {
  explicit BlockImpl(int64_t d) {
    fc = register_module("fc", nn::Linear(d, d));
    gain = register_parameter("gain", ones({d}));
    steps = register_buffer("steps", zeros({}, kInt64));
    cache = register_buffer("cache", zeros({d}), /*persistent=*/false);
  }
  Tensor forward(const Tensor& x) { return fc(x) * gain; }
  nn::Linear fc{nullptr};
  Tensor gain, steps, cache;
};
KILN_MODULE(Block);

struct NetImpl : nn::Module {
  NetImpl() {
    embed = register_module("embed", nn::Embedding(10, 4));
    blocks = register_module("blocks", nn::ModuleList(Block(4), Block(4)));
    head = register_module("head", nn::Linear(nn::LinearOptions(4, 2).bias(false)));
  }
  Tensor forward(const Tensor& tokens) {
    Tensor x = embed(tokens);
    for (const auto& b : *blocks) x = b->as<BlockImpl>()->forward(x);
    return head(x);
  }
  nn::Embedding embed{nullptr};
  nn::ModuleList blocks{nullptr};
  nn::Linear head{nullptr};
};
KILN_MODULE(Net);

Tensor tokens(std::vector<int64_t> v) {
  return from_blob(v.data(), {static_cast<int64_t>(v.size())}, kInt64).clone();
}

std::vector<std::string> keys_of(const std::map<std::string, Tensor>& m) {
  std::vector<std::string> out;
  for (const auto& [k, v] : m) out.push_back(k);
  return out;
}

TEST(ModuleTest, NamedParametersAreDottedInRegistrationOrder) {
  Net net;
  const std::vector<std::string> expected = {
      "embed.weight",  "blocks.0.gain",      "blocks.0.fc.weight", "blocks.0.fc.bias",
      "blocks.1.gain", "blocks.1.fc.weight", "blocks.1.fc.bias",   "head.weight"};
  // A module's own parameters come before its children's.
  EXPECT_EQ(net->named_parameters().keys(), expected);
  EXPECT_EQ(net->parameters().size(), expected.size());
  for (const auto& p : net->named_parameters()) {
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
    EXPECT_TRUE(p.value().is_leaf()) << p.key();
  }
  // The parameters are the members: same tensors, not copies.
  EXPECT_TRUE(net->named_parameters()["head.weight"].is_same(net->head->weight));
  EXPECT_TRUE(net->parameters()[0].is_same(net->embed->weight));
  // Not recursing: the module's own only.
  EXPECT_TRUE(net->named_parameters(/*recurse=*/false).is_empty());
  EXPECT_EQ(net->blocks[0]->named_parameters(false).keys(), std::vector<std::string>{"gain"});
  int64_t count = 0;
  for (const Tensor& p : net->parameters()) count += p.numel();
  EXPECT_EQ(count, 10 * 4 + 2 * (4 + 16 + 4) + 8);
}

TEST(ModuleTest, BuffersAndStateDict) {
  Net net;
  EXPECT_EQ(net->named_buffers().keys(),
            (std::vector<std::string>{"blocks.0.steps", "blocks.0.cache", "blocks.1.steps",
                                      "blocks.1.cache"}));
  EXPECT_EQ(net->buffers().size(), 4u);
  for (const Tensor& b : net->buffers()) EXPECT_FALSE(b.requires_grad());
  // Parameters and persistent buffers only, by dotted name.
  const auto sd = net->state_dict();
  EXPECT_EQ(keys_of(sd), (std::vector<std::string>{
                             "blocks.0.fc.bias", "blocks.0.fc.weight", "blocks.0.gain",
                             "blocks.0.steps", "blocks.1.fc.bias", "blocks.1.fc.weight",
                             "blocks.1.gain", "blocks.1.steps", "embed.weight", "head.weight"}));
  // Detached views of the same storage.
  const Tensor& w = sd.at("head.weight");
  EXPECT_FALSE(w.requires_grad());
  EXPECT_EQ(w.data_ptr(), net->head->weight.data_ptr());
  EXPECT_FALSE(net->blocks->at<BlockImpl>(0).is_persistent_buffer("cache"));
  EXPECT_TRUE(net->blocks->at<BlockImpl>(0).is_persistent_buffer("steps"));
}

TEST(ModuleTest, ChildrenAndModules) {
  Net net;
  EXPECT_EQ(net->named_children().keys(), (std::vector<std::string>{"embed", "blocks", "head"}));
  EXPECT_EQ(net->children().size(), 3u);
  EXPECT_EQ(net->children()[2].get(), net->head.get());
  const auto named = net->named_modules();
  EXPECT_EQ(named.keys(),
            (std::vector<std::string>{"", "embed", "blocks", "blocks.0", "blocks.0.fc", "blocks.1",
                                      "blocks.1.fc", "head"}));
  EXPECT_EQ(named[""].get(), net.get());
  EXPECT_EQ(net->modules().size(), 8u);
  EXPECT_EQ(net->modules(/*include_self=*/false).size(), 7u);
  EXPECT_EQ(net->named_modules("model").keys()[1], "model.embed");
  EXPECT_EQ(net->named_modules("", false).keys()[0], "embed");
}

TEST(ModuleTest, ModulesNeedSharedOwnershipForSelf) {
  BlockImpl block(2);  // on the stack: no shared_ptr to return for itself
  EXPECT_KILN_ERROR(block.modules(), "not held by a std::shared_ptr");
  EXPECT_EQ(block.modules(/*include_self=*/false).size(), 1u);
}

TEST(ModuleTest, SharedParametersAreListedOnce) {
  struct TiedImpl : nn::Module {
    TiedImpl() {
      a = register_module("a", nn::Linear(3, 3));
      b = register_module("b", nn::Linear(3, 3));
      b->weight = b->register_parameter("tied", a->weight);
    }
    nn::Linear a{nullptr}, b{nullptr};
  };
  auto tied = std::make_shared<TiedImpl>();
  const auto names = tied->named_parameters().keys();
  EXPECT_EQ(names, (std::vector<std::string>{"a.weight", "a.bias", "b.weight", "b.bias"}));
  EXPECT_EQ(tied->parameters().size(), 4u);
  // The state dict keeps every name (as PyTorch's), sharing the storage.
  const auto sd = tied->state_dict();
  EXPECT_EQ(sd.size(), 5u);
  EXPECT_EQ(sd.at("b.tied").data_ptr(), sd.at("a.weight").data_ptr());
}

TEST(ModuleTest, RegistrationErrors) {
  Module m;
  m.register_parameter("w", zeros({2}));
  EXPECT_KILN_ERROR(m.register_parameter("w", zeros({2})), "[register_parameter]");
  EXPECT_KILN_ERROR(m.register_buffer("w", zeros({2})), "already has a parameter named 'w'");
  EXPECT_KILN_ERROR(m.register_module("w", nn::Linear(2, 2)), "[register_module]");
  EXPECT_KILN_ERROR(m.register_parameter("a.b", zeros({2})), "must not contain a dot");
  EXPECT_KILN_ERROR(m.register_buffer("", zeros({2})), "must not be empty");
  EXPECT_KILN_ERROR(m.register_module("x", std::shared_ptr<nn::LinearImpl>()), "is null");
  EXPECT_KILN_ERROR(m.replace_module("nope", nn::Linear(2, 2)), "[replace_module]");
  EXPECT_KILN_ERROR(m.unregister_module("nope"), "[unregister_module]");
  // Integer tensors cannot require gradients.
  EXPECT_KILN_ERROR(m.register_parameter("i", zeros({2}, kInt64)), "[requires_grad_]");
  m.register_parameter("frozen", zeros({2}), /*requires_grad=*/false);
  EXPECT_FALSE(m.named_parameters()["frozen"].requires_grad());
  // A non-leaf is detached into a leaf of its own.
  Tensor x = ones({2}).requires_grad_(true);
  Tensor& p = m.register_parameter("derived", x * 2);
  EXPECT_TRUE(p.is_leaf());
  EXPECT_TRUE(p.requires_grad());
}

TEST(ModuleTest, ReplaceAndUnregisterModules) {
  Net net;
  auto old_head = net->head;
  net->head = net->replace_module("head", nn::Linear(4, 3));
  EXPECT_EQ(net->named_children()["head"].get(), net->head.get());
  EXPECT_NE(net->head.get(), old_head.get());
  EXPECT_EQ(net->named_parameters()["head.bias"].size(0), 3);
  net->unregister_module("head");
  EXPECT_FALSE(net->named_children().contains("head"));
  EXPECT_FALSE(net->state_dict().contains("head.weight"));
}

TEST(ModuleTest, TrainEvalPropagate) {
  Net net;
  EXPECT_TRUE(net->is_training());
  net->eval();
  for (const auto& m : net->modules()) EXPECT_FALSE(m->is_training()) << m->name();
  net->blocks->train();
  EXPECT_FALSE(net->is_training());
  EXPECT_TRUE(net->blocks[1]->is_training());
  EXPECT_TRUE(net->blocks->at<BlockImpl>(1).fc->is_training());
  net->train(true);
  for (const auto& m : net->modules()) EXPECT_TRUE(m->is_training());
}

TEST(ModuleTest, ToDtypeKeepsIdentityLeavesAndGrads) {
  Net net;
  Tensor w = net->head->weight;  // a handle taken before the conversion
  const auto before = net->head->weight.to_vector<double>();
  net->forward(tokens({1, 2})).sum().backward();
  ASSERT_TRUE(w.grad().defined());
  net->to(kDouble);
  for (const auto& p : net->named_parameters()) {
    EXPECT_EQ(p.value().dtype(), kDouble) << p.key();
    EXPECT_TRUE(p.value().is_leaf()) << p.key();
    EXPECT_TRUE(p.value().requires_grad()) << p.key();
  }
  // Every handle sees the converted data, values preserved; the gradient follows.
  EXPECT_EQ(w.dtype(), kDouble);
  EXPECT_TRUE(w.is_same(net->head->weight));
  EXPECT_EQ(w.to_vector<double>(), before);
  EXPECT_EQ(w.grad().dtype(), kDouble);
  // Integer buffers stay integers; floating buffers (persistent or not) convert.
  EXPECT_EQ(net->blocks->at<BlockImpl>(0).steps.dtype(), kInt64);
  EXPECT_EQ(net->blocks->at<BlockImpl>(0).cache.dtype(), kDouble);
  // The module still trains in the new dtype.
  net->zero_grad();
  net->forward(tokens({3})).sum().backward();
  EXPECT_EQ(net->head->weight.grad().dtype(), kDouble);
  net->to(kBFloat16);
  EXPECT_EQ(net->embed->weight.dtype(), kBFloat16);
  net->to(Device(kCPU), kFloat);
  EXPECT_EQ(net->embed->weight.dtype(), kFloat);
  net->to(Device(kCPU));
  EXPECT_EQ(net->embed->weight.device(), Device(kCPU));
  EXPECT_KILN_ERROR(net->to(kInt32), "[Module::to]");
}

TEST(ModuleTest, ZeroGrad) {
  nn::Linear fc(3, 2);
  fc(ones({4, 3})).sum().backward();
  ASSERT_TRUE(fc->weight.grad().defined());
  fc->zero_grad(/*set_to_none=*/false);
  EXPECT_TRUE(equal(fc->weight.grad(), zeros({2, 3})));
  EXPECT_TRUE(equal(fc->bias.grad(), zeros({2})));
  fc(ones({4, 3})).sum().backward();
  EXPECT_TRUE(allclose(fc->bias.grad(), full({2}, 4.0)));
  fc->zero_grad();
  EXPECT_FALSE(fc->weight.grad().defined());
  EXPECT_FALSE(fc->bias.grad().defined());
  fc->zero_grad();  // no gradient at all: nothing to do
}

TEST(ModuleTest, Apply) {
  Net net;
  std::vector<std::string> names;
  net->apply([&](const std::string& name, Module& m) { names.push_back(name); });
  EXPECT_EQ(names, net->named_modules().keys());
  int linears = 0;
  net->apply([&](Module& m) {
    if (auto* fc = m.as<nn::Linear>()) {
      ++linears;
      nn::init::zeros_(fc->weight);
    }
  });
  EXPECT_EQ(linears, 3);
  EXPECT_TRUE(equal(net->head->weight, zeros({2, 4})));
  int count = 0;
  static_cast<const Module&>(*net).apply([&](const Module&) { ++count; });
  EXPECT_EQ(count, 8);
}

TEST(ModuleTest, LoadStateDictCopiesAndConverts) {
  Net a, b;
  b->to(kDouble);
  b->load_state_dict(a->state_dict());
  const auto sa = a->state_dict(), sb = b->state_dict();
  for (const auto& [key, t] : sa) {
    const Tensor& mine = sb.at(key);
    EXPECT_EQ(mine.dtype(), t.dtype() == kInt64 ? kInt64 : kDouble) << key;
    EXPECT_TRUE(allclose(mine.to(t.dtype()), t)) << key;
  }
  // Copies, not aliases: b's parameters keep their own storage.
  EXPECT_NE(b->head->weight.data_ptr(), a->head->weight.data_ptr());
  EXPECT_TRUE(b->head->weight.is_leaf());
  EXPECT_TRUE(b->head->weight.requires_grad());
}

TEST(ModuleTest, LoadStateDictErrorsListEverything) {
  Net net;
  auto sd = net->state_dict();
  const Tensor before = net->embed->weight.clone();
  sd.erase("head.weight");
  sd.erase("blocks.1.gain");
  sd["extra.weight"] = zeros({1});
  sd["embed.weight"] = zeros({11, 4});
  try {
    net->load_state_dict(sd);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[load_state_dict]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing key(s): \"blocks.1.gain\", \"head.weight\""), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("unexpected key(s): \"extra.weight\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("size mismatch for embed.weight: copying a tensor of shape [11, 4]"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("the shape in the current model is [10, 4]"), std::string::npos) << msg;
  }
  // Nothing was copied.
  EXPECT_TRUE(equal(net->embed->weight, before));
  // Non-strict: missing and unexpected keys are reported, shape mismatches still fail.
  EXPECT_KILN_ERROR(net->load_state_dict(sd, /*strict=*/false), "size mismatch for embed.weight");
  sd.erase("embed.weight");
  const nn::LoadStateDictResult r = net->load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(r.missing_keys,
            (std::vector<std::string>{"blocks.1.gain", "embed.weight", "head.weight"}));
  EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"extra.weight"});
  sd.erase("extra.weight");
  sd["blocks.1.gain"] = Tensor();
  EXPECT_KILN_ERROR(net->load_state_dict(sd, false),
                    "blocks.1.gain: the given tensor is undefined");
}

TEST(ModuleTest, HoldersBehaveAsLibtorch) {
  nn::Linear empty{nullptr};
  EXPECT_TRUE(empty.is_empty());
  EXPECT_FALSE(static_cast<bool>(empty));
  EXPECT_KILN_ERROR(empty->weight, "[Linear] accessing an empty module holder");
  EXPECT_KILN_ERROR(empty(ones({1, 4})), "[Linear] accessing an empty module holder");
  EXPECT_KILN_ERROR(empty.ptr(), "[Linear] accessing an empty module holder");
  Block no_block{nullptr};
  EXPECT_KILN_ERROR(*no_block, "[Block] accessing an empty module holder");

  empty = nn::Linear(4, 1);
  EXPECT_FALSE(empty.is_empty());
  EXPECT_EQ(empty->weight.sizes(), (Shape{1, 4}));
  nn::Linear copy = empty;  // shares the module
  EXPECT_EQ(copy.get(), empty.get());
  nn::Linear from_ptr(std::make_shared<nn::LinearImpl>(2, 2));
  EXPECT_EQ(from_ptr->options.in_features(), 2);
  nn::Linear from_options(nn::LinearOptions(3, 5).bias(false));
  EXPECT_FALSE(from_options->bias.defined());
  EXPECT_EQ(from_options->parameters().size(), 1u);
  // Calling the holder runs forward.
  Tensor x = randn({2, 4});
  EXPECT_TRUE(equal(empty(x), empty->forward(x)));
  // A default-constructible module makes a default-constructible holder.
  nn::Sequential seq;
  EXPECT_FALSE(seq.is_empty());
  EXPECT_EQ(seq->size(), 0u);
  // register_module returns the holder (or the shared_ptr) it was given.
  Module parent;
  nn::Linear registered = parent.register_module("fc", nn::Linear(2, 2));
  EXPECT_EQ(parent.named_children()["fc"].get(), registered.get());
  std::shared_ptr<nn::LinearImpl> raw =
      parent.register_module("raw", std::make_shared<nn::LinearImpl>(2, 3));
  EXPECT_EQ(raw->options.out_features(), 3);
  EXPECT_EQ(parent.as<nn::Linear>(), nullptr);
  EXPECT_NE(registered->as<nn::LinearImpl>(), nullptr);
}

TEST(ModuleTest, UserModuleThroughItsHolder) {
  Block block(3);
  Tensor x = randn({5, 3});
  EXPECT_TRUE(allclose(block(x), block->fc(x) * block->gain));
  EXPECT_EQ(block->name(), "kiln::BlockImpl");
  Module named("MyName");
  EXPECT_EQ(named.name(), "MyName");
  EXPECT_EQ(Module().name(), "kiln::nn::Module");
}

TEST(ModuleTest, PrettyPrintsTheTree) {
  Net net;
  std::ostringstream os;
  os << *net;
  EXPECT_EQ(os.str(),
            "kiln::NetImpl(\n"
            "  (embed): kiln::nn::Embedding(num_embeddings=10, embedding_dim=4)\n"
            "  (blocks): kiln::nn::ModuleList(\n"
            "    (0): kiln::BlockImpl(\n"
            "      (fc): kiln::nn::Linear(in_features=4, out_features=4, bias=true)\n"
            "    )\n"
            "    (1): kiln::BlockImpl(\n"
            "      (fc): kiln::nn::Linear(in_features=4, out_features=4, bias=true)\n"
            "    )\n"
            "  )\n"
            "  (head): kiln::nn::Linear(in_features=4, out_features=2, bias=false)\n"
            ")");
  std::ostringstream one;
  one << nn::Linear(4, 1);  // holders print their module
  EXPECT_EQ(one.str(), "kiln::nn::Linear(in_features=4, out_features=1, bias=true)");
}

TEST(ModuleTest, OrderedDict) {
  OrderedDict<std::string, int> d("Thing");
  d.insert("b", 1);
  d.insert("a", 2);
  d.update("c", 3);
  d.update("b", 4);
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"b", "a", "c"}));
  EXPECT_EQ(d.values(), (std::vector<int>{4, 2, 3}));
  EXPECT_EQ(d["a"], 2);
  EXPECT_EQ(d.find("z"), nullptr);
  EXPECT_KILN_ERROR(d.insert("a", 0), "Thing 'a' already defined");
  EXPECT_KILN_ERROR(d["z"], "Thing 'z' is not defined");
  EXPECT_EQ(d.erase("b"), 4);
  EXPECT_EQ(d.keys(), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(d["c"], 3);
  int sum = 0;
  for (const auto& item : d) sum += item.value();
  EXPECT_EQ(sum, 5);
  d.clear();
  EXPECT_TRUE(d.is_empty());
}

}  // namespace
}  // namespace kiln
