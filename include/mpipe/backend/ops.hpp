// Ops on Tensors: one call site in the layers for both backends. Each function checks
// that its tensors share one device and one element type, then calls the CPU op
// (backend/cpu/ops.hpp) or the CUDA op (backend/cuda/ops.hpp) of that name. The
// overwrite/accumulate rules are those ops' rules.
//
// Element types: on the CPU everything is fp32. On the GPU activations, their gradients
// and the weights' compute copy are fp32 or bf16; parameter gradients and LayerNorm
// statistics are fp32.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mpipe/backend/op_types.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe::ops {

// The memory resource of a device for Arena, and whether device arenas are possible.
DeviceMemory device_memory(Device device);

// out (N, OC) = inp (N, C) · weight^T + bias; bias may be empty.
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias);
// dinp per mode, dweight and dbias accumulated; each may be empty (a split backward
// computes dinp alone, then dweight and dbias).
void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                     const Tensor& inp, const Tensor& weight, GradMode mode);
// GELU(inp · weight^T + bias) into out, keeping the pre-activation in `pre`: one fused
// GEMM epilogue on the GPU, the two ops in turn on the CPU.
void matmul_gelu_forward(const Tensor& out, const Tensor& pre, const Tensor& inp, const Tensor& weight,
                         const Tensor& bias);

void relu_forward(const Tensor& out, const Tensor& inp);
void relu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& out, GradMode mode);
void gelu_forward(const Tensor& out, const Tensor& inp);
void gelu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, GradMode mode);

void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& inp,
                       const Tensor& weight, const Tensor& bias);
// A residual block's sum and the LayerNorm after it in one pass: sum = residual +
// dropout(sum) (p 0: no dropout; masks by samples, as dropout_apply's), then out, mean and
// rstd as layernorm_forward(out, mean, rstd, sum, ...). The same bits as dropout_apply,
// add and layernorm_forward in turn, on either device.
void residual_layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& sum,
                                const Tensor& residual, float p, const DropoutKey& key, const Tensor& weight,
                                const Tensor& bias);
// With `residual` (mode overwrite): dinp = residual + the input gradient, in one pass, the
// bits of copying residual into dinp and accumulating (a residual block's sum of its two
// branches' gradients).
void layernorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                        const Tensor& inp, const Tensor& weight, const Tensor& mean, const Tensor& rstd,
                        GradMode mode, const Tensor& residual = Tensor{});

// RMSNorm (Llama's), rstd (N) fp32 on either device; the residual forms as LayerNorm's.
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
void residual_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& sum, const Tensor& residual,
                              float p, const DropoutKey& key, const Tensor& weight, float eps);
void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, GradMode mode, const Tensor& residual = Tensor{});

// RoPE in place over the queries and keys of qkv (B, T, C + 2·KV) at positions
// [position, position + T) (cpu/ops.hpp's rope_apply); `inverse` for their gradients.
void rope_apply(const Tensor& qkv, int64_t heads, int64_t kv_heads, int64_t position, float theta, bool inverse);

// SwiGLU: out (.., F) = silu(gate) · up of inp (.., 2F) = [gate | up]; dinp per mode.
void swiglu_forward(const Tensor& out, const Tensor& inp);
void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, GradMode mode);

// With p > 0, dropout after the sum (dropout_apply's bits): in the same pass on the GPU.
// wpe may be empty (no position table: RoPE's models); so may dwpe then.
void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& wte, const Tensor& wpe, float p = 0.0f,
                       const DropoutKey& key = {});
void embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& tokens);

// What the attention core keeps for backward: the scores' log-sum-exp (B, H, T), fp32,
// on either device (no (T, T) matrix is stored: the backward recomputes it tile by tile).
Shape attention_state_shape(int64_t B, int64_t H, int64_t T);
// qkv (B, T, C + 2·KV): `heads` query heads over C, key/value heads as many as qkv's
// width leaves (KV = (width - C) / 2; grouped-query attention where fewer than heads).
void attention_forward(const Tensor& out, const Tensor& state, const Tensor& qkv, int64_t heads);
// `out` is the forward's output (each row's dO·O).
void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& state);
// The key/value heads of a qkv of `width` over C channels in `heads` heads.
int64_t kv_heads_of(int64_t width, int64_t C, int64_t heads);

// Generation with a key/value cache: out (B, t, C) = the attention of the queries of qkv
// (B, t, C + 2·KV: the new rows, at positions [position, position + t)) over `cache`
// (B, capacity, 2·KV: the k and v rows of positions [0, position + t), the new ones
// written), each over the keys at or before it.
void attention_decode(const Tensor& out, const Tensor& qkv, const Tensor& cache, int64_t position, int64_t heads);

// How a loss reads its logits as rows of classes, each with a target: rows of the last
// axis (.., V), or, for (N, C, H, W), a row of C classes per pixel, read where it lies
// (classes plane apart: outer N, plane H·W). Row o · plane + p is position p of block o.
struct ClassRows {
  int64_t outer = 0, classes = 0, plane = 1;
  int64_t rows() const { return outer * plane; }
};
ClassRows class_rows(const Shape& logits);

// Softmax cross-entropy over class_rows(logits.shape): lse gets each row's log-sum-exp;
// the summed -log p(target) of the rows. The CPU returns it; the GPU adds it to
// *device_loss_sum (one double in device memory; null: not counted) and returns 0, so
// that nothing waits for the GPU here.
double crossentropy_forward(const Tensor& lse, const Tensor& logits, const Tensor& targets,
                            double* device_loss_sum);
// dlogits (logits' shape; may be logits) = scale (softmax - onehot(target)).
void crossentropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                           float scale);

// Rows (class_rows) whose largest entry is at the target: for accuracy. On a GPU the
// logits and targets are copied to the host first (evaluation only).
int64_t count_correct(const Tensor& logits, const Tensor& targets);

// A language-model head split over the vocabulary (cpu/ops.hpp has the rules); the
// statistics are (4, N) fp32 on either device, z and dz the activations' type. The loss
// is returned on the CPU; on a GPU it is added to *device_loss_sum (as cross-entropy).
void vocab_chunk_forward(const Tensor& out, const Tensor& in, const Tensor& z, const Tensor& targets, int64_t v0);
void vocab_chunk_backward(const Tensor& dz, const Tensor& din, const Tensor& dout, const Tensor& z, const Tensor& in,
                          const Tensor& out, const Tensor& targets, int64_t v0, GradMode mode);
double vocab_loss_forward(const Tensor& stats, const Tensor& targets, int64_t vocab, double* device_loss_sum);
void vocab_loss_backward(const Tensor& dstats, const Tensor& stats, float scale);
int64_t vocab_count_correct(const Tensor& stats, const Tensor& targets);

// Over the first dimension as samples.
void dropout_apply(const Tensor& out, const Tensor& inp, float p, const DropoutKey& key);
// out = base + dropout(branch) (p 0: base + branch) in one pass, the bits of dropout_apply
// then add; out may be base or branch.
void add_dropped(const Tensor& out, const Tensor& base, const Tensor& branch, float p, const DropoutKey& key);

// y = x in y's element type (fp32 <-> bf16 on the GPU); a plain copy when they agree.
void convert(const Tensor& y, const Tensor& x);
void add(const Tensor& y, const Tensor& x);
void copy(const Tensor& y, const Tensor& x);
void zero(const Tensor& y);
// y *= factor (fp32).
void scale(const Tensor& y, float factor);
// y = x between memories (host and device, either way, or within one); the host waits
// until it is done. Nothing to do where they are one memory.
void transfer(const Tensor& y, const Tensor& x);

// Sums of squares (in double) of fixed spans of one fp32 buffer, each in a fixed order:
// on the CPU one pass per span, on a GPU one launch for all of them and one copy back.
// Made once for the spans, so that a step allocates nothing.
class SpanSums {
 public:
  SpanSums();
  SpanSums(Device device, std::span<const std::int64_t> offsets, std::span<const std::int64_t> sizes);
  SpanSums(SpanSums&&) noexcept;
  SpanSums& operator=(SpanSums&&) noexcept;
  ~SpanSums();
  // Of `x`'s spans, in the order given; valid until the next call.
  std::span<const double> sums(const Tensor& x);

 private:
  Device device_ = Device::cpu;
  std::vector<std::int64_t> offsets_, sizes_;
  std::vector<double> host_;
  struct OnDevice;
  std::unique_ptr<OnDevice> gpu_;
};

}  // namespace mpipe::ops
