// kiln::save / kiln::load of modules and tensor maps: bit-exact round trips, the file's names
// and metadata, dtype conversion on load, strict and non-strict errors.
#include "nn/serialize.h"

#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            ("kiln_serialize_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

struct ModelImpl : nn::Module {
  ModelImpl() {
    embed = register_module("embed", nn::Embedding(16, 8));
    norm = register_module("norm", nn::BatchNorm2d(4));
    layers = register_module("layers", nn::ModuleList(nn::Linear(8, 8), nn::Linear(8, 4)));
    scratch = register_buffer("scratch", zeros({3}), /*persistent=*/false);
  }
  nn::Embedding embed{nullptr};
  nn::BatchNorm2d norm{nullptr};
  nn::ModuleList layers{nullptr};
  Tensor scratch;
};
KILN_MODULE(Model);

// Byte-for-byte equality of two tensors' contents (same dtype and shape).
bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.nbytes()) == 0;
}

void randomise(nn::Module& m) {
  NoGradGuard no_grad;
  for (Tensor& t : m.parameters()) t.normal_();
  for (Tensor& t : m.buffers()) {
    if (t.is_floating_point()) t.uniform_(0.5, 2);
  }
}

TEST(SerializeTest, ModuleRoundTripIsBitExact) {
  TempDir dir;
  for (ScalarType dt : {kFloat, kDouble, kBFloat16, kHalf}) {
    manual_seed(1);
    Model a, b;
    a->to(dt);
    b->to(dt);
    randomise(*a);
    {
      NoGradGuard no_grad;
      a->norm->num_batches_tracked.fill_(7);
    }
    const std::string path = dir.file("model_" + std::string(dtype_name(dt)) + ".safetensors");
    kiln::save(a, path);
    kiln::load(b, path);
    const auto sa = a->state_dict(), sb = b->state_dict();
    ASSERT_EQ(sa.size(), sb.size());
    for (const auto& [key, t] : sa) {
      EXPECT_TRUE(same_bits(t, sb.at(key))) << key << " " << dtype_name(dt);
    }
    EXPECT_EQ(b->norm->num_batches_tracked.item<int64_t>(), 7);
    EXPECT_EQ(b->norm->num_batches_tracked.dtype(), kInt64);
    // Parameters keep their identity and stay trainable leaves.
    EXPECT_TRUE(b->named_parameters()["embed.weight"].is_same(b->embed->weight));
    EXPECT_TRUE(b->embed->weight.is_leaf());
    EXPECT_TRUE(b->embed->weight.requires_grad());
  }
}

TEST(SerializeTest, FileHasHuggingFaceNamesAndMetadata) {
  TempDir dir;
  Model m;
  const std::string path = dir.file("model.safetensors");
  kiln::save(m, path);
  SafetensorsFile file(path);
  EXPECT_EQ(file.keys(), (std::vector<std::string>{
                             "embed.weight", "layers.0.bias", "layers.0.weight", "layers.1.bias",
                             "layers.1.weight", "norm.bias", "norm.num_batches_tracked",
                             "norm.running_mean", "norm.running_var", "norm.weight"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.info("norm.num_batches_tracked").dtype, kInt64);
  EXPECT_EQ(file.info("layers.1.weight").shape, (Shape{4, 8}));
  EXPECT_FALSE(file.contains("scratch"));  // not persistent
  // Saving again replaces the file.
  m->to(kBFloat16);
  kiln::save(*m, path);
  EXPECT_EQ(SafetensorsFile(path).info("embed.weight").dtype, kBFloat16);
}

// A checkpoint tensor in another dtype than the module's is another file: kiln::load refuses it
// (naming the file, the tensor and both dtypes) and touches nothing; load_state_dict converts
// when asked to, as torch's does.
TEST(SerializeTest, LoadRejectsAnotherDtypeAndLoadStateDictConverts) {
  TempDir dir;
  manual_seed(2);
  Model a, b;
  randomise(*a);
  a->to(kDouble);
  const std::string path = dir.file("f64.safetensors");
  kiln::save(a.ptr(), path);  // the shared_ptr overload
  const Tensor before = b->embed->weight.clone();
  EXPECT_KILN_ERROR(kiln::load(b.ptr(), path), "[load] " + path +
                                                   ": tensor \"embed.weight\" is "
                                                   "float64 in the file but float32 in the module");
  EXPECT_TRUE(same_bits(b->embed->weight, before));
  b->load_state_dict(load_safetensors(path));
  EXPECT_EQ(b->embed->weight.dtype(), kFloat);
  EXPECT_TRUE(same_bits(b->embed->weight, a->embed->weight.to(kFloat)));
  b->to(kBFloat16);
  b->load_state_dict(load_safetensors(path));
  EXPECT_TRUE(same_bits(b->layers->at<nn::LinearImpl>(1).weight,
                        a->layers->at<nn::LinearImpl>(1).weight.to(kBFloat16)));
  // The case the check is for: integers where the module has floats, even non-strict.
  kiln::save(TensorMap{{"0.weight", zeros({4, 8}, kInt32)}, {"0.bias", zeros({4})}},
             dir.file("i32.safetensors"));
  nn::Sequential small(nn::Linear(8, 4));
  EXPECT_KILN_ERROR(kiln::load(small, dir.file("i32.safetensors"), /*strict=*/false),
                    "tensor \"0.weight\" is int32 in the file but float32 in the module");
  // The same dtypes load.
  a->to(kFloat);
  b->to(kFloat);
  kiln::save(a, path);
  kiln::load(b, path);
  EXPECT_TRUE(same_bits(b->embed->weight, a->embed->weight));
}

TEST(SerializeTest, StrictAndNonStrictErrors) {
  TempDir dir;
  const std::string path = dir.file("small.safetensors");
  kiln::save(nn::Sequential(nn::Linear(8, 4), nn::Linear(4, 2)), path);
  // A different model: layer 1 is wider, layer 2 does not exist in the file, and the file's
  // layer "1" has no counterpart at the same name.
  manual_seed(3);
  nn::Sequential other(nn::Linear(8, 5), nn::ReLU(), nn::Linear(5, 2));
  const Tensor before = other->at<nn::LinearImpl>(0).weight.clone();
  try {
    kiln::load(other, path);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("[load] " + path + ": [load_state_dict]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("missing key(s): \"2.bias\", \"2.weight\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("unexpected key(s): \"1.bias\", \"1.weight\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("size mismatch for 0.bias: copying a tensor of shape [4]"),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("size mismatch for 0.weight"), std::string::npos) << msg;
  }
  EXPECT_TRUE(equal(other->at<nn::LinearImpl>(0).weight, before));  // untouched
  // Non-strict still refuses shape mismatches...
  EXPECT_KILN_ERROR(kiln::load(other, path, /*strict=*/false), "size mismatch for 0.weight");
  // ...and reports what it could not match.
  nn::Sequential partial(nn::Linear(8, 4), nn::ReLU(), nn::Linear(3, 3));
  const nn::LoadStateDictResult r = kiln::load(partial, path, /*strict=*/false);
  EXPECT_EQ(r.missing_keys, (std::vector<std::string>{"2.bias", "2.weight"}));
  EXPECT_EQ(r.unexpected_keys, (std::vector<std::string>{"1.bias", "1.weight"}));
  const TensorMap file = load_safetensors(path);
  EXPECT_TRUE(equal(partial->at<nn::LinearImpl>(0).weight, file.at("0.weight")));
  EXPECT_KILN_ERROR(kiln::load(partial, dir.file("missing.safetensors")), "missing.safetensors");
}

TEST(SerializeTest, TensorMaps) {
  TempDir dir;
  manual_seed(4);
  TensorMap tensors{{"step", full({}, 42, kInt64)},
                    {"moments.m", randn({3, 4}).to(kBFloat16)},
                    {"mask", randn({5}) > 0},
                    {"strided", randn({4, 6}, kDouble).t()}};
  const std::string path = dir.file("map.safetensors");
  kiln::save(tensors, path);
  TensorMap back{{"stale", ones({1})}};
  kiln::load(back, path);
  ASSERT_EQ(back.size(), tensors.size());
  EXPECT_FALSE(back.contains("stale"));
  for (const auto& [key, t] : tensors) EXPECT_TRUE(same_bits(back.at(key), t)) << key;
  EXPECT_EQ(SafetensorsFile(path).metadata().at("format"), "pt");
}

}  // namespace
}  // namespace kiln
