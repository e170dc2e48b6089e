// Philox4x32-10 exactly as docs/data.md ("How a batch is made") states it, written from
// that text alone: a test that rebuilds a run's batches with it fails if the code or the
// text changes.
#pragma once
#include <array>
#include <cstdint>

namespace mpipe::testing {

inline std::array<std::uint32_t, 4> documented_philox(std::array<std::uint32_t, 4> x, std::uint64_t key) {
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * x[0], p1 = std::uint64_t{0xCD9E8D57u} * x[2];
    x = {static_cast<std::uint32_t>(p1 >> 32) ^ x[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ x[3] ^ k1, static_cast<std::uint32_t>(p0)};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return x;
}

}  // namespace mpipe::testing
