// The CPU matrix product's baseline build and the choice among the builds (kernels/cpu/gemm.h).
#include "kernels/cpu/gemm.h"

#include <cstdint>

#include "tensor/error.h"

#define KILN_GEMM_NS baseline
#include "kernels/cpu/gemm_body.h"

namespace kiln::cpu {

// The wider builds' entry points (kernels/cpu/gemm_body.h), compiled where CMakeLists.txt adds
// kernels/cpu/isa/ (x86-64).
#define KILN_GEMM_DECLARE_BUILD(ns)                                                                \
  namespace ns {                                                                                   \
  void gemm_f32(float* c, int64_t ldc, const float* a, bool a_row, int64_t lda, const float* b,    \
                bool b_row, int64_t ldb, int64_t n, int64_t k, int64_t p, float alpha);            \
  void gemm_f64(double* c, int64_t ldc, const double* a, bool a_row, int64_t lda, const double* b, \
                bool b_row, int64_t ldb, int64_t n, int64_t k, int64_t p, double alpha);           \
  float exp_sum(float* x, int64_t n, float shift);                                                 \
  void tanh_cap(float* x, int64_t n, float cap);                                                   \
  void packet_exp(float* x, int64_t n);                                                            \
  void packet_erf(float* x, int64_t n);                                                            \
  }
#if defined(KILN_GEMM_AVX2)
KILN_GEMM_DECLARE_BUILD(avx2)
#endif
#if defined(KILN_GEMM_AVX512)
KILN_GEMM_DECLARE_BUILD(avx512)
#endif
#undef KILN_GEMM_DECLARE_BUILD

namespace {

// The builds this CPU runs, widest first. __builtin_cpu_supports also checks that the operating
// system saves the wider registers (XCR0).
std::vector<GemmVariant> supported() {
  std::vector<GemmVariant> v;
#if defined(KILN_GEMM_AVX512)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma")) {
    v.push_back({"avx512", avx512::gemm_f32, avx512::gemm_f64, avx512::exp_sum, avx512::tanh_cap,
                 avx512::packet_exp, avx512::packet_erf});
  }
#endif
#if defined(KILN_GEMM_AVX2)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    v.push_back({"avx2", avx2::gemm_f32, avx2::gemm_f64, avx2::exp_sum, avx2::tanh_cap,
                 avx2::packet_exp, avx2::packet_erf});
  }
#endif
  v.push_back({"baseline", baseline::gemm_f32, baseline::gemm_f64, baseline::exp_sum,
               baseline::tanh_cap, baseline::packet_exp, baseline::packet_erf});
  return v;
}

const GemmVariant& chosen() {
  static const GemmVariant v = supported().front();
  return v;
}

}  // namespace

void gemm(float* c, int64_t ldc, const float* a, GemmLayout la, const float* b, GemmLayout lb,
          int64_t n, int64_t k, int64_t p, float alpha) {
  chosen().f32(c, ldc, a, la.row_major, la.ld, b, lb.row_major, lb.ld, n, k, p, alpha);
}

void gemm(double* c, int64_t ldc, const double* a, GemmLayout la, const double* b, GemmLayout lb,
          int64_t n, int64_t k, int64_t p, double alpha) {
  chosen().f64(c, ldc, a, la.row_major, la.ld, b, lb.row_major, lb.ld, n, k, p, alpha);
}

float exp_sum(float* x, int64_t n, float shift) { return chosen().exp_sum(x, n, shift); }

void tanh_cap(float* x, int64_t n, float cap) { chosen().tanh_cap(x, n, cap); }

namespace {
void check_packets(const char* fn, const float* x, int64_t n) {
  KILN_CHECK(n >= 0 && n % kPacketFloats == 0 && reinterpret_cast<uintptr_t>(x) % 64 == 0, "[", fn,
             "] needs a 64-byte aligned array of a multiple of ", kPacketFloats, " floats, got ", n,
             " at ", static_cast<const void*>(x));
}
}  // namespace

void packet_exp(float* x, int64_t n) {
  check_packets("packet_exp", x, n);
  chosen().packet_exp(x, n);
}

void packet_erf(float* x, int64_t n) {
  check_packets("packet_erf", x, n);
  chosen().packet_erf(x, n);
}

const char* gemm_isa() { return chosen().isa; }

std::vector<GemmVariant> gemm_variants() { return supported(); }

}  // namespace kiln::cpu
