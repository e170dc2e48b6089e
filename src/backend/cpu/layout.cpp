// Layout ops on the CPU: runs copied between layouts (a skip's concatenation), nearest
// upsampling and its gradient.
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

// Each input row makes its first output row (each value `scale` times: no division per
// element), copied to the other scale - 1.
void upsample_nearest_forward(float* out, const float* inp, std::int64_t planes, std::int64_t H, std::int64_t W,
                              std::int64_t scale) {
  const std::int64_t OW = W * scale;
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t h = 0; h < H; ++h) {
      const float* in = inp + (p * H + h) * W;
      float* first = out + (p * H + h) * scale * OW;
      if (scale == 2) {
        for (std::int64_t w = 0; w < W; ++w) first[2 * w] = first[2 * w + 1] = in[w];
      } else {
        for (std::int64_t w = 0; w < W; ++w)
          for (std::int64_t j = 0; j < scale; ++j) first[w * scale + j] = in[w];
      }
      for (std::int64_t i = 1; i < scale; ++i)
        std::memcpy(first + i * OW, first, static_cast<std::size_t>(OW) * sizeof(float));
    }
}

// Each input element's block summed row by row, element by element (i, then j: the order
// of one loop over the block), with the whole input row as the running sums, so the
// inner loops run along memory.
void upsample_nearest_backward(float* dinp, const float* dout, std::int64_t planes, std::int64_t H, std::int64_t W,
                               std::int64_t scale) {
  const std::int64_t OW = W * scale;
#pragma omp parallel for schedule(static)
  for (std::int64_t p = 0; p < planes; ++p)
    for (std::int64_t h = 0; h < H; ++h) {
      float* d = dinp + (p * H + h) * W;
      std::fill(d, d + W, 0.0f);
      for (std::int64_t i = 0; i < scale; ++i) {
        const float* row = dout + (p * H * scale + h * scale + i) * OW;
        if (scale == 2) {
          for (std::int64_t w = 0; w < W; ++w) d[w] = d[w] + row[2 * w] + row[2 * w + 1];
        } else {
          for (std::int64_t w = 0; w < W; ++w)
            for (std::int64_t j = 0; j < scale; ++j) d[w] += row[w * scale + j];
        }
      }
    }
}

}  // namespace mpipe::cpu
