// The transformer's layers: token and position embedding, causal self-attention, and
// the pre-LN block around them.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"
#include "mpipe/nn/dense_layers.hpp"

namespace mpipe {

// Token embedding, plus a learned position embedding unless `learned_positions` is off
// (RoPE's models rotate inside attention instead): tokens (B, T) int32 -> (B, T, C), then
// dropout.
class Embedding final : public Layer {
 public:
  Embedding(int64_t vocab, int64_t max_seq, int64_t channels, float dropout, bool learned_positions = true);
  std::string kind() const override { return "embedding"; }
  DType input_dtype() const override { return DType::i32; }
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t vocab_, max_seq_, channels_;
  float dropout_;
  bool learned_positions_;
  bool fuse_;  // the dropout in the embedding's pass on a GPU (fusions_on())
  Tensor wte_, wpe_, dwte_, dwpe_;
};

// What shapes an attention layer beyond its channels: GPT-2's by default; Llama's with
// fewer key/value heads (grouped-query attention), RoPE and no biases.
struct AttentionOptions {
  int64_t heads = 1;
  int64_t kv_heads = 0;  // 0: heads (multi-head attention)
  bool rope = false;     // rotate q and k by position (the embedding then has no position table)
  float rope_theta = 10000.0f;
  bool bias = true;      // on the projections
  float init_std = 0.02f, proj_std = 0.02f;
};

// Causal self-attention: qkv projection (C -> C + 2 KV: q, then k and v of the kv_heads),
// RoPE on q and k where asked, attention core, output projection.
class CausalSelfAttention final : public Layer {
 public:
  CausalSelfAttention(int64_t channels, const AttentionOptions& options);
  std::string kind() const override { return "attention"; }
  bool defers_weight() const override { return true; }
  void set_global_index(int index) override;
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  int64_t heads() const { return heads_; }
  int64_t kv_heads() const { return kv_heads_; }
  // Its keys and values, rotated where RoPE is on: 2 KV, kv_heads / heads of 2C.
  std::int64_t cache_width() const override { return qkv_width() - channels_; }
  // The qkv projection's width: C + 2 KV (3C with every head its own keys and values).
  int64_t qkv_width() const { return channels_ + 2 * kv_heads_ * (channels_ / heads_); }
  // What a forward kept for the attention's backward, dead once backward() has run (its
  // memory lives as long as the forward's): the (B, H, T) log-sum-exp, fp32.
  static const Tensor& state(const Context& ctx) { return ctx.saved[1]; }
  // --remat selective: the input the forward let go, recomputed, for the backward (the
  // qkv projection's weight gradient reads it).
  static void rebind_input(Context& ctx, const Tensor& x) {
    ctx.input = x;
    ctx.children[0].input = x;
  }

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t channels_, heads_, kv_heads_;
  bool rope_;
  float rope_theta_;
  Linear qkv_, proj_;
};

// A block's choices beyond its attention's: GPT-2's (LayerNorm, GELU MLP of 4C) by
// default, Llama's with RMSNorm and a SwiGLU MLP.
struct BlockOptions {
  AttentionOptions attention;
  NormKind norm = NormKind::layer;
  float norm_eps = 1e-5f;  // RMSNorm's
  bool swiglu = false;     // the MLP: down(silu(gate(x)) · up(x)), else fc_proj(GELU(fc(x)))
  int64_t ffn = 0;         // the MLP's hidden width (0: 4C)
  float dropout = 0.0f;
};

// Pre-norm transformer block: x + drop(attn(norm1(x))), then + drop(mlp(norm2(.))), the
// MLP being Linear(C, F), GELU, Linear(F, C) (GPT-2, F = 4C), or Linear(C, 2F) giving
// [gate | up], SwiGLU, Linear(F, C) (Llama). Under --remat selective the forward keeps
// neither norm's output nor the activation's (6 of GPT-2's 16 (B, T, C) activations);
// the backward recomputes them from the kept inputs, bitwise the same values.
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(int64_t channels, const BlockOptions& options);
  std::string kind() const override { return "block"; }
  std::int64_t cache_width() const override { return attn_.cache_width(); }
  bool defers_weight() const override { return true; }
  void set_global_index(int index) override;
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t channels_, ffn_;
  bool swiglu_;
  LayerNorm ln1_, ln2_;
  CausalSelfAttention attn_;
  Linear fc_, fc_proj_;
  GELU gelu_;
  SwiGLU swiglu_act_;
  Layer& activation() { return swiglu_ ? static_cast<Layer&>(swiglu_act_) : gelu_; }
  float dropout_;
  bool fuse_;  // the residual sum and ln2 in one pass (fusions_on())
};

// Llama's MLP width for C channels: int(8C/3) rounded up to a multiple of 256 (Meta's
// multiple_of); block's default with mlp = "swiglu", the llama preset's --ffn default.
std::int64_t llama_ffn(std::int64_t channels);

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> transformer_layer_kinds();

}  // namespace mpipe
