// bfloat16 as stored: the top 16 bits of an IEEE float. Plain C++17 so that CUDA
// sources (compiled as C++17) and host code share it; on the device it is
// reinterpreted as __nv_bfloat16, which has the same layout.
#pragma once
#include <cstdint>
#include <cstring>

namespace mpipe {

struct bf16 {
  std::uint16_t bits = 0;
};
static_assert(sizeof(bf16) == 2);

// Round to nearest, ties to even, as the GPU's conversion does; NaN stays NaN.
inline bf16 to_bf16(float value) {
  std::uint32_t u;
  std::memcpy(&u, &value, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{static_cast<std::uint16_t>(u >> 16)};
}

inline float to_float(bf16 value) {
  const std::uint32_t u = static_cast<std::uint32_t>(value.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace mpipe
