// Layout ops on the CPU: runs copied between layouts (a skip's concatenation), nearest
// upsampling and its gradient, and batched transposes (a per-pixel loss's channels last).
#include <algorithm>
#include <cstring>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

void copy_runs(float* dst, const float* src, const Runs& runs) {
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < runs.count; ++i)
    std::memcpy(dst + i * runs.dst_stride + runs.dst_offset, src + i * runs.src_stride + runs.src_offset,
                static_cast<std::size_t>(runs.length) * sizeof(float));
}

void upsample_nearest_forward(float* out, const float* inp, std::int64_t planes, std::int64_t H, std::int64_t W,
                              std::int64_t scale) {
  const std::int64_t OW = W * scale;
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t oh = 0; oh < H * scale; ++oh) {
      const float* in = inp + (p * H + oh / scale) * W;
      float* o = out + (p * H * scale + oh) * OW;
      for (std::int64_t ow = 0; ow < OW; ++ow) o[ow] = in[ow / scale];
    }
}

void upsample_nearest_backward(float* dinp, const float* dout, std::int64_t planes, std::int64_t H, std::int64_t W,
                               std::int64_t scale) {
  const std::int64_t OW = W * scale;
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t w = 0; w < W; ++w) {
        float sum = 0.0f;
        for (std::int64_t i = 0; i < scale; ++i) {
          const float* row = dout + (p * H * scale + h * scale + i) * OW + w * scale;
          for (std::int64_t j = 0; j < scale; ++j) sum += row[j];
        }
        dinp[(p * H + h) * W + w] = sum;
      }
}

void transpose_planes(float* out, const float* inp, std::int64_t batch, std::int64_t rows, std::int64_t cols) {
  // Tiles of 32 x 32 keep both sides' lines in cache.
  constexpr std::int64_t tile = 32;
#pragma omp parallel for collapse(2) schedule(static)
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t r0 = 0; r0 < rows; r0 += tile) {
      const float* in = inp + b * rows * cols;
      float* o = out + b * rows * cols;
      for (std::int64_t c0 = 0; c0 < cols; c0 += tile)
        for (std::int64_t r = r0; r < std::min(rows, r0 + tile); ++r)
          for (std::int64_t c = c0; c < std::min(cols, c0 + tile); ++c) o[c * rows + r] = in[r * cols + c];
    }
}

}  // namespace mpipe::cpu
