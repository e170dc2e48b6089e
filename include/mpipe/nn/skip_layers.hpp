// Skips: a layer's output stashed under a name (`stash = "name"` in a model file) and
// taken by a later layer (`from = "name"`) that joins it to its own input: `concat` along
// the channels (U-Net's decoder taking the encoder's features) or `add`. The stashed
// tensor reaches its consumer through Pass::skips, its gradient goes back through
// Pass::skip_grads; the stage (pipeline/run/stage.cpp) fills both, sending a skip that
// crosses stages straight from its producer's rank to its consumer's. And `upsample2d`,
// a decoder's nearest upsampling.
#pragma once
#include <string>
#include <vector>

#include "mpipe/nn/layer.hpp"

namespace mpipe {

// The channel axis of a join: 1 of (N, C, H, W) images, else the last.
int join_axis(const Shape& shape);

class SkipJoin final : public Layer {
 public:
  enum class Op { concat, add };
  // `skip`: the stashed tensor's shape (batch 1), checked against the input's.
  SkipJoin(Op op, std::string from, Shape skip) : op_(op), from_(std::move(from)), skip_(skip) {}

  std::string kind() const override { return op_ == Op::concat ? "concat" : "add"; }
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;

  const std::string& from() const { return from_; }
  // The model's index of its skip (Model::skips()), set when the model resolves names.
  int skip() const { return skip_index_; }
  void set_skip(int index) { skip_index_ = index; }
  // The stashed tensor's shape for a micro-batch of `batch` (that of `in`).
  Shape skip_shape(const Shape& in) const;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) override;

 private:
  // The runs of x's (skip: the skip's) part of the output, for concat; channels last, an
  // image's runs are each position's channels.
  Runs runs(const Shape& in, bool skip, bool channels_last) const;
  Op op_;
  std::string from_;
  Shape skip_;  // batch 1
  int skip_index_ = -1;
};

class Upsample2d final : public Layer {
 public:
  explicit Upsample2d(std::int64_t scale) : scale_(scale) {}
  std::string kind() const override { return "upsample2d"; }
  Shape output_shape(const Shape& in) const override { return Shape{in[0], in[1], in[2] * scale_, in[3] * scale_}; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) override;

 private:
  std::int64_t scale_;
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> skip_layer_kinds();

}  // namespace mpipe
