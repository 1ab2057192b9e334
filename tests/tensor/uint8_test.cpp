// The uint8 dtype (kByte / kUInt8): bytes in and out (from_blob, safetensors "U8"), conversions
// to and from every dtype, PyTorch's type promotion and wraparound, reductions, comparisons, the
// factories, and the refusals (gradients, overflowing scalars). The expected values are what
// PyTorch 2.11 prints for the same expressions.
#include <gtest/gtest.h>
#include <kiln/kiln.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace kiln {
namespace {

Tensor bytes(std::vector<int64_t> v) { return tensor(TensorData(v), kByte); }

std::vector<int64_t> values_of(const Tensor& t) { return t.to_vector<int64_t>(); }

TEST(UInt8Test, SpellingsNameAndSize) {
  EXPECT_EQ(kByte, kUInt8);
  EXPECT_EQ(kU8, kUInt8);
  EXPECT_EQ(dtype_name(kByte), "uint8");
  EXPECT_EQ(element_size(kByte), 1u);
  EXPECT_EQ(dtype_of<uint8_t>(), kByte);
  EXPECT_TRUE(is_integral(kByte, /*include_bool=*/false));
  EXPECT_FALSE(is_floating_point(kByte));
  std::ostringstream os;
  os << kByte << " " << bytes({0, 7, 255});
  EXPECT_EQ(os.str(), "uint8 tensor([  0,   7, 255], dtype=kiln.uint8)");
}

// MNIST and image loaders: bytes wrapped without a copy, then scaled to [0, 1].
TEST(UInt8Test, FromBlobOverBytesAndBack) {
  std::vector<uint8_t> image = {0, 51, 102, 153, 204, 255, 1, 2, 3, 4, 5, 6};
  const Tensor t = from_blob(image.data(), {2, 2, 3}, kByte);
  EXPECT_EQ(t.dtype(), kByte);
  EXPECT_EQ(t.data_ptr<uint8_t>(), image.data());
  EXPECT_EQ(t[0][1][2].item<uint8_t>(), 255);
  EXPECT_EQ(t[0][1][2].item<int64_t>(), 255);

  const Tensor x = from_blob(image.data(), {2, 2, 3}, kByte).to(kFloat).div(255);
  EXPECT_EQ(x.dtype(), kFloat);
  EXPECT_FLOAT_EQ(x[0][0][1].item<float>(), 0.2f);
  EXPECT_FLOAT_EQ(x[0][1][2].item<float>(), 1.0f);
  EXPECT_NEAR(x.sum().item<double>(), (765 + 21) / 255.0, 1e-5);

  // Writes go through to the caller's bytes; to_vector reads them back.
  t[1].fill_(9);
  EXPECT_EQ(image[6], 9);
  EXPECT_EQ(t.to_vector<uint8_t>(), image);
  // The accessor of the CPU dtype.
  auto a = t.accessor<uint8_t, 3>();
  EXPECT_EQ(a[0][0][1], 51);
  // And back to the bytes of a float image, rounded as a loader would.
  const Tensor back = x.mul(255).round().to(kByte);
  EXPECT_EQ(back.dtype(), kByte);
  EXPECT_TRUE(equal(back[0], t[0]));
}

TEST(UInt8Test, ConversionsFromEveryDtype) {
  // Floats truncate toward zero and go through int64, so out-of-range values wrap modulo 256 as
  // in PyTorch (-1.0 -> 255, 300.0 -> 44, -2.7 -> 254). NaN and infinities give 0.
  const Tensor f = tensor({2.7, 255.9, 0.2, -0.5, -1.0, 300.0, -2.7, 256.0, 1e10});
  const std::vector<int64_t> want = {2, 255, 0, 0, 255, 44, 254, 0, 0};
  for (ScalarType dt : {kFloat, kDouble}) {
    EXPECT_EQ(values_of(f.to(dt).to(kByte)), want) << dtype_name(dt);
  }
  EXPECT_EQ(values_of(tensor({-1.0, 300.0, -2.7}, kHalf).to(kByte)),
            (std::vector<int64_t>{255, 44, 254}));
  EXPECT_EQ(values_of(tensor({-1.0, 200.0, 2.5}, kBFloat16).to(kByte)),
            (std::vector<int64_t>{255, 200, 2}));
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_EQ(values_of(tensor({std::nan(""), inf, -inf}).to(kByte)),
            (std::vector<int64_t>{0, 0, 0}));
  // Integers wrap modulo 256; bools are 0 and 1.
  EXPECT_EQ(values_of(tensor({-1, 256, 257, -256}).to(kByte)),
            (std::vector<int64_t>{255, 0, 1, 0}));
  EXPECT_EQ(values_of(tensor({-1, 300}, kInt32).to(kByte)), (std::vector<int64_t>{255, 44}));
  EXPECT_EQ(values_of(tensor({true, false}).to(kByte)), (std::vector<int64_t>{1, 0}));

  // copy_ converts the same way.
  Tensor dst = zeros({3}, kByte);
  dst.copy_(tensor({1.9, -1.0, 65.5}));
  EXPECT_EQ(values_of(dst), (std::vector<int64_t>{1, 255, 65}));
}

TEST(UInt8Test, ConversionsToEveryDtype) {
  const Tensor u = bytes({0, 1, 128, 255});
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16, kInt32, kInt64}) {
    const Tensor t = u.to(dt);
    EXPECT_EQ(t.dtype(), dt);
    EXPECT_EQ(t.to_vector<double>(), (std::vector<double>{0, 1, 128, 255})) << dtype_name(dt);
  }
  EXPECT_EQ(u.to(kBool).to_vector<bool>(), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ(u.to(kByte).data_ptr(), u.data_ptr());  // no copy to the same dtype
  EXPECT_EQ(u[3].item<int>(), 255);
  EXPECT_EQ(u[3].item<uint8_t>(), 255);
  EXPECT_EQ(u[3].item().to<double>(), 255.0);
}

TEST(UInt8Test, FactoriesAndScalarsThatDoNotFit) {
  EXPECT_EQ(values_of(zeros({2}, kByte)), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(values_of(ones({2}, kByte)), (std::vector<int64_t>{1, 1}));
  EXPECT_EQ(values_of(full({2}, 200, kByte)), (std::vector<int64_t>{200, 200}));
  EXPECT_EQ(empty({3, 4}, kByte).dtype(), kByte);
  EXPECT_EQ(zeros_like(bytes({1})).dtype(), kByte);
  EXPECT_EQ(values_of(arange(0, 5, kByte)), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(values_of(tensor({{1, 2}, {3, 255}}, kByte).flatten()),
            (std::vector<int64_t>{1, 2, 3, 255}));
  // As c10: integers down to -255 wrap, floats must lie in [0, 255].
  EXPECT_EQ(values_of(full({2}, -1, kByte)), (std::vector<int64_t>{255, 255}));
  EXPECT_EQ(values_of(tensor({-1}, kByte)), (std::vector<int64_t>{255}));
  EXPECT_KILN_ERROR(full({2}, 300, kByte), "the value 300 cannot be converted to uint8");
  EXPECT_KILN_ERROR(full({2}, -256, kByte), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(full({2}, 255.5, kByte), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(full({2}, -0.5, kByte), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(zeros({2}, kByte).fill_(300), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(tensor({300}, kByte), "cannot be converted to uint8");
  EXPECT_KILN_ERROR(tensor({300}).item<uint8_t>(), "cannot be converted to uint8");

  manual_seed(0);
  const Tensor r = randint(0, 256, {4096}, kByte);
  EXPECT_EQ(r.dtype(), kByte);
  EXPECT_EQ(r.min().item<int64_t>(), 0);
  EXPECT_EQ(r.max().item<int64_t>(), 255);
  EXPECT_GE(randint(250, 256, {64}, kByte).min().item<int64_t>(), 250);
  EXPECT_KILN_ERROR(randint(0, 257, {3}, kByte), "does not fit dtype uint8");
  EXPECT_KILN_ERROR(randint(-1, 3, {3}, kByte), "does not fit dtype uint8");
}

TEST(UInt8Test, PromotionTable) {
  EXPECT_EQ(promote_types(kByte, kByte), kByte);
  EXPECT_EQ(promote_types(kByte, kBool), kByte);
  EXPECT_EQ(promote_types(kBool, kByte), kByte);
  EXPECT_EQ(promote_types(kByte, kInt32), kInt32);
  EXPECT_EQ(promote_types(kInt64, kByte), kInt64);
  for (ScalarType f : {kHalf, kBFloat16, kFloat, kDouble}) {
    EXPECT_EQ(promote_types(kByte, f), f);
    EXPECT_EQ(promote_types(f, kByte), f);
  }

  const Tensor a = bytes({250, 5, 1, 16});
  const Tensor i32 = ones({4}, kInt32);
  EXPECT_EQ((a + i32).dtype(), kInt32);
  EXPECT_EQ(values_of(a + i32), (std::vector<int64_t>{251, 6, 2, 17}));
  EXPECT_EQ((a + ones({4}, kInt64)).dtype(), kInt64);
  EXPECT_EQ((a * ones({4})).dtype(), kFloat);
  EXPECT_EQ((a + ones({4}, kBool)).dtype(), kByte);
  // Scalars and 0-d tensors of the same category do not promote a dimensioned tensor.
  EXPECT_EQ((a + 2).dtype(), kByte);
  EXPECT_EQ((a + tensor(1)).dtype(), kByte);
  EXPECT_EQ((a + 2.5).dtype(), kFloat);
  EXPECT_EQ((a + tensor(1.0, kDouble)).dtype(), kDouble);
  EXPECT_EQ(values_of((a + 2.5).mul(2)), (std::vector<int64_t>{505, 15, 7, 37}));
  EXPECT_EQ(result_type(a, Scalar(1)), kByte);
  EXPECT_EQ(where(a > 5, a, tensor(0.5)).dtype(), kFloat);

  // In place, the result must cast to self's dtype: an integer result does, a float one not.
  Tensor b = a.clone();
  b.add_(i32);
  EXPECT_EQ(b.dtype(), kByte);
  EXPECT_EQ(values_of(b), (std::vector<int64_t>{251, 6, 2, 17}));
  EXPECT_KILN_ERROR(a.clone().add_(1.5),
                    "result type Float can't be cast to the desired output "
                    "type Byte");
}

TEST(UInt8Test, ArithmeticWrapsAround) {
  const Tensor a = bytes({250, 5, 1, 16});
  EXPECT_EQ(values_of(a + bytes({10, 3, 0, 0})), (std::vector<int64_t>{4, 8, 1, 16}));
  EXPECT_EQ((a + bytes({10, 3, 0, 0})).dtype(), kByte);
  EXPECT_EQ(values_of(a - 2), (std::vector<int64_t>{248, 3, 255, 14}));
  EXPECT_EQ(values_of(a + (-1)), (std::vector<int64_t>{249, 4, 0, 15}));
  EXPECT_EQ(values_of(a + 300), (std::vector<int64_t>{38, 49, 45, 60}));  // 300 reads as 44
  EXPECT_EQ(values_of(a * 16), (std::vector<int64_t>{160, 80, 16, 0}));
  EXPECT_EQ(values_of(-a), (std::vector<int64_t>{6, 251, 255, 240}));
  EXPECT_EQ(values_of(a.sub(a, 2)), (std::vector<int64_t>{6, 251, 255, 240}));
  EXPECT_KILN_ERROR(a.add(a, 300), "cannot be converted to uint8");
  EXPECT_EQ(values_of(a.pow(2)), (std::vector<int64_t>{36, 25, 1, 0}));
  EXPECT_EQ(values_of(a.pow(bytes({2, 2, 2, 2}))), (std::vector<int64_t>{36, 25, 1, 0}));
  EXPECT_EQ(values_of(a.square()), (std::vector<int64_t>{36, 25, 1, 0}));
  EXPECT_EQ(values_of(a.abs()), values_of(a));
  EXPECT_EQ(values_of(a.relu()), values_of(a));
  EXPECT_EQ(values_of(a.sign()), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(values_of(~a), (std::vector<int64_t>{5, 250, 254, 239}));
  EXPECT_EQ(values_of(maximum(a, bytes({251, 0, 0, 0}))), (std::vector<int64_t>{251, 5, 1, 16}));
  EXPECT_EQ(values_of(a.clamp(2, 200)), (std::vector<int64_t>{200, 5, 2, 16}));
  Tensor c = a.clone();
  c.add_(10).mul_(2);
  EXPECT_EQ(values_of(c), (std::vector<int64_t>{8, 30, 22, 52}));
  // Float functions promote to the default dtype.
  EXPECT_EQ(a.exp().dtype(), kFloat);
  EXPECT_FLOAT_EQ(bytes({4}).sqrt().item<float>(), 2.0f);
}

// `/` is true division (a float result); floor division keeps uint8 and refuses zero divisors.
TEST(UInt8Test, Division) {
  const Tensor a = bytes({250, 5, 1, 16});
  const Tensor q = a / 2;
  EXPECT_EQ(q.dtype(), kFloat);
  EXPECT_EQ(q.to_vector<float>(), (std::vector<float>{125.0f, 2.5f, 0.5f, 8.0f}));
  EXPECT_EQ((a / bytes({2, 2, 2, 2})).dtype(), kFloat);
  EXPECT_TRUE(std::isinf((a / zeros({4}, kByte))[0].item<float>()));
  const Tensor fl = floor_divide(a, bytes({3, 3, 3, 3}));
  EXPECT_EQ(fl.dtype(), kByte);
  EXPECT_EQ(values_of(fl), (std::vector<int64_t>{83, 1, 0, 5}));
  EXPECT_EQ(values_of(a.div(bytes({3, 3, 3, 3}), "trunc")), (std::vector<int64_t>{83, 1, 0, 5}));
  EXPECT_KILN_ERROR(floor_divide(a, zeros({4}, kByte)), "integer division by zero (uint8");
}

TEST(UInt8Test, ReductionsAccumulateInInt64) {
  const Tensor a = bytes({250, 5, 1, 16});
  EXPECT_EQ(a.sum().dtype(), kInt64);
  EXPECT_EQ(a.sum().item<int64_t>(), 272);
  EXPECT_EQ(a.prod().item<int64_t>(), 20000);
  EXPECT_EQ(a.view({2, 2}).sum(1).to_vector<int64_t>(), (std::vector<int64_t>{255, 17}));
  EXPECT_EQ(a.cumsum(0).dtype(), kInt64);
  EXPECT_EQ(values_of(a.cumsum(0)), (std::vector<int64_t>{250, 255, 256, 272}));
  EXPECT_EQ(a.sum({0}, false, kByte).item<int64_t>(), 272 - 256);  // an explicit dtype wraps
  EXPECT_KILN_ERROR(a.mean(), "[mean] could not infer output dtype");
  EXPECT_FLOAT_EQ(a.to(kFloat).mean().item<float>(), 68.0f);

  EXPECT_EQ(a.max().dtype(), kByte);
  EXPECT_EQ(a.max().item<int64_t>(), 250);
  EXPECT_EQ(a.min().item<int64_t>(), 1);
  EXPECT_EQ(a.argmax().item<int64_t>(), 0);
  EXPECT_EQ(a.argmin().item<int64_t>(), 2);
  const auto [values, indices] = a.view({2, 2}).max(1);
  EXPECT_EQ(values.dtype(), kByte);
  EXPECT_EQ(values_of(values), (std::vector<int64_t>{250, 16}));
  EXPECT_EQ(values_of(indices), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(a.amax().item<int64_t>(), 250);
  EXPECT_TRUE(a.any().item<bool>());
  EXPECT_FALSE(a.sub(a).any().item<bool>());
}

TEST(UInt8Test, Comparisons) {
  const Tensor a = bytes({250, 5, 1, 16});
  EXPECT_EQ((a == 250).to_vector<bool>(), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ((a != 5).to_vector<bool>(), (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ((a < 16).to_vector<bool>(), (std::vector<bool>{false, true, true, false}));
  EXPECT_EQ((a <= 16).to_vector<bool>(), (std::vector<bool>{false, true, true, true}));
  EXPECT_EQ((a > bytes({0, 5, 0, 20})).to_vector<bool>(),
            (std::vector<bool>{true, false, true, false}));
  EXPECT_EQ(a.ge(5).to_vector<bool>(), (std::vector<bool>{true, true, false, true}));
  // Against other dtypes, in the promoted type.
  EXPECT_EQ((a < 2.5).to_vector<bool>(), (std::vector<bool>{false, false, true, false}));
  EXPECT_EQ((a == tensor({250, 5, 1, 16}, kInt32)).all().item<bool>(), true);
  EXPECT_EQ((a > tensor({-1, -1, -1, -1})).all().item<bool>(), true);  // int64: no wrap
  // A negative scalar converts to uint8 first, as in PyTorch: -1 compares as 255.
  EXPECT_EQ((a > -1).any().item<bool>(), false);
  EXPECT_TRUE(isclose(a, a.clone()).all().item<bool>());
  EXPECT_TRUE(equal(a, bytes({250, 5, 1, 16})));
}

TEST(UInt8Test, ShapeOpsAndIndexing) {
  const Tensor a = arange(0, 12, kByte).view({3, 4});
  EXPECT_EQ(a.dtype(), kByte);
  EXPECT_EQ(values_of(a.t().contiguous().flatten().slice(0, 0, 4)),
            (std::vector<int64_t>{0, 4, 8, 1}));
  EXPECT_EQ(values_of(a.reshape({2, 6})[1]), (std::vector<int64_t>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(values_of(a.index({indexing::Slice(), 1})), (std::vector<int64_t>{1, 5, 9}));
  const Tensor c = cat({a[0], bytes({200})}, 0);
  EXPECT_EQ(c.dtype(), kByte);
  EXPECT_EQ(values_of(c), (std::vector<int64_t>{0, 1, 2, 3, 200}));
  const Tensor s = stack({a[0], a[1]}, 0);
  EXPECT_EQ(s.dtype(), kByte);
  EXPECT_EQ(to_shape(s.sizes()), (Shape{2, 4}));
  EXPECT_EQ(values_of(a.index_select(1, tensor({3, 0}))),
            (std::vector<int64_t>{3, 0, 7, 4, 11, 8}));
  EXPECT_EQ(values_of(a.masked_select(a > 9)), (std::vector<int64_t>{10, 11}));
  Tensor b = a.clone();
  b.index_put_({0, 0}, 77);
  EXPECT_EQ(b[0][0].item<int64_t>(), 77);
  const auto [sorted, order] = bytes({3, 255, 0, 7}).sort();
  EXPECT_EQ(values_of(sorted), (std::vector<int64_t>{0, 3, 7, 255}));
  EXPECT_EQ(values_of(order), (std::vector<int64_t>{2, 0, 3, 1}));
  // A uint8 tensor is not an index or a mask (PyTorch's deprecated byte masks are not kept).
  EXPECT_THROW(a.index({bytes({1, 0, 1})}), Error);
}

TEST(UInt8Test, GradientsAreRefused) {
  EXPECT_KILN_ERROR(zeros({2}, kByte).requires_grad_(),
                    "only floating-point tensors can require gradients, got dtype uint8");
  EXPECT_THROW(zeros({2}, TensorOptions(kByte).requires_grad(true)), Error);
  // A float tensor made from bytes can.
  Tensor x = bytes({1, 2}).to(kFloat).requires_grad_();
  (x * x).sum().backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2.0f, 4.0f}));
}

TEST(UInt8Test, SafetensorsU8RoundTrip) {
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kiln_uint8_test_" + std::to_string(::getpid()) + ".safetensors"))
                               .string();
  manual_seed(3);
  TensorMap m;
  m["image"] = randint(0, 256, {2, 3, 5}, kByte);
  m["w"] = randn({3});
  save_safetensors(m, path);
  const std::string file = read_file(path);
  EXPECT_NE(file.find("\"dtype\":\"U8\""), std::string::npos);
  const TensorMap got = load_safetensors(path);
  std::filesystem::remove(path);
  ASSERT_EQ(got.at("image").dtype(), kByte);
  EXPECT_TRUE(equal(got.at("image"), m.at("image")));
  EXPECT_TRUE(equal(got.at("w"), m.at("w")));
  // In memory too; a header that promises more U8 bytes than the data holds is refused.
  const TensorMap mem = load_safetensors_from_bytes(save_safetensors_to_bytes(m));
  EXPECT_TRUE(equal(mem.at("image"), m.at("image")));
  const std::string header = R"({"a":{"dtype":"U8","shape":[9],"data_offsets":[0,8]}})";
  std::string bad(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i)
    bad[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  bad += header + std::string(8, '\1');
  EXPECT_THROW(load_safetensors_from_bytes(bad), Error);
}

// The CUDA kernels give the CPU's values (skipped without a GPU).
class GpuUInt8Test : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(GpuUInt8Test, MatchesTheCpu) {
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor f = tensor({2.7, 255.9, -1.0, 300.0, -2.7, 256.0, 1e10, std::nan(""), inf, -inf});
  for (ScalarType dt : {kFloat, kDouble, kHalf, kBFloat16}) {
    EXPECT_TRUE(equal(f.to(dt).cuda().to(kByte).cpu(), f.to(dt).to(kByte))) << dtype_name(dt);
  }
  manual_seed(1);
  const Tensor a = randint(0, 256, {1000}, kByte), b = randint(0, 256, {1000}, kByte);
  const Tensor ga = a.cuda(), gb = b.cuda();
  EXPECT_EQ(ga.dtype(), kByte);
  EXPECT_TRUE(equal((ga + gb).cpu(), a + b));
  EXPECT_TRUE(equal((ga - gb).cpu(), a - b));
  EXPECT_TRUE(equal((ga * gb).cpu(), a * b));
  EXPECT_TRUE(equal((ga + 300).cpu(), a + 300));
  EXPECT_TRUE(equal((-ga).cpu(), -a));
  EXPECT_TRUE(equal((~ga).cpu(), ~a));
  EXPECT_TRUE(equal((ga / gb).cpu(), a / b));
  EXPECT_TRUE(equal((ga < gb).cpu(), a < b));
  EXPECT_TRUE(equal((ga + ones({1000}, TensorOptions(kInt32).device(kCUDA))).cpu(),
                    a + ones({1000}, kInt32)));
  EXPECT_TRUE(equal(ga.to(kFloat).div(255).cpu(), a.to(kFloat).div(255)));
  EXPECT_EQ(ga.sum().item<int64_t>(), a.sum().item<int64_t>());
  EXPECT_TRUE(equal(ga.view({10, 100}).sum(1).cpu(), a.view({10, 100}).sum(1)));
  EXPECT_TRUE(equal(ga.cumsum(0).cpu(), a.cumsum(0)));
  EXPECT_EQ(ga.max().item<int64_t>(), a.max().item<int64_t>());
  EXPECT_EQ(ga.argmin().item<int64_t>(), a.argmin().item<int64_t>());
  const auto [sv, si] = ga.sort();
  const auto [cv, ci] = a.sort();
  EXPECT_TRUE(equal(sv.cpu(), cv));
  EXPECT_TRUE(equal(si.cpu(), ci));
  EXPECT_TRUE(equal(cat({ga, gb}, 0).cpu(), cat({a, b}, 0)));
  EXPECT_TRUE(equal(ga.view({10, 100}).t().contiguous().cpu(), a.view({10, 100}).t().contiguous()));
  // Repeated indices accumulate with byte-wide atomics, wrapping as the CPU's sums.
  const Tensor idx = randint(0, 7, {1000});
  EXPECT_TRUE(
      equal(zeros({7}, TensorOptions(kByte).device(kCUDA)).index_add(0, idx.cuda(), ga).cpu(),
            zeros({7}, kByte).index_add(0, idx, a)));
  EXPECT_TRUE(
      equal(zeros({7}, TensorOptions(kByte).device(kCUDA)).scatter_add(0, idx.cuda(), ga).cpu(),
            zeros({7}, kByte).scatter_add(0, idx, a)));
  manual_seed(2);
  const Tensor r = randint(0, 256, {100000}, TensorOptions(kByte).device(kCUDA));
  EXPECT_EQ(r.min().item<int64_t>(), 0);
  EXPECT_EQ(r.max().item<int64_t>(), 255);
  EXPECT_EQ(full({3}, 7, TensorOptions(kByte).device(kCUDA)).sum().item<int64_t>(), 21);
}

}  // namespace
}  // namespace kiln
