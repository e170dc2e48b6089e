// Residual blocks: y = inner(x) + skip(x).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"

namespace mpipe {

// A residual block: y = inner(x) + skip(x), inner a list of layers (a model file's
// [[layer.layer]] tables), skip the identity or, where inner changes the shape, a
// projection (a 1x1 convolution with stride for images, a linear map otherwise; no bias),
// optionally followed by a BatchNorm (ResNet's downsample path).
// Its parameters are the inner layers' under "<i>.", the projection's under "skip." and
// the projection's BatchNorm's under "skip_norm.".
class Residual final : public Layer {
 public:
  // `skip`: empty (the identity), {projection} or {projection, norm}.
  Residual(std::vector<std::unique_ptr<Layer>> inner, std::vector<std::unique_ptr<Layer>> skip);
  std::string kind() const override { return "residual"; }
  bool defers_weight() const override { return true; }
  bool output_reusable() const override { return true; }  // its backward reads its parts' contexts
  void set_global_index(int index) override;
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  void parts(std::vector<Layer*>& out) override;
  int fusions() const override { return fusions_; }

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  std::vector<std::unique_ptr<Layer>> inner_;
  std::vector<std::unique_ptr<Layer>> skip_;  // empty: the identity
  bool sums_in_place() const;
  // --remat selective: inner part i's output is left to the transient arena and
  // recomputed in backward (an output_recomputable() part before the inner path's last,
  // whose output the sum takes: the inner BatchNorm and ReLU).
  bool light(std::size_t i) const { return i + 1 < inner_.size() && inner_[i]->output_recomputable(); }
  bool gives_back_skip() const;
  int fusions_ = 0;  // BatchNorm + ReLU pairs of its chains (mark_fusions)
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> residual_layer_kinds();

}  // namespace mpipe
