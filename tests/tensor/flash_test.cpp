// flash_attention and flash_attention_backward on the CPU (kernels/cpu/flash_attention.cpp, the
// reference of the CUDA kernels) against the composite F::scaled_dot_product_attention in f64:
// outputs, logsumexp (from the composite's masked scores) and the gradients autograd takes
// through the composite, over causal/window/softcap/GQA/MQA, T != S, dead rows and strided
// inputs; plus misuse errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "autograd/engine.h"
#include "nn/functional.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace F = nn::functional;

double rel_error(const Tensor& got, const Tensor& want) {
  const std::vector<double> g = got.to_vector<double>(), w = want.to_vector<double>();
  EXPECT_EQ(g.size(), w.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < g.size() && i < w.size(); ++i) {
    if (std::isinf(w[i]) && g[i] == w[i]) continue;  // dead rows: lse -inf on both sides
    num += (g[i] - w[i]) * (g[i] - w[i]);
    den += w[i] * w[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

struct Case {
  int64_t b, h, hkv, t, s, d;
  bool causal = false;
  int64_t window = 0;
  double softcap = 0;
};

// logsumexp over the visible keys of each row, from the composite's own building blocks.
Tensor ref_lse(const Tensor& q, const Tensor& k, const Case& c, double scale) {
  const int64_t rep = c.h / c.hkv;
  const Tensor kr =
      k.unsqueeze(2).expand({c.b, c.hkv, rep, c.s, c.d}).reshape({c.b, c.h, c.s, c.d});
  Tensor s = q.matmul(kr.transpose(-2, -1)) * scale;
  if (c.softcap > 0) s = (s / c.softcap).tanh() * c.softcap;
  const TensorOptions o(kInt64);
  const Tensor i = arange(c.t, o).view({c.t, 1}), j = arange(c.s, o).view({1, c.s});
  Tensor allowed = ones({c.t, c.s}, TensorOptions(kBool));
  if (c.causal || c.window > 0) allowed = allowed & (j <= i);  // a window is causal
  if (c.window > 0) allowed = allowed & (j > i - c.window);
  s = where(allowed, s, Scalar(-std::numeric_limits<double>::infinity()));
  return s.logsumexp({-1});
}

void check_case(const Case& c, bool strided = false) {
  SCOPED_TRACE(::testing::Message()
               << "B" << c.b << " H" << c.h << "/" << c.hkv << " T" << c.t << " S" << c.s << " D"
               << c.d << " causal " << c.causal << " window " << c.window << " softcap "
               << c.softcap << (strided ? " strided" : ""));
  Tensor q, k, v;
  if (strided) {  // q, k, v as a fused projection split + transpose: [B, T, H, D] memory
    ASSERT_EQ(c.t, c.s);
    const Tensor qkv = randn({c.b, c.t, c.h + 2 * c.hkv, c.d}, TensorOptions(kDouble));
    q = qkv.narrow(2, 0, c.h).transpose(1, 2);
    k = qkv.narrow(2, c.h, c.hkv).transpose(1, 2);
    v = qkv.narrow(2, c.h + c.hkv, c.hkv).transpose(1, 2);
  } else {
    q = randn({c.b, c.h, c.t, c.d}, TensorOptions(kDouble));
    k = randn({c.b, c.hkv, c.s, c.d}, TensorOptions(kDouble));
    v = randn({c.b, c.hkv, c.s, c.d}, TensorOptions(kDouble));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d)) * 1.3;
  auto [out, lse] = flash_attention(q, k, v, scale, c.causal, c.window, c.softcap);
  ASSERT_EQ(out.dtype(), kDouble);
  ASSERT_EQ(lse.dtype(), kDouble);

  const Tensor ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
               vl = v.detach().requires_grad_(true);
  const Tensor want = F::scaled_dot_product_attention(ql, kl, vl, {}, 0.0, c.causal, scale,
                                                      /*enable_gqa=*/true, c.window, c.softcap);
  EXPECT_LE(rel_error(out, want), 1e-12);
  const Tensor want_lse = ref_lse(ql, kl, c, scale);
  EXPECT_LE(rel_error(lse, want_lse), 1e-12);

  // Gradients of sum(out * dout) + sum(lse * dlse).
  const Tensor dout = randn(out.sizes(), TensorOptions(kDouble));
  const Tensor dlse = randn(lse.sizes(), TensorOptions(kDouble));
  const Tensor live = where(want_lse == Scalar(-std::numeric_limits<double>::infinity()),
                            Scalar(0.0), want_lse);  // no -inf * 0
  const Tensor obj = (want * dout).sum() + (live * dlse).sum();
  const autograd::variable_list g = autograd::grad({obj}, {ql, kl, vl});
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const TensorVec got =
      call_op(bwd, {dout, q, k, v, out, lse, dlse}, {scale, c.causal, c.window, c.softcap});
  EXPECT_LE(rel_error(got[0], g[0]), 1e-10) << "dq";
  EXPECT_LE(rel_error(got[1], g[1]), 1e-10) << "dk";
  EXPECT_LE(rel_error(got[2], g[2]), 1e-10) << "dv";
}

TEST(FlashAttentionCpu, MatchesCompositeF64) {
  manual_seed(31);
  check_case({1, 2, 2, 5, 5, 8});
  check_case({2, 2, 2, 17, 17, 16, true});
  check_case({1, 4, 1, 9, 13, 8, true});            // MQA, S > T (top-left causal)
  check_case({1, 4, 2, 13, 9, 8, true});            // GQA 2:1, T > S
  check_case({2, 8, 2, 19, 19, 8, true, 5});        // GQA 4:1 with a window
  check_case({1, 2, 2, 11, 11, 8, false, 4});       // a window alone (implies causal)
  check_case({1, 2, 1, 12, 12, 16, true, 0, 2.0});  // softcap
  check_case({1, 3, 3, 1, 1, 8, true});             // T = S = 1
  check_case({1, 2, 1, 7, 3, 8, false, 0, 5.0});    // softcap, no mask
}

TEST(FlashAttentionCpu, StridedQkvSplit) {
  manual_seed(32);
  check_case({2, 4, 2, 10, 10, 8, true}, /*strided=*/true);
  check_case({1, 2, 2, 7, 7, 16, false, 3}, /*strided=*/true);
}

// out follows q's memory order: the heads of a [B, T, H, D] layout give an out stored
// [B, T, H, D] (so that the projection after attention reads [B T, H D] in place), with the
// same values as for a contiguous q.
TEST(FlashAttentionCpu, OutputFollowsTheQueryLayout) {
  manual_seed(36);
  const int64_t b = 2, h = 4, t = 6, d = 8;
  const Tensor q = randn({b, t, h, d}).transpose(1, 2);  // [B, H, T, D] stored [B, T, H, D]
  const Tensor k = randn({b, 2, t, d}), v = randn({b, 2, t, d});
  const auto [out, lse] = flash_attention(q, k, v, 0.3, true);
  EXPECT_EQ(to_shape(out.strides()), (Shape{t * h * d, d, h * d, 1}));
  EXPECT_TRUE(out.transpose(1, 2).is_contiguous());
  const auto [want, want_lse] = flash_attention(q.contiguous(), k, v, 0.3, true);
  EXPECT_TRUE(want.is_contiguous());
  EXPECT_TRUE(equal(out, want));
  EXPECT_TRUE(equal(lse, want_lse));
  // The backward reads a strided out (and its dout) in place.
  const Tensor ql = q.detach().requires_grad_(true), ql2 = q.contiguous().requires_grad_(true);
  const Tensor dy = randn({b, h, t, d});
  std::get<0>(flash_attention(ql, k, v, 0.3, true)).backward(dy);
  std::get<0>(flash_attention(ql2, k, v, 0.3, true)).backward(dy);
  EXPECT_TRUE(allclose(ql.grad(), ql2.grad(), 1e-6, 1e-7));
}

TEST(FlashAttentionCpu, DeadRowsGiveZerosAndMinusInfinity) {
  manual_seed(33);
  // T > S with a window: rows i >= S + window - 1 see no key.
  check_case({1, 2, 2, 9, 3, 8, true, 2});
  const Tensor q = randn({1, 1, 6, 4}, TensorOptions(kDouble));
  const Tensor k = randn({1, 1, 2, 4}, TensorOptions(kDouble));
  auto [out, lse] = flash_attention(q, k, k, 0.5, true, 2);
  const std::vector<double> l = lse.to_vector<double>();
  for (int i = 3; i < 6; ++i) EXPECT_EQ(l[i], -std::numeric_limits<double>::infinity()) << i;
  EXPECT_EQ(out.narrow(2, 3, 3).abs().sum().item<double>(), 0.0);
}

TEST(FlashAttentionCpu, ReducedPrecisionCloseToF64) {
  manual_seed(34);
  const Tensor q = randn({1, 4, 33, 16}), k = randn({1, 2, 33, 16}), v = randn({1, 2, 33, 16});
  auto [o64, l64] = flash_attention(q.to(kDouble), k.to(kDouble), v.to(kDouble), 0.25, true);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf}) {
    auto [o, l] = flash_attention(q.to(dt), k.to(dt), v.to(dt), 0.25, true);
    EXPECT_EQ(o.dtype(), dt);
    EXPECT_EQ(l.dtype(), kFloat);
    // Inputs rounded to the dtype (bf16: 2^-9 relative) move the output by about that much.
    const double tol = dt == kFloat ? 1e-6 : dt == kHalf ? 4e-3 : 2e-2;
    EXPECT_LE(rel_error(o, o64), tol) << dtype_name(dt);
    EXPECT_LE(rel_error(l, l64), tol) << dtype_name(dt);
  }
}

// The f32 path (blocks of query rows as matrix products; bf16 and f16 run it too) against the
// f64 reference loops on the same inputs: output, logsumexp and the three gradients, over
// several query blocks, T != S, causal, windows with dead rows, softcap, GQA and MQA, and keys
// past the long-row block size.
TEST(FlashAttentionCpu, BlockedF32PathMatchesTheF64Reference) {
  manual_seed(41);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  struct R {
    Case c;
    ScalarType dtype;
  };
  for (const R& r : {R{{2, 4, 2, 150, 150, 32, true}, kFloat},
                     R{{1, 4, 1, 70, 200, 16, false}, kFloat},          // T < S, MQA
                     R{{1, 2, 2, 130, 40, 8, true, 0}, kFloat},         // T > S: dead rows
                     R{{1, 4, 2, 140, 140, 16, true, 50}, kFloat},      // a window
                     R{{1, 2, 1, 100, 100, 64, true, 0, 5.0}, kFloat},  // softcap
                     R{{1, 1, 1, 20, 9000, 8, false}, kFloat},          // long rows
                     R{{1, 4, 2, 96, 96, 32, true, 30, 3.0}, kBFloat16},
                     R{{2, 2, 1, 80, 80, 16, true}, kHalf}}) {
    const Case& c = r.c;
    SCOPED_TRACE(::testing::Message() << "B" << c.b << " H" << c.h << "/" << c.hkv << " T" << c.t
                                      << " S" << c.s << " D" << c.d << " window " << c.window
                                      << " softcap " << c.softcap << " " << dtype_name(r.dtype));
    const TensorOptions o(r.dtype);
    const Tensor q = randn({c.b, c.h, c.t, c.d}, o), k = randn({c.b, c.hkv, c.s, c.d}, o),
                 v = randn({c.b, c.hkv, c.s, c.d}, o);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
    const absl::InlinedVector<Attr, 4> attrs = {scale, c.causal, c.window, c.softcap};
    const auto [out, lse] = flash_attention(q, k, v, scale, c.causal, c.window, c.softcap);
    const Tensor q64 = q.to(kDouble), k64 = k.to(kDouble), v64 = v.to(kDouble);
    const auto [out64, lse64] =
        flash_attention(q64, k64, v64, scale, c.causal, c.window, c.softcap);
    // f32: the products' rounding; bf16/f16: the output's.
    const double tol = r.dtype == kFloat ? 2e-6 : r.dtype == kHalf ? 2e-3 : 1e-2;
    EXPECT_LE(rel_error(out, out64), tol) << "out";
    EXPECT_LE(rel_error(lse, lse64), tol) << "lse";
    const Tensor dout = randn(out.sizes(), o), dlse = randn(lse.sizes(), TensorOptions(kFloat));
    const TensorVec got = call_op(bwd, {dout, q, k, v, out, lse, dlse}, attrs);
    // The reference from the same (rounded) forward results, in f64.
    const TensorVec want = call_op(
        bwd, {dout.to(kDouble), q64, k64, v64, out.to(kDouble), lse.to(kDouble), dlse.to(kDouble)},
        attrs);
    const char* names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(got[i].dtype(), r.dtype);
      EXPECT_LE(rel_error(got[i], want[i]), r.dtype == kFloat ? 1e-5 : tol) << names[i];
    }
  }
}

// The f32 path's bits do not depend on the thread count or on where the inputs lie in memory
// (its vector loops run on aligned scratch: the resume-exact and compiled-equals-eager tests of the
// trainer rest on this).
TEST(FlashAttentionCpu, BlockedF32PathIsTheSameForAnyThreadCountAndAddress) {
  manual_seed(43);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const Tensor q = randn({2, 4, 130, 16}), k = randn({2, 2, 130, 16}), v = randn({2, 2, 130, 16});
  const Tensor dout = randn({2, 4, 130, 16});
  const absl::InlinedVector<Attr, 4> attrs = {0.25, true, int64_t{0}, 3.0};
  const int threads = get_num_threads();
  std::vector<TensorVec> runs;
  for (int t : {1, 2}) {
    for (int64_t offset : {0, 1, 3}) {  // q, k, v, dout as views at an element offset
      set_num_threads(t);
      auto at = [&](const Tensor& x) {
        return empty({x.numel() + offset})
            .narrow(0, offset, x.numel())
            .copy_(x.flatten())
            .view(x.sizes());
      };
      const auto [out, lse] = flash_attention(at(q), at(k), at(v), 0.25, true, 0, 3.0);
      const TensorVec g = call_op(bwd, {at(dout), at(q), at(k), at(v), out, lse, Tensor()}, attrs);
      runs.push_back({out, lse, g[0], g[1], g[2]});
    }
  }
  set_num_threads(threads);
  for (size_t r = 1; r < runs.size(); ++r) {
    for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(equal(runs[r][i], runs[0][i])) << r << " " << i;
  }
}

// An undefined dlse means zeros (what the backward rule passes when lse received no gradient):
// the same bits as an explicit zeros dlse, over dtypes, GQA, causal, a window with dead rows,
// softcap and a strided q.
TEST(FlashAttentionCpu, UndefinedDlseIsZerosBitwise) {
  manual_seed(37);
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  struct R {
    Case c;
    ScalarType dtype;
  };
  for (const R& r :
       {R{{1, 2, 2, 7, 7, 8}, kDouble}, R{{2, 4, 2, 9, 6, 16, true}, kFloat},
        R{{1, 4, 1, 9, 3, 8, true, 2}, kDouble},  // dead rows: T > S, a window
        R{{1, 2, 1, 12, 12, 16, true, 0, 2.0}, kBFloat16}, R{{1, 2, 2, 5, 8, 8, false}, kHalf}}) {
    const Case& c = r.c;
    SCOPED_TRACE(::testing::Message() << "H" << c.h << "/" << c.hkv << " T" << c.t << " S" << c.s
                                      << " " << dtype_name(r.dtype));
    const TensorOptions o(r.dtype);
    const Tensor q = randn({c.b, c.t, c.h, c.d}, o).transpose(1, 2);  // strided
    const Tensor k = randn({c.b, c.hkv, c.s, c.d}, o), v = randn({c.b, c.hkv, c.s, c.d}, o);
    const absl::InlinedVector<Attr, 4> attrs = {0.4, c.causal, c.window, c.softcap};
    const auto [out, lse] = flash_attention(q, k, v, 0.4, c.causal, c.window, c.softcap);
    const Tensor dout = randn(out.sizes(), o);
    const TensorVec none = call_op(bwd, {dout, q, k, v, out, lse, Tensor()}, attrs);
    const TensorVec zero = call_op(bwd, {dout, q, k, v, out, lse, zeros_like(lse)}, attrs);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(equal(none[i], zero[i])) << "gradient " << i;
      EXPECT_EQ(none[i].dtype(), r.dtype);
    }
  }
}

TEST(FlashAttentionCpu, Errors) {
  const Tensor q = randn({1, 4, 5, 8}), k = randn({1, 2, 5, 8});
  EXPECT_KILN_ERROR(flash_attention(q.view({4, 5, 8}), k, k, 1.0), "[flash_attention]");
  EXPECT_KILN_ERROR(flash_attention(q, randn({1, 3, 5, 8}), randn({1, 3, 5, 8}), 1.0),
                    "multiple of the key/value heads");
  EXPECT_KILN_ERROR(flash_attention(q, k, randn({1, 2, 6, 8}), 1.0),
                    "must agree in batch, heads and keys");
  EXPECT_KILN_ERROR(flash_attention(q, randn({1, 2, 5, 4}), randn({1, 2, 5, 4}), 1.0), "head size");
  EXPECT_KILN_ERROR(flash_attention(q, k.to(kDouble), k, 1.0), "one dtype");
  EXPECT_KILN_ERROR(flash_attention(q, k, k, 1.0, true, -1), "sliding_window");
  EXPECT_KILN_ERROR(flash_attention(q, k, k, 1.0, true, 0, -2.0), "softcap");
  static const OpDef& bwd = KILN_OP(flash_attention_backward);
  const Tensor lse = randn({1, 4, 5});
  EXPECT_KILN_ERROR(
      call_op(bwd, {q, q, k, k, q, lse, randn({1, 4, 4})}, {1.0, false, int64_t{0}, 0.0}),
      "[flash_attention_backward] lse and dlse");
  EXPECT_KILN_ERROR(
      call_op(bwd, {q, q, k, k, q, Tensor(), Tensor()}, {1.0, false, int64_t{0}, 0.0}),
      "[flash_attention_backward] dout, out and lse must be defined");
}

}  // namespace
}  // namespace kiln
