// IEEE binary16 and bfloat16 storage types with round-to-nearest-even
// conversions, portable C++ (no F16C or compiler _Float16 assumed).
#pragma once

#include <cstdint>
#include <cstring>

namespace pyddp {

struct Half {
  uint16_t bits;
};
struct BFloat16 {
  uint16_t bits;
};

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float half_to_float(Half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t mant = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
  if (mant == 0) return bits_float(sign);
  // Subnormal half: value = mant * 2^-24, exact in float.
  const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -v : v;
}

inline Half float_to_half(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u) {  // inf or nan (keep nan quiet and non-zero)
    return Half{static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u))};
  }
  if (abs >= 0x477ff000u) return Half{static_cast<uint16_t>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): scale so the float adder does the
    // round-to-nearest-even at the half subnormal step 2^-24.
    const float scaled = bits_float(abs) + 0.5f;  // 0.5 = 2^-1: ulp of [0.5,1) is 2^-24
    return Half{static_cast<uint16_t>(sign | (float_bits(scaled) - 0x3f000000u))};
  }
  // Normal: rebias exponent, round mantissa from 23 to 10 bits (nearest even).
  const uint32_t odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xfffu + odd;
  return Half{static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13))};
}

inline float bfloat16_to_float(BFloat16 b) { return bits_float(static_cast<uint32_t>(b.bits) << 16); }

inline BFloat16 float_to_bfloat16(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40u)};
  const uint32_t odd = (u >> 16) & 1u;
  return BFloat16{static_cast<uint16_t>((u + 0x7fffu + odd) >> 16)};
}

}  // namespace pyddp
