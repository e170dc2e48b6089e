// Elementary functions the compiler can vectorise. A call to libm's expf or tanhf inside a
// loop stays a scalar call per element (GCC maps them to libmvec only under -ffast-math);
// these are plain arithmetic, so `#pragma omp simd` loops over them run 8 or 16 wide.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace mpipe::cpu {

// e^x for x in [-87, 87], within 2 ulp of the correctly rounded value (tests/unit/test_ops.cpp
// sweeps it against double precision); x outside is clamped to that range, so the result is
// always a normal float (no infinities, no denormals: GELU's sigmoid divides by 1 + e^x);
// NaN gives NaN.
// Cody-Waite reduction x = n ln 2 + r with |r| <= ln 2 / 2, Cephes' degree-6 polynomial for
// e^r, and 2^n built in the exponent bits.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = x * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  float r = x - n * 0.693359375f;  // ln 2 in two parts: 0.693359375 is exact in 10 bits
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // t's low mantissa bits hold n: 2^n's exponent field without a float-to-int conversion
  // (undefined for NaN, which instead flows through p to the result).
  const std::uint32_t bits =
      (std::bit_cast<std::uint32_t>(t) - std::bit_cast<std::uint32_t>(kRound) + 127u) << 23;
  return p * std::bit_cast<float>(bits);
}

// The tanh-approximated GELU written through the sigmoid, 0.5 (1 + tanh u) = 1 / (1 + e^(-2u))
// with u = sqrt(2/pi) (x + 0.044715 x^3): the same function as PyTorch's
// gelu(approximate="tanh"), without the cancellation of 1 + tanh u for negative u.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

// e^(-2u), the one transcendental both directions need.
inline float gelu_exp(float x) { return exp_clamped(-2.0f * kGeluScale * (x + kGeluCubic * x * x * x)); }

inline float gelu_value(float x) { return x / (1.0f + gelu_exp(x)); }

// d gelu / dx = s + x (1 - tanh^2 u) u' / 2 = s + 2 x s (1 - s) u', with s = 1 / (1 + e),
// e = e^(-2u); 1 - s is taken as e s, which does not cancel where s is near 1.
inline float gelu_derivative(float x) {
  const float e = gelu_exp(x);
  const float s = 1.0f / (1.0f + e);
  const float du = kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
  return s + 2.0f * x * ((e * s) * s) * du;
}

}  // namespace mpipe::cpu
