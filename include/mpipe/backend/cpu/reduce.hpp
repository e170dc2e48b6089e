// The CPU ops' sums in a fixed order, whatever the thread count (inside backend/cpu):
// a row's sum in 16 running sums, and a normalisation's parameter gradients by strips of
// channels.
#pragma once

#include <algorithm>
#include <cstdint>

namespace mpipe::cpu {

// The sum over a row of term(c), in 16 running sums (element c into sum c mod 16, the
// sums then added pairwise): a fixed order the loop vectorises.
template <class Term>
inline float row_sum(Term term, int64_t C) {
  constexpr int64_t lanes = 16;
  alignas(64) float sums[lanes] = {};
  int64_t c = 0;
  for (; c + lanes <= C; c += lanes)
#pragma omp simd
    for (int64_t j = 0; j < lanes; ++j) sums[j] += term(c + j);
  for (int64_t j = 0; c + j < C; ++j) sums[j] += term(c + j);
  for (int64_t half = lanes / 2; half >= 1; half /= 2)
    for (int64_t j = 0; j < half; ++j) sums[j] += sums[j + half];
  return sums[0];
}

// A normalisation's parameter gradients over N rows of C channels: each strip of 64
// channels summed over the rows in row order by one thread, then added to dweight (and
// dbias, unless null). add(n, c, dw, db) adds row n's terms of channel c to dw and db.
template <class Add>
void channel_strip_sums(float* dweight, float* dbias, int64_t N, int64_t C, Add add) {
  constexpr int64_t strip = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += strip) {
    const int64_t c1 = std::min(C, c0 + strip);
    float dw[strip] = {}, db[strip] = {};
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = c0; c < c1; ++c) add(n, c, dw[c - c0], db[c - c0]);
    for (int64_t c = c0; c < c1; ++c) {
      dweight[c] += dw[c - c0];
      if (dbias) dbias[c] += db[c - c0];
    }
  }
}

}  // namespace mpipe::cpu
