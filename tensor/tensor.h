// kiln::Tensor: the handle users hold, in libtorch's spelling.
//
//   auto x = kiln::randn({2, 3});
//   auto y = (x * 2 + 1).relu().sum(/*dim=*/{1});
//   float v = y[0].item<float>();
//
// A Tensor is a refcounted pointer to a TensorImpl: copying a Tensor shares the data, like
// libtorch (`clone()` copies). Views (view, transpose, slice, ...) share storage with their
// base; in-place ops (names ending in `_`) write through and bump the version counter.
//
// Every op goes through the op registry (tensor/registry.h): the methods below are thin
// wrappers, implemented by family in tensor/ops/*.cpp. Free-function spellings live in
// tensor/ops.h. Misuse throws kiln::Error with the op's name in brackets.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "tensor/accessor.h"
#include "tensor/device.h"
#include "tensor/dtype.h"
#include "tensor/scalar.h"
#include "tensor/shape.h"
#include "tensor/tensor_impl.h"
#include "tensor/tensor_options.h"

namespace kiln {

class Tensor;
using TensorList = absl::Span<const Tensor>;
// libtorch's spellings of a read-only array view and of an optional value: kiln::ArrayRef<size_t>
// (a vector, a {1, 2} list or a span converts to it) and kiln::optional / kiln::nullopt.
template <typename T>
using ArrayRef = absl::Span<const T>;
using std::nullopt;
using std::optional;

namespace indexing {
class TensorIndex;
}
namespace autograd {
class Node;
}

class Tensor {
 public:
  Tensor() = default;  // undefined: defined() is false
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Assigning to a temporary writes into it, as in libtorch: `t[0] = 1;`, `t.select(0, 1) = u;`.
  // Assigning to a named Tensor rebinds the handle.
  Tensor(const Tensor&) = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(const Tensor&) & = default;
  Tensor& operator=(Tensor&&) & noexcept = default;
  Tensor& operator=(const Tensor& src) &&;
  Tensor& operator=(const Scalar& value) &&;

  // --- Properties -------------------------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  IntArrayRef sizes() const { return impl()->sizes(); }
  IntArrayRef strides() const { return impl()->strides(); }
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return impl()->dim(); }
  int64_t ndimension() const { return dim(); }
  int64_t numel() const { return impl()->numel(); }
  int64_t storage_offset() const { return impl()->storage_offset(); }
  ScalarType dtype() const { return impl()->dtype(); }
  ScalarType scalar_type() const { return dtype(); }
  Device device() const { return impl()->device(); }
  TensorOptions options() const { return TensorOptions().dtype(dtype()).device(device()); }
  bool is_cpu() const { return device().is_cpu(); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_meta() const { return device().is_meta(); }
  bool is_contiguous() const { return impl()->is_contiguous(); }
  bool is_floating_point() const { return kiln::is_floating_point(dtype()); }
  size_t element_size() const { return kiln::element_size(dtype()); }
  size_t nbytes() const { return numel() * element_size(); }
  uint64_t _version() const { return impl()->version(); }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  long use_count() const { return impl_.use_count(); }

  void* data_ptr() const;
  // Typed pointer to element 0; fails unless T matches the dtype and the tensor has data.
  template <typename T>
  T* data_ptr() const;
  template <typename T>
  const T* const_data_ptr() const { return data_ptr<T>(); }
  // libtorch's older spelling of data_ptr<T>().
  template <typename T>
  T* data() const {
    return data_ptr<T>();
  }
  // Element access by index on a CPU tensor of dtype T and N dims (tensor/accessor.h).
  template <typename T, size_t N>
  TensorAccessor<T, N> accessor() const&;
  template <typename T, size_t N>
  TensorAccessor<T, N> accessor() && = delete;
  // The single value of a one-element tensor (copied to the host if needed).
  Scalar item() const;
  template <typename T>
  T item() const { return item().to<T>(); }
  // Copies the elements to a std::vector<T> in row-major order (dtype converted to T).
  template <typename T>
  std::vector<T> to_vector() const;

  // --- Autograd (implemented in autograd/) ------------------------------------------------
  bool requires_grad() const { return impl()->requires_grad(); }
  Tensor& requires_grad_(bool r = true);
  Tensor& set_requires_grad(bool r) { return requires_grad_(r); }
  // The accumulated gradient of a leaf (undefined until a backward reaches it).
  const Tensor& grad() const;
  Tensor& mutable_grad();
  // Computes the gradient of this tensor w.r.t. the graph leaves and accumulates it into their
  // grad(). `gradient` may be omitted for a one-element tensor. retain_graph defaults to
  // create_graph; `inputs`, when given, limits accumulation to those tensors.
  void backward(const Tensor& gradient = {}, std::optional<bool> retain_graph = std::nullopt,
                bool create_graph = false, std::vector<Tensor> inputs = {}) const;
  // The node that produced this tensor (null for leaves and tensors that need no grad).
  const std::shared_ptr<autograd::Node>& grad_fn() const;
  bool is_leaf() const;
  int64_t output_nr() const;
  // Makes a non-leaf keep its gradient in grad() during backward.
  void retain_grad() const;
  bool retains_grad() const;
  // A tensor sharing storage with this one, outside the graph.
  Tensor detach() const;
  Tensor& detach_();
  Tensor data() const { return detach(); }
  // Runs `hook` on this tensor's gradient during backward; a hook that returns a defined
  // tensor replaces the gradient. Returns a handle for remove_hook.
  template <typename F>
  unsigned register_hook(F&& hook) const {
    if constexpr (std::is_void_v<std::invoke_result_t<F&, const Tensor&>>) {
      return add_grad_hook([h = std::forward<F>(hook)](const Tensor& g) {
        h(g);
        return Tensor();
      });
    } else {
      return add_grad_hook(std::function<Tensor(const Tensor&)>(std::forward<F>(hook)));
    }
  }
  unsigned add_grad_hook(std::function<Tensor(const Tensor&)> hook) const;
  void remove_hook(unsigned handle) const;

  // --- Conversion and copies --------------------------------------------------------------
  Tensor to(ScalarType dtype, bool copy = false) const;
  // A copy to another device returns once it is queued when non_blocking is true and the
  // host side is pinned (pin_memory(); a GPU-to-CPU copy then lands in fresh pinned memory):
  // synchronise (kiln::cuda::synchronize, an Event or the stream) before reading the result.
  // Otherwise copies that touch the host wait for the device, as PyTorch's blocking copies.
  Tensor to(Device device, bool non_blocking = false, bool copy = false) const;
  Tensor to(Device device, ScalarType dtype, bool non_blocking = false, bool copy = false) const;
  Tensor to(const TensorOptions& options, bool copy = false) const;
  Tensor to(const TensorOptions& options, bool non_blocking, bool copy) const;
  Tensor to(DeviceType device, bool non_blocking = false, bool copy = false) const {
    return to(Device(device), non_blocking, copy);
  }
  // A copy of this CPU tensor in page-locked (pinned) host memory, from which copies to and
  // from a GPU can run asynchronously; the tensor itself when it is pinned already. Needs a
  // CUDA build with a GPU. The memory returns to a cache when the tensor dies.
  Tensor pin_memory() const;
  bool is_pinned() const;
  Tensor cpu() const { return to(Device(kCPU)); }
  Tensor cuda() const { return to(Device(kCUDA)); }
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor& copy_(const Tensor& src);

  // --- Views (share storage) --------------------------------------------------------------
  Tensor view(IntArrayRef sizes) const;
  Tensor view_as(const Tensor& other) const { return view(other.sizes()); }
  Tensor reshape(IntArrayRef sizes) const;
  Tensor reshape_as(const Tensor& other) const { return reshape(other.sizes()); }
  Tensor permute(IntArrayRef dims) const;
  Tensor transpose(int64_t dim0, int64_t dim1) const;
  Tensor t() const;
  Tensor mT() const { return transpose(-2, -1); }
  Tensor expand(IntArrayRef sizes) const;
  Tensor expand_as(const Tensor& other) const { return expand(other.sizes()); }
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor unflatten(int64_t dim, IntArrayRef sizes) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor slice(int64_t dim = 0, std::optional<int64_t> start = std::nullopt,
               std::optional<int64_t> end = std::nullopt, int64_t step = 1) const;
  Tensor select(int64_t dim, int64_t index) const;
  std::vector<Tensor> split(int64_t split_size, int64_t dim = 0) const;
  std::vector<Tensor> split_with_sizes(IntArrayRef split_sizes, int64_t dim = 0) const;
  std::vector<Tensor> chunk(int64_t chunks, int64_t dim = 0) const;
  std::vector<Tensor> unbind(int64_t dim = 0) const;
  Tensor as_strided(IntArrayRef sizes, IntArrayRef strides,
                    std::optional<int64_t> storage_offset = std::nullopt) const;
  Tensor alias() const;

  // --- Indexing ---------------------------------------------------------------------------
  Tensor operator[](int64_t index) const { return select(0, index); }
  Tensor operator[](const Tensor& index) const;
  Tensor index(std::initializer_list<indexing::TensorIndex> indices) const;
  Tensor index(absl::Span<const indexing::TensorIndex> indices) const;
  Tensor& index_put_(std::initializer_list<indexing::TensorIndex> indices, const Tensor& value);
  Tensor& index_put_(std::initializer_list<indexing::TensorIndex> indices, const Scalar& value);
  Tensor& index_put_(absl::Span<const indexing::TensorIndex> indices, const Tensor& value);
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor gather(int64_t dim, const Tensor& index) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor scatter(int64_t dim, const Tensor& index, const Scalar& value) const;
  Tensor scatter_add(int64_t dim, const Tensor& index, const Tensor& src) const;
  Tensor index_add(int64_t dim, const Tensor& index, const Tensor& source,
                   const Scalar& alpha = 1) const;
  Tensor& scatter_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& scatter_(int64_t dim, const Tensor& index, const Scalar& value);
  Tensor& scatter_add_(int64_t dim, const Tensor& index, const Tensor& src);
  Tensor& index_add_(int64_t dim, const Tensor& index, const Tensor& source,
                     const Scalar& alpha = 1);
  Tensor masked_fill(const Tensor& mask, const Scalar& value) const;
  Tensor& masked_fill_(const Tensor& mask, const Scalar& value);
  Tensor masked_select(const Tensor& mask) const;
  Tensor triu(int64_t diagonal = 0) const;
  Tensor tril(int64_t diagonal = 0) const;
  std::tuple<Tensor, Tensor> topk(int64_t k, int64_t dim = -1, bool largest = true,
                                  bool sorted = true) const;
  std::tuple<Tensor, Tensor> sort(int64_t dim = -1, bool descending = false,
                                  bool stable = false) const;
  Tensor argsort(int64_t dim = -1, bool descending = false, bool stable = false) const;
  Tensor multinomial(int64_t num_samples, bool replacement = false) const;
  Tensor softmax(int64_t dim, std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor log_softmax(int64_t dim, std::optional<ScalarType> dtype = std::nullopt) const;

  // --- Elementwise unary ------------------------------------------------------------------
  Tensor neg() const;
  Tensor abs() const;
  Tensor exp() const;
  Tensor log() const;
  Tensor log1p() const;
  Tensor expm1() const;
  Tensor sqrt() const;
  Tensor rsqrt() const;
  Tensor sin() const;
  Tensor cos() const;
  Tensor tanh() const;
  Tensor sigmoid() const;
  Tensor relu() const;
  // approximate: "none" (exact, erf) or "tanh".
  Tensor gelu(std::string_view approximate = "none") const;
  Tensor silu() const;
  Tensor erf() const;
  Tensor reciprocal() const;
  Tensor sign() const;
  Tensor floor() const;
  Tensor ceil() const;
  Tensor round() const;
  Tensor square() const;
  Tensor logical_not() const;
  Tensor pow(const Scalar& exponent) const;
  Tensor& neg_();
  Tensor& exp_();
  Tensor& relu_();
  Tensor& sqrt_();

  // --- Elementwise binary (broadcasting, type promotion) ----------------------------------
  Tensor add(const Tensor& other, const Scalar& alpha = 1) const;
  Tensor add(const Scalar& other, const Scalar& alpha = 1) const;
  Tensor sub(const Tensor& other, const Scalar& alpha = 1) const;
  Tensor sub(const Scalar& other, const Scalar& alpha = 1) const;
  Tensor mul(const Tensor& other) const;
  Tensor mul(const Scalar& other) const;
  // rounding_mode: nullopt (true division), "trunc" or "floor".
  Tensor div(const Tensor& other, std::optional<std::string_view> rounding_mode = std::nullopt) const;
  Tensor div(const Scalar& other, std::optional<std::string_view> rounding_mode = std::nullopt) const;
  Tensor floor_divide(const Tensor& other) const;
  Tensor pow(const Tensor& exponent) const;
  Tensor maximum(const Tensor& other) const;
  Tensor minimum(const Tensor& other) const;
  Tensor atan2(const Tensor& other) const;
  Tensor eq(const Tensor& other) const;
  Tensor eq(const Scalar& other) const;
  Tensor ne(const Tensor& other) const;
  Tensor ne(const Scalar& other) const;
  Tensor lt(const Tensor& other) const;
  Tensor lt(const Scalar& other) const;
  Tensor le(const Tensor& other) const;
  Tensor le(const Scalar& other) const;
  Tensor gt(const Tensor& other) const;
  Tensor gt(const Scalar& other) const;
  Tensor ge(const Tensor& other) const;
  Tensor ge(const Scalar& other) const;
  Tensor logical_and(const Tensor& other) const;
  Tensor logical_or(const Tensor& other) const;
  Tensor logical_xor(const Tensor& other) const;
  Tensor where(const Tensor& condition, const Tensor& other) const;  // condition ? self : other
  Tensor clamp(std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt) const;
  Tensor clamp_min(const Scalar& min) const { return clamp(min, std::nullopt); }
  Tensor clamp_max(const Scalar& max) const { return clamp(std::nullopt, max); }
  Tensor lerp(const Tensor& end, const Scalar& weight) const;
  Tensor lerp(const Tensor& end, const Tensor& weight) const;
  Tensor& add_(const Tensor& other, const Scalar& alpha = 1);
  Tensor& add_(const Scalar& other, const Scalar& alpha = 1);
  Tensor& sub_(const Tensor& other, const Scalar& alpha = 1);
  Tensor& sub_(const Scalar& other, const Scalar& alpha = 1);
  Tensor& mul_(const Tensor& other);
  Tensor& mul_(const Scalar& other);
  Tensor& div_(const Tensor& other);
  Tensor& div_(const Scalar& other);
  Tensor& clamp_(std::optional<Scalar> min, std::optional<Scalar> max = std::nullopt);
  Tensor& lerp_(const Tensor& end, const Scalar& weight);
  Tensor& zero_();
  Tensor& fill_(const Scalar& value);
  // In-place comparisons: self = (self op other), in self's dtype (1 or 0, true or false).
  Tensor& eq_(const Tensor& other) { return copy_(eq(other)); }
  Tensor& eq_(const Scalar& other) { return copy_(eq(other)); }
  Tensor& ne_(const Tensor& other) { return copy_(ne(other)); }
  Tensor& ne_(const Scalar& other) { return copy_(ne(other)); }
  Tensor& lt_(const Tensor& other) { return copy_(lt(other)); }
  Tensor& lt_(const Scalar& other) { return copy_(lt(other)); }
  Tensor& le_(const Tensor& other) { return copy_(le(other)); }
  Tensor& le_(const Scalar& other) { return copy_(le(other)); }
  Tensor& gt_(const Tensor& other) { return copy_(gt(other)); }
  Tensor& gt_(const Scalar& other) { return copy_(gt(other)); }
  Tensor& ge_(const Tensor& other) { return copy_(ge(other)); }
  Tensor& ge_(const Scalar& other) { return copy_(ge(other)); }

  // --- In-place ops on a const handle -------------------------------------------------------
  // As libtorch's, in-place methods are callable on a `const Tensor&` (`x.grad().zero_()`): a
  // Tensor is a handle, and const on the handle does not make the shared data read-only.
#define KILN_CONST_INPLACE(name, params, args) \
  const Tensor& name params const { return const_cast<Tensor&>(*this).name args; }
  KILN_CONST_INPLACE(neg_, (), ())
  KILN_CONST_INPLACE(exp_, (), ())
  KILN_CONST_INPLACE(relu_, (), ())
  KILN_CONST_INPLACE(sqrt_, (), ())
  KILN_CONST_INPLACE(zero_, (), ())
  KILN_CONST_INPLACE(fill_, (const Scalar& v), (v))
  KILN_CONST_INPLACE(copy_, (const Tensor& src), (src))
  KILN_CONST_INPLACE(add_, (const Tensor& o, const Scalar& alpha = 1), (o, alpha))
  KILN_CONST_INPLACE(add_, (const Scalar& o, const Scalar& alpha = 1), (o, alpha))
  KILN_CONST_INPLACE(sub_, (const Tensor& o, const Scalar& alpha = 1), (o, alpha))
  KILN_CONST_INPLACE(sub_, (const Scalar& o, const Scalar& alpha = 1), (o, alpha))
  KILN_CONST_INPLACE(mul_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(mul_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(div_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(div_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(clamp_, (std::optional<Scalar> lo, std::optional<Scalar> hi = std::nullopt),
                     (lo, hi))
  KILN_CONST_INPLACE(lerp_, (const Tensor& end, const Scalar& w), (end, w))
  KILN_CONST_INPLACE(uniform_, (double from = 0, double to = 1), (from, to))
  KILN_CONST_INPLACE(normal_, (double mean = 0, double std = 1), (mean, std))
  KILN_CONST_INPLACE(bernoulli_, (double p = 0.5), (p))
  KILN_CONST_INPLACE(masked_fill_, (const Tensor& mask, const Scalar& v), (mask, v))
  KILN_CONST_INPLACE(scatter_, (int64_t dim, const Tensor& index, const Tensor& src),
                     (dim, index, src))
  KILN_CONST_INPLACE(scatter_, (int64_t dim, const Tensor& index, const Scalar& v),
                     (dim, index, v))
  KILN_CONST_INPLACE(scatter_add_, (int64_t dim, const Tensor& index, const Tensor& src),
                     (dim, index, src))
  KILN_CONST_INPLACE(index_add_,
                     (int64_t dim, const Tensor& index, const Tensor& s, const Scalar& alpha = 1),
                     (dim, index, s, alpha))
  KILN_CONST_INPLACE(index_put_,
                     (std::initializer_list<indexing::TensorIndex> i, const Tensor& v), (i, v))
  KILN_CONST_INPLACE(index_put_,
                     (std::initializer_list<indexing::TensorIndex> i, const Scalar& v), (i, v))
  KILN_CONST_INPLACE(requires_grad_, (bool r = true), (r))
  KILN_CONST_INPLACE(eq_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(eq_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(ne_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(ne_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(lt_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(lt_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(le_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(le_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(gt_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(gt_, (const Scalar& o), (o))
  KILN_CONST_INPLACE(ge_, (const Tensor& o), (o))
  KILN_CONST_INPLACE(ge_, (const Scalar& o), (o))
#undef KILN_CONST_INPLACE

  // --- Reductions (dims empty = all dims) -------------------------------------------------
  Tensor sum(std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor sum(IntArrayRef dims, bool keepdim = false,
             std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor mean(std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor mean(IntArrayRef dims, bool keepdim = false,
              std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor prod(std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor prod(int64_t dim, bool keepdim = false, std::optional<ScalarType> dtype = std::nullopt) const;
  Tensor amax(IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor amin(IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor max() const;
  Tensor min() const;
  std::tuple<Tensor, Tensor> max(int64_t dim, bool keepdim = false) const;  // values, indices
  std::tuple<Tensor, Tensor> min(int64_t dim, bool keepdim = false) const;
  Tensor argmax(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  Tensor argmin(std::optional<int64_t> dim = std::nullopt, bool keepdim = false) const;
  // correction 1 is the unbiased estimate (PyTorch's default).
  Tensor var(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor std(IntArrayRef dims = {}, int64_t correction = 1, bool keepdim = false) const;
  Tensor norm(const Scalar& p = 2, IntArrayRef dims = {}, bool keepdim = false) const;
  Tensor logsumexp(IntArrayRef dims, bool keepdim = false) const;
  Tensor all() const;
  Tensor all(int64_t dim, bool keepdim = false) const;
  Tensor any() const;
  Tensor any(int64_t dim, bool keepdim = false) const;
  Tensor cumsum(int64_t dim, std::optional<ScalarType> dtype = std::nullopt) const;

  // --- Linear algebra ---------------------------------------------------------------------
  Tensor matmul(const Tensor& other) const;
  Tensor mm(const Tensor& other) const;
  Tensor bmm(const Tensor& other) const;
  Tensor addmm(const Tensor& mat1, const Tensor& mat2, const Scalar& beta = 1,
               const Scalar& alpha = 1) const;
  Tensor outer(const Tensor& other) const;
  Tensor dot(const Tensor& other) const;

  // --- Random fill (kiln::manual_seed makes them reproducible) -----------------------------
  Tensor& uniform_(double from = 0, double to = 1);
  Tensor& normal_(double mean = 0, double std = 1);
  Tensor& bernoulli_(double p = 0.5);
  Tensor bernoulli() const;  // each element is the probability of a 1

  // Compound assignment writes in place, as in libtorch.
  Tensor& operator+=(const Tensor& o) { return add_(o); }
  Tensor& operator+=(const Scalar& o) { return add_(o); }
  Tensor& operator-=(const Tensor& o) { return sub_(o); }
  Tensor& operator-=(const Scalar& o) { return sub_(o); }
  Tensor& operator*=(const Tensor& o) { return mul_(o); }
  Tensor& operator*=(const Scalar& o) { return mul_(o); }
  Tensor& operator/=(const Tensor& o) { return div_(o); }
  Tensor& operator/=(const Scalar& o) { return div_(o); }

  std::string str() const;  // what operator<< prints

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// --- Operators with tensors and scalars on either side -------------------------------------
Tensor operator-(const Tensor& a);
Tensor operator~(const Tensor& a);  // logical_not for bool, as PyTorch's bitwise_not on bool
Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, const Scalar& b);
Tensor operator+(const Scalar& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Scalar& b);
Tensor operator-(const Scalar& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Scalar& b);
Tensor operator*(const Scalar& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Scalar& b);
Tensor operator/(const Scalar& a, const Tensor& b);
Tensor operator==(const Tensor& a, const Tensor& b);
Tensor operator==(const Tensor& a, const Scalar& b);
Tensor operator==(const Scalar& a, const Tensor& b);
Tensor operator!=(const Tensor& a, const Tensor& b);
Tensor operator!=(const Tensor& a, const Scalar& b);
Tensor operator!=(const Scalar& a, const Tensor& b);
Tensor operator<(const Tensor& a, const Tensor& b);
Tensor operator<(const Tensor& a, const Scalar& b);
Tensor operator<(const Scalar& a, const Tensor& b);
Tensor operator<=(const Tensor& a, const Tensor& b);
Tensor operator<=(const Tensor& a, const Scalar& b);
Tensor operator<=(const Scalar& a, const Tensor& b);
Tensor operator>(const Tensor& a, const Tensor& b);
Tensor operator>(const Tensor& a, const Scalar& b);
Tensor operator>(const Scalar& a, const Tensor& b);
Tensor operator>=(const Tensor& a, const Tensor& b);
Tensor operator>=(const Tensor& a, const Scalar& b);
Tensor operator>=(const Scalar& a, const Tensor& b);
Tensor operator&(const Tensor& a, const Tensor& b);  // logical_and on bool tensors
Tensor operator|(const Tensor& a, const Tensor& b);
Tensor operator^(const Tensor& a, const Tensor& b);

// Prints in PyTorch's format: tensor([[1., 2.], [3., 4.]]) with dtype/device suffixes.
std::ostream& operator<<(std::ostream& os, const Tensor& t);

template <typename T, size_t N>
TensorAccessor<T, N> Tensor::accessor() const& {
  static_assert(N > 0, "accessor is used for indexing a tensor; for a 0-d one use item()");
  KILN_CHECK(defined() && is_cpu(), "[accessor] expected a CPU tensor",
             defined() ? ", got one on " : "", defined() ? device().str() : std::string());
  KILN_CHECK(dim() == static_cast<int64_t>(N), "[accessor] expected a ", N,
             "-D tensor, got one of shape ", shape_str(sizes()));
  return TensorAccessor<T, N>(data_ptr<T>(), impl()->sizes().data(), impl()->strides().data());
}

template <typename T>
T* Tensor::data_ptr() const {
  KILN_CHECK(defined(), "[data_ptr] the tensor is undefined");
  KILN_CHECK(dtype_of<std::remove_const_t<T>>() == dtype(), "[data_ptr] expected dtype ",
             dtype_name(dtype_of<std::remove_const_t<T>>()), " but the tensor has dtype ",
             dtype_name(dtype()));
  return static_cast<T*>(data_ptr());
}

}  // namespace kiln

namespace kiln {
template <typename T>
std::vector<T> Tensor::to_vector() const {
  const Tensor c = to(Device(kCPU), dtype_of<T>()).contiguous();
  const T* p = c.data_ptr<T>();
  return std::vector<T>(p, p + c.numel());
}
}  // namespace kiln
