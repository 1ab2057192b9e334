// When a norm kernel takes a row's reduction again in f64: the CPU kernels (kernels/cpu/norm.cpp)
// and the CUDA ones (kernels/cuda/norm.cuh, kernels/cuda/layer_norm.cuh) of rms_norm and
// layer_norm share this rule.
//
//   float ss = ...;                                    // the row's f32 sum of squares
//   if (!kiln::internal::rms_sum_in_range(ss, eps)) {  // that row again, in f64
//     ...
//   }
//
// An f32 sum of squares overflows to infinity once |x| passes about 1e19 (torch's f32 RMSNorm
// then returns zeros), and flushes to zero below about 1e-19, where an eps below about 1e-11 no
// longer hides it. The squares of any f32 (or bf16, f16) value, and their sums over any row, fit
// in f64 with room to spare, so the CPU kernels sum a row outside the range again in f64; the CUDA
// kernels, whose registers matter, sum it again in f32 scaled by a power of two (rms_rescale).
// Rows inside the range keep their f32 arithmetic, bit for bit: the range test is the only cost
// of the common case. A NaN sum is outside the range too (it stays NaN). f64 rows are never taken
// again.
#pragma once

#ifdef __CUDACC__
#define KILN_NORM_HD __host__ __device__ __forceinline__
#else
#define KILN_NORM_HD inline
#endif

namespace kiln::internal {

// Above it an element's square has lost nothing to underflow that matters against the sum (a
// square flushed to zero is below 2^-126 < kNormSumMin * 2^-66).
inline constexpr float kNormSumMin = 0x1p-60f;
inline constexpr float kNormSumMax = 0x1.fffffep+127f;  // FLT_MAX

// rms_norm: the f32 sum of squares of a row gives an accurate rstd = 1 / sqrt(ss / d + eps): it
// has not overflowed, and it has not underflowed, or eps hides what underflow lost (eps >=
// kNormTinyEps is 2^24 times kNormSumMin: a mean square below kNormSumMin is below half an ulp of
// eps). Rows of zeros pass with any usual eps.
inline constexpr float kNormTinyEps = 0x1p-36f;
KILN_NORM_HD bool rms_sum_in_range(float ss, float eps) {
  return ss <= kNormSumMax && (ss >= kNormSumMin || eps >= kNormTinyEps);
}
KILN_NORM_HD bool rms_sum_in_range(double, double) { return true; }

// The CUDA kernels sum the squares of a row out of range again in f32, each element multiplied
// first by this power of two (exact): 2^-80 for a sum that overflowed (elements up to FLT_MAX,
// squares up to 2^96, sums of up to 2^31 of them fit), 2^80 for one that underflowed (elements
// below 2^-30, squares up to 2^100). Then rstd = rsqrt(ss' / d + eps * scale^2) * scale, where
// eps * scale^2 cannot overflow (tiny rows are taken again only for eps < kNormTinyEps).
KILN_NORM_HD float rms_rescale(float ss) { return ss > kNormSumMax ? 0x1p-80f : 0x1p80f; }
KILN_NORM_HD double rms_rescale(double) { return 1; }

// layer_norm: the f32 sum s of a row is finite, and the sum ss of its squared deviations from the
// mean obeys rms_norm's rule (finite; not underflowed, or hidden by eps). Rows of equal values
// pass with any usual eps (their variance is zero, or the rounding of the mean).
KILN_NORM_HD bool layer_norm_sums_in_range(float s, float ss, float eps) {
  return s >= -kNormSumMax && s <= kNormSumMax && rms_sum_in_range(ss, eps);
}
KILN_NORM_HD bool layer_norm_sums_in_range(double, double, double) { return true; }

// The CUDA layer_norm kernels take a row out of range again in f32 with this power of two: 2^80
// where ss underflowed, applied to each deviation x - mean (the mean is accurate there, and x
// itself may be large: a row of equal values near 1e30 with eps 0); 2^-80 where a sum overflowed
// or is NaN, applied to each element before the sum and before its deviation from the scaled mean
// (x - mean may itself overflow; deviations up to 2^49, squares up to 2^98). Then
// mean = mean' / scale and rstd = rsqrt(ss' / d + eps * scale^2) * scale.
KILN_NORM_HD float layer_norm_rescale(float ss) { return ss < kNormSumMin ? 0x1p80f : 0x1p-80f; }
KILN_NORM_HD double layer_norm_rescale(double) { return 1; }

// rms_norm_backward: r^3 (r = rstd) and the row's dot(dy * w, x) in the f32 range where
// x * r^3 * dot / d keeps its precision: r^3 neither under- nor overflows.
KILN_NORM_HD bool rms_backward_in_range(float r, float dot) {
  const float r3 = r * r * r;
  return r3 >= 0x1p-100f && r3 <= 0x1p100f && dot >= -kNormSumMax && dot <= kNormSumMax;
}
KILN_NORM_HD bool rms_backward_in_range(double, double) { return true; }

}  // namespace kiln::internal

#undef KILN_NORM_HD
