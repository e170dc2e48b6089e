// Dense layers: linear maps, activations, layer normalisation, dropout, and the loss.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"

namespace mpipe {

// y (.., OC) = x (.., C) · W^T + b, W stored (OC, C) as PyTorch does.
class Linear final : public Layer {
 public:
  Linear(int64_t in, int64_t out, bool bias, float init_std);
  std::string kind() const override { return "linear"; }
  bool defers_weight() const override { return true; }
  bool keeps_dy() const override { return true; }
  bool reads_output_in_backward() const override { return false; }  // its input and weight
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  // GELU(forward(x)) in one call (a fused GEMM epilogue on a GPU). Fills this layer's
  // context and `gelu_ctx` exactly as forward() and then GELU::forward() would.
  Tensor forward_gelu(const Tensor& x, Context& ctx, Context& gelu_ctx, const Pass& pass);
  // For composite layers: prefix parameter names and tie the weight to another layer.
  void tie_weight(int layer, std::string name) { tied_layer_ = layer; tied_name_ = std::move(name); }

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t in_, out_;
  bool has_bias_;
  float init_std_;
  int tied_layer_ = -1;
  std::string tied_name_;
  Tensor weight_, bias_, dweight_, dbias_;
};

class ReLU final : public Layer {
 public:
  std::string kind() const override { return "relu"; }
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  // Its backward reads only its output: over its input, it keeps no memory of its own.
  void allow_in_place(bool allowed) override { in_place_ = allowed; }
  bool writes_over_input() const override { return in_place_; }
  bool output_recomputable() const override { return true; }
  bool rectifies_in_place() const override { return in_place_; }
  void input_rectified(bool on) override { input_rectified_ = on; }

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
 private:
  bool in_place_ = false;
  bool input_rectified_ = false;  // a training forward's input comes rectified (mark_fusions)
};

class GELU final : public Layer {
 public:
  std::string kind() const override { return "gelu"; }
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
};

// SwiGLU (Llama's MLP activation): (.., 2F) = [gate | up] -> (.., F) = silu(gate) · up.
class SwiGLU final : public Layer {
 public:
  std::string kind() const override { return "swiglu"; }
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
};

// Normalisation over the channels: LayerNorm ((x - mean) / std · weight + bias, eps 1e-5)
// or RMSNorm (x / sqrt(mean(x²) + eps) · weight, no bias: Llama's), statistics in fp32.
enum class NormKind { layer, rms };

class LayerNorm final : public Layer {
 public:
  explicit LayerNorm(int64_t channels, NormKind norm = NormKind::layer, float eps = 1e-5f)
      : channels_(channels), norm_(norm), eps_(eps) {}
  std::string kind() const override { return norm_ == NormKind::rms ? "rmsnorm" : "layernorm"; }
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  // backward(ctx, dy, dx, overwrite) with dx = residual + the input gradient, in one pass
  // (a residual block's two branches; the bits of copying residual into dx and
  // accumulating).
  void backward_onto(Context& ctx, const Tensor& dy, const Tensor& dx, const Tensor& residual);
  // A residual block's sum and this LayerNorm after it, in one pass: `sum` becomes
  // residual + dropout(sum) (p 0: no dropout; `key` its masks), and the result is
  // forward(sum) then, bit for bit, with the context keeping the sum as its input.
  Tensor forward_sum(const Tensor& sum, const Tensor& residual, float p, const DropoutKey& key, Context& ctx,
                     const Pass& pass);

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  // The output and statistics of x (after residual + dropout(x) into x where residual
  // is given).
  Tensor normalize(const Tensor& x, const Tensor& residual, float p, const DropoutKey& key, Context& ctx,
                   const Pass& pass);
  int64_t channels_;
  NormKind norm_;
  float eps_;  // RMSNorm's (LayerNorm's op has its own 1e-5)
  Tensor weight_, bias_, dweight_, dbias_;
};

// Inverted dropout with counter-based masks; `site` tells apart the dropouts of one
// global layer. The mask is recomputed in backward, never stored.
class Dropout final : public Layer {
 public:
  Dropout(float p, int site) : p_(p), site_(site) {}
  std::string kind() const override { return "dropout"; }
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  float p_;
  int site_;
};

// The mask key of dropout site `site` of global layer `layer` in this pass.
DropoutKey dropout_key(const Pass& pass, int layer, int site);

// Softmax cross-entropy over the last dimension against pass.targets. Its output is the
// micro-batch's summed loss, shape (1); backward ignores dy and writes
// dlogits = loss_scale * (softmax - onehot).
class CrossEntropyLoss final : public Layer {
 public:
  std::string kind() const override { return "cross_entropy"; }
  bool needs_targets() const override { return true; }
  // Rows of logits, or a row per pixel: each element's gradient from that element alone.
  bool gradient_over_input(const Shape& in) const override { return true; }
  Shape output_shape(const Shape& in) const override { return Shape{1}; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> dense_layer_kinds();

}  // namespace mpipe
