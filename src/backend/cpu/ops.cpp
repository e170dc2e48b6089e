// CPU ops: BLAS for the GEMMs, OpenMP loops for the rest. See ops.hpp for contracts.
#include "mpipe/backend/cpu/ops.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "mpipe/backend/cpu/reduce.hpp"
#include "mpipe/backend/cpu/vmath.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/core/rng.hpp"

extern "C" void openblas_set_num_threads(int);

namespace mpipe::cpu {

namespace {
int g_threads = 1;
}

void set_threads(int threads) {
  g_threads = std::max(1, threads);
  omp_set_num_threads(g_threads);
  openblas_set_num_threads(g_threads);
}
int threads() { return g_threads; }
bool threads_here() { return omp_get_max_threads() > 1 && !omp_in_parallel(); }

// ---- matmul ------------------------------------------------------------------------

void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC) {
  if (bias) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::copy(bias, bias + OC, out + n * OC);
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
              bias ? 1.0f : 0.0f, out, OC);
}

void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                     GradMode mode) {
  if (dinp) {
    // dinp (N, C) = dout (N, OC) · weight (OC, C)
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                mode == GradMode::accumulate ? 1.0f : 0.0f, dinp, C);
  }
  if (!dweight) return;  // split backward: the input gradient alone
  // dweight (OC, C) += dout^T (OC, N) · inp (N, C)
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
              dweight, C);
  if (dbias) {
    // Each output channel is summed over rows by one thread, in row order.
    constexpr int64_t strip = 64;
#pragma omp parallel for schedule(static)
    for (int64_t o0 = 0; o0 < OC; o0 += strip) {
      const int64_t o1 = std::min(OC, o0 + strip);
      float acc[strip] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* row = dout + n * OC;
        for (int64_t o = o0; o < o1; ++o) acc[o - o0] += row[o];
      }
      for (int64_t o = o0; o < o1; ++o) dbias[o] += acc[o - o0];
    }
  }
}

// ---- activations -------------------------------------------------------------------

void relu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = inp[i] < 0.0f ? 0.0f : inp[i];  // NaN passes, as in PyTorch
}

void relu_backward(float* dinp, const float* dout, const float* out, int64_t n, GradMode mode) {
  if (mode == GradMode::accumulate) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dinp[i] += out[i] > 0.0f ? dout[i] : 0.0f;
  } else {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dinp[i] = out[i] > 0.0f ? dout[i] : 0.0f;
  }
}

// Through vmath.hpp's sigmoid form: plain arithmetic the loop vectorises (std::tanh was a
// scalar libm call per element, a third of a CPU GPT step).
void gelu_forward(float* out, const float* inp, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_value(inp[i]);
}

void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n, GradMode mode) {
  if (mode == GradMode::accumulate) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dinp[i] += gelu_derivative(inp[i]) * dout[i];
  } else {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) dinp[i] = gelu_derivative(inp[i]) * dout[i];
  }
}

// ---- layernorm ---------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C) {
  constexpr float eps = 1e-5f;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    float m = 0.0f;
    for (int64_t c = 0; c < C; ++c) m += x[c];
    m /= static_cast<float>(C);
    float var = 0.0f;
    for (int64_t c = 0; c < C; ++c) var += (x[c] - m) * (x[c] - m);
    var /= static_cast<float>(C);
    const float s = 1.0f / std::sqrt(var + eps);
    float* y = out + n * C;
    for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - m) * s * weight[c] + bias[c];
    mean[n] = m;
    rstd[n] = s;
  }
}

void residual_layernorm_forward(float* out, float* mean, float* rstd, float* sum, const float* residual,
                                const float* weight, const float* bias, int64_t N, int64_t C,
                                int64_t rows_per_sample, float p, const DropoutKey& key) {
  // The sum, then the LayerNorm, each over all rows: on the CPU, whose rows are in cache,
  // one pass over each row was no faster (1.1x slower, 8 x 128 rows of 128).
  add_dropped(sum, residual, sum, N / rows_per_sample, rows_per_sample * C, p, key);
  layernorm_forward(out, mean, rstd, sum, weight, bias, N, C);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C, GradMode mode) {
  const bool accumulate = mode == GradMode::accumulate;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;
    const float* dy = dout + n * C;
    const float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * dy[c];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<float>(C);
    dnorm_norm_mean /= static_cast<float>(C);
    float* dx = dinp + n * C;
    for (int64_t c = 0; c < C; ++c) {
      const float norm = (x[c] - m) * s;
      const float d = (weight[c] * dy[c] - dnorm_mean - norm * dnorm_norm_mean) * s;
      dx[c] = accumulate ? dx[c] + d : d;
    }
  }
  // Parameter gradients: each channel strip summed over rows in row order by one thread.
  channel_strip_sums(dweight, dbias, N, C, [=](int64_t n, int64_t c, float& dw, float& db) {
    const float dy = dout[n * C + c];
    dw += (inp[n * C + c] - mean[n]) * rstd[n] * dy;
    db += dy;
  });}

// ---- embedding ---------------------------------------------------------------------

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C, int64_t V) {
  for (int64_t i = 0; i < B * T; ++i)
    MPIPE_CHECK(tokens[i] >= 0 && tokens[i] < V, "token ", tokens[i], " outside vocabulary ", V);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < B * T; ++i) {
    const float* te = wte + static_cast<int64_t>(tokens[i]) * C;
    float* y = out + i * C;
    if (!wpe) {  // no position table (RoPE rotates inside attention)
      std::copy_n(te, C, y);
      continue;
    }
    const float* pe = wpe + (i % T) * C;
    for (int64_t c = 0; c < C; ++c) y[c] = te[c] + pe[c];
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C) {
  // Threads own channel strips, so rows sharing a token never race and the order of
  // accumulation (row order) is fixed.
  constexpr int64_t strip = 64;
#pragma omp parallel for schedule(static)
  for (int64_t c0 = 0; c0 < C; c0 += strip) {
    const int64_t c1 = std::min(C, c0 + strip);
    for (int64_t i = 0; i < B * T; ++i) {
      const float* dy = dout + i * C;
      float* te = dwte + static_cast<int64_t>(tokens[i]) * C;
      if (!dwpe) {
        for (int64_t c = c0; c < c1; ++c) te[c] += dy[c];
        continue;
      }
      float* pe = dwpe + (i % T) * C;
      for (int64_t c = c0; c < c1; ++c) {
        te[c] += dy[c];
        pe[c] += dy[c];
      }
    }
  }
}

// ---- attention ---------------------------------------------------------------------
// FlashAttention (Dao et al., 2022; FA-2's loop order) on the CPU. Per (batch, head), a
// query tile of `attention_tile` rows meets the key tiles at or before it (causal: the
// tiles after it are skipped, half the work of the whole T x T): S = Q K^T / sqrt(hs)
// and O += P V as BLAS GEMMs on strided views of qkv, the online softmax in between.
// Only a tile's scores live at a time (on the stack); the backward recomputes them from
// q, k and the forward's log-sum-exp. Called inside an OpenMP loop over (b, h), where
// OpenMP-flavoured OpenBLAS runs each call on the calling thread; each (b, h) writes only
// its own columns, so the loop needs no reduction. Every tile's arithmetic is the same
// for a sample whatever the batch it comes in (partition transparency).

namespace {
constexpr int64_t attention_tile = 64;
}

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                       int64_t KVH) {
  const int64_t hs = C / H, KV = KVH * hs, ld = C + 2 * KV, group = H / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  constexpr int64_t tile = attention_tile;
#pragma omp parallel for schedule(static)
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H, h = bh % H;
    const float* q = qkv + b * T * ld + h * hs;
    const float* k = qkv + b * T * ld + C + (h / group) * hs;  // its group's key/value head
    const float* v = k + KV;
    float* o = out + b * T * C + h * hs;
    float* row_lse = lse + bh * T;
    float s[tile * tile];          // (rows, keys) scores, then probabilities
    float m[tile], l[tile];        // each row's running maximum and sum
    for (int64_t i0 = 0; i0 < T; i0 += tile) {
      const int64_t rows = std::min(tile, T - i0);
      for (int64_t r = 0; r < rows; ++r) {
        std::fill_n(o + (i0 + r) * C, hs, 0.0f);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.0f;
      }
      for (int64_t j0 = 0; j0 < i0 + rows; j0 += tile) {  // key tiles with a key at or before a row
        const int64_t keys = std::min(tile, i0 + rows - j0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hs, scale, q + i0 * ld, ld, k + j0 * ld, ld,
                    0.0f, s, tile);
        for (int64_t r = 0; r < rows; ++r) {
          float* row = s + r * tile;
          const int64_t seen = std::clamp<int64_t>(i0 + r - j0 + 1, 0, keys);  // keys at or before the query
          float mx = m[r];
          for (int64_t c = 0; c < seen; ++c) mx = std::max(mx, row[c]);
          float sum = 0.0f;
          for (int64_t c = 0; c < seen; ++c) {
            row[c] = std::exp(row[c] - mx);
            sum += row[c];
          }
          std::fill(row + seen, row + keys, 0.0f);
          if (mx != m[r]) {  // a new maximum: what came before shrinks
            const float shrink = std::exp(m[r] - mx);  // 0 for the first
            float* orow = o + (i0 + r) * C;
            for (int64_t c = 0; c < hs; ++c) orow[c] *= shrink;
            l[r] *= shrink;
            m[r] = mx;
          }
          l[r] += sum;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, keys, 1.0f, s, tile, v + j0 * ld, ld, 1.0f,
                    o + i0 * C, C);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / l[r];
        float* orow = o + (i0 + r) * C;
        for (int64_t c = 0; c < hs; ++c) orow[c] *= inv;
        row_lse[i0 + r] = m[r] + std::log(l[r]);
      }
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH) {
  const int64_t hs = C / H, KV = KVH * hs, ld = C + 2 * KV, group = H / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  constexpr int64_t tile = attention_tile;
  // A thread per (sample, key/value head): the group's query heads add into its dk and dv
  // one after another, in ascending order (no two threads write one head's gradient).
#pragma omp parallel for schedule(static)
  for (int64_t bg = 0; bg < B * KVH; ++bg) {
    const int64_t b = bg / KVH, g = bg % KVH;
    const float* k = qkv + b * T * ld + C + g * hs;
    const float* v = k + KV;
    float* dk = dqkv + b * T * ld + C + g * hs;
    float* dv = dk + KV;
    for (int64_t t = 0; t < T; ++t) {
      std::fill_n(dk + t * ld, hs, 0.0f);
      std::fill_n(dv + t * ld, hs, 0.0f);
    }
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const int64_t bh = b * H + h;
      const float* q = qkv + b * T * ld + h * hs;
      const float* o = out + b * T * C + h * hs;
      const float* dy = dout + b * T * C + h * hs;
      const float* row_lse = lse + bh * T;
      float* dq = dqkv + b * T * ld + h * hs;
      for (int64_t t = 0; t < T; ++t) std::fill_n(dq + t * ld, hs, 0.0f);
      float p[tile * tile], dp[tile * tile];  // (rows, keys): probabilities; their gradient, then dS
      float delta[tile];                      // each row's dO · O (= rowsum(P * dP))
      for (int64_t i0 = 0; i0 < T; i0 += tile) {
        const int64_t rows = std::min(tile, T - i0);
        for (int64_t r = 0; r < rows; ++r) {
          const float* dyrow = dy + (i0 + r) * C;
          const float* orow = o + (i0 + r) * C;
          float dot = 0.0f;
          for (int64_t c = 0; c < hs; ++c) dot += dyrow[c] * orow[c];
          delta[r] = dot;
        }
        for (int64_t j0 = 0; j0 < i0 + rows; j0 += tile) {
          const int64_t keys = std::min(tile, i0 + rows - j0);
          // P = exp(S - lse), zero where masked.
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hs, scale, q + i0 * ld, ld, k + j0 * ld, ld,
                      0.0f, p, tile);
          for (int64_t r = 0; r < rows; ++r) {
            float* row = p + r * tile;
            const int64_t seen = std::clamp<int64_t>(i0 + r - j0 + 1, 0, keys);
            const float row_max = row_lse[i0 + r];
            for (int64_t c = 0; c < seen; ++c) row[c] = std::exp(row[c] - row_max);
            std::fill(row + seen, row + keys, 0.0f);
          }
          // dV_j += P^T dO_i ; dP = dO_i V_j^T
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, hs, rows, 1.0f, p, tile, dy + i0 * C, C, 1.0f,
                      dv + j0 * ld, ld);
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, keys, hs, 1.0f, dy + i0 * C, C, v + j0 * ld, ld,
                      0.0f, dp, tile);
          // dS = P * (dP - delta), in place over dP (zero where P is).
          for (int64_t r = 0; r < rows; ++r) {
            const float* prow = p + r * tile;
            float* drow = dp + r * tile;
            for (int64_t c = 0; c < keys; ++c) drow[c] = prow[c] * (drow[c] - delta[r]);
          }
          // dQ_i += scale dS K_j ; dK_j += scale dS^T Q_i
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, hs, keys, scale, dp, tile, k + j0 * ld, ld, 1.0f,
                      dq + i0 * ld, ld);
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, keys, hs, rows, scale, dp, tile, q + i0 * ld, ld, 1.0f,
                      dk + j0 * ld, ld);
        }
      }
    }
  }
}

// ---- dropout -----------------------------------------------------------------------

namespace {

RandomStream dropout_stream(const DropoutKey& key, int64_t sample) {
  return make_stream(key.seed, Stream::dropout, static_cast<uint32_t>(key.sample_begin + sample), key.site,
                     static_cast<uint32_t>(key.step));
}

// x, as a value the compiler cannot look into: a product that dropout_apply stores and
// add reads back is not contracted with the sum into one fused multiply-add here (GCC
// contracts across statements by default), so add_dropped keeps the two ops' bits.
inline float opaque(float x) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(x));
#elif defined(__aarch64__)
  asm("" : "+w"(x));
#else
  volatile float v = x;
  x = v;
#endif
  return x;
}

}  // namespace

void dropout_apply(float* out, const float* inp, int64_t B, int64_t per_sample, float p,
                   const DropoutKey& key) {
  const DropoutRule rule(p);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    const RandomStream stream = dropout_stream(key, b);
    const float* x = inp + b * per_sample;
    float* y = out + b * per_sample;
    for (int64_t e0 = 0; e0 < per_sample; e0 += 4) {
      const Philox4 words = stream.block(static_cast<uint64_t>(e0 / 4));
      const int64_t e1 = std::min(per_sample, e0 + 4);
      for (int64_t e = e0; e < e1; ++e) y[e] = words[e - e0] >= rule.threshold ? x[e] * rule.keep_scale : 0.0f;
    }
  }
}

void add_dropped(float* out, const float* base, const float* branch, int64_t B, int64_t per_sample, float p,
                 const DropoutKey& key) {
  if (p == 0.0f) {
#pragma omp parallel for simd schedule(static)
    for (int64_t e = 0; e < B * per_sample; ++e) out[e] = branch[e] + base[e];
    return;
  }
  if (out != base) {  // dropout_apply into out, then the sum: the two passes were fastest
    dropout_apply(out, branch, B, per_sample, p, key);
    add(out, base, B * per_sample);
    return;
  }
  // Onto base: by chunks of a sample, dropout_apply's values into a buffer on the stack,
  // then the sums in vectors.
  const DropoutRule rule(p);
  constexpr int64_t kChunk = 256;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    const RandomStream stream = dropout_stream(key, b);
    alignas(64) float dropped[kChunk];
    for (int64_t c0 = b * per_sample; c0 < (b + 1) * per_sample; c0 += kChunk) {
      const int64_t c1 = std::min((b + 1) * per_sample, c0 + kChunk);
      for (int64_t e = c0; e < c1;) {  // e - b per_sample: the element's index in the sample
        const int64_t i = e - b * per_sample;
        const Philox4 words = stream.block(static_cast<uint64_t>(i / 4));
        for (int64_t k = i % 4; k < 4 && e < c1; ++k, ++e)
          dropped[e - c0] = opaque(words[k] >= rule.threshold ? branch[e] * rule.keep_scale : 0.0f);
      }
#pragma omp simd
      for (int64_t e = c0; e < c1; ++e) out[e] = dropped[e - c0] + base[e];
    }
  }
}

// ---- elementwise and reductions ------------------------------------------------------

void add(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void copy(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = x[i];
}

void scale(float* y, float factor, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] *= factor;
}

double sum_squares(const float* x, int64_t n) {
  // A fixed number of chunks, each summed in `lanes` interleaved partial sums (one
  // dependency chain per element was latency bound: 70 ms for a GPT's 53M gradients on
  // one core), the lanes in order, then the chunks in order: the result depends on n
  // alone, not on the thread count.
  constexpr int64_t chunks = 64;
  constexpr int lanes = 16;
  double partial[chunks];
  const int64_t per = (n + chunks - 1) / chunks;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    double lane[lanes] = {};
    int64_t i = std::min(n, c * per);
    const int64_t end = std::min(n, (c + 1) * per);
    for (; i + lanes <= end; i += lanes)
#pragma omp simd
      for (int j = 0; j < lanes; ++j) lane[j] += static_cast<double>(x[i + j]) * x[i + j];
    for (int j = 0; i < end; ++i, ++j) lane[j] += static_cast<double>(x[i]) * x[i];
    double acc = 0.0;
    for (const double v : lane) acc += v;
    partial[c] = acc;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

// ---- optimizers --------------------------------------------------------------------

void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step) {
  const float inv_bias1 = 1.0f / (1.0f - std::pow(beta1, static_cast<float>(step)));
  const float inv_bias2 = 1.0f / (1.0f - std::pow(beta2, static_cast<float>(step)));
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grads[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    params[i] -= lr * (mi * inv_bias1 / (std::sqrt(vi * inv_bias2) + eps) + weight_decay * params[i]);
  }
}

void sgd_update(float* params, const float* grads, float* velocity, int64_t n, float lr,
                float momentum, float weight_decay) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float vel = momentum * velocity[i] + grads[i];
    velocity[i] = vel;
    params[i] -= lr * (vel + weight_decay * params[i]);
  }
}

}  // namespace mpipe::cpu
