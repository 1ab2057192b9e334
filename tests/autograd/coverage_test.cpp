// Backward-rule coverage of the op registry: every op is either differentiable, with a
// backward rule and a gradcheck test in tests/autograd/*_grad_test.cpp, or listed below as
// non-differentiable. A new op fails this test until it gets a rule (autograd/*_backward.cpp)
// and a gradcheck, or is added to the non-differentiable list with the reason.
#include <algorithm>
#include <iostream>
#include <set>
#include <string>

#include "grad_test_util.h"

namespace kiln {
namespace {

// Ops whose outputs carry no gradient.
const std::set<std::string> kNonDifferentiable = {
    // Comparisons and logical ops: bool outputs.
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "isclose",
    "logical_and",
    "logical_or",
    "logical_xor",
    "logical_not",
    "all",
    "any",
    "bitwise_not",
    // Integer outputs: indices and encodings.
    "argmax",
    "argmin",
    "nonzero",
    "one_hot",
    // Random sampling of integers (the random fills of existing tensors are differentiable:
    // they overwrite, and have rules giving the old values a zero gradient).
    "multinomial",
    "randperm",
    // Collectives (dist/collective_ops.h): in place on gradients and gathered parameters, under
    // no_grad.
    "dist_all_reduce_",
    "dist_broadcast_",
    "dist_wait_",
    "dist_all_gather_",
    "dist_reduce_scatter_",
    "dist_all_gather_coalesced_",
    "dist_reduce_scatter_coalesced_",
    // Factories: no tensor inputs.
    "arange",
    "empty",
    "eye",
    // The fused backward kernels behind the rules of rms_norm, layer_norm, cross_entropy_fused,
    // swiglu, geglu_tanh, lstm_cell_fused and gru_cell_fused: their own derivatives (double
    // backward through the fused ops) are not
    // implemented yet, and backward through them fails with a clear error.
    "rms_norm_backward",
    "layer_norm_backward",
    "cross_entropy_fused_backward",
    // The cross-entropy's loss and gradient in one call (linear_cross_entropy's chunks): it
    // returns the gradient itself.
    "cross_entropy_fused_with_grad",
    "flash_attention_backward",
    // The compiler's rewrites (fuse_qkv_rotary, fold_copy_into_mm, compiler/passes.h), written
    // into programs whose backward is already traced: the backward of attention merged into the
    // qkv gradient, split_qkv_rotary's rotation in place, and a product written where a copy put
    // it.
    "flash_attention_backward_qkv",
    "rotary_qkv_",
    "mm_into_",
    // matmul_epilogue's relu / tanh-gelu after an mm or addmm, and tanh-gelu's gradient in the
    // product that makes it (compiler/matmul_epilogue.cpp).
    "addmm_activation",
    "addmm_gelu_aux",
    "mm_dgelu",
    "swiglu_backward",
    "geglu_tanh_backward",
    "lstm_cell_fused_backward",
    "gru_cell_fused_backward",
    // The optimizer updates: in place on parameters and state, run under NoGradGuard; and
    // increment_, which advances their int64 step counts.
    "adam_update_",
    "sgd_update_",
    "increment_",
    // Gradient clipping's multi-tensor ops (tensor/foreach.h): they run on gradients under
    // NoGradGuard, as torch's _foreach_norm / _foreach_mul_ in clip_grad_norm_.
    "foreach_norm",
    "foreach_mul_",
};

// Differentiable ops and the test that gradchecks each (a name check_grad asserts is in the
// recorded graph there). Kept by hand; GradCoverage.EveryDifferentiableOpIsGradchecked compares
// it with the registry.
const std::set<std::string> kGradchecked = {
    // unary_grad_test.cpp
    "exp",
    "log",
    "log1p",
    "expm1",
    "sqrt",
    "rsqrt",
    "sin",
    "cos",
    "tanh",
    "sigmoid",
    "erf",
    "reciprocal",
    "silu",
    "gelu",
    "gelu_backward",
    "square",
    "neg",
    "abs",
    "relu",
    "sign",
    "floor",
    "ceil",
    "round",
    "pow_tensor_scalar",
    "exp_",
    "sqrt_",
    "neg_",
    "relu_",
    // binary_grad_test.cpp
    "add",
    "sub",
    "mul",
    "div",
    "pow",
    "atan2",
    "maximum",
    "minimum",
    "where",
    "clamp",
    "lerp",
    "add_",
    "sub_",
    "mul_",
    "div_",
    "clamp_",
    "lerp_",
    // reduce_grad_test.cpp
    "sum",
    "mean",
    "prod",
    "amax",
    "amin",
    "max",
    "min",
    "max_dim",
    "min_dim",
    "var",
    "std",
    "norm",
    "logsumexp",
    "cumsum",
    "softmax",
    "log_softmax",
    // index_grad_test.cpp
    "index",
    "index_put_",
    "index_select",
    "gather",
    "scatter",
    "scatter_",
    "scatter_value",
    "scatter_value_",
    "scatter_add",
    "scatter_add_",
    "index_add",
    "index_add_",
    "masked_fill",
    "masked_fill_",
    "masked_select",
    "embedding",
    "triu",
    "tril",
    "cat",
    "sort",
    "topk",
    "rms_norm",
    "flash_attention",
    "cross_entropy_fused",
    // fused_grad_test.cpp
    "layer_norm",
    "rotary_emb",
    "rotary_emb_qk",
    "split_qkv_rotary",
    "merge_qkv_rotary",
    "linear_cross_entropy",
    "swiglu",
    "geglu_tanh",
    // tests/nn/rnn_test.cpp
    "lstm_cell_fused",
    "gru_cell_fused",
    "unbind_copy",
    // index_grad_test.cpp
    "split_with_sizes_copy",
    // view_grad_test.cpp
    "view",
    "permute",
    "expand",
    "squeeze",
    "unsqueeze",
    "slice",
    "select",
    "as_strided",
    "alias",
    "slice_backward",
    "select_backward",
    "to_copy",
    "copy_",
    "fill_",
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    // linalg_grad_test.cpp
    "mm",
    "bmm",
    "addmm",
    "mm_with_bias_grad",
};

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

TEST(GradCoverage, EveryDifferentiableOpHasABackwardRule) {
  Registry& reg = Registry::get();
  std::vector<std::string> missing, listed_with_rule;
  int64_t differentiable = 0, with_rule = 0;
  for (const std::string& name : reg.names()) {
    const OpDef& op = reg.entry(name);
    if (op.meta == nullptr) continue;  // an entry without a definition (e.g. a kernel only)
    if (kNonDifferentiable.count(name)) {
      if (op.backward != nullptr) listed_with_rule.push_back(name);
      continue;
    }
    ++differentiable;
    if (op.backward != nullptr) {
      ++with_rule;
    } else {
      missing.push_back(name);
    }
  }
  std::cout << "backward rules: " << with_rule << " of " << differentiable
            << " differentiable ops (" << kNonDifferentiable.size()
            << " ops listed non-differentiable)" << std::endl;
  RecordProperty("backward_rules",
                 std::to_string(with_rule) + " of " + std::to_string(differentiable));
  EXPECT_TRUE(missing.empty()) << "ops without a backward rule: " << join(missing);
  EXPECT_TRUE(listed_with_rule.empty())
      << "ops listed non-differentiable that have a backward rule: " << join(listed_with_rule);
  const std::vector<std::string> names = reg.names();
  for (const std::string& name : kNonDifferentiable) {
    EXPECT_TRUE(std::ranges::find(names, name) != names.end())
        << name << " is listed non-differentiable but is not a registry op";
  }
}

TEST(GradCoverage, EveryDifferentiableOpIsGradchecked) {
  Registry& reg = Registry::get();
  std::vector<std::string> unchecked, stale;
  int64_t differentiable = 0, checked = 0;
  const std::vector<std::string> names = reg.names();
  for (const std::string& name : names) {
    if (reg.entry(name).meta == nullptr || kNonDifferentiable.count(name)) continue;
    ++differentiable;
    if (kGradchecked.count(name)) {
      ++checked;
    } else {
      unchecked.push_back(name);
    }
  }
  for (const std::string& name : kGradchecked) {
    if (std::ranges::find(names, name) == names.end()) stale.push_back(name);
  }
  std::cout << "gradcheck coverage: " << checked << " of " << differentiable
            << " differentiable ops" << std::endl;
  RecordProperty("gradcheck_coverage",
                 std::to_string(checked) + " of " + std::to_string(differentiable));
  EXPECT_TRUE(unchecked.empty()) << "differentiable ops without a gradcheck test: "
                                 << join(unchecked);
  EXPECT_TRUE(stale.empty()) << "listed as gradchecked but not registry ops: " << join(stale);
}

// Guards the helper the suites rely on: a wrong rule must fail check_grad. A custom function
// whose backward is off by a factor stands in for a broken registry rule.
class WrongDouble : public autograd::Function<WrongDouble> {
 public:
  static Tensor forward(autograd::AutogradContext*, Tensor x) { return x * 2.0; }
  static autograd::variable_list backward(autograd::AutogradContext*, autograd::variable_list g) {
    return {g[0] * 3.0};
  }
};

TEST(GradCoverage, CheckGradCatchesWrongGradients) {
  Tensor x = gradtest::leaf({3});
  EXPECT_FALSE(gradtest::check_grad(
      {}, [](const gradtest::variable_list& in) { return WrongDouble::apply(in[0]); }, {x}));
  // And an op claimed but absent from the graph.
  EXPECT_FALSE(gradtest::check_grad(
      {"exp"}, [](const gradtest::variable_list& in) { return in[0] * 2.0; }, {x}));
}

}  // namespace
}  // namespace kiln
