// Random ops: uniform_, normal_, random_ (randint), bernoulli_, multinomial, randperm, and the
// factories built on them (rand, randn, randint, *_like, bernoulli).
//
// Every op reserves its Philox blocks from the global generator when called and carries the
// seed and base offset as its last two attributes, so a recorded call replays the same numbers.
// The element -> counter mapping is documented in tensor/random.h.
#include "tensor/random.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln {
namespace {

uint64_t blocks_for(int64_t n, int64_t per_block) {
  return static_cast<uint64_t>((n + per_block - 1) / per_block);
}

// Seed and offset attributes for a call that uses `blocks` Philox blocks.
std::pair<Attr, Attr> reserve(uint64_t blocks) {
  const RngState s = philox_reserve(blocks);
  return {static_cast<int64_t>(s.seed), static_cast<int64_t>(s.offset)};
}

// A random fill writes each element once; an expanded target (stride 0) would be written from
// several elements at once.
void check_fill_target(const OpCall& c) {
  const Tensor& t = c.input(0);
  for (int64_t d = 0; d < t.dim(); ++d) {
    KILN_CHECK(t.size(d) <= 1 || t.stride(d) != 0, "[", c.name(),
               "] unsupported operation: more than one element of the written-to tensor of "
               "shape ",
               shape_str(t.sizes()), " (strides ", shape_str(t.strides()),
               ") refers to a single memory location");
  }
}

void check_floating(const OpCall& c, const Tensor& t) {
  KILN_CHECK(is_floating_point(t.dtype()), "[", c.name(),
             "] expected a floating-point tensor, got dtype ", dtype_name(t.dtype()));
}

double dtype_max(ScalarType t) {
  switch (t) {
    case kHalf:
      return 65504.0;
    case kBFloat16:
      return 3.3895313892515355e38;
    case kFloat:
      return std::numeric_limits<float>::max();
    default:
      return std::numeric_limits<double>::max();
  }
}

// Integers a floating dtype represents exactly: [-2^digits, 2^digits].
double exact_int_limit(ScalarType t) {
  switch (t) {
    case kHalf:
      return 2048.0;
    case kBFloat16:
      return 256.0;
    case kFloat:
      return 16777216.0;
    default:
      return 9007199254740992.0;
  }
}

SpecList uniform_meta(const OpCall& c) {
  check_floating(c, c.input(0));
  check_fill_target(c);
  const double from = c.attr<double>(0), to = c.attr<double>(1);
  KILN_CHECK(std::isfinite(from) && std::isfinite(to),
             "[uniform_] from and to must be finite, got ", from, " and ", to);
  KILN_CHECK(from <= to, "[uniform_] expects to return a [from, to) range, but found from=", from,
             " > to=", to);
  KILN_CHECK(to - from <= dtype_max(c.input(0).dtype()),
             "[uniform_] expects to-from <= the "
             "largest ",
             dtype_name(c.input(0).dtype()), ", got to-from=", to - from);
  return {};
}

SpecList normal_meta(const OpCall& c) {
  check_floating(c, c.input(0));
  check_fill_target(c);
  const double stdev = c.attr<double>(1);
  KILN_CHECK(stdev >= 0.0, "[normal_] expects std >= 0.0, but found std ", stdev);
  return {};
}

SpecList random_meta(const OpCall& c) {
  check_fill_target(c);
  const int64_t low = c.attr<int64_t>(0), high = c.attr<int64_t>(1);
  KILN_CHECK(low < high, "[random_] expects 'from' to be less than 'to', but got from=", low,
             " >= to=", high);
  const ScalarType dt = c.input(0).dtype();
  double lo_limit = 0, hi_limit = 0;  // allowed [low, high - 1]
  switch (dt) {
    case kBool:
      lo_limit = 0;
      hi_limit = 1;
      break;
    case kUInt8:
      lo_limit = 0;
      hi_limit = 255;
      break;
    case kInt32:
      lo_limit = std::numeric_limits<int32_t>::min();
      hi_limit = std::numeric_limits<int32_t>::max();
      break;
    case kInt64:
      return {};
    default:
      lo_limit = -exact_int_limit(dt);
      hi_limit = exact_int_limit(dt);
      break;
  }
  KILN_CHECK(static_cast<double>(low) >= lo_limit && static_cast<double>(high - 1) <= hi_limit,
             "[random_] the range [", low, ", ", high, ") does not fit dtype ", dtype_name(dt),
             " (values from ", lo_limit, " to ", hi_limit, ")");
  return {};
}

SpecList bernoulli_meta(const OpCall& c) {
  check_fill_target(c);
  const Tensor& self = c.input(0);
  if (c.inputs.size() > 1) {
    const Tensor& p = c.input(1);
    check_floating(c, p);
    KILN_CHECK(broadcast_shapes(self.sizes(), p.sizes(), "bernoulli_") == to_shape(self.sizes()),
               "[bernoulli_] probabilities of shape ", shape_str(p.sizes()),
               " cannot be broadcast to the shape ", shape_str(self.sizes()));
  } else {
    const double p = c.attr<double>(0);
    KILN_CHECK(p >= 0.0 && p <= 1.0, "[bernoulli_] expects p to be in [0, 1], but got p=", p);
  }
  return {};
}

SpecList multinomial_meta(const OpCall& c) {
  const Tensor& probs = c.input(0);
  KILN_CHECK(probs.defined(), "[multinomial] got an undefined tensor");
  check_floating(c, probs);
  KILN_CHECK(probs.dim() == 1 || probs.dim() == 2,
             "[multinomial] prob_dist must be 1 or 2 dim, got shape ", shape_str(probs.sizes()));
  const int64_t categories = probs.size(-1);
  const int64_t n = c.attr<int64_t>(0);
  const bool replacement = c.attr<bool>(1);
  KILN_CHECK(categories > 0, "[multinomial] number of categories cannot be zero, got shape ",
             shape_str(probs.sizes()));
  KILN_CHECK(n > 0, "[multinomial] cannot sample n_sample <= 0 samples, got ", n);
  KILN_CHECK(replacement || n <= categories, "[multinomial] cannot sample n_sample (", n,
             ") > prob_dist.size(-1) (", categories, ") samples without replacement");
  Shape out = probs.dim() == 2 ? Shape{probs.size(0), n} : Shape{n};
  return {{out, kInt64, probs.device()}};
}

SpecList randperm_meta(const OpCall& c) {
  const int64_t n = c.attr<int64_t>(0);
  const ScalarType dt = c.attr<ScalarType>(1);
  KILN_CHECK(n >= 0, "[randperm] n must be non-negative, got ", n);
  KILN_CHECK(dt != kBool, "[randperm] is not implemented for dtype bool");
  if (dt == kInt32) {
    KILN_CHECK(n - 1 <= std::numeric_limits<int32_t>::max(), "[randperm] n=", n,
               " does not fit dtype int32");
  } else if (is_floating_point(dt)) {
    KILN_CHECK(static_cast<double>(n) <= exact_int_limit(dt), "[randperm] n must be at most ",
               exact_int_limit(dt), " for dtype ", dtype_name(dt), ", got ", n);
  }
  return {{Shape{n}, dt, c.attr<Device>(2)}};
}

Tensor finish(Tensor t, const TensorOptions& options) {
  if (options.requires_grad()) t.requires_grad_(true);
  return t;
}

void run_inplace(const OpDef& op, TensorVec inputs, absl::InlinedVector<Attr, 4> attrs) {
  OpCall call;
  call.op = &op;
  call.inputs = std::move(inputs);
  call.attrs = std::move(attrs);
  dispatch(call);
}

void bernoulli_tensor_(Tensor& self, const Tensor& p) {
  static const OpDef& op = KILN_OP(bernoulli_);
  auto [seed, offset] = reserve(blocks_for(self.numel(), 4));
  run_inplace(op, {self, p}, {std::monostate{}, seed, offset});
}

}  // namespace

KILN_DEFINE_OP(uniform_, OpKind::kInplace, uniform_meta, OpFlags{.random = true});
KILN_DEFINE_OP(normal_, OpKind::kInplace, normal_meta, OpFlags{.random = true});
KILN_DEFINE_OP(random_, OpKind::kInplace, random_meta, OpFlags{.random = true});
KILN_DEFINE_OP(bernoulli_, OpKind::kInplace, bernoulli_meta, OpFlags{.random = true});
KILN_DEFINE_OP(multinomial, OpKind::kFunctional, multinomial_meta, OpFlags{.random = true});
KILN_DEFINE_OP(randperm, OpKind::kFunctional, randperm_meta, OpFlags{.random = true});

Tensor& Tensor::uniform_(double from, double to) {
  static const OpDef& op = KILN_OP(uniform_);
  auto [seed, offset] = reserve(blocks_for(numel(), dtype() == kDouble ? 2 : 4));
  run_inplace(op, {*this}, {from, to, seed, offset});
  return *this;
}

Tensor& Tensor::normal_(double mean, double std) {
  static const OpDef& op = KILN_OP(normal_);
  auto [seed, offset] = reserve(blocks_for(numel(), dtype() == kDouble ? 2 : 4));
  run_inplace(op, {*this}, {mean, std, seed, offset});
  return *this;
}

Tensor& Tensor::bernoulli_(double p) {
  static const OpDef& op = KILN_OP(bernoulli_);
  auto [seed, offset] = reserve(blocks_for(numel(), 4));
  run_inplace(op, {*this}, {p, seed, offset});
  return *this;
}

Tensor Tensor::bernoulli() const { return kiln::bernoulli(*this); }

Tensor Tensor::multinomial(int64_t num_samples, bool replacement) const {
  return kiln::multinomial(*this, num_samples, replacement);
}

Tensor rand(IntArrayRef sizes, const TensorOptions& options) {
  KILN_CHECK(is_floating_point(options.dtype()), "[rand] expected a floating-point dtype, got ",
             dtype_name(options.dtype()));
  Tensor t = empty(sizes, options.requires_grad(false));
  t.uniform_(0.0, 1.0);
  return finish(t, options);
}

Tensor randn(IntArrayRef sizes, const TensorOptions& options) {
  KILN_CHECK(is_floating_point(options.dtype()), "[randn] expected a floating-point dtype, got ",
             dtype_name(options.dtype()));
  Tensor t = empty(sizes, options.requires_grad(false));
  t.normal_(0.0, 1.0);
  return finish(t, options);
}

Tensor rand_like(const Tensor& t, const TensorOptions& options) {
  return rand(t.sizes(), options_like(t, options));
}

Tensor randn_like(const Tensor& t, const TensorOptions& options) {
  return randn(t.sizes(), options_like(t, options));
}

Tensor randint(int64_t high, IntArrayRef sizes, const TensorOptions& options) {
  return randint(0, high, sizes, options);
}

Tensor randint(int64_t low, int64_t high, IntArrayRef sizes, const TensorOptions& options) {
  KILN_CHECK(low < high, "[randint] expects 'low' to be less than 'high', but got low=", low,
             " >= high=", high);
  // As torch.randint: int64 unless the options say otherwise.
  const TensorOptions o = options.has_dtype() ? options : options.dtype(kInt64);
  Tensor t = empty(sizes, o.requires_grad(false));
  static const OpDef& op = KILN_OP(random_);
  const uint64_t range = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  auto [seed, offset] = reserve(blocks_for(t.numel(), range <= (uint64_t{1} << 32) ? 4 : 2));
  run_inplace(op, {t}, {low, high, seed, offset});
  return finish(t, options);
}

Tensor bernoulli(const Tensor& p) {
  KILN_CHECK(p.defined() && is_floating_point(p.dtype()),
             "[bernoulli] expected a floating-point tensor of probabilities",
             p.defined() ? ", got dtype " : "", p.defined() ? dtype_name(p.dtype()) : "");
  Tensor out = empty_like(p);
  bernoulli_tensor_(out, p);
  return out;
}

Tensor bernoulli(const Tensor& t, double p) {
  Tensor out = empty_like(t);
  out.bernoulli_(p);
  return out;
}

Tensor multinomial(const Tensor& probs, int64_t num_samples, bool replacement) {
  static const OpDef& op = KILN_OP(multinomial);
  const int64_t rows = probs.defined() && probs.dim() == 2 ? probs.size(0) : 1;
  const int64_t categories = probs.defined() && probs.dim() > 0 ? probs.size(-1) : 0;
  const int64_t draws = rows * (replacement ? std::max<int64_t>(num_samples, 0) : categories);
  auto [seed, offset] = reserve(blocks_for(draws, 2));
  return call_op1(op, {probs}, {num_samples, replacement, seed, offset});
}

Tensor randperm(int64_t n, const TensorOptions& options) {
  static const OpDef& op = KILN_OP(randperm);
  auto [seed, offset] = reserve(blocks_for(std::max<int64_t>(n, 0), 2));
  const ScalarType dt = options.has_dtype() ? options.dtype() : kInt64;
  return finish(call_op1(op, {}, {n, dt, options.device(), seed, offset}), options);
}

}  // namespace kiln
