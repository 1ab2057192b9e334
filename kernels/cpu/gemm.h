// CPU matrix products in f32 and f64 (and the exp and tanh loops of attention, the gated MLPs'
// exp), compiled for several x86-64 instruction sets and chosen at run time by what the CPU has:
// AVX-512 (x86-64-v4), AVX2 with FMA (x86-64-v3), or the baseline the rest of the library is built
// for (SSE2 on x86-64; whatever the compiler targets elsewhere). PyTorch ships its CPU kernels the
// same way (ATen's CPU_CAPABILITY builds), as a prebuilt library must run on any CPU of the
// architecture; the products are where the wider registers pay most.
//
//   // c [n, p] (row-major, row stride ldc) += alpha * a [n, k] @ b [k, p]
//   cpu::gemm(c, ldc, a, {true, k}, b, {true, p}, n, k, p, 1.0f);
//
// Each instruction set's build is Eigen's GEMM compiled with that set's flags
// (kernels/cpu/gemm_body.h, included by gemm.cpp and by kernels/cpu/isa/*.cpp). Eigen is renamed
// in the wider builds, so that none of their code can stand in for the baseline's at link time.
// Internal to kernels/.
#pragma once

#include <cstdint>
#include <vector>

namespace kiln::cpu {

// How a [rows, cols] operand is stored: row-major (row stride ld) or column-major (column
// stride ld).
struct GemmLayout {
  bool row_major = true;
  int64_t ld = 0;
};

// c [n, p], row-major with row stride ldc: c += alpha * a [n, k] @ b [k, p]. Eigen's threads
// (OpenMP, kiln::set_num_threads) split large products; inside a parallel region it runs serially.
void gemm(float* c, int64_t ldc, const float* a, GemmLayout la, const float* b, GemmLayout lb,
          int64_t n, int64_t k, int64_t p, float alpha);
void gemm(double* c, int64_t ldc, const double* a, GemmLayout la, const double* b, GemmLayout lb,
          int64_t n, int64_t k, int64_t p, double alpha);

// x[i] = exp(x[i] - shift) for i < n; returns their sum. Eigen's vectorised exp (within 2 ulp of
// std::exp); the bits depend on n and the build, not on x's address or the thread count. The CPU
// attention kernel's softmax.
float exp_sum(float* x, int64_t n, float shift);
// x[i] = cap * tanh(x[i] / cap) for i < n (attention's logit softcap), Eigen's vectorised tanh.
void tanh_cap(float* x, int64_t n, float cap);

// x[i] = exp(x[i]) for i < n, every element by Eigen's packet function (within a few ulp of
// std::exp): the bits depend on the value and the build only, not on n, the address or how a
// tensor is split into calls. x must be 64-byte aligned and n a multiple of kPacketFloats (pad
// the tail); else an error. The gated MLPs' CPU kernels (kernels/cpu/glu.cpp).
inline constexpr int64_t kPacketFloats = 16;
void packet_exp(float* x, int64_t n);
// x[i] = erf(x[i]) likewise, by Eigen's packet erf (gelu's gradient, kernels/cpu/glu.cpp).
void packet_erf(float* x, int64_t n);

// The instruction set gemm runs with on this CPU: "avx512", "avx2" or "baseline".
const char* gemm_isa();

// Every build of gemm in this library that this CPU can run, the chosen one first (tests compare
// them all against f64; the benchmark times them side by side).
struct GemmVariant {
  const char* isa;
  void (*f32)(float* c, int64_t ldc, const float* a, bool a_row_major, int64_t lda, const float* b,
              bool b_row_major, int64_t ldb, int64_t n, int64_t k, int64_t p, float alpha);
  void (*f64)(double* c, int64_t ldc, const double* a, bool a_row_major, int64_t lda,
              const double* b, bool b_row_major, int64_t ldb, int64_t n, int64_t k, int64_t p,
              double alpha);
  float (*exp_sum)(float* x, int64_t n, float shift);
  void (*tanh_cap)(float* x, int64_t n, float cap);
  void (*packet_exp)(float* x, int64_t n);
  void (*packet_erf)(float* x, int64_t n);
};
std::vector<GemmVariant> gemm_variants();

}  // namespace kiln::cpu
