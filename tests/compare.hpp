// Comparisons shared by the test binaries.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

namespace mpipe::test {

// ||a - b|| / ||b||, accumulated in double.
inline double relative_difference(std::span<const float> a, std::span<const float> b) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

// Equal bit for bit (NaN payloads and the sign of zero included).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

}  // namespace mpipe::test
