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

// Token + learned position embedding: tokens (B, T) int32 -> (B, T, C), then dropout.
class Embedding final : public Layer {
 public:
  Embedding(int64_t vocab, int64_t max_seq, int64_t channels, float dropout);
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
  bool fuse_;  // the dropout in the embedding's pass on a GPU (fusions_on())
  Tensor wte_, wpe_, dwte_, dwpe_;
};

// Causal multi-head self-attention: qkv projection, attention core, output projection.
class CausalSelfAttention final : public Layer {
 public:
  CausalSelfAttention(int64_t channels, int64_t heads, float init_std, float proj_std);
  std::string kind() const override { return "attention"; }
  bool defers_weight() const override { return true; }
  void set_global_index(int index) override;
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  int64_t heads() const { return heads_; }
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
  int64_t channels_, heads_;
  Linear qkv_, proj_;
};

// Pre-LayerNorm transformer block: x + drop(attn(ln1(x))), then + drop(mlp(ln2(.))),
// the MLP being Linear(C, 4C), GELU, Linear(4C, C). Under --remat selective the forward
// keeps neither LayerNorm's output nor GELU's (6 of its 16 (B, T, C) activations); the
// backward recomputes them from the kept inputs, bitwise the same values.
class TransformerBlock final : public Layer {
 public:
  TransformerBlock(int64_t channels, int64_t heads, float dropout, float init_std, float proj_std);
  std::string kind() const override { return "block"; }
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
  int64_t channels_;
  LayerNorm ln1_, ln2_;
  CausalSelfAttention attn_;
  Linear fc_, fc_proj_;
  GELU gelu_;
  float dropout_;
  bool fuse_;  // the residual sum and ln2 in one pass (fusions_on())
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> transformer_layer_kinds();

}  // namespace mpipe
