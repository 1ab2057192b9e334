// Sample calls of the registry's ops for tests/compiler/registry_test.cpp: each sample is a
// callable written with the public API (tensor/ops.h, Tensor methods, nn::functional) and a
// generator of its inputs (random, drawn after a fixed manual_seed). The test runs each sample
// eagerly and through kiln::compile and compares outputs and gradients; the traces of all samples
// together must name every registry op (CompiledRegistryCoverage).
//
// Inputs mix in what stresses the compiler's guards and kernels where it is cheap: broadcasting
// ([4, 3] with [3] or [4, 1]), non-contiguous tensors (nc(): a transposed view), size-1 dims.
// In-place ops write a clone of their input (the test hands the same inputs to both runs).
// Samples are grouped by op family, as tensor/ops/ is; the fused, indexing, random and
// optimizer families are in op_samples_nn.h.
#pragma once

#include <kiln/kiln.h>

#include <functional>
#include <ostream>
#include <string>
#include <vector>

namespace kiln::compiler_test {

using Tensors = std::vector<Tensor>;

struct OpSample {
  std::string name;  // unique; the test's name ("Samples/CompiledRegistry.MatchesEager/<name>")
  std::function<Tensors(const Tensors&)> fn;
  std::function<Tensors()> inputs;
  // Whether gradients are compared too: the floating inputs require grad in a second run and,
  // when some output then requires grad, the test differentiates sum(outputs * fixed random
  // weights). False only where eager autograd cannot, or where a DISABLED_ test in
  // registry_test.cpp reproduces a compiler bug.
  bool grad = true;
  // Draws random numbers: every run starts from the same manual_seed.
  bool random = false;
};

// gtest prints a sample by its name.
inline void PrintTo(const OpSample& s, std::ostream* os) { *os << s.name; }

namespace samples {

inline Tensor f32(IntArrayRef sizes) { return randn(sizes); }
inline Tensor f64(IntArrayRef sizes) { return randn(sizes, kDouble); }
// Positive values for log, sqrt and the like: in [0.5, 1.5).
inline Tensor pos(IntArrayRef sizes) { return rand(sizes) + 0.5; }
// A non-contiguous [rows, cols] f32 tensor: the transpose of a contiguous [cols, rows] one.
inline Tensor nc(int64_t rows, int64_t cols) { return randn({cols, rows}).t(); }
inline Tensor ints(int64_t high, IntArrayRef sizes) { return randint(0, high, sizes); }
inline Tensor mask(IntArrayRef sizes) { return rand(sizes) > 0.5; }
// Per row of a [rows, n] table, k distinct column indices (int64 [rows, k]).
inline Tensor distinct_cols(int64_t rows, int64_t n, int64_t k) {
  return rand({rows, n}).argsort(1).narrow(1, 0, k).contiguous();
}

// A one-output sample.
inline OpSample one(std::string name, std::function<Tensor(const Tensors&)> fn,
                    std::function<Tensors()> inputs, bool grad = true) {
  return {std::move(name), [fn](const Tensors& x) { return Tensors{fn(x)}; }, std::move(inputs),
          grad};
}

// Unary elementwise ops on a non-contiguous [4, 3] input (`positive`: values in [0.5, 1.5)).
inline OpSample unary(std::string name, std::function<Tensor(const Tensor&)> fn,
                      bool positive = false) {
  return one(
      std::move(name), [fn](const Tensors& x) { return fn(x[0]); },
      [positive] {
        return Tensors{positive ? pos({3, 4}).t() : nc(4, 3)};
      });
}

// Binary ops broadcasting [4, 3] (non-contiguous) against [3].
inline OpSample binary(std::string name, std::function<Tensor(const Tensor&, const Tensor&)> fn,
                       bool positive = false) {
  return one(
      std::move(name), [fn](const Tensors& x) { return fn(x[0], x[1]); },
      [positive] {
        return positive ? Tensors{pos({3, 4}).t(), pos({3})} : Tensors{nc(4, 3), f32({3})};
      });
}

// An in-place op on a clone of input 0 ([4, 3]), input 1 broadcast from [4, 1].
inline OpSample inplace(std::string name, std::function<void(Tensor&, const Tensor&)> fn,
                        bool positive = false, bool grad = true) {
  return one(
      std::move(name),
      [fn](const Tensors& x) {
        Tensor y = x[0].clone();
        fn(y, x[1]);
        return y;
      },
      [positive] {
        return positive ? Tensors{pos({4, 3}), pos({4, 1})} : Tensors{nc(4, 3), f32({4, 1})};
      },
      grad);
}

}  // namespace samples

// Elementwise ops: unary, binary, comparisons and logical ops, and their in-place forms.
inline std::vector<OpSample> elementwise_samples() {
  using namespace samples;
  return {
      unary("abs", [](const Tensor& a) { return a.abs(); }),
      unary("ceil", [](const Tensor& a) { return a.ceil(); }),
      unary("cos", [](const Tensor& a) { return a.cos(); }),
      unary("erf", [](const Tensor& a) { return a.erf(); }),
      unary("exp", [](const Tensor& a) { return a.exp(); }),
      unary("expm1", [](const Tensor& a) { return a.expm1(); }),
      unary("floor", [](const Tensor& a) { return a.floor(); }),
      unary("gelu", [](const Tensor& a) { return a.gelu(); }),
      unary("gelu_tanh", [](const Tensor& a) { return a.gelu("tanh"); }),
      // gelu's gradient op, called directly (its own gradients: double backward through gelu).
      {"gelu_backward",
       [](const Tensors& x) {
         static const OpDef& op = KILN_OP(gelu_backward);
         return Tensors{call_op1(op, {x[0], x[1]}, {std::string("none")}),
                        call_op1(op, {x[0], x[1]}, {std::string("tanh")})};
       },
       [] {
         return Tensors{f32({4, 3}), nc(4, 3)};
       }},
      unary(
          "log", [](const Tensor& a) { return a.log(); }, true),
      unary(
          "log1p", [](const Tensor& a) { return a.log1p(); }, true),
      unary("neg", [](const Tensor& a) { return -a; }),
      unary(
          "reciprocal", [](const Tensor& a) { return a.reciprocal(); }, true),
      unary("relu", [](const Tensor& a) { return a.relu(); }),
      unary("round", [](const Tensor& a) { return (a * 4.0).round(); }),
      unary(
          "rsqrt", [](const Tensor& a) { return a.rsqrt(); }, true),
      unary("sigmoid", [](const Tensor& a) { return a.sigmoid(); }),
      unary("sign", [](const Tensor& a) { return a.sign(); }),
      unary("silu", [](const Tensor& a) { return a.silu(); }),
      unary("sin", [](const Tensor& a) { return a.sin(); }),
      unary(
          "sqrt", [](const Tensor& a) { return a.sqrt(); }, true),
      unary("square", [](const Tensor& a) { return a.square(); }),
      unary("tanh", [](const Tensor& a) { return a.tanh(); }),
      unary(
          "pow_tensor_scalar", [](const Tensor& a) { return a.pow(2.5); }, true),
      one(
          "logical_not", [](const Tensors& x) { return x[0].logical_not(); },
          [] {
            return Tensors{mask({4, 3})};
          }),
      one(
          "bitwise_not", [](const Tensors& x) { return ~x[0]; },
          [] {
            return Tensors{mask({4, 3})};
          }),
      // f64 and a size-1 dim.
      one(
          "exp_f64", [](const Tensors& x) { return x[0].exp(); },
          [] {
            return Tensors{f64({2, 1, 3})};
          }),

      binary("add", [](const Tensor& a, const Tensor& b) { return a.add(b, 2.0); }),
      binary("add_scalar", [](const Tensor& a, const Tensor&) { return a + 1.5; }),
      binary("sub", [](const Tensor& a, const Tensor& b) { return a - b; }),
      binary("mul", [](const Tensor& a, const Tensor& b) { return a * b; }),
      binary(
          "div", [](const Tensor& a, const Tensor& b) { return a / b; }, true),
      binary(
          "pow", [](const Tensor& a, const Tensor& b) { return a.pow(b); }, true),
      binary("atan2", [](const Tensor& a, const Tensor& b) { return a.atan2(b); }),
      binary("maximum", [](const Tensor& a, const Tensor& b) { return a.maximum(b); }),
      binary("minimum", [](const Tensor& a, const Tensor& b) { return a.minimum(b); }),
      binary("clamp", [](const Tensor& a, const Tensor&) { return a.clamp(-0.5, 0.5); }),
      binary("lerp", [](const Tensor& a, const Tensor& b) { return a.lerp(b, 0.3); }),
      one(
          "lerp_tensor_weight", [](const Tensors& x) { return x[0].lerp(x[1], x[2]); },
          [] {
            return Tensors{f32({4, 3}), f32({4, 1}), rand({3})};
          }),
      one(
          "mixed_dtypes", [](const Tensors& x) { return x[0] * x[1] + x[2]; },
          [] {
            return Tensors{f32({4, 3}), f64({3}), ints(5, {4, 1})};
          }),
      binary("lt", [](const Tensor& a, const Tensor& b) { return a.lt(b); }),
      binary("le", [](const Tensor& a, const Tensor& b) { return a.le(b); }),
      binary("gt", [](const Tensor& a, const Tensor& b) { return a.gt(b); }),
      binary("ge", [](const Tensor& a, const Tensor& b) { return a.ge(b); }),
      binary("isclose", [](const Tensor& a, const Tensor& b) { return isclose(a, b, 0.5, 0.5); }),
      one(
          "eq", [](const Tensors& x) { return x[0].eq(x[1]); },
          [] {
            return Tensors{ints(3, {4, 3}), ints(3, {3})};
          }),
      one(
          "ne", [](const Tensors& x) { return x[0].ne(x[1]); },
          [] {
            return Tensors{ints(3, {4, 3}), ints(3, {4, 1})};
          }),
      one(
          "logical_and", [](const Tensors& x) { return x[0].logical_and(x[1]); },
          [] {
            return Tensors{mask({4, 3}), mask({3})};
          }),
      one(
          "logical_or", [](const Tensors& x) { return x[0].logical_or(x[1]); },
          [] {
            return Tensors{mask({4, 3}), mask({3})};
          }),
      one(
          "logical_xor", [](const Tensors& x) { return x[0].logical_xor(x[1]); },
          [] {
            return Tensors{mask({4, 3}), mask({4, 1})};
          }),
      one(
          "where", [](const Tensors& x) { return where(x[0], x[1], x[2]); },
          [] {
            return Tensors{mask({4, 1}), nc(4, 3), f32({3})};
          }),

      inplace("add_", [](Tensor& y, const Tensor& b) { y.add_(b, 0.5); }),
      inplace("sub_", [](Tensor& y, const Tensor& b) { y.sub_(b); }),
      inplace("mul_", [](Tensor& y, const Tensor& b) { y.mul_(b); }),
      inplace(
          "div_", [](Tensor& y, const Tensor& b) { y.div_(b); }, true),
      inplace("clamp_", [](Tensor& y, const Tensor&) { y.clamp_(-0.3, std::nullopt); }),
      inplace("lerp_",
              [](Tensor& y, const Tensor& b) {
                y.lerp_(b.expand({4, 3}), 0.25);
              }),
      inplace("exp_", [](Tensor& y, const Tensor&) { y.exp_(); }),
      inplace("neg_", [](Tensor& y, const Tensor&) { y.neg_(); }),
      inplace("relu_", [](Tensor& y, const Tensor&) { y.relu_(); }),
      inplace(
          "sqrt_", [](Tensor& y, const Tensor&) { y.sqrt_(); }, true),
  };
}

// Reductions, scans, softmax and linear algebra.
inline std::vector<OpSample> reduction_samples() {
  using namespace samples;
  auto two = [](std::tuple<Tensor, Tensor> t) { return Tensors{std::get<0>(t), std::get<1>(t)}; };
  return {
      unary("sum", [](const Tensor& a) { return a.sum({1}); }),
      unary("sum_all_f64", [](const Tensor& a) { return a.sum(kDouble); }),
      unary("mean", [](const Tensor& a) { return a.mean({0}, true); }),
      unary("prod", [](const Tensor& a) { return a.prod(1); }),
      unary("amax", [](const Tensor& a) { return a.amax({1}); }),
      unary("amin", [](const Tensor& a) { return a.amin({0}, true); }),
      unary("max", [](const Tensor& a) { return a.max(); }),
      unary("min", [](const Tensor& a) { return a.min(); }),
      {"max_dim", [two](const Tensors& x) { return two(x[0].max(1)); },
       [] { return Tensors{nc(4, 3)}; }},
      {"min_dim", [two](const Tensors& x) { return two(x[0].min(0, true)); },
       [] { return Tensors{nc(4, 3)}; }},
      unary("argmax", [](const Tensor& a) { return a.argmax(1); }),
      unary("argmin", [](const Tensor& a) { return a.argmin(); }),
      unary("var", [](const Tensor& a) { return a.var({1}); }),
      unary("std", [](const Tensor& a) { return a.std({0}, 0, true); }),
      unary("norm", [](const Tensor& a) { return a.norm(2, {1}); }),
      unary("logsumexp", [](const Tensor& a) { return a.logsumexp({1}); }),
      unary("cumsum", [](const Tensor& a) { return a.cumsum(0); }),
      unary("softmax", [](const Tensor& a) { return a.softmax(1); }),
      unary("log_softmax", [](const Tensor& a) { return a.log_softmax(0); }),
      one(
          "all", [](const Tensors& x) { return x[0].all(1); },
          [] {
            return Tensors{mask({4, 3})};
          }),
      one(
          "any", [](const Tensors& x) { return x[0].any(); },
          [] {
            return Tensors{mask({4, 3})};
          }),
      // A size-1 dim reduced.
      one(
          "sum_size1", [](const Tensors& x) { return x[0].sum({1}); },
          [] {
            return Tensors{f32({2, 1, 3})};
          }),

      one(
          "mm", [](const Tensors& x) { return mm(x[0], x[1]); },
          [] {
            return Tensors{f32({4, 5}), nc(5, 3)};
          }),
      // A weight gradient copied into a bucket's view (DDP): the fold_copy_into_mm pass's
      // mm_into_. The product is transposed twice, as autograd's weight gradient is.
      one(
          "mm_copied_into_place",
          [](const Tensors& x) {
            Tensor bucket = zeros({2 * 4 * 3}, x[0].options());
            bucket.narrow(0, 4 * 3, 4 * 3).view({4, 3}).copy_(mm(x[0], x[1]).t().t());
            return bucket * 1.0;
          },
          [] {
            return Tensors{f32({4, 5}), nc(5, 3)};
          }),
      one(
          "matmul_broadcast", [](const Tensors& x) { return matmul(x[0], x[1]); },
          [] {
            return Tensors{f32({2, 4, 5}), f32({5, 3})};
          }),
      one(
          "bmm", [](const Tensors& x) { return bmm(x[0], x[1]); },
          [] {
            return Tensors{f32({2, 4, 5}), f32({2, 5, 3})};
          }),
      one(
          "addmm", [](const Tensors& x) { return addmm(x[0], x[1], x[2], 0.5, 2.0); },
          [] {
            return Tensors{f32({3}), f32({4, 5}), nc(5, 3)};
          }),
      // A Linear layer's weight and bias gradients in one call (addmm's backward on a GPU), either
      // operand summed; its gradients compared too (double backward).
      {"mm_with_bias_grad",
       [](const Tensors& x) {
         static const OpDef& op = KILN_OP(mm_with_bias_grad);
         const TensorVec r0 = call_op(op, {x[0].t(), x[1]}, {int64_t{0}});
         const TensorVec r1 = call_op(op, {x[1].t(), x[0]}, {int64_t{1}});
         return Tensors{r0[0], r0[1], r1[0], r1[1]};
       },
       [] {
         return Tensors{f32({6, 4}), f32({6, 3})};
       }},
      // matmul_epilogue's mm or addmm with relu / tanh-gelu. No gradients: the op has no backward
      // (it is written into programs whose backward is already traced).
      {"addmm_activation",
       [](const Tensors& x) {
         static const OpDef& op = KILN_OP(addmm_activation);
         return Tensors{call_op1(op, {x[0], x[1], x[2]}, {Scalar(1.0), Scalar(1.0), false}),
                        call_op1(op, {x[0], x[1], x[2]}, {Scalar(0.5), Scalar(2.0), true})};
       },
       [] {
         return Tensors{f32({3}), f32({4, 5}), nc(5, 3)};
       },
       false},
      // matmul_epilogue's tanh-gelu layer that keeps its input, and the product of its gradient
      // times gelu'(pre). No gradients: no backward rules (as addmm_activation).
      {"addmm_gelu_aux",
       [](const Tensors& x) {
         static const OpDef& op = KILN_OP(addmm_gelu_aux);
         const TensorVec r = call_op(op, {x[0], x[1], x[2]}, {Scalar(1.0), Scalar(1.0)});
         return Tensors{r[0], r[1]};
       },
       [] {
         return Tensors{f32({3}), f32({4, 5}), nc(5, 3)};
       },
       false},
      {"mm_dgelu",
       [](const Tensors& x) {
         static const OpDef& op = KILN_OP(mm_dgelu);
         return Tensors{call_op1(op, {x[0], x[1], x[2]})};
       },
       [] {
         return Tensors{f32({4, 5}), nc(5, 3), f32({4, 3})};
       },
       false},
      // The multi-tensor ops of gradient clipping (tensor/foreach.h), on contiguous lists (their
      // kernels; others run the decomposition). No gradients: the ops have no backward.
      {"foreach_norm",
       [](const Tensors& x) {
         const std::vector<Tensor> n = foreach_norm({x[0], x[1], x[2]}, 2.0);
         return Tensors(n.begin(), n.end());
       },
       [] {
         return Tensors{f32({4, 3}), f32({5}), f32({})};
       },
       false},
      {"foreach_mul_",
       [](const Tensors& x) {
         NoGradGuard no_grad;
         Tensor a = x[0].clone(), b = x[1].clone();
         foreach_mul_({a, b}, x[2]);
         return Tensors{a, b};
       },
       [] {
         return Tensors{f32({4, 3}), f32({5}), f32({})};
       },
       false},
  };
}

// Views (returned as they are: outputs that alias an input) and copies.
inline std::vector<OpSample> view_samples() {
  using namespace samples;
  return {
      one(
          "view",
          [](const Tensors& x) {
            return x[0].view({3, 4});
          },
          [] {
            return Tensors{f32({4, 3})};
          }),
      unary("permute",
            [](const Tensor& a) {
              return a.permute({1, 0});
            }),
      one(
          "expand",
          [](const Tensors& x) {
            return x[0].expand({2, 4, 3});
          },
          [] {
            return Tensors{f32({4, 1})};
          }),
      one(
          "squeeze", [](const Tensors& x) { return x[0].squeeze(1); },
          [] {
            return Tensors{f32({2, 1, 3})};
          }),
      unary("unsqueeze", [](const Tensor& a) { return a.unsqueeze(1); }),
      unary("slice", [](const Tensor& a) { return a.slice(1, 1, 3); }),
      unary("select", [](const Tensor& a) { return a.select(0, 2); }),
      one(
          "as_strided",
          [](const Tensors& x) {
            return x[0].as_strided({3, 2}, {1, 3}, 1);
          },
          [] { return Tensors{f32({12})}; }),
      unary("alias", [](const Tensor& a) { return a.alias(); }),
      // A view written through: slice of a clone, in place.
      one(
          "slice_inplace",
          [](const Tensors& x) {
            Tensor y = x[0].clone();
            y.slice(1, 0, 2).mul_(x[1]);
            return y;
          },
          // Eager autograd rejects in-place writes to views of tensors that require grad.
          [] {
            return Tensors{f32({4, 3}), f32({4, 1})};
          },
          false),
      one(
          "to_copy", [](const Tensors& x) { return x[0].to(kDouble); },
          [] { return Tensors{nc(4, 3)}; }),
      one(
          "to_copy_int", [](const Tensors& x) { return x[0].to(kFloat); },
          [] {
            return Tensors{ints(7, {4, 3})};
          }),
      one(
          "contiguous", [](const Tensors& x) { return x[0].contiguous(); },
          [] { return Tensors{nc(4, 3)}; }),
      one(
          "copy_",
          [](const Tensors& x) {
            Tensor y = x[1].clone();
            y.copy_(x[0]);
            return y;
          },
          [] {
            return Tensors{f32({3}), f32({4, 3})};
          }),
      one(
          "fill_",
          [](const Tensors& x) {
            Tensor y = x[0].clone();
            y.fill_(2.5);
            return y * x[0];
          },
          [] {
            return Tensors{f32({4, 3})};
          }),
  };
}

}  // namespace kiln::compiler_test
