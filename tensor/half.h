// 16-bit floating-point storage types: Half (IEEE binary16) and BFloat16.
//
// Both are plain 16-bit values that convert to and from float; arithmetic happens in float.
// Conversions from float round to nearest even, as PyTorch and the hardware do. NaN stays NaN.
// In CUDA device code the conversions are the hardware's single instructions (cvt.rn.bf16.f32,
// cvt.rn.f16.f32, cvt.f32.f16), which round the same way (NaN payloads aside): the software
// rounding below cost every bf16/f16 kernel about six instructions per element written, and
// made memory-bound kernels issue-bound (ncu on the RoPE kernel: 387 instructions per warp for
// 512 elements).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace kiln {

struct BFloat16 {
  uint16_t x = 0;

  BFloat16() = default;
  constexpr BFloat16(float f) : x(round(f)) {}  // NOLINT: implicit like c10::BFloat16
  constexpr operator float() const { return std::bit_cast<float>(uint32_t{x} << 16); }
  static constexpr BFloat16 from_bits(uint16_t bits) {
    BFloat16 b;
    b.x = bits;
    return b;
  }

 private:
  static constexpr uint16_t round(float f) {
#if defined(__CUDA_ARCH__)
    if (!std::is_constant_evaluated()) return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#endif
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};

struct Half {
  uint16_t x = 0;

  Half() = default;
  constexpr Half(float f) : x(from_float(f)) {}  // NOLINT: implicit like c10::Half
  constexpr operator float() const { return to_float(x); }
  static constexpr Half from_bits(uint16_t bits) {
    Half h;
    h.x = bits;
    return h;
  }

 private:
  static constexpr uint16_t from_float(float f) {
#if defined(__CUDA_ARCH__)
    if (!std::is_constant_evaluated()) return __half_as_ushort(__float2half_rn(f));
#endif
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
    if (abs < 0x38800000u) {
      // Subnormal half (or zero): scale by 2^24 so the result's bits are an integer, then
      // round to nearest even through float addition.
      const float scaled = std::bit_cast<float>(abs) + 0.5f;  // 0.5 = 2^-1 moves bits down
      return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(scaled) - 0x3f000000u));
    }
    const uint32_t mant_odd = (abs >> 13) & 1u;
    const uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // rebias 127->15 and round
    return static_cast<uint16_t>(sign | (rounded >> 13));
  }
  static constexpr float to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
    if (!std::is_constant_evaluated()) return __half2float(__ushort_as_half(h));
#endif
    const uint32_t sign = uint32_t{h & 0x8000u} << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    const uint32_t mant = h & 0x3ffu;
    if (exp == 0) {
      // Zero or subnormal: value = mant * 2^-24.
      const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
      return sign ? -v : v;
    }
    if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
    return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  }
};

}  // namespace kiln

template <>
class std::numeric_limits<kiln::BFloat16> {
 public:
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr kiln::BFloat16 lowest() { return kiln::BFloat16::from_bits(0xff7f); }
  static constexpr kiln::BFloat16 max() { return kiln::BFloat16::from_bits(0x7f7f); }
  static constexpr kiln::BFloat16 min() { return kiln::BFloat16::from_bits(0x0080); }
  static constexpr kiln::BFloat16 epsilon() { return kiln::BFloat16::from_bits(0x3c00); }
  static constexpr kiln::BFloat16 infinity() { return kiln::BFloat16::from_bits(0x7f80); }
  static constexpr kiln::BFloat16 quiet_NaN() { return kiln::BFloat16::from_bits(0x7fc0); }
};

template <>
class std::numeric_limits<kiln::Half> {
 public:
  static constexpr bool is_specialized = true;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr kiln::Half lowest() { return kiln::Half::from_bits(0xfbff); }
  static constexpr kiln::Half max() { return kiln::Half::from_bits(0x7bff); }
  static constexpr kiln::Half min() { return kiln::Half::from_bits(0x0400); }
  static constexpr kiln::Half epsilon() { return kiln::Half::from_bits(0x1400); }
  static constexpr kiln::Half infinity() { return kiln::Half::from_bits(0x7c00); }
  static constexpr kiln::Half quiet_NaN() { return kiln::Half::from_bits(0x7e00); }
};
