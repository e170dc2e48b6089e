// The CPU's row ops of the Llama family (cpu/ops.hpp): RMSNorm and its residual form,
// RoPE, SwiGLU. Every reduction is in a fixed order, whatever the thread count.
#include <algorithm>
#include <cmath>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cpu/reduce.hpp"
#include "mpipe/backend/cpu/vmath.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::cpu {

// ---- rmsnorm -----------------------------------------------------------------------

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float s = 1.0f / std::sqrt(row_sum([x](int64_t c) { return x[c] * x[c]; }, C) / static_cast<float>(C) + eps);
    float* y = out + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) y[c] = x[c] * s * weight[c];
    rstd[n] = s;
  }
}

void residual_rmsnorm_forward(float* out, float* rstd, float* sum, const float* residual, const float* weight,
                              int64_t N, int64_t C, int64_t rows_per_sample, float p, const DropoutKey& key, float eps) {
  add_dropped(sum, residual, sum, N / rows_per_sample, rows_per_sample * C, p, key);  // as residual_layernorm_forward
  rmsnorm_forward(out, rstd, sum, weight, N, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradMode mode) {
  // y = w x s with s = (mean(x²) + eps)^(-1/2): dx = s (w dy - x s · mean(w dy x s)).
  const bool accumulate = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    const float s = rstd[n];
    const float mean = row_sum([=](int64_t c) { return weight[c] * dy[c] * x[c]; }, C) * s / static_cast<float>(C);
    float* dx = dinp + n * C;
    if (accumulate) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dx[c] += (weight[c] * dy[c] - x[c] * s * mean) * s;
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dx[c] = (weight[c] * dy[c] - x[c] * s * mean) * s;
    }
  }
  // The weight's gradient: each channel strip summed over rows in row order by one thread.
  channel_strip_sums(dweight, nullptr, N, C, [=](int64_t n, int64_t c, float& dw, float&) {
    dw += inp[n * C + c] * rstd[n] * dout[n * C + c];
  });
}

// ---- rotary position embedding -------------------------------------------------------

void rope_apply(float* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t position, float theta,
                bool inverse) {
  const int64_t hs = C / H, half = hs / 2, KV = KVH * hs, ld = C + 2 * KV;
  constexpr int64_t max_half = 512;
  MPIPE_CHECK(hs % 2 == 0 && half <= max_half, "rope: head size ", hs);
  double frequencies[max_half];  // theta^(-2i/hs)
  for (int64_t i = 0; i < half; ++i)
    frequencies[i] = std::pow(static_cast<double>(theta), -2.0 * static_cast<double>(i) / static_cast<double>(hs));
  // A row's angles depend on its position alone: computed once per position, applied to
  // every sample's queries and keys there (the H + KVH heads side by side at the row's start).
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    alignas(64) float cosines[max_half], sines[max_half];
    const double p = static_cast<double>(position + t);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = p * frequencies[i];
      cosines[i] = static_cast<float>(std::cos(angle));
      sines[i] = static_cast<float>(inverse ? -std::sin(angle) : std::sin(angle));
    }
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv + (b * T + t) * ld;
      for (int64_t head = 0; head < H + KVH; ++head) {
        float* x = row + head * hs;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * cosines[i] - x2 * sines[i];
          x[i + half] = x2 * cosines[i] + x1 * sines[i];
        }
      }
    }
  }
}

// ---- SwiGLU --------------------------------------------------------------------------
// silu(g) = g sigmoid(g), the exponential through vmath.hpp's exp_clamped (vectorised;
// sigmoid then never divides by infinity).

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = inp + n * 2 * F;
    const float* up = gate + F;
    float* y = out + n * F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) y[f] = gate[f] / (1.0f + exp_clamped(-gate[f])) * up[f];
  }
}

void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t F, GradMode mode) {
  const bool accumulate = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = inp + n * 2 * F;
    const float* up = gate + F;
    const float* dy = dout + n * F;
    float* dgate = dinp + n * 2 * F;
    float* dup = dgate + F;
#pragma omp simd
    for (int64_t f = 0; f < F; ++f) {
      const float g = gate[f], sg = 1.0f / (1.0f + exp_clamped(-g)), silu = g * sg;
      const float dg = dy[f] * up[f] * (sg * (1.0f + g * (1.0f - sg))), du = dy[f] * silu;
      dgate[f] = accumulate ? dgate[f] + dg : dg;
      dup[f] = accumulate ? dup[f] + du : du;
    }
  }
}

}  // namespace mpipe::cpu
