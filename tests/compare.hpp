// Comparisons shared by the test binaries.
#pragma once
#include <cmath>
#include <cstddef>
#include <span>

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

}  // namespace mpipe::test
