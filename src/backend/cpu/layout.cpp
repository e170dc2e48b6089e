// Layout ops on the CPU: runs copied between layouts (a skip's concatenation), nearest
// upsampling and its gradient, images between channels first and channels last.
#include <algorithm>
#include <cstring>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

// Tiles of 32 x 32 (4 KiB of each side in cache), over (sample, tile row) in parallel.
void swap_inner(float* dst, const float* src, std::int64_t N, std::int64_t A, std::int64_t B, bool accumulate) {
  constexpr std::int64_t kTile = 32;
  const std::int64_t tiles = (A + kTile - 1) / kTile;
#pragma omp parallel for schedule(static) collapse(2)
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t ta = 0; ta < tiles; ++ta) {
      const float* in = src + n * A * B;
      float* out = dst + n * A * B;
      const std::int64_t a1 = std::min(A, (ta + 1) * kTile);
      for (std::int64_t b0 = 0; b0 < B; b0 += kTile) {
        const std::int64_t b1 = std::min(B, b0 + kTile);
        for (std::int64_t b = b0; b < b1; ++b)
          for (std::int64_t a = ta * kTile; a < a1; ++a) {
            const float v = in[a * B + b];
            out[b * A + a] = accumulate ? out[b * A + a] + v : v;
          }
      }
    }
}

void copy_runs(float* dst, const float* src, const Runs& runs) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < runs.count; ++i)
    std::memcpy(dst + i * runs.dst_stride + runs.dst_offset, src + i * runs.src_stride + runs.src_offset,
                static_cast<std::size_t>(runs.length) * sizeof(float));
}

// Each input row makes its first output row (each value `scale` times: no division per
// element), copied to the other scale - 1. Scale 2 (a U-Net's) writes both output rows
// of every input row in one loop over all the rows: a plane of 8 x 8 spent more time in
// the per-row calls than in the copies.
void upsample_nearest_forward(float* out, const float* inp, std::int64_t planes, std::int64_t H, std::int64_t W,
                              std::int64_t scale) {
  const std::int64_t OW = W * scale;
  if (scale == 2) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < planes * H; ++r) {
      const float* in = inp + r * W;
      float* top = out + r * 2 * OW;
      float* bottom = top + OW;
#pragma omp simd
      for (std::int64_t w = 0; w < W; ++w) {
        const float v = in[w];
        top[2 * w] = v;
        top[2 * w + 1] = v;
        bottom[2 * w] = v;
        bottom[2 * w + 1] = v;
      }
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < planes * H; ++r) {
    const float* in = inp + r * W;
    float* first = out + r * scale * OW;
    for (std::int64_t w = 0; w < W; ++w)
      for (std::int64_t j = 0; j < scale; ++j) first[w * scale + j] = in[w];
    for (std::int64_t i = 1; i < scale; ++i)
      std::memcpy(first + i * OW, first, static_cast<std::size_t>(OW) * sizeof(float));
  }
}

// Each input element's block summed from zero, row by row, element by element (i, then
// j: the order of one loop over the block; the GPU's kernel sums in this order too).
// Scale 2 sums its four in one expression over all the rows; otherwise the whole input
// row is the running sums, so the inner loops run along memory.
void upsample_nearest_backward(float* dinp, const float* dout, std::int64_t planes, std::int64_t H, std::int64_t W,
                               std::int64_t scale) {
  const std::int64_t OW = W * scale;
  if (scale == 2) {
#pragma omp parallel for schedule(static)
    for (std::int64_t r = 0; r < planes * H; ++r) {
      float* d = dinp + r * W;
      const float* top = dout + r * 2 * OW;
      const float* bottom = top + OW;
#pragma omp simd
      for (std::int64_t w = 0; w < W; ++w)
        d[w] = (((0.0f + top[2 * w]) + top[2 * w + 1]) + bottom[2 * w]) + bottom[2 * w + 1];
    }
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < planes * H; ++r) {
    float* d = dinp + r * W;
    std::fill(d, d + W, 0.0f);
    for (std::int64_t i = 0; i < scale; ++i) {
      const float* row = dout + (r * scale + i) * OW;
      for (std::int64_t w = 0; w < W; ++w)
        for (std::int64_t j = 0; j < scale; ++j) d[w] += row[w * scale + j];
    }
  }
}

}  // namespace mpipe::cpu
