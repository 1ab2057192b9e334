// "matmul_epilogue": an mm and the add or sub after it as one addmm (compiler/fuse.h,
// attach_epilogues; the contract is in compiler/executor.h).
//
// A transformer's residual stream is such a pair in every block, twice in the forward
// (h = x + o_proj(attn), h + down_proj(mlp)) and again in the backward, where the gradient of a
// projection's input is added to the residual's gradient. Eager code writes the product, reads it
// back with the residual and writes the sum; addmm hands the residual to the GEMM as its C matrix
// (beta = 1: cuBLASLt adds it in the epilogue, before the one rounding to the output dtype), or a
// bias row to the bias epilogue, so the product never reaches memory and one kernel launch goes.
//
//   y = r + alpha * (a @ b)   ->  addmm(r, a, b; beta = 1,      alpha = alpha)
//   y = (a @ b) + alpha * r   ->  addmm(r, a, b; beta = alpha,  alpha = 1)
//   y = r - alpha * (a @ b)   ->  addmm(r, a, b; beta = 1,      alpha = -alpha)
//   y = (a @ b) - alpha * r   ->  addmm(r, a, b; beta = -alpha, alpha = 1)
//
// r is either of the consumer's output shape (read as [m, n]) or a row of n elements.
//
// An mm or addmm read only by relu or gelu(approximate = "tanh") becomes addmm_activation: on
// CUDA cuBLASLt's RELU(_BIAS) / GELU(_BIAS) epilogue (a Linear layer with a bias, then the
// activation, in one kernel; the pre-activation never reaches memory). In a training step this
// holds for relu, whose backward reads its output. Tanh-gelu's backward reads its input, the
// product, which the forward then keeps: addmm_gelu_aux writes both (GELU_AUX(_BIAS)). In the
// backward, the product that gelu_backward reads as its gradient becomes mm_dgelu (DGELU: the
// product times gelu'(pre), pre read in the epilogue), so the gradient of gelu's output never
// reaches memory either.
//
//   y = relu(addmm(b, x, w))               ->  addmm_activation(b, x, w; beta, alpha, false)
//   y = gelu(mm(x, w), "tanh")             ->  addmm_activation(0, x, w; 0, 1, true)
//   y = gelu(p = addmm(b, x, w), "tanh"), p kept  ->  (y, p) = addmm_gelu_aux(b, x, w; beta, alpha)
//   dp = gelu_backward(mm(g, w), p, "tanh")       ->  dp = mm_dgelu(g, w, p)
#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "compiler/executor.h"
#include "compiler/fuse.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::compiler {
namespace {

bool floating(ScalarType d) { return d == kFloat || d == kDouble || d == kBFloat16 || d == kHalf; }

bool contiguous_spec(const TensorSpec& s) {
  int64_t expected = 1;
  for (size_t d = s.sizes.size(); d-- > 0;) {
    if (s.sizes[d] != 1 && s.strides.size() == s.sizes.size() && s.strides[d] != expected) {
      return false;
    }
    expected *= s.sizes[d];
  }
  return s.strides.size() == s.sizes.size();
}

// How the consumer combines the product with its other input.
struct Combine {
  int other = -1;       // value id of the residual or bias
  bool row = false;     // a bias row of n elements (else the output's shape, read as [m, n])
  double beta = 1.0;    // addmm's attributes
  double alpha = 1.0;
};

// The addmm that computes `consumer` (an add or sub reading `product`, the last value of the
// chain), or nothing when it is not one of the forms above.
std::optional<Combine> combine_of(const Trace& t, const BoundOp& consumer, int product, int64_t n) {
  const bool add = consumer.name() == "add";
  if ((!add && consumer.name() != "sub") || consumer.inputs.size() != 2 ||
      consumer.attrs.size() != 1 || consumer.outputs.size() != 1) {
    return std::nullopt;
  }
  const auto* alpha_attr = std::get_if<Scalar>(&consumer.attrs[0]);
  if (alpha_attr == nullptr || !(alpha_attr->is_floating_point() || alpha_attr->is_integral(false)))
    return std::nullopt;
  const double alpha = alpha_attr->to<double>();
  const bool product_first = consumer.inputs[0] == product;
  Combine c;
  c.other = consumer.inputs[product_first ? 1 : 0];
  if (c.other < 0 || c.other == product || consumer.inputs[product_first ? 0 : 1] != product) {
    return std::nullopt;
  }
  const TensorSpec& out = t.value(consumer.outputs[0]).spec;
  const TensorSpec& other = t.value(c.other).spec;
  const TensorSpec& prod = t.value(product).spec;
  if (out.dtype != prod.dtype || other.dtype != prod.dtype || out.sizes != prod.sizes ||
      !contiguous_spec(out) || !contiguous_spec(other) || other.device != prod.device) {
    return std::nullopt;
  }
  if (other.sizes == out.sizes) {
    c.row = false;
  } else if (other.sizes.size() == 1 && other.sizes[0] == n) {
    c.row = true;
  } else {
    return std::nullopt;
  }
  const double sign = add ? 1.0 : -1.0;
  if (product_first) {
    c.beta = sign * alpha;
    c.alpha = 1.0;
  } else {
    c.beta = 1.0;
    c.alpha = sign * alpha;
  }
  return c;
}

// Whether `consumer` is an activation cuBLASLt's epilogue applies: relu, or gelu with the tanh
// approximation (its GELU); sets *use_gelu.
bool activation_of(const BoundOp& consumer, bool* use_gelu) {
  if (consumer.inputs.size() != 1 || consumer.outputs.size() != 1) return false;
  if (consumer.name() == "relu") {
    *use_gelu = false;
    return true;
  }
  if (consumer.name() != "gelu" || consumer.attrs.size() != 1) return false;
  const auto* approximate = std::get_if<std::string>(&consumer.attrs[0]);
  *use_gelu = true;
  return approximate != nullptr && *approximate == "tanh";
}

// Whether `consumer` is gelu_backward(product, pre; "tanh") with pre a contiguous value of the
// product's dtype and element count (cuBLASLt's DGELU reads it as the product's aux matrix).
bool dgelu_of(const Trace& t, const BoundOp& consumer, int product, const TensorSpec& prod) {
  if (consumer.name() != "gelu_backward" || consumer.inputs.size() != 2 ||
      consumer.outputs.size() != 1 || consumer.attrs.size() != 1 || consumer.inputs[0] != product ||
      consumer.inputs[1] < 0 || consumer.inputs[1] == product) {
    return false;
  }
  const auto* approximate = std::get_if<std::string>(&consumer.attrs[0]);
  if (approximate == nullptr || *approximate != "tanh") return false;
  const TensorSpec& pre = t.value(consumer.inputs[1]).spec;
  return pre.dtype == prod.dtype && pre.device == prod.device &&
         numel_of(pre.sizes) == numel_of(prod.sizes) && contiguous_spec(pre) &&
         t.value(consumer.outputs[0]).spec.dtype == prod.dtype;
}

class MatmulEpilogueExecutor final : public Executor {
 public:
  MatmulEpilogueExecutor(std::string name, std::vector<DeviceType> devices)
      : name_(std::move(name)), devices_(std::move(devices)) {}

  const std::string& name() const override { return name_; }
  bool claims(const Trace&, const BoundOp&) const override { return false; }
  Step lower(const Trace&, const BoundOp& op) const override {
    KILN_FAIL("[compile] ", name_, " runs matmul-epilogue regions only, not the single op ",
              op.name());
  }

  bool fuses_epilogue(const Trace& t, const BoundOp& mm, int product, const BoundOp& consumer,
                      bool keeps_product) const override {
    const bool addmm = mm.name() == "addmm";
    const size_t operands = addmm ? 3 : 2;
    if (mm.autocast.any() || consumer.autocast.any() || mm.inputs.size() != operands) return false;
    for (int v : mm.inputs) {
      if (v < 0) return false;
    }
    const TensorSpec& prod = t.value(mm.outputs[0]).spec;
    if (!floating(prod.dtype) || prod.sizes.size() != 2 ||
        std::find(devices_.begin(), devices_.end(), prod.device.type()) == devices_.end()) {
      return false;
    }
    bool use_gelu = false;
    if (activation_of(consumer, &use_gelu)) {
      // Kept for a backward: only gelu's input, through GELU_AUX.
      return t.value(consumer.outputs[0]).spec.dtype == prod.dtype && (!keeps_product || use_gelu);
    }
    if (keeps_product) return false;
    if (dgelu_of(t, consumer, product, prod)) return !addmm;
    return !addmm && combine_of(t, consumer, product, prod.sizes[1]).has_value();
  }

  Step lower_region(const Trace& t, size_t begin, size_t end) const override {
    const BoundOp& mm = t.ops[begin];
    const BoundOp& consumer = t.ops[end - 1];
    const TensorSpec& prod = t.value(mm.outputs[0]).spec;
    bool use_gelu = false;
    if (activation_of(consumer, &use_gelu)) {
      const absl::flat_hash_set<int> outside = values_read_outside(t, begin, end);
      std::vector<int> kept;
      for (size_t k = begin; k + 1 < end; ++k) {
        if (outside.contains(t.ops[k].outputs[0])) kept.push_back(t.ops[k].outputs[0]);
      }
      KILN_CHECK(kept.empty() || use_gelu, "[compile] ", name_,
                 " was given a relu region whose product is read outside it");
      return lower_activation(t, mm, consumer, use_gelu, kept);
    }
    if (consumer.name() == "gelu_backward") return lower_dgelu(t, mm, consumer);
    const int product = end - begin > 2 ? t.ops[end - 2].outputs[0] : mm.outputs[0];
    const std::optional<Combine> c = combine_of(t, consumer, product, prod.sizes[1]);
    KILN_CHECK(c.has_value(), "[compile] ", name_, " was given a region that is not an mm and an ",
               "add or sub of its output");
    const int a = mm.inputs[0], b = mm.inputs[1], out = consumer.outputs[0];
    const Shape mn = prod.sizes;
    const Shape out_sizes = t.value(out).spec.sizes;
    const Combine comb = *c;
    return [=](Frame& frame) {
      static const OpDef& addmm = KILN_OP(addmm);
      const Tensor& other = frame.slots[static_cast<size_t>(comb.other)];
      OpCall call;
      call.op = &addmm;
      call.inputs = {comb.row ? other : other.view(mn), frame.slots[static_cast<size_t>(a)],
                     frame.slots[static_cast<size_t>(b)]};
      call.attrs = {Scalar(comb.beta), Scalar(comb.alpha)};
      const AutocastScope no_autocast(BoundOp::Autocast{});
      dispatch_after(call, DispatchKey::Trace);
      frame.slots[static_cast<size_t>(out)] =
          out_sizes == mn ? std::move(call.outputs[0]) : call.outputs[0].view(out_sizes);
    };
  }

 private:
  // mm or addmm, then relu or tanh-gelu (through views): one addmm_activation, its output viewed
  // as the consumer's; or, with the product (or views of it: `kept`) read outside too, one
  // addmm_gelu_aux, its second output viewed as each kept value.
  static Step lower_activation(const Trace& t, const BoundOp& mm, const BoundOp& consumer,
                               bool use_gelu, const std::vector<int>& kept) {
    const TensorSpec& prod = t.value(mm.outputs[0]).spec;
    const bool addmm = mm.name() == "addmm";
    const int self = addmm ? mm.inputs[0] : -1;
    const int a = mm.inputs[addmm ? 1 : 0], b = mm.inputs[addmm ? 2 : 1];
    const Scalar beta = addmm ? std::get<Scalar>(mm.attrs[0]) : Scalar(0.0);
    const Scalar alpha = addmm ? std::get<Scalar>(mm.attrs[1]) : Scalar(1.0);
    // mm has no self: beta = 0 ignores this one.
    const Tensor none = addmm ? Tensor() : zeros({}, TensorOptions(prod.dtype).device(prod.device));
    const Shape mn = prod.sizes;
    const int out = consumer.outputs[0];
    const Shape out_sizes = t.value(out).spec.sizes;
    std::vector<std::pair<int, Shape>> kept_sizes;
    for (int v : kept) kept_sizes.emplace_back(v, t.value(v).spec.sizes);
    return [=](Frame& frame) {
      static const OpDef& activation = KILN_OP(addmm_activation);
      static const OpDef& aux = KILN_OP(addmm_gelu_aux);
      OpCall call;
      call.op = kept_sizes.empty() ? &activation : &aux;
      call.inputs = {self >= 0 ? frame.slots[static_cast<size_t>(self)] : none,
                     frame.slots[static_cast<size_t>(a)], frame.slots[static_cast<size_t>(b)]};
      call.attrs = {beta, alpha};
      if (kept_sizes.empty()) call.attrs.push_back(use_gelu);
      const AutocastScope no_autocast(BoundOp::Autocast{});
      dispatch_after(call, DispatchKey::Trace);
      for (const auto& [v, sizes] : kept_sizes) {
        frame.slots[static_cast<size_t>(v)] =
            sizes == mn ? call.outputs[1] : call.outputs[1].view(sizes);
      }
      frame.slots[static_cast<size_t>(out)] =
          out_sizes == mn ? std::move(call.outputs[0]) : call.outputs[0].view(out_sizes);
    };
  }

  // mm (through views), then gelu_backward(product, pre; "tanh"): one mm_dgelu with pre read
  // as the product's [m, n], its output viewed as the consumer's.
  static Step lower_dgelu(const Trace& t, const BoundOp& mm, const BoundOp& consumer) {
    const Shape mn = t.value(mm.outputs[0]).spec.sizes;
    const int a = mm.inputs[0], b = mm.inputs[1], pre = consumer.inputs[1];
    const int out = consumer.outputs[0];
    const Shape out_sizes = t.value(out).spec.sizes;
    return [=](Frame& frame) {
      static const OpDef& op = KILN_OP(mm_dgelu);
      const Tensor& p = frame.slots[static_cast<size_t>(pre)];
      OpCall call;
      call.op = &op;
      call.inputs = {frame.slots[static_cast<size_t>(a)], frame.slots[static_cast<size_t>(b)],
                     p.sizes() == IntArrayRef(mn) ? p : p.view(mn)};
      const AutocastScope no_autocast(BoundOp::Autocast{});
      dispatch_after(call, DispatchKey::Trace);
      frame.slots[static_cast<size_t>(out)] =
          out_sizes == mn ? std::move(call.outputs[0]) : call.outputs[0].view(out_sizes);
    };
  }

  std::string name_;
  std::vector<DeviceType> devices_;
};

}  // namespace

std::shared_ptr<const Executor> make_matmul_epilogue_executor(std::string name,
                                                              std::vector<DeviceType> devices) {
  return std::make_shared<MatmulEpilogueExecutor>(std::move(name), std::move(devices));
}

}  // namespace kiln::compiler
