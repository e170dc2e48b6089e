// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11).
//
// A value is a pure function of (key, counter), so any rank, any split of the batch and
// any recomputation draws the same numbers for the same logical element: what dropout
// masks, parameter initialisation and synthetic data rely on. The same function is
// trivial to run in a CUDA kernel.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>

namespace mpipe {

using Philox4 = std::array<std::uint32_t, 4>;

constexpr Philox4 philox4x32(Philox4 counter, std::uint64_t key) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * counter[0];
    const std::uint64_t p1 = std::uint64_t{0xCD9E8D57u} * counter[2];
    counter = {static_cast<std::uint32_t>(p1 >> 32) ^ counter[1] ^ k0, static_cast<std::uint32_t>(p1),
               static_cast<std::uint32_t>(p0 >> 32) ^ counter[3] ^ k1, static_cast<std::uint32_t>(p0)};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return counter;
}

// Distinct purposes draw from distinct streams, so their numbers never coincide.
enum class Stream : std::uint32_t { init = 1, dropout = 2, data = 3, data_setup = 4, sampling = 5 };

// A stream of random words indexed by element: word(i) for i = 0, 1, 2, ...
struct RandomStream {
  std::uint64_t key = 0;
  std::uint32_t a = 0, b = 0, c = 0;  // what this stream is for (sample, layer, step, ...)

  Philox4 block(std::uint64_t i) const {
    return philox4x32({static_cast<std::uint32_t>(i), a, b ^ static_cast<std::uint32_t>(i >> 32), c}, key);
  }
  std::uint32_t word(std::uint64_t i) const { return block(i / 4)[i % 4]; }
  // Uniform in [0, 1) with 24 bits.
  float uniform(std::uint64_t i) const { return static_cast<float>(word(i) >> 8) * 0x1p-24f; }
  // Four standard normals from block `index`: Box-Muller on words (0, 1) and (2, 3).
  // Element i of the stream is normals4(i / 4)[i % 4].
  std::array<float, 4> normals4(std::uint64_t index) const {
    const Philox4 w = block(index);
    std::array<float, 4> out;
    for (int pair = 0; pair < 2; ++pair) {
      const float u1 = (static_cast<float>(w[2 * pair] >> 8) + 1.0f) * 0x1p-24f;  // (0, 1]
      const float u2 = static_cast<float>(w[2 * pair + 1] >> 8) * 0x1p-24f;
      const float r = std::sqrt(-2.0f * std::log(u1));
      const float theta = 6.28318530717958647692f * u2;
      out[2 * pair] = r * std::cos(theta);
      out[2 * pair + 1] = r * std::sin(theta);
    }
    return out;
  }
  float normal(std::uint64_t i) const { return normals4(i / 4)[i % 4]; }
  // Fills out[0, n) with elements [0, n) of the stream's normals.
  void fill_normal(float* out, std::uint64_t n, float scale = 1.0f) const {
    for (std::uint64_t k = 0; k * 4 < n; ++k) {
      const auto v = normals4(k);
      for (std::uint64_t j = 0; j < 4 && k * 4 + j < n; ++j) out[k * 4 + j] = scale * v[j];
    }
  }
  // Uniform integer in [0, n) (multiply-shift; bias below 2^-32 * n).
  std::uint64_t below(std::uint64_t i, std::uint64_t n) const {
    const Philox4 w = block(i);
    const std::uint64_t r = (std::uint64_t{w[0]} << 32) | w[1];
    __extension__ using u128 = unsigned __int128;
    return static_cast<std::uint64_t>((static_cast<u128>(r) * n) >> 64);
  }
};

// The purpose goes into the key's top byte (seeds are user numbers, far below 2^56), so
// a, b and c are free for what identifies the element: sample, layer, step, ...
inline RandomStream make_stream(std::uint64_t seed, Stream purpose, std::uint32_t a,
                                std::uint32_t b, std::uint32_t c) {
  return RandomStream{seed ^ (static_cast<std::uint64_t>(purpose) << 56), a, b, c};
}

}  // namespace mpipe
