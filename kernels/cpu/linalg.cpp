// CPU kernels for mm, bmm and addmm: every matrix product is one Eigen GEMM on Eigen::Map views
// of the operands, written into the contiguous output with .noalias(). f32 and f64 products run
// the build of that GEMM for the widest instruction set the CPU has (kernels/cpu/gemm.h).
//
// An operand whose last dim has stride 1 maps row-major, one whose second-last dim has stride 1
// maps column-major (a transposed view needs no copy); anything else is made contiguous first.
// Batches may have any stride, 0 included (matmul's broadcast operands). Eigen threads each
// GEMM through OpenMP; a batch of small products is split across threads instead, one whole
// GEMM per task. f16/bf16 are computed in f32 (converted in, converted back); integers use
// Eigen's generic integer GEMM.
#include <Eigen/Core>
#include <cstring>
#include <optional>
#include <type_traits>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/loops.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

// How Eigen reads one [rows, cols] matrix: storage order and leading dimension (elements).
using Layout = GemmLayout;

// The Eigen layout of a [rows, cols] matrix with element strides (rs, cs), if one exists. A
// size-1 dim's stride is irrelevant, so it never forces a copy.
std::optional<Layout> matrix_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs) {
  if (cs == 1 || cols <= 1) {
    const int64_t ld = rows <= 1 ? std::max<int64_t>(cols, 1) : rs;
    if (ld >= std::max<int64_t>(cols, 1)) return Layout{true, ld};
  }
  if (rs == 1 || rows <= 1) {
    const int64_t ld = cols <= 1 ? std::max<int64_t>(rows, 1) : cs;
    if (ld >= std::max<int64_t>(rows, 1)) return Layout{false, ld};
  }
  return std::nullopt;
}

// A batch of matrices (a 2-D tensor is a batch of one) that Eigen can map directly.
struct Matrices {
  Tensor owner;  // keeps a contiguous copy alive when one was needed
  const void* data = nullptr;
  int64_t batch = 1, rows = 0, cols = 0, batch_stride = 0;
  Layout layout;
};

// `t` (2-D or 3-D, already of the compute dtype) as mappable matrices, copied only if needed.
Matrices matrices(const Tensor& t) {
  const int64_t d = t.dim();
  const int64_t rows = t.size(d - 2), cols = t.size(d - 1);
  std::optional<Layout> layout = matrix_layout(rows, cols, t.stride(d - 2), t.stride(d - 1));
  Tensor src = t;
  if (!layout) {
    src = t.contiguous();
    layout = Layout{true, std::max<int64_t>(cols, 1)};
  }
  Matrices m{src, src.data_ptr(), 1, rows, cols, 0, *layout};
  if (d == 3) {
    m.batch = src.size(0);
    m.batch_stride = src.stride(0);
  }
  return m;
}

template <typename T, int Order>
using ConstMatMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>,
                               Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>;

template <typename T, typename F>
void with_map(const T* p, int64_t rows, int64_t cols, const Layout& l, F&& f) {
  if (l.row_major) {
    f(ConstMatMap<T, Eigen::RowMajor>(p, rows, cols, Eigen::OuterStride<>(l.ld)));
  } else {
    f(ConstMatMap<T, Eigen::ColMajor>(p, rows, cols, Eigen::OuterStride<>(l.ld)));
  }
}

// c += alpha * a @ b for one [n, k] @ [k, p] product into a contiguous row-major c.
template <typename T>
void gemm(T* c, const T* a, const Layout& la, const T* b, const Layout& lb, int64_t n, int64_t k,
          int64_t p, T alpha) {
  if (n == 0 || p == 0 || k == 0) return;
  if constexpr (std::is_floating_point_v<T>) {
    cpu::gemm(c, p, a, la, b, lb, n, k, p, alpha);  // the build for this CPU's widest registers
    return;
  }
  OutMap<T> dst(c, n, p);
  with_map(a, n, k, la, [&](const auto& A) {
    with_map(b, k, p, lb, [&](const auto& B) { dst.noalias() += alpha * A * B; });
  });
}

// Below this many multiply-adds a product gains little from Eigen's threads, so a batch of
// them is split across threads instead.
constexpr int64_t kSmallGemm = int64_t{1} << 21;

// out[i] = beta * self + alpha * a[i] @ b[i] (self broadcast to out[i], ignored when absent or
// beta is 0) for contiguous out of dtype T. a and b have dtype T.
template <typename T>
void batched_product(const Tensor& out, const Tensor* self, const Tensor& a, const Tensor& b,
                     const Scalar& beta, const Scalar& alpha) {
  const Matrices ma = matrices(a), mb = matrices(b);
  const int64_t n = ma.rows, k = ma.cols, p = mb.cols, batch = ma.batch;
  if (self != nullptr && beta.toDouble() != 0.0) {
    const T bv = beta.to<T>();
    const Tensor s = as_dtype(*self, out.dtype());
    auto scale = [bv](T v) { return bv * v; };
    elementwise<T, T>(out, scale, s);
  } else if (out.numel() > 0) {
    // PyTorch ignores self when beta is 0 (NaNs in it do not propagate).
    std::memset(out.data_ptr(), 0, out.nbytes());
  }
  T* c = static_cast<T*>(out.data_ptr());
  const T* pa = static_cast<const T*>(ma.data);
  const T* pb = static_cast<const T*>(mb.data);
  const T av = alpha.to<T>();
  const int64_t work = std::max<int64_t>(n * k * p, 1);
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      gemm<T>(c + i * n * p, pa + i * ma.batch_stride, ma.layout, pb + i * mb.batch_stride,
              mb.layout, n, k, p, av);
    }
  };
  if (batch > 1 && work < kSmallGemm) {
    // Inside the parallel region Eigen sees more than one OpenMP thread and stays serial.
    internal::parallel_for(0, batch, std::max<int64_t>(1, (kSmallGemm / 8) / work), run);
  } else {
    run(0, batch);
  }
}

// Runs the product in the compute type of out's dtype (f32 for f16/bf16).
void product(const Tensor& out, const Tensor* self, const Tensor& a, const Tensor& b,
             const Scalar& beta, const Scalar& alpha, const char* op) {
  auto compute = [&]<typename T>(TypeTag<T>) {
    constexpr ScalarType ct = dtype_of<T>();
    if (out.dtype() == ct) {
      batched_product<T>(out, self, a, b, beta, alpha);
      return;
    }
    // Reduced precision: products and sums in f32, one rounding at the end (as PyTorch's CPU
    // path does), so the result is the f32 result rounded to the output dtype.
    const Tensor acc = empty(out.sizes(), ct);
    Tensor self32;
    if (self != nullptr) self32 = as_dtype(*self, ct);
    batched_product<T>(acc, self != nullptr ? &self32 : nullptr, as_dtype(a, ct), as_dtype(b, ct),
                       beta, alpha);
    Tensor(out).copy_(acc);  // a handle to the same tensor: copy_ writes through
  };
  switch (out.dtype()) {
    case kFloat:
    case kHalf:
    case kBFloat16:
      return compute(TypeTag<float>{});
    case kDouble:
      return compute(TypeTag<double>{});
    case kInt32:
      return compute(TypeTag<int32_t>{});
    case kInt64:
      return compute(TypeTag<int64_t>{});
    default:
      break;
  }
  KILN_FAIL("[", op, "] is not implemented for dtype ", dtype_name(out.dtype()));
}

void mm_cpu(OpCall& c) { product(c.outputs[0], nullptr, c.input(0), c.input(1), 0, 1, "mm"); }

void bmm_cpu(OpCall& c) { product(c.outputs[0], nullptr, c.input(0), c.input(1), 0, 1, "bmm"); }

void addmm_cpu(OpCall& c) {
  product(c.outputs[0], &c.input(0), c.input(1), c.input(2), c.attr<Scalar>(0), c.attr<Scalar>(1),
          "addmm");
}

}  // namespace

KILN_REGISTER_KERNEL(mm, kCPU, mm_cpu);
KILN_REGISTER_KERNEL(bmm, kCPU, bmm_cpu);
KILN_REGISTER_KERNEL(addmm, kCPU, addmm_cpu);

}  // namespace kiln::cpu
