// One instruction set's build of the CPU matrix product (kernels/cpu/gemm.h): Eigen's GEMM on
// Eigen::Map views, the two vector loops of the CPU attention kernel and the packet exp and erf
// of the gated MLPs and gelu's gradient (Eigen's packet functions), compiled with the flags of the
// file that includes this one. That file defines KILN_GEMM_NS (the namespace its entry points go
// in) and, in the wider builds, renames Eigen (`#define Eigen kiln_eigen_avx2`) before including
// this, so that every Eigen function of that build has its own symbol. The includer includes
// nothing else: a standard-library function instantiated here with wider flags would share its
// symbol with the baseline's, and the linker keeps one of the two.
//
// No include guard: each includer includes it once, under its own namespace.
#include <Eigen/Core>
#include <cstdint>
#include <unsupported/Eigen/SpecialFunctions>

#ifndef KILN_GEMM_NS
#error "define KILN_GEMM_NS before including kernels/cpu/gemm_body.h"
#endif

namespace kiln::cpu::KILN_GEMM_NS {
namespace {

template <typename T, int Order>
using ConstMap = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Order>,
                            Eigen::Unaligned, Eigen::OuterStride<>>;
template <typename T>
using OutMap = Eigen::Map<Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>,
                          Eigen::Unaligned, Eigen::OuterStride<>>;

template <typename T, typename F>
void with_map(const T* p, int64_t rows, int64_t cols, bool row_major, int64_t ld, F&& f) {
  if (row_major) {
    f(ConstMap<T, Eigen::RowMajor>(p, rows, cols, Eigen::OuterStride<>(ld)));
  } else {
    f(ConstMap<T, Eigen::ColMajor>(p, rows, cols, Eigen::OuterStride<>(ld)));
  }
}

template <typename T>
void product(T* c, int64_t ldc, const T* a, bool a_row, int64_t lda, const T* b, bool b_row,
             int64_t ldb, int64_t n, int64_t k, int64_t p, T alpha) {
  if (n == 0 || p == 0 || k == 0) return;
  OutMap<T> dst(c, n, p, Eigen::OuterStride<>(ldc));
  with_map(a, n, k, a_row, lda, [&](const auto& A) {
    with_map(b, k, p, b_row, ldb, [&](const auto& B) { dst.noalias() += alpha * A * B; });
  });
}

}  // namespace

// Eigen peels the elements before the first aligned address off a vectorised loop and computes
// them with the scalar function, whose bits differ from the packet function's (and sums in
// another order). So the loops run on a thread's aligned scratch copy: a result does not depend
// on where its row lies in memory, which varies with the allocator and the thread count.
namespace {
Eigen::Map<Eigen::ArrayXf, Eigen::AlignedMax> aligned_scratch(int64_t n) {
  static thread_local Eigen::ArrayXf scratch;
  if (scratch.size() < n) scratch.resize(n);
  return {scratch.data(), n};
}
}  // namespace

float exp_sum(float* x, int64_t n, float shift) {
  if (n <= 0) return 0.0f;
  auto a = aligned_scratch(n);
  a = (Eigen::Map<const Eigen::ArrayXf>(x, n) - shift).exp();
  Eigen::Map<Eigen::ArrayXf>(x, n) = a;
  return a.sum();
}

void tanh_cap(float* x, int64_t n, float cap) {
  if (n <= 0) return;
  auto a = aligned_scratch(n);
  a = (Eigen::Map<const Eigen::ArrayXf>(x, n) / cap).tanh() * cap;
  Eigen::Map<Eigen::ArrayXf>(x, n) = a;
}

// Every element in packets (gemm.h's precondition: n a multiple of 16, x 64-byte aligned), so
// that none takes the scalar function: the bits depend on the value and the build only.
void packet_exp(float* x, int64_t n) {
  Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64> a(x, n);
  a = a.exp();
}

void packet_erf(float* x, int64_t n) {
  Eigen::Map<Eigen::ArrayXf, Eigen::Aligned64> a(x, n);
  a = a.erf();
}

void gemm_f32(float* c, int64_t ldc, const float* a, bool a_row, int64_t lda, const float* b,
              bool b_row, int64_t ldb, int64_t n, int64_t k, int64_t p, float alpha) {
  product<float>(c, ldc, a, a_row, lda, b, b_row, ldb, n, k, p, alpha);
}

void gemm_f64(double* c, int64_t ldc, const double* a, bool a_row, int64_t lda, const double* b,
              bool b_row, int64_t ldb, int64_t n, int64_t k, int64_t p, double alpha) {
  product<double>(c, ldc, a, a_row, lda, b, b_row, ldb, n, k, p, alpha);
}

}  // namespace kiln::cpu::KILN_GEMM_NS
