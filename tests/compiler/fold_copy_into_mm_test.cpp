// The fold_copy_into_mm pass (compiler/passes.h): `copy_(dst, mm(a, b))` (through views that
// end in the product's layout) becomes `mm_into_(dst, a, b)`, and the op it makes
// (tensor/ops/linalg.cpp). On the CPU: the pattern folds as DDP's buckets take weight gradients,
// what it must keep is kept, a compiled step equals eager bit for bit; mm_into_ against mm, its
// errors, and an out that shares memory with an operand.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "kiln.h"
#include "tensor/registry.h"
#include "test_util.h"
#include "trace_test_util.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;

using Body = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Bit for bit: the same shape, dtype and elements.
void expect_same(const Tensor& got, const Tensor& want) {
  EXPECT_EQ(got.dtype(), want.dtype());
  EXPECT_TRUE(equal(got, want)) << got << "\n" << want;
}

Trace folded(const Body& fn, const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::fold_copy_into_mm(compiler::trace_callable(fn, args).trace);
}

// a [4, 6], b [6, 5], dst [4, 5] (a bucket's view), as CPU tensors.
std::vector<Tensor> operands() {
  manual_seed(7);
  return {randn({4, 6}), randn({6, 5}), zeros({4, 5})};
}

// A weight gradient as autograd makes it (the product transposed twice) copied into dst.
std::vector<Tensor> weight_gradient_into(const std::vector<Tensor>& in) {
  Tensor dst = in[2];
  dst.copy_(mm(in[0], in[1]).t().t());
  return {dst};
}

TEST(FoldCopyIntoMm, TheProductIsWrittenWhereTheCopyPutIt) {
  const Trace t = folded(weight_gradient_into, operands());
  EXPECT_EQ(count_ops(t, "mm"), 0) << t.str();
  EXPECT_EQ(count_ops(t, "copy_"), 0) << t.str();
  EXPECT_EQ(count_ops(t, "permute"), 0) << t.str();
  ASSERT_EQ(count_ops(t, "mm_into_"), 1) << t.str();
  EXPECT_EQ(t.stage, "fold_copy_into_mm");
}

TEST(FoldCopyIntoMm, KeepsWhatItMustKeep) {
  const std::vector<Tensor> in = operands();
  auto kept = [&](const Body& fn, const std::string& what) {
    const Trace t = folded(fn, in);
    EXPECT_EQ(count_ops(t, "mm_into_"), 0) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "mm"), 1) << what << "\n" << t.str();
  };
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2];
        const Tensor y = mm(x[0], x[1]);
        dst.copy_(y);
        return std::vector<Tensor>{dst, y.sum()};
      },
      "the product read again");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2];
        const Tensor y = mm(x[0], x[1]);
        dst.copy_(y);
        return std::vector<Tensor>{dst, y};
      },
      "the product handed out");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2];
        const Tensor y = mm(x[0], x[1]);
        Tensor a = x[0];
        a.mul_(2.0);  // the operand changes between the product and the copy
        dst.copy_(y);
        return std::vector<Tensor>{dst};
      },
      "an in-place op between the product and the copy");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2].t();  // [5, 4], strided
        dst.copy_(mm(x[1].t(), x[0].t()));
        return std::vector<Tensor>{x[2]};
      },
      "a strided destination");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2].reshape({5, 4}).clone();
        dst.copy_(mm(x[0], x[1]).t());
        return std::vector<Tensor>{dst};
      },
      "the copy reads the product transposed");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2].to(kDouble);
        dst.copy_(mm(x[0], x[1]));
        return std::vector<Tensor>{dst};
      },
      "a conversion");
  kept(
      [](const std::vector<Tensor>& x) {
        Tensor dst = x[2].narrow(0, 0, 2);
        dst.copy_(mm(x[0], x[1]).narrow(0, 2, 2));
        return std::vector<Tensor>{x[2]};
      },
      "a view that moves the offset");
}

TEST(FoldCopyIntoMm, CompiledEqualsEagerBitForBit) {
  const std::vector<Tensor> eager_in = operands(), compiled_in = operands();
  NoGradGuard no_grad;
  auto step = [](const Tensor& a, const Tensor& b, const Tensor& dst) {
    weight_gradient_into({a, b, dst});
    return dst.sum();
  };
  auto compiled = kiln::compile(step);
  for (int i = 0; i < 2; ++i) {  // the compiling call, then a cache hit
    step(eager_in[0], eager_in[1], eager_in[2]);
    compiled(compiled_in[0], compiled_in[1], compiled_in[2]);
    expect_same(compiled_in[2], eager_in[2]);
  }
  bool folded_seen = false;
  for (const Trace& t : compiled.traces()) folded_seen |= count_ops(t, "mm_into_") > 0;
  EXPECT_TRUE(folded_seen);
  // Skipped by name, the copy stays.
  auto unfolded = kiln::compile(step, CompileOptions().skip_pass("fold_copy_into_mm"));
  unfolded(compiled_in[0], compiled_in[1], compiled_in[2]);
  for (const Trace& t : unfolded.traces()) EXPECT_EQ(count_ops(t, "mm_into_"), 0) << t.str();
}

TEST(MmInto, WritesTheProductIntoOut) {
  static const OpDef& op = KILN_OP(mm_into_);
  for (ScalarType dtype : {kFloat, kDouble, kBFloat16}) {
    manual_seed(11);
    const Tensor a = randn({3, 7}).to(dtype), b = randn({7, 2}).to(dtype);
    Tensor out = full({3, 2}, 5.0, TensorOptions(dtype));
    const TensorVec r = call_op(op, {out, a, b});
    EXPECT_EQ(r[0].data_ptr(), out.data_ptr());
    expect_same(out, mm(a, b));
  }
  // out sharing memory with an operand: the product of the operands as they were.
  manual_seed(12);
  Tensor a = randn({4, 4});
  const Tensor b = randn({4, 4});
  const Tensor want = mm(a, b);
  call_op(op, {a, a, b});
  expect_same(a, want);
}

TEST(MmInto, ErrorsNameTheOpAndTheShapes) {
  static const OpDef& op = KILN_OP(mm_into_);
  const Tensor a = ones({3, 7}), b = ones({7, 2});
  EXPECT_KILN_ERROR(call_op(op, {ones({2, 3}), a, b}),
                    "[mm_into_] expected out to be a contiguous float32 tensor of shape [3, 2] on "
                    "cpu, got float32 [2, 3] on cpu");
  EXPECT_KILN_ERROR(call_op(op, {ones({2, 3}).t(), a, b}), "got float32 [3, 2] strided on cpu");
  EXPECT_KILN_ERROR(call_op(op, {ones({3, 2}, kDouble), a, b}), "got float64 [3, 2] on cpu");
  EXPECT_KILN_ERROR(call_op(op, {ones({3, 2}), a, ones({6, 2})}), "[mm] shapes [3, 7] and [6, 2]");
  // A pass's op: no derivative.
  const Tensor leaf = ones({3, 7}).requires_grad_(true);
  const Tensor y = leaf * 2;
  Tensor out = zeros({3, 2});
  call_op(op, {out, y, b});
  EXPECT_KILN_ERROR(out.sum().backward(),
                    "[mm_into_] the derivative of mm_into_ is not implemented");
}

}  // namespace
}  // namespace kiln
