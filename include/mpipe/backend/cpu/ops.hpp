// CPU ops: the numerical reference of mpipe. Free functions in pairs,
// <op>_forward / <op>_backward, outputs first, then inputs, then sizes, with the
// dimension vocabulary used everywhere: N rows, B batch, T time, C channels, OC output
// channels, H heads, V vocabulary. GEMMs go through BLAS (cblas_sgemm); everything
// else is an OpenMP loop whose reduction order does not depend on the thread count.
//
// Which outputs are overwritten and which are accumulated is stated per function:
// parameter gradients are always accumulated (+=), so micro-batches sum into them;
// input gradients follow `mode`.
#pragma once
#include <cstdint>

#include "mpipe/backend/op_types.hpp"

namespace mpipe::cpu {

using mpipe::DropoutKey;
using mpipe::GradMode;

// Threads for our loops and for BLAS; called once at start-up.
void set_threads(int threads);
int threads();
// Whether a loop on the calling thread can split across threads: its team would have more
// than one (not inside another loop's team, where a nested region is a team of one).
bool threads_here();

// f(i) for i in [0, n): split across the threads where `parallel`, else a plain loop.
// Not `omp parallel for if (...)`: a region whose condition is false still enters the
// OpenMP runtime (a team of one), and loops that run per sample and group paid that
// each time (the small CNN lost 2-3% of its step to it). Each f(i) is independent, so
// the bits are the same either way.
template <class F>
void for_each_index(bool parallel, int64_t n, F f) {
  if (!parallel) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) f(i);
}

// out (N, OC) = inp (N, C) · weight (OC, C)^T + bias (OC); bias may be null. Overwrites out.
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias,
                    int64_t N, int64_t C, int64_t OC);
// dinp (N, C) per mode (skipped when null); dweight (OC, C) and dbias (OC) accumulate
// (dbias skipped when null; both when dweight is: the input gradient of a split backward).
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                     const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC,
                     GradMode mode);

// out = max(inp, 0). Overwrites out (may alias inp).
void relu_forward(float* out, const float* inp, int64_t n);
// dinp = dout * (out > 0), per mode; `out` is the forward's output.
void relu_backward(float* dinp, const float* dout, const float* out, int64_t n, GradMode mode);

// GELU, tanh approximation (GPT-2's). Overwrites out.
void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* dout, const float* inp, int64_t n, GradMode mode);

// LayerNorm over the last dimension, eps 1e-5. Overwrites out (N, C), mean (N), rstd (N).
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                       const float* weight, const float* bias, int64_t N, int64_t C);
// A residual block's sum and the LayerNorm after it: sum (N, C) = residual + dropout(sum)
// (add_dropped; p 0: no dropout; the N rows are samples of rows_per_sample rows each, as
// dropout numbers them), then out, mean and rstd as layernorm_forward of that sum. The
// GPU's op does it in one pass; here the two run in turn (rows in cache: no faster fused).
void residual_layernorm_forward(float* out, float* mean, float* rstd, float* sum, const float* residual,
                                const float* weight, const float* bias, int64_t N, int64_t C,
                                int64_t rows_per_sample, float p, const DropoutKey& key);
// dinp per mode; dweight, dbias accumulate.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout,
                        const float* inp, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C, GradMode mode);

// RMSNorm over the last dimension (Llama's): out = inp · rstd · weight, rstd = 1 /
// sqrt(mean(inp²) + eps), summed in a fixed order. Overwrites out (N, C) and rstd (N).
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
// residual_layernorm_forward's sum, then rmsnorm_forward of it.
void residual_rmsnorm_forward(float* out, float* rstd, float* sum, const float* residual, const float* weight,
                              int64_t N, int64_t C, int64_t rows_per_sample, float p, const DropoutKey& key, float eps);
// dinp per mode; dweight accumulates.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradMode mode);

// Rotary position embedding (RoPE, Hugging Face's rotate-half pairing) in place over the
// queries and keys of qkv (B, T, C + 2·KV): q is the row's first C = H·hs values, k the
// next KV = KVH·hs, v (untouched) the last KV. Within a head of hs values, i < hs/2 pairs
// with i + hs/2: (x_i, x_{i+hs/2}) is rotated by the angle (position + t) · theta^(-2i/hs)
// (cos and sin computed in double, rounded to fp32). `inverse`: rotated back, the
// gradient of the rotation (the backward of dq, dk).
void rope_apply(float* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t position, float theta,
                bool inverse);

// SwiGLU (Shazeer 2020, Llama's MLP): out (N, F) = silu(gate) · up, where inp (N, 2F) holds
// each row's gate (first F) and up (last F). Overwrites out.
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t F);
// dinp (N, 2F) per mode: dgate = dout · up · silu'(gate), dup = dout · silu(gate).
void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t F, GradMode mode);

// out (B, T, C) = wte[tokens] + wpe[t] (wpe null: no position table). Overwrites out. Tokens are checked < V.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                       int64_t B, int64_t T, int64_t C, int64_t V);
// dwte (V, C) and dwpe (T, C; null: none) accumulate.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens,
                        int64_t B, int64_t T, int64_t C);

// Causal multi-head self-attention core, FlashAttention's algorithm: no (T, T) matrix is
// ever stored. qkv (B, T, C + 2·KV) holds q (H heads of hs = C / H), k and v (KVH heads
// each, KV = KVH·hs) side by side; query head h reads key/value head h / (H / KVH)
// (grouped-query attention; KVH = H: multi-head, 1: multi-query; qkv then (B, T, 3C)).
// The forward runs over tiles of queries and keys with an online softmax and overwrites
// out (B, T, C) and lse (B, H, T), each row's log-sum-exp of its scaled scores (kept for
// backward).
void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                       int64_t KVH);
// Overwrites dqkv (B, T, C + 2·KV), recomputing the probabilities tile by tile from q, k
// and lse; `out` is the forward's output (for each row's dO·O). A key/value head's
// gradient sums its group's query heads in ascending order.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH);

// Generation with a key/value cache (cpu/decode.cpp): qkv (B, rows, C + 2·KV) the new
// rows (their queries read here), cache (B, capacity, 2·KV) the k and v rows of positions
// [0, position + rows) of B sequences (the new ones written already); out (B, rows, C)
// gets the attention of queries [position, position + rows), each over the keys at or
// before it. No log-sum-exp is kept (nothing runs backward). Overwrites out.
void attention_decode(float* out, const float* qkv, const float* cache, int64_t B, int64_t rows, int64_t position,
                      int64_t capacity, int64_t C, int64_t H, int64_t KVH);

// Softmax cross-entropy (loss.cpp) over rows of V classes: logits (outer, V, plane), row
// o * plane + p the classes of position p (plane 1: rows (N, V); a per-pixel loss: (N, C,
// H, W) as (N, C, H * W)). The same bits in either layout. Overwrites lse (outer * plane)
// with each row's log-sum-exp; returns the sum over rows of -log p(target), accumulated in
// row order. Targets (outer * plane) are checked < V.
double crossentropy_forward(float* lse, const float* logits, const int32_t* targets, int64_t outer, int64_t V,
                            int64_t plane = 1);
// dlogits = scale * (softmax(logits) - onehot(target)), laid out as logits. Overwrites;
// dlogits may be logits (each element read before it is written: a loss's gradient over
// its input).
void crossentropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets, float scale,
                           int64_t outer, int64_t V, int64_t plane = 1);
// Rows (laid out as crossentropy_forward's) whose largest logit, the first of equal ones,
// is the target's: accuracy.
int64_t count_correct(const float* logits, const int32_t* targets, int64_t outer, int64_t V, int64_t plane = 1);

// A language-model head split over the vocabulary (nn/vocab_layers.hpp; vocab.cpp): each chunk's
// logits z (N, V) for vocabulary entries [v0, v0 + V) update per-row statistics, kept as
// four arrays of N: the running maximum m, the sum s of e^(z - m) so far, the target's
// logit t (0 until its chunk) and the index a of the first largest logit, as a float.
// `in`: the statistics so far, null for the first chunk. Overwrites `out`.
void vocab_chunk_forward(float* out, const float* in, const float* z, const int32_t* targets, int64_t N, int64_t V,
                         int64_t v0);
// From the gradient `dout` of the statistics out (only ds and dt are non-zero; m is a
// stabiliser, the loss does not depend on it): dz (N, V) = ds e^(z - m_out) + dt at the
// target, overwritten (dz may be z: each entry is read before it is written); and,
// unless `din` is null, the gradient of the statistics in: ds e^(m_in - m_out) and dt,
// by `mode`.
void vocab_chunk_backward(float* dz, float* din, const float* dout, const float* z, const float* in, const float* out,
                          const int32_t* targets, int64_t N, int64_t V, int64_t v0, GradMode mode);
// The loss from the last chunk's statistics: the sum over rows of m + log s - t, in a
// fixed order. Targets are checked < vocab.
double vocab_loss_forward(const float* stats, const int32_t* targets, int64_t N, int64_t vocab);
// dstats (4 N): ds = scale / s, dt = -scale, dm = da = 0. Overwrites.
void vocab_loss_backward(float* dstats, const float* stats, float scale, int64_t N);
// Rows whose first largest logit (the statistics' a) is the target.
int64_t vocab_count_correct(const float* stats, const int32_t* targets, int64_t N);

// out = inp * mask / (1 - p) over B samples of per_sample elements each. Overwrites out
// (may alias inp). The backward is the same call on the gradient.
void dropout_apply(float* out, const float* inp, int64_t B, int64_t per_sample, float p,
                   const DropoutKey& key);

// out = base + dropout(branch) (p 0: base + branch) in one pass, the bits of dropout_apply
// then add; out may alias base or branch.
void add_dropped(float* out, const float* base, const float* branch, int64_t B, int64_t per_sample, float p,
                 const DropoutKey& key);

// ---- convolution and pooling over NCHW (conv.cpp) ------------------------------------
using mpipe::Window2d;
// out (N, OC, OH, OW) = conv(inp, weight (OC, C/g, KH, KW)) + bias (OC; may be null),
// per sample and group, through im2col and GEMMs or (conv2d_shifted) register tiles over
// the padded planes; with threads, samples side by side (one per thread, each its own
// columns). `cols` is scratch of conv2d_cols(w) floats (it grows with threads()).
// Overwrites out.
int64_t conv2d_cols(const Window2d& w);
// Whether the window takes the shifted-plane path (stride 1, 16 to 1152 taps a group, planes
// of 8 columns or more for 3x3): no im2col; sums of runs of the zero-padded planes, tiled
// in registers (conv.cpp). Chosen by the window alone: the same for any thread count.
bool conv2d_shifted(const Window2d& w);
void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                    const Window2d& w);
// dinp per mode (skipped when null); dweight and dbias (null: none; both when dweight
// is, the input gradient of a split backward) accumulate, over the samples in order.
void conv2d_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, float* cols, const Window2d& w, GradMode mode);
// Max over each window (padding counts as -inf); `argmax` (N, C, OH, OW) keeps the
// input offset within its (n, c) plane for backward. Overwrites out and argmax.
void maxpool2d_forward(float* out, int32_t* argmax, const float* inp, const Window2d& w);
void maxpool2d_backward(float* dinp, const float* dout, const int32_t* argmax, const Window2d& w, GradMode mode);
// Mean over each window, padding counted as zeros (PyTorch's count_include_pad).
void avgpool2d_forward(float* out, const float* inp, const Window2d& w);
void avgpool2d_backward(float* dinp, const float* dout, const Window2d& w, GradMode mode);
// Layout (cpu/layout.cpp): runs copied (Runs); nearest upsampling of `planes` H x W planes
// by `scale` (each input element fills a scale x scale block) and its gradient, each
// element the sum of its block's in (row, column) order.
void copy_runs(float* dst, const float* src, const Runs& runs);
void upsample_nearest_forward(float* out, const float* inp, std::int64_t planes, std::int64_t H, std::int64_t W,
                              std::int64_t scale);
void upsample_nearest_backward(float* dinp, const float* dout, std::int64_t planes, std::int64_t H, std::int64_t W,
                               std::int64_t scale);
// dst (N, B, A) = src (N, A, B) with its inner two axes swapped (an image between
// channels first and channels last: A, B = C, H W or H W, C); accumulate adds to dst.
void swap_inner(float* dst, const float* src, std::int64_t N, std::int64_t A, std::int64_t B, bool accumulate);


// BatchNorm over (N, C, plane) per channel, eps inside the root. Training: the batch's
// mean and biased variance (mean, rstd (C) kept for backward); running statistics, when
// given, move by `momentum` toward the batch's (the variance unbiased, as PyTorch).
// `sums`, when given (1 + 2C), gathers the batch for deferred statistics: [0] += the
// values per channel, [1 + c] += their sum, [1 + C + c] += the sum of their squares.
// Inference: the running statistics. Both overwrite out.
void batchnorm_forward_train(float* out, float* mean, float* rstd, float* running_mean, float* running_var,
                             double* sums, const float* inp, const float* weight, const float* bias, int64_t N,
                             int64_t C, int64_t plane, float eps, float momentum, bool relu = false);
// Running statistics moved by `momentum` toward those of the batch gathered in `sums`.
void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum);
void batchnorm_forward_eval(float* out, const float* inp, const float* weight, const float* bias,
                            const float* running_mean, const float* running_var, int64_t N, int64_t C, int64_t plane,
                            float eps);
// dinp per mode; dweight and dbias accumulate.
void batchnorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane,
                        GradMode mode);

// y (+)= x
void add(float* y, const float* x, int64_t n);
void copy(float* y, const float* x, int64_t n);
void scale(float* y, float factor, int64_t n);
// Sum of squares in double, in a fixed order (chunked per 4096 elements).
double sum_squares(const float* x, int64_t n);

// AdamW with decoupled weight decay; `step` counts from 1.
void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n, float lr,
                  float beta1, float beta2, float eps, float weight_decay, int64_t step);
// SGD with (heavy-ball) momentum and decoupled weight decay.
void sgd_update(float* params, const float* grads, float* velocity, int64_t n, float lr,
                float momentum, float weight_decay);

}  // namespace mpipe::cpu
