// The CPU's attention over a key/value cache, for generation: a few new queries (one per
// token once the prompt is in) against every key before them. Blocks of keys with an
// online softmax, as the training forward, but plain loops: a single query row leaves a
// GEMM nothing to block, and a BLAS call per (head, block) costs more than its work.
#include <algorithm>
#include <cmath>
#include <limits>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

void attention_decode(float* out, const float* qkv, const float* cache, int64_t B, int64_t rows, int64_t position,
                      int64_t capacity, int64_t C, int64_t H, int64_t KVH) {
  const int64_t hs = C / H, KV = KVH * hs, ld = 2 * KV, group = H / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  constexpr int64_t block = 128;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float* base = cache + b * capacity * ld + (h / group) * hs;  // row j: k, then v at + KV
    float s[block];                                                    // one block's scores, then weights
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = position + i;
      const float* q = qkv + (b * rows + i) * (C + 2 * KV) + h * hs;
      float* o = out + (b * rows + i) * C + h * hs;
      std::fill_n(o, hs, 0.0f);
      float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
      for (int64_t j0 = 0; j0 <= row; j0 += block) {
        const int64_t keys = std::min(block, row + 1 - j0);
        float mx = m;
        for (int64_t j = 0; j < keys; ++j) {
          const float* k = base + (j0 + j) * ld;
          float dot = 0.0f;
          for (int64_t c = 0; c < hs; ++c) dot += q[c] * k[c];
          s[j] = dot * scale;
          mx = std::max(mx, s[j]);
        }
        if (mx != m) {  // a new maximum: what came before shrinks (to 0 the first time)
          const float shrink = std::exp(m - mx);
          for (int64_t c = 0; c < hs; ++c) o[c] *= shrink;
          l *= shrink;
          m = mx;
        }
        for (int64_t j = 0; j < keys; ++j) {
          const float p = std::exp(s[j] - m);
          const float* v = base + (j0 + j) * ld + KV;
          l += p;
          for (int64_t c = 0; c < hs; ++c) o[c] += p * v[c];
        }
      }
      const float inv = 1.0f / l;
      for (int64_t c = 0; c < hs; ++c) o[c] *= inv;
    }
  }
}

}  // namespace mpipe::cpu
