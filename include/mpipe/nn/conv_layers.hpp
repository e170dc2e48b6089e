// Convolutional layers over (N, C, H, W) tensors, NCHW in memory or NHWC under
// --channels-last on (Pass::channels_last): conv2d, max and average pooling, global
// average pooling, flatten, BatchNorm; on the CPU and the GPU (backend/cuda/conv.cu).
#pragma once
#include <algorithm>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/nn/layer.hpp"

namespace mpipe {

// y (N, out, OH, OW) = conv(x (N, C, H, W), weight (out, C/groups, k, k)) + bias,
// OH = (H + 2 padding - k) / stride + 1.
class Conv2d final : public Layer {
 public:
  Conv2d(int64_t channels, int64_t out, int64_t kernel, int64_t stride, int64_t padding, int64_t groups, bool bias,
         float init_std);
  std::string kind() const override { return "conv2d"; }
  bool output_reusable() const override { return true; }  // its backward reads its input
  bool output_last() const override { return true; }  // its columns are given back
  bool defers_weight() const override { return true; }
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  Window2d window(const Shape& in) const;
  Window2d window(const Shape& in, const Pass& pass) const;  // with the pass's layout
  int64_t channels_, out_, kernel_, stride_, padding_, groups_;
  bool has_bias_;
  float init_std_;
  Tensor weight_, bias_, dweight_, dbias_;
};

// Max or mean over k x k windows of each plane: (N, C, H, W) -> (N, C, OH, OW). The
// mean counts padding as zeros; global averages a whole plane: (N, C, H, W) -> (N, C).
class Pool2d final : public Layer {
 public:
  enum class Op { max, average, global_average };
  Pool2d(Op op, int64_t kernel, int64_t stride, int64_t padding)
      : op_(op), kernel_(kernel), stride_(stride), padding_(padding) {}
  std::string kind() const override;
  bool output_reusable() const override { return true; }  // the max pool keeps its argmax apart
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  Window2d window(const Shape& in) const;
  Op op_;
  int64_t kernel_, stride_, padding_;
};

// BatchNorm over the channels of (N, C, ...) with GPipe's micro-batch semantics: in
// training each micro-batch is normalised with its own statistics, and the running mean
// and variance (buffers) move once per micro-batch, in micro-batch order, never in a
// recomputation (remat); evaluation normalises with the running statistics.
class BatchNorm2d final : public Layer {
 public:
  // `zero_weight`: the scale starts at 0 (a residual block's last BatchNorm: the block
  // starts as its skip path; Goyal et al. 2017, timm's zero_init_last).
  BatchNorm2d(int64_t channels, float eps, float momentum, bool zero_weight = false)
      : channels_(channels), eps_(eps), momentum_(momentum), zero_weight_(zero_weight),
        sums_(static_cast<std::size_t>(1 + 2 * channels), 0.0) {}
  std::string kind() const override { return "batchnorm2d"; }
  bool output_reusable() const override { return true; }  // its backward reads its input and statistics
  bool output_last() const override { return true; }  // its statistics come first
  bool output_recomputable() const override { return true; }
  // Its training output rectified for the ReLU after it (mark_fusions); its backward reads
  // its input, not its output.
  bool can_rectify_output() const override { return true; }
  void rectify_output(bool on) override { relu_ = on; }
  Shape output_shape(const Shape& in) const override { return in; }
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  std::span<double> step_sums() override;
  void apply_step_sums() override;
  void clear_step_sums() override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t channels_;
  float eps_, momentum_;
  bool zero_weight_ = false;
  bool relu_ = false;  // a training forward rectifies its output (mark_fusions)
  std::vector<double> sums_;  // --batchnorm deferred: the step's count, sums and sums of squares
  // On a GPU the step's sums gather in device memory, micro-batch by micro-batch with no
  // wait, and come to sums_ once, when step_sums() is asked for them (the step's end).
  cuda::DeviceBuffer device_sums_;
  bool device_newer_ = false;  // sums on the device not yet in sums_
  bool device_used_ = false;   // the device's sums are not all zero (a step gathered there)
  Tensor weight_, bias_, running_mean_, running_var_, dweight_, dbias_;
};

// (N, d1, d2, ...) -> (N, d1 * d2 * ...), a copy.
class Flatten final : public Layer {
 public:
  std::string kind() const override { return "flatten"; }
  Shape output_shape(const Shape& in) const override { return Shape{in[0], in.numel() / in[0]}; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> conv_layer_kinds();

}  // namespace mpipe
