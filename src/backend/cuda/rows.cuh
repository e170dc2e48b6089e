// What the one-warp-a-row norms share (LayerNorm in rows.cu, RMSNorm in rmsnorm.cu): the
// residual sum a fused norm makes of its row before its statistics, and the running
// statistic each lane keeps of what it stores. Included only by src/backend/cuda/*.cu.
#pragma once
#include <cstdint>

#include "kernels.cuh"

namespace mpipe::cuda {

// A lane's running statistic of its row's elements, in element order: the plain sum
// (LayerNorm's mean) or the sum of squares (RMSNorm's), the square an explicit fused
// multiply-add so that a one-pass op and the plain norm round it alike whatever the
// compiler contracts.
struct ValueSum {
  __device__ __forceinline__ float operator()(float sum, float v) const { return sum + v; }
};
struct SquareSum {
  __device__ __forceinline__ float operator()(float sum, float v) const { return fmaf(v, v, sum); }
};

// The residual sum of row `row` in place, x = residual + dropout(x) (dropout_apply's
// rounded value, then AddF's sum: the bits of the separate passes), W elements a pack at
// lane W, then 32 W on; returns this lane's `Statistic` of the stored (rounded) values,
// so that the norm after it sums what the plain norm would read back. Element e of a
// sample's (rows_per_sample, C) takes word e % 4 of its group e / 4, as dropout_kernel.
template <int W, bool Drop, class T, class Statistic>
__device__ __forceinline__ float residual_sum_row(T* x, const T* r, int64_t C, int64_t row, int64_t rows_per_sample,
                                                  int lane, const DropoutRule& rule, const RandomStream& first,
                                                  bool residual_packed, Statistic statistic) {
  const int64_t b = row / rows_per_sample, e_row = (row % rows_per_sample) * C;
  float acc = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    auto v = load_pack<W>(x + c);
    const auto rv = load_run<W>(r + c, residual_packed);
    Philox4 words{};
#pragma unroll
    for (int k = 0; k < W; ++k) {
      float d = to_f32(v.v[k]);
      if constexpr (Drop && W >= 4) {
        // C and c are multiples of W, so a pack starts a group: word k % 4, known here.
        if (k % 4 == 0) words = dropout_words(first, b, (e_row + c + k) / 4);
        d = dropped<T>(d, words[k % 4], rule.threshold, rule.keep_scale);
      } else if constexpr (Drop) {
        const int64_t e = e_row + c + k;
        words = dropout_words(first, b, e / 4);
        d = dropped<T>(d, words[e % 4], rule.threshold, rule.keep_scale);
      }
      v.v[k] = from_f32<T>(d + to_f32(rv.v[k]));
      acc = statistic(acc, to_f32(v.v[k]));
    }
    store_pack<W>(x + c, v);
  }
  return acc;
}

}  // namespace mpipe::cuda
