// The multi-tensor ops foreach_norm and foreach_mul_ (tensor/ops/foreach.cpp) on the CPU: the
// kernel, the decomposition and the per-tensor ops (t.norm, t.mul_) give the same bits on lists of
// mixed shapes (empty, 0-d, odd, 2-D, one long enough for the threaded reduction), f32, bf16, f16
// and f64, every ord; non-contiguous lists run the decomposition with the same results; meta
// tensors; and every misuse, with the op's name in the message.
#include "tensor/foreach.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tensor/ops.h"
#include "tensor/ops/foreach.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

using Attrs = absl::InlinedVector<Attr, 4>;

const std::vector<Shape> kShapes = {{0}, {}, {7}, {33, 17}, {0, 3}, {1}, {70001}};
const std::vector<ScalarType> kDtypes = {kFloat, kBFloat16, kHalf, kDouble};
const std::vector<double> kOrds = {2.0, 1.0, 0.0, 3.0, 0.5, -1.5, INFINITY, -INFINITY};

// Identical dtype, shape and bytes (NaNs included).
::testing::AssertionResult same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.sizes() != b.sizes()) {
    return ::testing::AssertionFailure() << dtype_name(a.dtype()) << shape_str(a.sizes()) << " vs "
                                         << dtype_name(b.dtype()) << shape_str(b.sizes());
  }
  const Tensor x = a.contiguous(), y = b.contiguous();
  if (x.numel() == 0 || std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure()
         << "values differ: "
         << x.to(kDouble).flatten().narrow(0, 0, std::min<int64_t>(x.numel(), 4)) << " vs "
         << y.to(kDouble).flatten().narrow(0, 0, std::min<int64_t>(y.numel(), 4));
}

// Random values of every shape in `dtype`, a few of them zero (the 0-norm counts non-zeros).
std::vector<Tensor> make_list(ScalarType dtype, uint64_t seed, bool with_empty = true) {
  manual_seed(seed);
  std::vector<Tensor> out;
  for (const Shape& s : kShapes) {
    if (!with_empty && numel_of(s) == 0) continue;
    Tensor t = randn(s) * 3.0;
    t = where(t.abs() < 0.3, 0.0, t);
    out.push_back(t.to(dtype).contiguous());
  }
  return out;
}

std::vector<Tensor> clones(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.clone());
  return out;
}

TensorVec vec(const std::vector<Tensor>& ts) { return TensorVec(ts.begin(), ts.end()); }

const OpDef& norm_op() { return KILN_OP(foreach_norm); }
const OpDef& mul_op() { return KILN_OP(foreach_mul_); }

// --- foreach_norm --------------------------------------------------------------------------------

TEST(ForeachNormTest, KernelDecompositionAndNormAgreeBitForBit) {
  for (ScalarType dtype : kDtypes) {
    for (double ord : kOrds) {
      const std::vector<Tensor> ts = make_list(dtype, 7, /*with_empty=*/!std::isinf(ord));
      const Attrs attrs{static_cast<int64_t>(ts.size()), ord};
      const TensorVec kernel = call_op_with_kernel(norm_op(), "multi_tensor", vec(ts), attrs);
      const TensorVec decomposed = call_decomposition(norm_op(), vec(ts), attrs);
      const std::vector<Tensor> api = foreach_norm(ts, ord);
      ASSERT_EQ(kernel.size(), ts.size());
      ASSERT_EQ(decomposed.size(), ts.size());
      ASSERT_EQ(api.size(), ts.size());
      const ScalarType rt = dtype == kDouble ? kDouble : kFloat;
      for (size_t i = 0; i < ts.size(); ++i) {
        const std::string what = std::string(dtype_name(dtype)) + " ord " + std::to_string(ord) +
                                 " tensor " + std::to_string(i) + " " + shape_str(ts[i].sizes());
        EXPECT_EQ(kernel[i].dtype(), rt) << what;
        EXPECT_EQ(kernel[i].dim(), 0) << what;
        EXPECT_TRUE(same_bits(kernel[i], decomposed[i])) << what;
        EXPECT_TRUE(same_bits(kernel[i], api[i])) << what;
        EXPECT_TRUE(same_bits(kernel[i], ts[i].to(rt).norm(ord))) << what;
        // t.norm(ord) is the f32 result rounded to t's 16-bit dtype.
        EXPECT_TRUE(same_bits(kernel[i].to(dtype), ts[i].norm(ord))) << what;
      }
    }
  }
}

TEST(ForeachNormTest, MatchesAnF64Reference) {
  const std::vector<Tensor> ts = make_list(kBFloat16, 3);
  const std::vector<Tensor> norms = foreach_norm(ts);
  for (size_t i = 0; i < ts.size(); ++i) {
    double ss = 0;
    for (double v : ts[i].to(kDouble).flatten().to_vector<double>()) ss += v * v;
    EXPECT_NEAR(norms[i].item<double>(), std::sqrt(ss), 1e-6 * std::sqrt(ss)) << i;
  }
}

TEST(ForeachNormTest, PropagatesNanAndInf) {
  Tensor a = ones({5});
  a.narrow(0, 2, 1).fill_(NAN);
  Tensor b = ones({4}, kBFloat16);
  b.narrow(0, 1, 1).fill_(INFINITY);
  for (double ord : {2.0, double(INFINITY), 1.0}) {
    EXPECT_TRUE(std::isnan(foreach_norm({a}, ord)[0].item<double>())) << ord;
    EXPECT_TRUE(std::isinf(foreach_norm({b}, ord)[0].item<double>())) << ord;
  }
}

TEST(ForeachNormTest, NonContiguousTensorsRunTheDecomposition) {
  const std::vector<Tensor> ts = {randn({6, 5}).t(), randn({20}).narrow(0, 3, 10), randn({4})};
  OpCall call;
  call.op = &norm_op();
  call.inputs = vec(ts);
  call.attrs = {static_cast<int64_t>(ts.size()), 2.0};
  EXPECT_FALSE(internal::foreach_supported(call));
  const std::vector<Tensor> norms = foreach_norm(ts);
  for (size_t i = 0; i < ts.size(); ++i) EXPECT_TRUE(same_bits(norms[i], ts[i].norm(2.0))) << i;
}

TEST(ForeachNormTest, EmptyListAndMetaTensors) {
  EXPECT_TRUE(foreach_norm({}).empty());
  const TensorOptions meta = TensorOptions(kBFloat16).device(Device(kMeta));
  const std::vector<Tensor> norms = foreach_norm({empty({3, 4}, meta), empty({}, meta)}, 2.0);
  ASSERT_EQ(norms.size(), 2u);
  for (const Tensor& n : norms) {
    EXPECT_TRUE(n.is_meta());
    EXPECT_EQ(n.dtype(), kFloat);
    EXPECT_EQ(n.dim(), 0);
  }
}

TEST(ForeachNormTest, RejectsMisuse) {
  EXPECT_KILN_ERROR(foreach_norm({ones({2}), ones({3}, kBFloat16)}),
                    "[foreach_norm] tensors[1] has dtype bfloat16 but tensors[0] has float32");
  EXPECT_KILN_ERROR(foreach_norm({ones({2}), empty({3}, Device(kMeta))}), "[foreach_norm]");
  EXPECT_KILN_ERROR(foreach_norm({ones({2}), ones({}, TensorOptions().device(Device(kMeta)))}),
                    "[foreach_norm]");
  EXPECT_KILN_ERROR(foreach_norm({arange(3)}),
                    "[foreach_norm] expected floating-point tensors, got int64 for tensors[0]");
  EXPECT_KILN_ERROR(foreach_norm({ones({2}), ones({0, 3})}, INFINITY),
                    "[foreach_norm] cannot compute the inf norm of tensors[1], which is empty "
                    "(shape [0, 3])");
  EXPECT_KILN_ERROR(foreach_norm({ones({0})}, -INFINITY), "[foreach_norm] cannot compute the -inf");
  EXPECT_KILN_ERROR(foreach_norm({ones({2})}, NAN), "[foreach_norm] ord must not be nan");
  EXPECT_KILN_ERROR(foreach_norm({Tensor()}), "[foreach_norm] tensors[0] is undefined");
}

// --- foreach_mul_ --------------------------------------------------------------------------------

TEST(ForeachMulTest, KernelDecompositionAndMulAgreeBitForBit) {
  for (ScalarType dtype : kDtypes) {
    for (ScalarType sdtype : {kDouble, kFloat, kBFloat16}) {
      for (double value : {0.3183098861837907, 1.0 / 3.0, 0.0, -2.5, double(NAN)}) {
        // 0-d tensors only where the product keeps their dtype (else: the decomposition).
        std::vector<Tensor> ts = make_list(dtype, 11);
        if (promote_types(dtype, sdtype) != dtype) ts.erase(ts.begin() + 1);  // the 0-d one
        const Tensor scale = full({}, value, sdtype);
        const std::vector<Tensor> a = clones(ts), b = clones(ts), d = clones(ts), e = clones(ts);
        TensorVec ka = vec(a), kb = vec(b);
        ka.push_back(scale);
        kb.push_back(scale);
        const Attrs attrs{static_cast<int64_t>(ts.size())};
        call_op_with_kernel(mul_op(), "multi_tensor", ka, attrs);
        call_decomposition(mul_op(), kb, attrs);
        foreach_mul_(d, scale);
        for (size_t i = 0; i < ts.size(); ++i) {
          Tensor(e[i]).mul_(scale);
          const std::string what = std::string(dtype_name(dtype)) + " * " +
                                   std::string(dtype_name(sdtype)) + " " + std::to_string(value) +
                                   " tensor " + std::to_string(i);
          EXPECT_TRUE(same_bits(a[i], e[i])) << what;
          EXPECT_TRUE(same_bits(b[i], e[i])) << what;
          EXPECT_TRUE(same_bits(d[i], e[i])) << what;
        }
      }
    }
  }
}

TEST(ForeachMulTest, ZeroDimTensorsThatWidenRunTheDecomposition) {
  // t.mul_(s) of a 0-d bf16 t and a 0-d f64 s computes in f64 (both are 0-d).
  const Tensor t = full({}, 1.3, kBFloat16), u = randn({5}).to(kBFloat16);
  const Tensor s = full({}, 0.7001, kDouble);
  OpCall call;
  call.op = &mul_op();
  call.inputs = {t, u, s};
  call.attrs = {int64_t{2}};
  EXPECT_FALSE(internal::foreach_supported(call));
  call.inputs = {u, s};
  call.attrs = {int64_t{1}};
  EXPECT_TRUE(internal::foreach_supported(call));
  Tensor a = t.clone(), b = u.clone(), ea = t.clone(), eb = u.clone();
  foreach_mul_({a, b}, s);
  ea.mul_(s);
  eb.mul_(s);
  EXPECT_TRUE(same_bits(a, ea));
  EXPECT_TRUE(same_bits(b, eb));
}

TEST(ForeachMulTest, NonContiguousTensorsAndVersions) {
  Tensor base = randn({6, 5});
  Tensor t = base.t(), u = randn({4});
  const Tensor et = t.clone().mul_(full({}, 0.25)), eu = u.clone().mul_(full({}, 0.25));
  const uint64_t version = u._version();
  foreach_mul_({t, u}, full({}, 0.25));
  EXPECT_TRUE(same_bits(t, et));
  EXPECT_TRUE(same_bits(u, eu));
  EXPECT_GT(u._version(), version);
  foreach_mul_({}, full({}, 2.0));  // nothing to do
}

TEST(ForeachMulTest, RejectsMisuse) {
  Tensor a = ones({2}), b = ones({3}, kBFloat16);
  EXPECT_KILN_ERROR(foreach_mul_({a, b}, full({}, 0.5)),
                    "[foreach_mul_] tensors[1] has dtype bfloat16 but tensors[0] has float32");
  EXPECT_KILN_ERROR(foreach_mul_({a}, full({1}, 0.5)),
                    "[foreach_mul_] the scale must be a 0-d floating-point tensor, got a float32 "
                    "tensor of shape [1]");
  EXPECT_KILN_ERROR(foreach_mul_({a}, full({}, 2, kInt64)),
                    "[foreach_mul_] the scale must be a 0-d floating-point tensor, got a int64");
  EXPECT_KILN_ERROR(foreach_mul_({a}, Tensor()), "[foreach_mul_] the scale is undefined");
  Tensor i = arange(3);
  EXPECT_KILN_ERROR(foreach_mul_({i}, full({}, 0.5)),
                    "[foreach_mul_] expected floating-point tensors, got int64 for tensors[0]");
  EXPECT_KILN_ERROR(foreach_mul_({a, empty({2}, Device(kMeta))}, full({}, 0.5)), "[foreach_mul_]");
  Tensor s = full({}, 0.5);
  EXPECT_KILN_ERROR(foreach_mul_({a, s}, s), "[foreach_mul_] the scale is tensors[1] itself");
  Tensor expanded = ones({1}).expand({4});
  EXPECT_KILN_ERROR(foreach_mul_({expanded}, full({}, 0.5)), "[foreach_mul_] unsupported");
}

}  // namespace
}  // namespace kiln
