// Core tensor behaviour: dtypes, 16-bit floats, factories, views, copies, the registry.
#include <gtest/gtest.h>

#include <cmath>

#include <kiln/kiln.h>

#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

TEST(DtypeTest, PromotionFollowsPyTorch) {
  EXPECT_EQ(promote_types(kInt32, kInt64), kInt64);
  EXPECT_EQ(promote_types(kBool, kInt32), kInt32);
  EXPECT_EQ(promote_types(kInt64, kHalf), kHalf);
  EXPECT_EQ(promote_types(kHalf, kBFloat16), kFloat);
  EXPECT_EQ(promote_types(kBFloat16, kFloat), kFloat);
  EXPECT_EQ(promote_types(kFloat, kDouble), kDouble);
  EXPECT_EQ(promote_types(kBool, kBool), kBool);
  EXPECT_EQ(element_size(kBool), 1u);
  EXPECT_EQ(element_size(kBFloat16), 2u);
  EXPECT_EQ(dtype_name(kBFloat16), "bfloat16");
}

TEST(HalfTest, RoundTripsAndRoundsToNearestEven) {
  // Every half value converts to float and back unchanged.
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const Half h = Half::from_bits(static_cast<uint16_t>(bits));
    const float f = h;
    if (std::isnan(f)) continue;
    EXPECT_EQ(Half(f).x, h.x) << bits;
  }
  EXPECT_EQ(static_cast<float>(Half(1.0f)), 1.0f);
  EXPECT_EQ(static_cast<float>(Half(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(static_cast<float>(Half(65520.0f))));
  EXPECT_EQ(static_cast<float>(Half(5.960464477539063e-8f)), 5.960464477539063e-8f);
  // 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: ties to even (1).
  EXPECT_EQ(static_cast<float>(Half(1.0f + 0x1p-11f)), 1.0f);
  EXPECT_EQ(static_cast<float>(Half(1.0f + 3 * 0x1p-11f)), 1.0f + 0x1p-9f);
  EXPECT_TRUE(std::isnan(static_cast<float>(Half(NAN))));
}

TEST(BFloat16Test, RoundsToNearestEven) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const BFloat16 b = BFloat16::from_bits(static_cast<uint16_t>(bits));
    const float f = b;
    if (std::isnan(f)) continue;
    EXPECT_EQ(BFloat16(f).x, b.x);
  }
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 0x1p-8f)), 1.0f);           // tie -> even
  EXPECT_EQ(static_cast<float>(BFloat16(1.0f + 3 * 0x1p-8f)), 1.0f + 0x1p-6f);  // tie -> even
  EXPECT_TRUE(std::isnan(static_cast<float>(BFloat16(NAN))));
}

TEST(FactoryTest, ShapesDtypesAndValues) {
  Tensor z = zeros({2, 3});
  EXPECT_EQ(z.dtype(), kFloat);
  EXPECT_EQ(to_shape(z.sizes()), (Shape{2, 3}));
  EXPECT_EQ(to_shape(z.strides()), (Shape{3, 1}));
  for (float v : z.to_vector<float>()) EXPECT_EQ(v, 0.0f);
  Tensor o = ones({4}, kInt64);
  EXPECT_EQ(o.dtype(), kInt64);
  EXPECT_EQ(o.to_vector<int64_t>(), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(full({2}, 2.5).dtype(), kFloat);
  EXPECT_EQ(full({2}, 7).dtype(), kInt64);
  EXPECT_EQ(full({2}, true).dtype(), kBool);
  EXPECT_EQ(arange(5).to_vector<int64_t>(), (std::vector<int64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(arange(1, 2, 0.25).to_vector<float>(), (std::vector<float>{1, 1.25, 1.5, 1.75}));
  EXPECT_EQ(arange(5, 0, -2).to_vector<int64_t>(), (std::vector<int64_t>{5, 3, 1}));
  EXPECT_EQ(linspace(0, 1, 5).to_vector<float>(), (std::vector<float>{0, 0.25, 0.5, 0.75, 1}));
  EXPECT_EQ(eye(2, 3).to_vector<float>(), (std::vector<float>{1, 0, 0, 0, 1, 0}));
  Tensor t = tensor({{1.5, 2.0}, {3.0, 4.0}});
  EXPECT_EQ(t.dtype(), kFloat);
  EXPECT_EQ(to_shape(t.sizes()), (Shape{2, 2}));
  EXPECT_EQ(tensor({{1, 2}, {3, 4}}).dtype(), kInt64);
  EXPECT_EQ(tensor({true, false}).dtype(), kBool);
  EXPECT_EQ(tensor({1, 2}, kBFloat16).to_vector<float>(), (std::vector<float>{1, 2}));
  EXPECT_EQ(tensor(3.5).dim(), 0);
  EXPECT_EQ(empty_like(t, kInt32).dtype(), kInt32);
  EXPECT_TRUE(zeros({2}, requires_grad()).requires_grad());
  EXPECT_TRUE(ones({2}, dtype(kBFloat16).device(kCPU).requires_grad(true)).requires_grad());
}

TEST(FactoryTest, FromBlobSharesMemory) {
  float data[6] = {0, 1, 2, 3, 4, 5};
  Tensor t = from_blob(data, {2, 3});
  EXPECT_EQ(t.data_ptr<float>(), data);
  t.fill_(7);
  EXPECT_EQ(data[5], 7.0f);
  bool freed = false;
  {
    float* heap = new float[4]{1, 2, 3, 4};
    Tensor u = from_blob(heap, {4}, [&](void* p) {
      delete[] static_cast<float*>(p);
      freed = true;
    });
    EXPECT_EQ(u.to_vector<float>()[3], 4.0f);
  }
  EXPECT_TRUE(freed);
}

TEST(FactoryTest, Errors) {
  EXPECT_KILN_ERROR(empty({2, -1}), "[empty]");
  EXPECT_KILN_ERROR(arange(0, 5, 0), "[arange]");
  EXPECT_KILN_ERROR(arange(5, 0, 1), "[arange]");
  EXPECT_KILN_ERROR(tensor({{1, 2}, {3}}), "[tensor] ragged");
  EXPECT_KILN_ERROR(ones({2}, kInt64).requires_grad_(), "[requires_grad_]");
}

TEST(ViewTest, ViewsShareStorage) {
  Tensor t = arange(24).view({2, 3, 4});
  EXPECT_TRUE(t.is_contiguous());
  Tensor p = t.permute({2, 0, 1});
  EXPECT_EQ(to_shape(p.sizes()), (Shape{4, 2, 3}));
  EXPECT_EQ(to_shape(p.strides()), (Shape{1, 12, 4}));
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_EQ(p.data_ptr(), t.data_ptr());
  Tensor tt = t.transpose(0, 2);
  EXPECT_EQ(tt.to_vector<int64_t>()[1], 12);  // tt[0, 0, 1] == t[1, 0, 0]
  EXPECT_EQ(t.select(1, 2).to_vector<int64_t>(),
            (std::vector<int64_t>{8, 9, 10, 11, 20, 21, 22, 23}));
  EXPECT_EQ(t[1][2][3].item<int64_t>(), 23);
  EXPECT_EQ(t.slice(2, 1, 4, 2).to_vector<int64_t>(),
            (std::vector<int64_t>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23}));
  EXPECT_EQ(t.slice(2, -2).size(2), 2);
  EXPECT_EQ(t.narrow(0, 1, 1).storage_offset(), 12);
  Tensor s = arange(3).view({3, 1}).expand({3, 4});
  EXPECT_EQ(to_shape(s.strides()), (Shape{1, 0}));
  EXPECT_EQ(s.contiguous().to_vector<int64_t>(),
            (std::vector<int64_t>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2}));
  EXPECT_EQ(zeros({1, 3, 1}).squeeze().dim(), 1);
  EXPECT_EQ(zeros({1, 3, 1}).squeeze(0).dim(), 2);
  EXPECT_EQ(zeros({1, 3, 1}).squeeze(1).dim(), 3);
  EXPECT_EQ(to_shape(zeros({3}).unsqueeze(-1).sizes()), (Shape{3, 1}));
  EXPECT_EQ(to_shape(zeros({2, 3, 4}).flatten(1).sizes()), (Shape{2, 12}));
  EXPECT_EQ(to_shape(zeros({2, 12}).unflatten(1, {3, -1}).sizes()), (Shape{2, 3, 4}));
  EXPECT_EQ(arange(10).split(4).size(), 3u);
  EXPECT_EQ(arange(10).split(4)[2].numel(), 2);
  EXPECT_EQ(arange(10).chunk(3)[0].numel(), 4);
  EXPECT_EQ(arange(6).split_with_sizes({1, 5})[1].numel(), 5);
  EXPECT_EQ(arange(6).view({2, 3}).unbind(1).size(), 3u);
  EXPECT_EQ(arange(6).as_strided({2, 2}, {1, 2}).to_vector<int64_t>(),
            (std::vector<int64_t>{0, 2, 1, 3}));
  // A non-contiguous tensor reshapes by copying, views where it can.
  EXPECT_EQ(tt.reshape({-1}).numel(), 24);
  EXPECT_EQ(t.reshape({6, 4}).data_ptr(), t.data_ptr());
  Tensor m = arange(6).view({2, 3});
  EXPECT_EQ(m.t().t().data_ptr(), m.data_ptr());
}

TEST(ViewTest, WritesThroughViewsAndBumpsVersion) {
  Tensor t = zeros({3, 4});
  const uint64_t v0 = t._version();
  Tensor row = t[1];
  row.fill_(2);
  EXPECT_GT(t._version(), v0);
  t.select(1, 3) = 5;  // assignment to a temporary writes in place
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 0, 0, 5, 2, 2, 2, 5, 0, 0, 0, 5}));
  t.t()[0].copy_(tensor({9.0, 9.0, 9.0}));
  EXPECT_EQ(t.select(1, 0).to_vector<float>(), (std::vector<float>{9, 9, 9}));
}

TEST(ViewTest, Errors) {
  Tensor t = zeros({2, 3});
  EXPECT_KILN_ERROR(t.view({4, 2}), "[view] shape [4, 2] is invalid for input of size 6");
  EXPECT_KILN_ERROR(t.t().view({6}), "[view] size [6] is not compatible");
  EXPECT_KILN_ERROR(t.view({-1, -1}), "[view] only one dimension can be inferred");
  EXPECT_KILN_ERROR(t.permute({0, 0}), "[permute] repeated dim");
  EXPECT_KILN_ERROR(t.permute({0}), "[permute]");
  EXPECT_KILN_ERROR(t.transpose(0, 2), "[transpose] dim 2 is out of range");
  EXPECT_KILN_ERROR(t.expand({3, 3}), "[expand]");
  EXPECT_KILN_ERROR(t.select(0, 2), "[select] index 2 is out of bounds");
  EXPECT_KILN_ERROR(t.narrow(1, 2, 2), "[narrow]");
  EXPECT_KILN_ERROR(t.as_strided({3, 3}, {3, 1}), "[as_strided]");
  EXPECT_KILN_ERROR(t.split_with_sizes({1, 1}, 1), "[split_with_sizes]");
  EXPECT_KILN_ERROR(zeros({2, 3, 4}).t(), "[t]");
  EXPECT_KILN_ERROR(t.item(), "[item] a Tensor with 6 elements cannot be converted");
  EXPECT_KILN_ERROR(t.data_ptr<int64_t>(), "[data_ptr] expected dtype int64");
}

TEST(CopyTest, ConvertsDtypesAndLayouts) {
  Tensor t = tensor({{1.7, -2.2}, {3.5, 0.0}});
  EXPECT_EQ(t.to(kInt64).to_vector<int64_t>(), (std::vector<int64_t>{1, -2, 3, 0}));
  EXPECT_EQ(t.to(kBool).to_vector<bool>(), (std::vector<bool>{true, true, true, false}));
  // Conversion to bool happens in the source's own precision.
  EXPECT_TRUE(tensor({1e-300}, kDouble).to(kBool).item<bool>());
  EXPECT_EQ(t.to(kHalf).to(kDouble).to_vector<double>()[0], static_cast<double>(Half(1.7f)));
  EXPECT_EQ(t.to(kBFloat16).dtype(), kBFloat16);
  EXPECT_TRUE(t.to(kFloat).is_same(t));  // no copy without need
  EXPECT_FALSE(t.to(kFloat, /*copy=*/true).is_same(t));
  Tensor c = t.t().contiguous();
  EXPECT_EQ(c.to_vector<float>(), (std::vector<float>{1.7f, 3.5f, -2.2f, 0.0f}));
  Tensor dst = zeros({2, 2}, kFloat64);
  dst.copy_(tensor({1, 2}));  // broadcast and convert
  EXPECT_EQ(dst.to_vector<double>(), (std::vector<double>{1, 2, 1, 2}));
  EXPECT_KILN_ERROR(dst.copy_(zeros({3})), "[copy_]");
  // Large enough to run on several threads.
  Tensor big = arange(1 << 20, kFloat).view({1024, 1024}).t().contiguous();
  EXPECT_EQ(big.to_vector<float>()[1], 1024.0f);
  EXPECT_EQ(big.to_vector<float>()[1024], 1.0f);
}

TEST(PrintTest, PyTorchFormat) {
  EXPECT_EQ(tensor({1, 2, 3}).str(), "tensor([1, 2, 3])");
}

TEST(DeviceTest, Parsing) {
  EXPECT_EQ(Device("cuda:1").index(), 1);
  EXPECT_TRUE(Device("cpu").is_cpu());
  EXPECT_EQ(Device("cuda").str(), "cuda:0");
  EXPECT_KILN_ERROR(Device("tpu"), "[Device] unknown device");
  EXPECT_KILN_ERROR(Device("cuda:x"), "[Device] bad device index");
}

TEST(RegistryTest, MetaTensorsCarryShapesWithoutData) {
  Tensor m = empty({2, 3}, Device(kMeta));
  Tensor v = m.t();
  EXPECT_EQ(to_shape(v.sizes()), (Shape{3, 2}));
  Tensor c = m.to(kHalf);
  EXPECT_TRUE(c.is_meta());
  EXPECT_EQ(c.dtype(), kHalf);
  EXPECT_KILN_ERROR(m.data_ptr(), "[data_ptr] a meta tensor");
}

// A dispatch handler sees every op call while installed, without any op knowing about it.
int g_seen = 0;
TEST(RegistryTest, DispatchHandlersInterceptCalls) {
  static const DispatchHandler counter{
      [](const OpCall&) { return true; },
      [](OpCall& call) {
        ++g_seen;
        dispatch_after(call, DispatchKey::Trace);
      }};
  set_dispatch_handler(DispatchKey::Trace, &counter);
  g_seen = 0;
  Tensor t = zeros({2, 2}).t();
  set_dispatch_handler(DispatchKey::Trace, nullptr);
  EXPECT_EQ(g_seen, 2);  // fill_ and permute
  Tensor u = t.t().view({4}).alias();
  (void)u;
  EXPECT_EQ(g_seen, 2);
  const auto names = Registry::get().names();
  EXPECT_NE(std::find(names.begin(), names.end(), "permute"), names.end());
  EXPECT_KILN_ERROR(Registry::get().op("no_such_op"), "[no_such_op] no such op");
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

TEST(AllocatorTest, LargeCpuBlocksAreReused) {
  empty_cpu_cache();
  void* first = nullptr;
  {
    Tensor t = empty({1 << 20}, kFloat);  // 4 MiB
    first = t.data_ptr();
  }
  EXPECT_GE(cpu_cached_bytes(), size_t{4} << 20);
  Tensor u = empty({1 << 20}, kFloat);
  EXPECT_EQ(u.data_ptr(), first);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(u.data_ptr()) % 64, 0u);
  empty_cpu_cache();
  EXPECT_EQ(cpu_cached_bytes(), 0u);
}

}  // namespace
}  // namespace kiln
