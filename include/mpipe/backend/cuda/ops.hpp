// CUDA ops: the CPU ops (backend/cpu/ops.hpp) op for op, on device pointers, queued on
// the rank's compute stream (cuda::init() first). Same names, argument order, dimension
// vocabulary (N rows, B batch, T time, C channels, OC output channels, H heads,
// V vocabulary) and overwrite/accumulate rules; where an op differs, it says so.
//
// Element type `E` of activations, their gradients and the compute copy of the weights
// is float (fp32) or bf16; parameter gradients, optimizer state, LayerNorm statistics
// and the loss are always fp32 or wider, and every sum accumulates in fp32 at least.
//
// Every op is deterministic: no floating-point atomics, so a rerun, a recomputation and
// any stage count give bitwise the same results (promise 1 on the GPU).
// Plain C++17: this header is included by both g++ and nvcc sources.
#pragma once
#include <cstdint>

#include "mpipe/backend/op_types.hpp"
#include "mpipe/core/bf16.hpp"

namespace mpipe::cuda {

// out (N, OC) = inp (N, C) · weight (OC, C)^T + bias (OC); bias may be null. cuBLASLt
// with the bias in the epilogue. Overwrites out.
template <class E>
void matmul_forward(E* out, const E* inp, const E* weight, const E* bias, int64_t N, int64_t C, int64_t OC);
// As matmul_forward followed by gelu_forward, fused into the GEMM's epilogue: `pre`
// (N, OC) receives the pre-activation that gelu_backward needs, `out` the GELU of it.
template <class E>
void matmul_gelu_forward(E* out, E* pre, const E* inp, const E* weight, const E* bias, int64_t N, int64_t C,
                         int64_t OC);
// dinp (N, C) per mode (skipped when null); dweight (OC, C) and dbias (OC) accumulate in
// fp32 (dbias skipped when null).
template <class E>
void matmul_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     int64_t N, int64_t C, int64_t OC, GradMode mode);

template <class E>
void relu_forward(E* out, const E* inp, int64_t n);
template <class E>
void relu_backward(E* dinp, const E* dout, const E* out, int64_t n, GradMode mode);

// GELU, tanh approximation. dinp may alias dout.
template <class E>
void gelu_forward(E* out, const E* inp, int64_t n);
template <class E>
void gelu_backward(E* dinp, const E* dout, const E* inp, int64_t n, GradMode mode);

// LayerNorm over the last dimension, eps 1e-5; statistics in fp32.
template <class E>
void layernorm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias, int64_t N,
                       int64_t C);
// sum = residual + dropout(sum) (p 0: no dropout), then LayerNorm of it, one warp a row:
// the bits of dropout_apply, add and layernorm_forward in turn (the dropped value rounded
// to E before the sum, the sum before the statistics). Rows are samples of
// rows_per_sample rows, as dropout numbers them.
template <class E>
void residual_layernorm_forward(E* out, float* mean, float* rstd, E* sum, const E* residual, const E* weight,
                                const E* bias, int64_t N, int64_t C, int64_t rows_per_sample, float p,
                                const DropoutKey& key);
template <class E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, GradMode mode,
                        const E* residual = nullptr);

// RMSNorm over the last dimension (the CPU's rmsnorm_forward), statistics in fp32, one
// warp a row; the weight applied after the normalised value is rounded to E (Hugging
// Face's LlamaRMSNorm).
template <class E>
void rmsnorm_forward(E* out, float* rstd, const E* inp, const E* weight, int64_t N, int64_t C, float eps);
// residual_layernorm_forward's sum (its bits), then RMSNorm of it, in one pass.
template <class E>
void residual_rmsnorm_forward(E* out, float* rstd, E* sum, const E* residual, const E* weight, int64_t N, int64_t C,
                              int64_t rows_per_sample, float p, const DropoutKey& key, float eps);
// dinp per mode (with `residual`, mode overwrite: dinp = residual + the input gradient, as
// layernorm_backward); dweight accumulates in fp32 (deterministic: per-block partials
// summed in a fixed order).
template <class E>
void rmsnorm_backward(E* dinp, float* dweight, const E* dout, const E* inp, const E* weight, const float* rstd,
                      int64_t N, int64_t C, GradMode mode, const E* residual = nullptr);

// RoPE in place over qkv's queries and keys (the CPU's rope_apply: the same pairing, the
// angles, cosines and sines in double, rounded to fp32), the rotation in fp32, rounded to E.
template <class E>
void rope_apply(E* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t position, float theta,
                bool inverse);

// SwiGLU (the CPU's swiglu_forward and swiglu_backward), in fp32 arithmetic.
template <class E>
void swiglu_forward(E* out, const E* inp, int64_t N, int64_t F);
template <class E>
void swiglu_backward(E* dinp, const E* dout, const E* inp, int64_t N, int64_t F, GradMode mode);

// out (B, T, C) = wte[tokens] + wpe[t] (wpe null: none), then dropout (p > 0) in the same pass: the bits of
// dropout_apply after it. Tokens must be < V: the datasets check them when they load, and
// the device cannot report a bad one.
template <class E>
void embedding_forward(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t B, int64_t T, int64_t C,
                       int64_t V, float p = 0.0f, const DropoutKey& key = {});
// dwte (V, C) and dwpe (T, C; null: none) accumulate. Deterministic: positions are sorted by token
// (a stable radix sort), then each token's rows are summed in position order.
template <class E>
void embedding_backward(float* dwte, float* dwpe, const E* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V);

// Causal multi-head self-attention core, qkv (B, T, C + 2·KV) holding q, k, v side by side
// (grouped-query attention as the CPU op: KVH key/value heads, query head h reads head
// h / (H / KVH); KVH = H: qkv (B, T, 3C)).
// Differs from the CPU op in what it keeps for backward: the log-sum-exp of each score
// row, lse (B, H, T) in fp32, instead of the probabilities (B, H, T, T). Backward
// recomputes the scores from q and k, so the memory kept per call is O(B·H·T).
// Overwrites out (B, T, C) and lse.
template <class E>
void attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH);
// Overwrites dqkv (B, T, C + 2·KV). `out` is the forward's output. A key/value head's
// gradient is the sum over its group's query heads in a fixed order (no atomics).
template <class E>
void attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B, int64_t T,
                        int64_t C, int64_t H, int64_t KVH);

// Which engine bf16 attention runs on: `automatic` (the default), cuDNN's fused attention
// for each shape where cuDNN builds a deterministic plan and its first call agrees with
// the FlashAttention-2 kernel, the kernel elsewhere; `kernel`, the kernel always (as
// MPIPE_ATTENTION=flash). fp32 always runs the kernel.
enum class AttentionEngine { automatic, kernel };
void set_attention_engine(AttentionEngine engine);
// Whether calls of this shape and direction run on cuDNN (known after the first one).
bool attention_on_cudnn(int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, bool backward);

// Generation: the CPU's attention_decode (cpu/ops.hpp), one block per (sequence, head,
// query), the scores in shared memory (keys up to kMaxDecodeKeys).
inline constexpr int64_t kMaxDecodeKeys = 8192;
// qkv (B, rows, C + 2·KV) the new rows (their queries), cache (B, capacity, 2·KV) the keys
// and values so far (the new ones written).
template <class E>
void attention_decode(E* out, const E* qkv, const E* cache, int64_t B, int64_t rows, int64_t position,
                      int64_t capacity, int64_t C, int64_t H, int64_t KVH);

// Softmax cross-entropy over logits (outer, V, plane), laid out as the CPU op's (plane 1:
// rows (N, V), a block each; otherwise a thread per position, its V classes plane apart).
// Overwrites lse (outer * plane); adds the sum over rows of -log p(target) to *loss_sum
// (one double on the device), summed in a fixed order, unless loss_sum is null. Differs
// from the CPU op, which returns the sum: reading it back would stall the stream.
template <class E>
void crossentropy_forward(float* lse, double* loss_sum, const E* logits, const int32_t* targets, int64_t outer,
                          int64_t V, int64_t plane = 1);
// dlogits = scale * (softmax(logits) - onehot(target)), as logits. Overwrites; dlogits may
// be logits (each element read before it is written: a loss's gradient over its input).
template <class E>
void crossentropy_backward(E* dlogits, const E* logits, const float* lse, const int32_t* targets, float scale,
                           int64_t outer, int64_t V, int64_t plane = 1);

// A language-model head split over the vocabulary (vocab.cu), as the CPU ops
// (cpu/ops.hpp): the statistics (4, N) are fp32 (m, s, t, first argmax as a float), the
// logits z (N, V) of the chunk [v0, v0 + V) are E. One warp per row, the row's entries in
// a fixed order, so the bits do not depend on the launch; m, t and the argmax are the
// CPU's exactly, s within rounding (e^x is CUDA's expf, clamped as the CPU's). Overwrites
// out (which may be in).
template <class E>
void vocab_chunk_forward(float* out, const float* in, const E* z, const int32_t* targets, int64_t N, int64_t V,
                         int64_t v0);
// dz (N, V) overwritten, and may be z (each entry is read before it is written); din
// (4, N) per mode (skipped when null).
template <class E>
void vocab_chunk_backward(E* dz, float* din, const float* dout, const E* z, const float* in, const float* out,
                          const int32_t* targets, int64_t N, int64_t V, int64_t v0, GradMode mode);
// Adds the sum over rows of m + log s - t to *loss_sum (device; null: not counted), in a
// fixed order. Targets are not checked here (the datasets check them when they load).
void vocab_loss_forward(double* loss_sum, const float* stats, int64_t N);
// dstats (4, N): ds = scale / s, dt = -scale, dm = da = 0. Overwrites.
void vocab_loss_backward(float* dstats, const float* stats, float scale, int64_t N);

// ---- convolution, pooling and BatchNorm over NCHW (conv.cu, conv_dnn.cu) ---------------
// Convolution: forward, input gradient and weight gradient on cuDNN where it has a
// deterministic algorithm for the shape (fp32 without TF32 or transforms; in bf16 the
// weight gradient is rounded to bf16 before it is added to the fp32 one, as PyTorch's
// autocast does), else one GEMM per group over the whole micro-batch: the input unfolded
// into columns (C/g x KH x KW, N x OH x OW) in scratch(), then out = weight · columns. A conv
// layer holds nothing between its forward and backward. MPIPE_CONV=gemm: no cuDNN;
// MPIPE_CONV=verbose: each shape's choice on stderr. Overwrites out; bias may be null.
template <class E>
void conv2d_forward(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w);
// dinp per mode (skipped when null); dweight and dbias (null: none) accumulate in fp32.
template <class E>
void conv2d_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     const Window2d& w, GradMode mode);
// Channels last (NHWC activations; weights (OC, C/groups, KH, KW) as ever), on cuDNN's
// NHWC convolutions, its filters (OC, KH, KW, C/groups) swapped from the weights per
// call: false (nothing written) where cuDNN declines the shape or direction, which the
// caller then runs through channels first. The weight gradient comes back swapped and is
// added to the fp32 one (in bf16 rounded to bf16 first, as channels first).
template <class E>
bool conv2d_forward_last(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w);
template <class E>
bool conv2d_input_gradient_last(E* dinp, const E* dout, const E* weight, const Window2d& w, GradMode mode);
template <class E>
bool conv2d_weight_gradient_last(float* dweight, const E* dout, const E* inp, const Window2d& w);
// dbias (OC) += the column sums of dout (rows, OC), each channel's rows in a fixed order.
template <class E>
void conv2d_bias_gradient_last(float* dbias, const E* dout, int64_t rows, int64_t OC);
// As the CPU ops: argmax (N, C, OH, OW) keeps the input offset within its plane.
// Channels last (w.channels_last): every tensor NHWC, argmax (N, OH, OW, C), the same
// offsets and the same choice. The
// backward gathers, for each input element, the windows that chose it (no atomics).
template <class E>
void maxpool2d_forward(E* out, int32_t* argmax, const E* inp, const Window2d& w);
template <class E>
void maxpool2d_backward(E* dinp, const E* dout, const int32_t* argmax, const Window2d& w, GradMode mode);
template <class E>
void avgpool2d_forward(E* out, const E* inp, const Window2d& w);
template <class E>
void avgpool2d_backward(E* dinp, const E* dout, const Window2d& w, GradMode mode);
// Layout (layout.cu): the CPU ops' (cpu/ops.hpp), the same sums in the same order.
template <class E>
void copy_runs(E* dst, const E* src, const Runs& runs);
// Upsampling's elements are `inner` values side by side: 1 channels first (planes N C),
// C channels last (planes N, each position's channels copied and summed together).
template <class E>
void upsample_nearest_forward(E* out, const E* inp, int64_t planes, int64_t H, int64_t W, int64_t scale,
                              int64_t inner = 1);
template <class E>
void upsample_nearest_backward(E* dinp, const E* dout, int64_t planes, int64_t H, int64_t W, int64_t scale,
                               int64_t inner = 1);
// dst (N, B, A) = (or +=) src (N, A, B): an image between channels first and last.
template <class E>
void swap_inner(E* dst, const E* src, int64_t N, int64_t A, int64_t B, bool accumulate);
// BatchNorm per channel of (N, C, plane), the CPU op's math (statistics in double; each
// channel's sums split into segments of samples, one block each, added in segment order:
// an order fixed by the sizes). weight and bias are E, the statistics and
// running statistics fp32. Running statistics null: not moved. sums (1 + 2C doubles,
// device; null: none) gather the batch for the deferred rule, added in place.
template <class E>
void batchnorm_forward_train(E* out, float* mean, float* rstd, float* running_mean, float* running_var,
                             double* sums, const E* inp, const E* weight, const E* bias, int64_t N, int64_t C,
                             int64_t plane, float eps, float momentum, bool relu = false);
void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum);
template <class E>
void batchnorm_forward_eval(E* out, const E* inp, const E* weight, const E* bias, const float* running_mean,
                            const float* running_var, int64_t N, int64_t C, int64_t plane, float eps);
// dinp per mode (skipped when null); dweight and dbias accumulate.
template <class E>
void batchnorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane, GradMode mode);

// BatchNorm over channels-last (rows, C) (batchnorm_last.cu): the same statistics and
// rules, each channel's sums over segments of rows (a block a segment and 32 channels,
// partials added in segment order). Evaluation is batchnorm_forward_eval with N = rows,
// plane 1.
template <class E>
void batchnorm_forward_train_last(E* out, float* mean, float* rstd, float* running_mean, float* running_var,
                                  double* sums, const E* inp, const E* weight, const E* bias, int64_t rows, int64_t C,
                                  float eps, float momentum, bool relu);
template <class E>
void batchnorm_backward_last(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                             const float* mean, const float* rstd, int64_t rows, int64_t C, GradMode mode);

// Same masks as the CPU op, bit for bit (the same Philox4x32-10 words). out may alias inp.
template <class E>
void dropout_apply(E* out, const E* inp, int64_t B, int64_t per_sample, float p, const DropoutKey& key);
// out = base + dropout(branch) (p 0: base + branch) in one pass: dropout_apply then add,
// bit for bit. out may alias base or branch.
template <class E>
void add_dropped(E* out, const E* base, const E* branch, int64_t B, int64_t per_sample, float p,
                 const DropoutKey& key);

// y (+)= x, y = x, y *= factor.
template <class E>
void add(E* y, const E* x, int64_t n);
template <class E>
void copy(E* y, const E* x, int64_t n);
template <class E>
void scale(E* y, float factor, int64_t n);
// Precision casts, for the bf16 compute copy of fp32 master weights and for tests.
void convert(bf16* y, const float* x, int64_t n);
void convert(float* y, const bf16* x, int64_t n);

// Sums of squares in double of `count` spans (x + offsets[i], sizes[i] elements), into
// out[i] (device). One launch for all of a stage's parameter views; each sum in a fixed
// order. offsets and sizes are device arrays.
void sum_squares(double* out, const float* x, const int64_t* offsets, const int64_t* sizes, int count);

// AdamW and SGD over many parameter views in one launch each. Views are described by
// device arrays: param_offsets (into params), offsets (into grads), state_offsets, sizes and
// per-view weight decay. The update math is the CPU op's, in fp32.
struct ViewTable {
  const int64_t* param_offsets = nullptr;
  const int64_t* offsets = nullptr;
  const int64_t* state_offsets = nullptr;  // into the optimizer state (packed when sharded)
  const int64_t* sizes = nullptr;
  const float* weight_decay = nullptr;
  int count = 0;
  int64_t largest = 0;  // elements of the largest view
};
// `copy` (may be null): the bf16 compute copy of params, element for element, written in
// the same pass with each updated value (rounded to nearest even, convert's bits), so no
// second pass over the parameters follows an update.
void adamw_update(float* params, const float* grads, float* m, float* v, const ViewTable& views, float lr,
                  float beta1, float beta2, float eps, int64_t step, bf16* copy = nullptr);
void sgd_update(float* params, const float* grads, float* velocity, const ViewTable& views, float lr,
                float momentum, bf16* copy = nullptr);

}  // namespace mpipe::cuda
