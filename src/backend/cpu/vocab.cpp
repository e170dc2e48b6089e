// CPU ops of the language-model head split over the vocabulary (nn/vocab_layers.hpp): a
// chunk's logits folded into per-row online-softmax statistics, their backward, and the
// loss from the last chunk's statistics. Contracts in ops.hpp; cuda/vocab.cu mirrors each.
#include <cmath>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/cpu/vmath.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::cpu {

void vocab_chunk_forward(float* out, const float* in, const float* z, const int32_t* targets, int64_t N, int64_t V,
                         int64_t v0) {
  float *m = out, *s = out + N, *t = out + 2 * N, *a = out + 3 * N;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = z + n * V;
    int64_t arg = 0;
    for (int64_t i = 1; i < V; ++i)
      if (row[i] > row[arg]) arg = i;
    const float top = row[arg];
    // An earlier chunk's maximum wins a tie (the first largest logit, as argmax).
    const bool earlier = in && !(top > in[n]);
    const float mx = earlier ? in[n] : top;
    float sum = 0.0f;
    for (int64_t i = 0; i < V; ++i) sum += exp_clamped(row[i] - mx);
    const int64_t local = static_cast<int64_t>(targets[n]) - v0;
    const float own = local >= 0 && local < V ? row[local] : 0.0f;
    m[n] = mx;
    s[n] = in ? in[N + n] * exp_clamped(in[n] - mx) + sum : sum;
    t[n] = in ? in[2 * N + n] + own : own;
    a[n] = earlier ? in[3 * N + n] : static_cast<float>(v0 + arg);
  }
}

void vocab_chunk_backward(float* dz, float* din, const float* dout, const float* z, const float* in, const float* out,
                          const int32_t* targets, int64_t N, int64_t V, int64_t v0, GradMode mode) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float ds = dout[N + n], dt = dout[2 * N + n], mx = out[n];
    const float* row = z + n * V;
    float* d = dz + n * V;
    for (int64_t i = 0; i < V; ++i) d[i] = ds * exp_clamped(row[i] - mx);
    const int64_t local = static_cast<int64_t>(targets[n]) - v0;
    if (local >= 0 && local < V) d[local] += dt;
    if (!din) continue;
    const float g[4] = {0.0f, ds * exp_clamped(in[n] - mx), dt, 0.0f};
    for (int k = 0; k < 4; ++k) {
      float& x = din[k * N + n];
      x = mode == GradMode::accumulate ? x + g[k] : g[k];
    }
  }
}

double vocab_loss_forward(const float* stats, const int32_t* targets, int64_t N, int64_t vocab) {
  for (int64_t n = 0; n < N; ++n)
    MPIPE_CHECK(targets[n] >= 0 && targets[n] < vocab, "target ", targets[n], " outside ", vocab, " classes");
  double loss = 0.0;
  for (int64_t n = 0; n < N; ++n) {
    const float lse = stats[n] + std::log(stats[N + n]);
    loss += static_cast<double>(lse) - stats[2 * N + n];
  }
  return loss;
}

void vocab_loss_backward(float* dstats, const float* stats, float scale, int64_t N) {
  for (int64_t n = 0; n < N; ++n) {
    dstats[n] = 0.0f;
    dstats[N + n] = scale / stats[N + n];
    dstats[2 * N + n] = -scale;
    dstats[3 * N + n] = 0.0f;
  }
}

int64_t vocab_count_correct(const float* stats, const int32_t* targets, int64_t N) {
  int64_t correct = 0;
  for (int64_t n = 0; n < N; ++n) correct += static_cast<int64_t>(stats[3 * N + n]) == targets[n] ? 1 : 0;
  return correct;
}

}  // namespace mpipe::cpu
