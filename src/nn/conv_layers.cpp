// Convolutional layers: shapes, costs and parameters here, the math in backend/ops.
#include "mpipe/nn/conv_layers.hpp"

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/nn/registry.hpp"

#include <cmath>

namespace mpipe {

namespace {
// The output side of a window sweep.
int64_t swept(int64_t size, int64_t kernel, int64_t stride, int64_t padding) {
  return (size + 2 * padding - kernel) / stride + 1;
}
}  // namespace

// ---- Conv2d --------------------------------------------------------------------------

Conv2d::Conv2d(int64_t channels, int64_t out, int64_t kernel, int64_t stride, int64_t padding, int64_t groups,
               bool bias, float init_std)
    : channels_(channels), out_(out), kernel_(kernel), stride_(stride), padding_(padding), groups_(groups),
      has_bias_(bias), init_std_(init_std) {}

Window2d Conv2d::window(const Shape& in, const Pass& pass) const {
  Window2d w = window(in);
  w.channels_last = pass.channels_last;
  return w;
}

Window2d Conv2d::window(const Shape& in) const {
  Window2d w;
  w.N = in[0];
  w.C = in[1];
  w.H = in[2];
  w.W = in[3];
  w.OC = out_;
  w.KH = w.KW = kernel_;
  w.stride = stride_;
  w.padding = padding_;
  w.groups = groups_;
  w.OH = swept(w.H, kernel_, stride_, padding_);
  w.OW = swept(w.W, kernel_, stride_, padding_);
  return w;
}

Shape Conv2d::output_shape(const Shape& in) const {
  const Window2d w = window(in);
  return Shape{w.N, w.OC, w.OH, w.OW};
}

Cost Conv2d::cost(const Shape& in) const {
  const Window2d w = window(in);
  const double macs = static_cast<double>(w.N * w.OC * w.OH * w.OW) * static_cast<double>(w.C / w.groups * w.KH * w.KW);
  const double params = static_cast<double>(w.OC * (w.C / w.groups) * w.KH * w.KW + (has_bias_ ? w.OC : 0));
  // Held until the micro-batch's backward: the output. The forward's im2col scratch is
  // given back as the forward returns (the next layer's output takes its place), so it
  // adds to a peak only while the backward's, no smaller, is not there. The backward's,
  // and W's, come from the stage's scratch arena, reset after each: one layer's at a
  // time. W keeps the output's gradient.
  const double output = 4.0 * static_cast<double>(w.N * w.OC * w.OH * w.OW);
  const double cols = 4.0 * static_cast<double>(ops::conv2d_scratch(w, Device::cpu));
  Cost c{2 * macs, 4 * macs, 4 * params, output, 2 * macs, output};
  c.forward_peak_bytes = output + cols;
  c.backward_scratch_bytes = c.backward_spent_bytes = cols;
  return c;
}

std::vector<ParamSpec> Conv2d::param_specs() const {
  std::vector<ParamSpec> specs;
  specs.push_back({"weight", Shape{out_, channels_ / groups_, kernel_, kernel_}, Init::normal, init_std_, true});
  if (has_bias_) specs.push_back({"bias", Shape{out_}, Init::zeros, 0.0f, false});
  return specs;
}

void Conv2d::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_weight_bias(params, grads, weight_, dweight_, bias_, dbias_);
}

Tensor Conv2d::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const Window2d w = window(x.shape, pass);
  Tensor y = pass.arena->tensor(output_shape(x.shape), pass.dtype);
  // The columns are dead once the forward returns: the arena takes them back (on a GPU
  // the next allocations reuse them in stream order, after this kernel).
  const Arena::Mark columns = pass.arena->mark();
  ops::conv2d_forward(y, x, weight_, bias_, pass.arena->tensor(Shape{ops::conv2d_scratch(w, x.device)}), w);
  pass.arena->rewind(columns);
  return y;
}

void Conv2d::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  const Window2d w = window(ctx.input.shape, pass);
  // The columns in spent memory where it has room (an unsplit backward), else scratch.
  const int64_t floats = ops::conv2d_scratch(w, dy.device);
  Tensor cols = pass.spent && floats > 0 ? pass.spent->take(Shape{floats}, DType::f32) : Tensor{};
  if (cols.empty()) cols = pass.arena->tensor(Shape{floats});
  if (!pass.stash) {
    ops::conv2d_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, cols, w, mode);
    return;
  }
  // Split, as Linear: dx now, dy kept for the weight and bias gradients.
  ops::conv2d_backward(dx, Tensor{}, Tensor{}, dy, ctx.input, weight_, cols, w, mode);
  ctx.output_grad = pass.stash->tensor(dy.shape, dy.dtype);
  ops::copy(ctx.output_grad, dy);
}

void Conv2d::backward_weight_impl(Context& ctx, const Pass& pass) {
  MPIPE_CHECK(!ctx.output_grad.empty(), "conv2d layer ", global_index(), ": weight gradient without a split backward");
  const Window2d w = window(ctx.input.shape, pass);
  ops::conv2d_backward(Tensor{}, dweight_, dbias_, ctx.output_grad, ctx.input, weight_,
                       pass.arena->tensor(Shape{ops::conv2d_scratch(w, weight_.device)}), w, GradMode::accumulate);
  ctx.output_grad = Tensor{};
}

// ---- Pool2d --------------------------------------------------------------------------

std::string Pool2d::kind() const {
  return op_ == Op::max ? "maxpool2d" : op_ == Op::average ? "avgpool2d" : "global-avgpool";
}

Window2d Pool2d::window(const Shape& in) const {
  Window2d w;
  w.N = in[0];
  w.C = w.OC = in[1];
  w.H = in[2];
  w.W = in[3];
  if (op_ == Op::global_average) {
    w.KH = w.H;
    w.KW = w.W;
  } else {
    w.KH = w.KW = kernel_;
    w.stride = stride_;
    w.padding = padding_;
  }
  w.OH = swept(w.H, w.KH, w.stride, w.padding);
  w.OW = swept(w.W, w.KW, w.stride, w.padding);
  return w;
}

Shape Pool2d::output_shape(const Shape& in) const {
  const Window2d w = window(in);
  return op_ == Op::global_average ? Shape{w.N, w.C} : Shape{w.N, w.C, w.OH, w.OW};
}

Cost Pool2d::cost(const Shape& in) const {
  const Window2d w = window(in);
  const double out = static_cast<double>(w.N * w.C * w.OH * w.OW), window_size = static_cast<double>(w.KH * w.KW);
  // The max pool keeps its argmax (int32) beside the output.
  Cost c{out * window_size, out * window_size, 0, (op_ == Op::max ? 8.0 : 4.0) * out};
  if (op_ == Op::max) c.fixed_bytes = 4.0 * out;  // the argmax, int32
  return c;
}

Tensor Pool2d::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  Window2d w = window(x.shape);
  w.channels_last = pass.channels_last;
  Tensor y = pass.arena->tensor(output_shape(x.shape), pass.dtype);
  if (op_ == Op::max) {
    ctx.saved[0] = pass.arena->tensor(Shape{w.N, w.C, w.OH, w.OW}, DType::i32);
    ops::maxpool2d_forward(y, ctx.saved[0], x, w);
  } else {
    ops::avgpool2d_forward(y, x, w);
  }
  return y;
}

void Pool2d::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  if (dx.empty()) return;
  Window2d w = window(ctx.input.shape);
  w.channels_last = pass.channels_last;
  if (op_ == Op::max) ops::maxpool2d_backward(dx, dy, ctx.saved[0], w, mode);
  else ops::avgpool2d_backward(dx, dy, w, mode);
}

// ---- BatchNorm2d ---------------------------------------------------------------------

Cost BatchNorm2d::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  Cost c{5 * n, 8 * n, 4.0 * 4 * static_cast<double>(channels_), 4 * n + 8.0 * static_cast<double>(channels_)};
  c.fixed_bytes = 8.0 * static_cast<double>(channels_);  // the mean and 1 / std, fp32
  return c;
}

std::vector<ParamSpec> BatchNorm2d::param_specs() const {
  std::vector<ParamSpec> specs;
  specs.push_back({"weight", Shape{channels_}, zero_weight_ ? Init::zeros : Init::ones, 0.0f, false});
  specs.push_back({"bias", Shape{channels_}, Init::zeros, 0.0f, false});
  ParamSpec mean{"running_mean", Shape{channels_}, Init::zeros, 0.0f, false};
  ParamSpec var{"running_var", Shape{channels_}, Init::ones, 0.0f, false};
  mean.buffer = var.buffer = true;
  specs.push_back(mean);
  specs.push_back(var);
  return specs;
}

void BatchNorm2d::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  weight_ = params[0];
  bias_ = params[1];
  running_mean_ = params[2];
  running_var_ = params[3];
  dweight_ = grads[0];
  dbias_ = grads[1];
  if (weight_.device == Device::cuda && device_sums_.bytes() == 0)
    device_sums_ = cuda::DeviceBuffer(sums_.size() * sizeof(double));  // zeroed
}

std::span<double> BatchNorm2d::step_sums() {
  if (device_newer_) {
    cuda::copy_to_host(sums_.data(), device_sums_.data(), sums_.size() * sizeof(double));
    cuda::synchronize(cuda::StreamKind::compute);
    device_newer_ = false;
  }
  return sums_;
}

void BatchNorm2d::clear_step_sums() {
  std::fill(sums_.begin(), sums_.end(), 0.0);
  // Every step begins here, under either rule: the micro-batch rule never gathers, so
  // its steps launch nothing.
  if (device_used_) cuda::zero(device_sums_.data(), device_sums_.bytes());
  device_newer_ = device_used_ = false;
}

Tensor BatchNorm2d::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  if (!pass.training) {
    Tensor y = pass.arena->tensor(x.shape, pass.dtype);
    ops::batchnorm_forward_eval(y, x, weight_, bias_, running_mean_, running_var_, eps_, pass.channels_last);
    return y;
  }
  // The statistics before the output, which is then the last allocation (output_last).
  ctx.saved[0] = pass.arena->tensor(Shape{channels_});  // the micro-batch's mean
  ctx.saved[1] = pass.arena->tensor(Shape{channels_});  // and 1 / sqrt(var + eps)
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
  // Micro-batch statistics move the running ones now (GPipe); deferred, the step's sums
  // gather them and move them once at its end. A recomputation does neither.
  const bool update = !pass.recompute && !pass.deferred_statistics, gather = !pass.recompute && pass.deferred_statistics;
  const bool on_device = gather && device_sums_.bytes() > 0;
  ops::batchnorm_forward_train(y, ctx.saved[0], ctx.saved[1], update ? running_mean_ : Tensor{},
                               update ? running_var_ : Tensor{},
                               gather && !on_device ? std::span<double>(sums_) : std::span<double>(), x, weight_, bias_,
                               eps_, momentum_, on_device ? device_sums_.as<double>() : nullptr, relu_,
                               pass.channels_last);
  device_newer_ = device_newer_ || on_device;
  device_used_ = device_used_ || on_device;
  return y;
}

void BatchNorm2d::apply_step_sums() {
  ops::batchnorm_apply_sums(running_mean_, running_var_, sums_, momentum_);
  clear_step_sums();
}

void BatchNorm2d::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  ops::batchnorm_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, ctx.saved[0], ctx.saved[1], mode,
                          pass.channels_last);
}

// ---- Flatten -------------------------------------------------------------------------

Cost Flatten::cost(const Shape& in) const { return {0, 0, 0, 0}; }  // a view: nothing computed or held

namespace {
// Whether a flatten of `in` must reorder: a channels-last image of planes over one
// element, whose features are (C, H, W)-ordered (the next layer's weights are).
bool reorders(const Shape& in, const Pass& pass) {
  return pass.channels_last && in.rank == 4 && in[2] * in[3] > 1;
}
}  // namespace

// A view of the input under the flat shape: the input's memory lives as long as this
// micro-batch's contexts (it is the previous layer's output or the received message).
// A channels-last image is swapped back to channels first, into an output of its own.
Tensor Flatten::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  if (reorders(x.shape, pass)) {
    const Tensor y = pass.arena->tensor(output_shape(x.shape), x.dtype);
    ops::change_layout(y.view(x.shape), x, false);
    return y;
  }
  Tensor y = x;
  y.shape = output_shape(x.shape);
  return y;
}

void Flatten::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  if (dx.empty()) return;
  Tensor d = dy;
  d.shape = dx.shape;
  if (reorders(dx.shape, pass)) ops::change_layout(dx, d, true, mode);
  else if (mode == GradMode::overwrite) ops::copy(dx, d);
  else ops::add(dx, d);
}

// ---- registry entries ----------------------------------------------------------------

// NCHW, on the CPU and the GPU.
std::vector<LayerKind> conv_layer_kinds() {
  using T = OptionType;
  std::vector<LayerKind> k;
  k.push_back({"conv2d", "2-D convolution: (N, C, H, W) -> (N, out, OH, OW), OH = (H + 2 padding - kernel) / stride + 1",
               {{"out", T::integer, std::nullopt, "output channels"},
                {"kernel", T::integer, std::nullopt, "kernel side"},
                {"stride", T::integer, std::int64_t{1}, "stride"},
                {"padding", T::integer, std::int64_t{0}, "zero padding on each side"},
                {"groups", T::integer, std::int64_t{1}, "groups (dividing C and out)"},
                {"bias", T::boolean, true, "add a learned bias"},
                {"init-std", T::number, -1.0, "std of the normal initial weights; -1: sqrt(2 / fan-in) (He)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Window2d w = a.image_window(a.integer("kernel"), a.integer("stride"), a.integer("padding", 0));
                 const std::int64_t out = a.integer("out"), groups = a.integer("groups");
                 if (w.C % groups != 0 || out % groups != 0)
                   a.refuse("groups", cat(groups, " does not divide the ", w.C, " channels in and ", out, " out"), "pick groups dividing both");
                 const double fan_in = static_cast<double>(w.C / groups * w.KH * w.KW), given = a.deviation("init-std", true);
                 return std::make_unique<Conv2d>(w.C, out, w.KH, w.stride, w.padding, groups, a.boolean("bias"),
                                                 static_cast<float>(given < 0 ? std::sqrt(2.0 / fan_in) : given));
               },
               true});
  for (const bool max : {true, false})
    k.push_back({max ? "maxpool2d" : "avgpool2d",
                 max ? "max over kernel x kernel windows of each plane (padding counts as -inf)"
                     : "mean over kernel x kernel windows of each plane (padding counts as zeros)",
                 {{"kernel", T::integer, std::nullopt, "window side"},
                  {"stride", T::integer, std::int64_t{0}, "stride; 0: the kernel"},
                  {"padding", T::integer, std::int64_t{0}, "padding on each side, at most kernel / 2"}},
                 false,
                 [max](const LayerArgs& a) -> std::unique_ptr<Layer> {
                   const std::int64_t kernel = a.integer("kernel"), stride = a.integer("stride", 0);
                   const Window2d w = a.image_window(kernel, stride ? stride : kernel, a.integer("padding", 0));
                   if (2 * w.padding > kernel) a.refuse("padding", cat(w.padding, " is more than half the kernel ", kernel), "pad at most kernel / 2");
                   return std::make_unique<Pool2d>(max ? Pool2d::Op::max : Pool2d::Op::average, kernel, w.stride, w.padding);
                 },
                 true});
  k.push_back({"global-avgpool", "mean of each plane: (N, C, H, W) -> (N, C)", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 a.image_window(1, 1, 0);
                 return std::make_unique<Pool2d>(Pool2d::Op::global_average, 0, 1, 0);
               }});
  k.push_back({"batchnorm2d",
               "BatchNorm over the channels of (N, C, H, W): each micro-batch normalised with its own statistics in "
               "training (GPipe's rule), the running statistics in evaluation",
               {{"eps", T::number, 1e-5, "added to the variance"},
                {"momentum", T::number, 0.1, "how far the running statistics move toward each micro-batch's"},
                {"zero-init", T::boolean, false,
                 "start the scale (weight) at 0, not 1: as a residual block's last layer, the block starts as its skip path"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const Window2d w = a.image_window(1, 1, 0);
                 const double eps = a.number("eps"), momentum = a.number("momentum");
                 if (!(eps > 0)) a.refuse("eps", cat("must be positive, got ", eps), "e.g. eps = 1e-5");
                 if (!(momentum >= 0 && momentum <= 1)) a.refuse("momentum", cat("must be in [0, 1], got ", momentum), "e.g. momentum = 0.1");
                 return std::make_unique<BatchNorm2d>(w.C, static_cast<float>(eps), static_cast<float>(momentum), a.boolean("zero-init"));
               },
               true});
  k.push_back({"flatten", "(N, d1, d2, ...) -> (N, d1 x d2 x ...)", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.input.rank < 2) a.refuse("kind", cat("needs (batch, ...), gets ", a.input.str()), "put it after a layer with features");
                 return std::make_unique<Flatten>();
               }});
  return k;
}

}  // namespace mpipe
