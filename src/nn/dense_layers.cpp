// Dense layers (linear, activations, layernorm, dropout, the loss) and their kinds.
#include "mpipe/nn/dense_layers.hpp"

#include <cmath>

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

// ---- Linear ------------------------------------------------------------------------

Linear::Linear(int64_t in, int64_t out, bool bias, float init_std)
    : in_(in), out_(out), has_bias_(bias), init_std_(init_std) {}

Shape Linear::output_shape(const Shape& in) const {
  Shape out = in;
  out[-1] = out_;
  return out;
}

Cost Linear::cost(const Shape& in) const {
  const double rows = static_cast<double>(in.rows());
  return {2.0 * rows * in_ * out_, 4.0 * rows * in_ * out_,
          f32_bytes(static_cast<double>(in_) * out_ + (has_bias_ ? out_ : 0)), f32_bytes(rows * out_),
          2.0 * rows * in_ * out_, f32_bytes(rows * out_)};
}

std::vector<ParamSpec> Linear::param_specs() const {
  std::vector<ParamSpec> specs;
  specs.push_back({"weight", Shape{out_, in_}, Init::normal, init_std_, true, tied_layer_, tied_name_});
  if (has_bias_) specs.push_back({"bias", Shape{out_}, Init::zeros, 0.0f, false});
  return specs;
}

void Linear::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_weight_bias(params, grads, weight_, dweight_, bias_, dbias_);
}

Tensor Linear::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  MPIPE_CHECK(x.shape[-1] == in_, "linear layer ", global_index(), ": input ", x.shape.str(),
              " has not ", in_, " features");
  Tensor y = pass.arena->tensor(output_shape(x.shape), pass.dtype);  // (N, OC)
  ops::matmul_forward(y, x, weight_, bias_);
  return y;
}

Tensor Linear::forward_gelu(const Tensor& x, Context& ctx, Context& gelu_ctx, const Pass& pass) {
  MPIPE_CHECK(x.shape[-1] == in_, "linear layer ", global_index(), ": input ", x.shape.str(), " has not ", in_,
              " features");
  const Shape shape = output_shape(x.shape);
  Tensor pre = pass.arena->tensor(shape, pass.dtype);  // (N, OC), what GELU's backward needs
  Tensor y = pass.arena->tensor(shape, pass.dtype);    // (N, OC)
  ops::matmul_gelu_forward(y, pre, x, weight_, bias_);
  ctx.input = x;
  gelu_ctx.input = pre;
  return y;
}

void Linear::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                           const Pass& pass) {
  if (!pass.stash) {
    ops::matmul_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, mode);
    return;
  }
  // Split: dx now; dy kept (the caller may overwrite its own) for the weight gradient,
  // which is then the same two calls as above, only later.
  ops::matmul_backward(dx, Tensor{}, Tensor{}, dy, ctx.input, weight_, mode);
  if (pass.stash_into.empty()) {
    ctx.output_grad = pass.stash->tensor(dy.shape, dy.dtype);
  } else {
    MPIPE_CHECK(pass.stash_into.shape == dy.shape && pass.stash_into.dtype == dy.dtype, "linear layer ", global_index(),
                ": a stash buffer of ", pass.stash_into.shape.str(), " for dy ", dy.shape.str());
    ctx.output_grad = pass.stash_into;
  }
  if (ctx.output_grad.data != dy.data) ops::copy(ctx.output_grad, dy);
}

void Linear::backward_weight_impl(Context& ctx, const Pass& pass) {
  MPIPE_CHECK(!ctx.output_grad.empty(), "linear layer ", global_index(), ": weight gradient without a split backward");
  ops::matmul_backward(Tensor{}, dweight_, dbias_, ctx.output_grad, ctx.input, weight_, GradMode::accumulate);
  ctx.output_grad = Tensor{};  // once per backward
}

// ---- ReLU, GELU --------------------------------------------------------------------

Cost ReLU::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  return {n, n, 0, in_place_ ? 0.0 : f32_bytes(n)};  // in place: the first of a stage is Plan's
}

Tensor ReLU::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const bool over = in_place_ && x.data != pass.stage_input;
  if (over && input_rectified_ && pass.training) {  // the BatchNorm before it rectified its output
    ctx.saved[0] = x;
    return x;
  }
  Tensor y = over ? x : pass.arena->tensor(x.shape, pass.dtype);
  ops::relu_forward(y, x);
  ctx.saved[0] = y;  // backward needs only the sign of the output
  return y;
}

void ReLU::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                         const Pass& pass) {
  ops::relu_backward(dx, dy, ctx.saved[0], mode);
}

Cost GELU::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  return {8 * n, 16 * n, 0, f32_bytes(n)};
}

Tensor GELU::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
  ops::gelu_forward(y, x);
  return y;
}

void GELU::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                         const Pass& pass) {
  ops::gelu_backward(dx, dy, ctx.input, mode);
}

// ---- LayerNorm ---------------------------------------------------------------------

Shape SwiGLU::output_shape(const Shape& in) const {
  Shape out = in;
  out[-1] = in[-1] / 2;
  return out;
}

Cost SwiGLU::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel()) / 2;  // outputs
  return {6 * n, 14 * n, 0, f32_bytes(n)};
}

Tensor SwiGLU::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  MPIPE_CHECK(x.shape[-1] % 2 == 0, "swiglu layer ", global_index(), ": input ", x.shape.str(), " has an odd width");
  Tensor y = pass.arena->tensor(output_shape(x.shape), pass.dtype);  // (N, F)
  ops::swiglu_forward(y, x);
  return y;
}

void SwiGLU::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  ops::swiglu_backward(dx, dy, ctx.input, mode);
}

Cost LayerNorm::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  // The statistics of each row, fp32: LayerNorm's mean and 1 / std, RMSNorm's 1 / rms.
  const double statistics = norm_ == NormKind::rms ? 1.0 : 2.0;
  Cost c{(norm_ == NormKind::rms ? 5 : 8) * n, (norm_ == NormKind::rms ? 9 : 12) * n,
         f32_bytes(statistics * static_cast<double>(channels_)), f32_bytes(n + statistics * in.rows())};
  c.fixed_bytes = f32_bytes(statistics * in.rows());
  return c;
}

std::vector<ParamSpec> LayerNorm::param_specs() const {
  if (norm_ == NormKind::rms) return {{"weight", Shape{channels_}, Init::ones, 0.0f, false}};
  return {{"weight", Shape{channels_}, Init::ones, 0.0f, false},
          {"bias", Shape{channels_}, Init::zeros, 0.0f, false}};
}

void LayerNorm::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  weight_ = params[0];
  dweight_ = grads[0];
  if (norm_ == NormKind::rms) return;
  bias_ = params[1];
  dbias_ = grads[1];
}

Tensor LayerNorm::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  return normalize(x, Tensor{}, 0.0f, DropoutKey{}, ctx, pass);
}

Tensor LayerNorm::forward_sum(const Tensor& sum, const Tensor& residual, float p, const DropoutKey& key,
                              Context& ctx, const Pass& pass) {
  MPIPE_CHECK(residual.shape == sum.shape, "layernorm layer ", global_index(), ": sum ", sum.shape.str(),
              ", residual ", residual.shape.str());
  enter_forward(sum, ctx, pass);
  return normalize(sum, residual, p, key, ctx, pass);
}

Tensor LayerNorm::normalize(const Tensor& x, const Tensor& residual, float p, const DropoutKey& key, Context& ctx,
                            const Pass& pass) {
  MPIPE_CHECK(x.shape[-1] == channels_, "layernorm: input ", x.shape.str());
  const int64_t rows = x.shape.rows();
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
  if (norm_ == NormKind::rms) {
    ctx.saved[0] = pass.arena->tensor(Shape{rows});  // rstd (N), fp32
    if (residual.empty()) ops::rmsnorm_forward(y, ctx.saved[0], x, weight_, eps_);
    else ops::residual_rmsnorm_forward(y, ctx.saved[0], x, residual, p, key, weight_, eps_);
    return y;
  }
  ctx.saved[0] = pass.arena->tensor(Shape{rows});  // mean (N), fp32
  ctx.saved[1] = pass.arena->tensor(Shape{rows});  // rstd (N), fp32
  if (residual.empty()) ops::layernorm_forward(y, ctx.saved[0], ctx.saved[1], x, weight_, bias_);
  else ops::residual_layernorm_forward(y, ctx.saved[0], ctx.saved[1], x, residual, p, key, weight_, bias_);
  return y;
}

void LayerNorm::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                              GradMode mode, const Pass& pass) {
  if (norm_ == NormKind::rms) ops::rmsnorm_backward(dx, dweight_, dy, ctx.input, weight_, ctx.saved[0], mode);
  else ops::layernorm_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, ctx.saved[0], ctx.saved[1], mode);
}

void LayerNorm::backward_onto(Context& ctx, const Tensor& dy, const Tensor& dx, const Tensor& residual) {
  MPIPE_CHECK(dy.shape == ctx.input.shape && dx.shape == ctx.input.shape, "layernorm layer ", global_index(), ": dy ",
              dy.shape.str(), ", dx ", dx.shape.str(), " expected ", ctx.input.shape.str());
  if (norm_ == NormKind::rms)
    ops::rmsnorm_backward(dx, dweight_, dy, ctx.input, weight_, ctx.saved[0], GradMode::overwrite, residual);
  else
    ops::layernorm_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, ctx.saved[0], ctx.saved[1],
                            GradMode::overwrite, residual);
}

// ---- Dropout -----------------------------------------------------------------------

DropoutKey dropout_key(const Pass& pass, int layer, int site) {
  return {pass.seed, pass.step, pass.sample_begin, static_cast<uint32_t>(layer * 16 + site)};
}

Cost Dropout::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  return {n, n, 0, f32_bytes(n)};
}

Tensor Dropout::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  if (!pass.training || p_ == 0.0f) return x;
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
  ops::dropout_apply(y, x, p_, dropout_key(pass, global_index(), site_));
  return y;
}

void Dropout::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                            const Pass& pass) {
  if (!pass.training || p_ == 0.0f) {
    if (mode == GradMode::accumulate) ops::add(dx, dy);
    else ops::copy(dx, dy);
    return;
  }
  if (mode == GradMode::overwrite) {
    ops::dropout_apply(dx, dy, p_, dropout_key(pass, global_index(), site_));
  } else {
    ops::add_dropped(dx, dx, dy, p_, dropout_key(pass, global_index(), site_));
  }
}

// ---- CrossEntropyLoss --------------------------------------------------------------

// Per-pixel labels: (N, C, H, W) logits are N·H·W rows of C classes, read where they lie
// (ops::class_rows), the gradient written the same way.
Cost CrossEntropyLoss::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  Cost c{4 * n, 3 * n, 0, f32_bytes(static_cast<double>(ops::class_rows(in).rows()))};
  c.fixed_bytes = c.activation_bytes;  // fp32 whatever the precision
  return c;
}

namespace {
// The logits as the loss reads them: a channels-last image's (N, C, H, W) are rows of C
// classes (N H W, C), as the targets (N, H, W) run.
Tensor class_view(const Tensor& logits, const Pass& pass) {
  const Shape& s = logits.shape;
  return pass.channels_last && s.rank == 4 ? logits.view(Shape{s[0] * s[2] * s[3], s[1]}) : logits;
}
}  // namespace

Tensor CrossEntropyLoss::forward_impl(const Tensor& logits, Context& ctx, const Pass& pass) {
  const Tensor input = class_view(logits, pass);
  const int64_t rows = ops::class_rows(input.shape).rows();
  MPIPE_CHECK(pass.targets.numel() == rows, "cross-entropy: ", pass.targets.numel(),
              " targets for ", rows, " rows");
  ctx.saved[0] = pass.arena->tensor(Shape{rows});  // log-sum-exp (N), fp32
  ctx.saved[1] = pass.targets;
  ctx.value = ops::crossentropy_forward(ctx.saved[0], input, pass.targets, pass.device_loss_sum);
  if (!pass.training) ctx.correct = static_cast<double>(ops::count_correct(input, pass.targets));
  // The summed loss on the CPU. On a GPU the sum went to pass.device_loss_sum, which the
  // executor reads once per step, and this output is zero.
  Tensor loss = pass.arena->zeros(Shape{1});
  if (loss.device == Device::cpu) loss.f32()[0] = static_cast<float>(ctx.value);
  return loss;
}

void CrossEntropyLoss::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                                     GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, "cross-entropy writes its gradient");
  if (dx.empty()) return;
  ops::crossentropy_backward(class_view(dx, pass), class_view(ctx.input, pass), ctx.saved[0], ctx.saved[1],
                             pass.loss_scale);
}

// ---- registry entries ----------------------------------------------------------------

// linear, layernorm and the activations may be inner layers of a residual block; dropout
// is not (a block's layers share its index, which keys dropout masks).
std::vector<LayerKind> dense_layer_kinds() {
  using T = OptionType;
  const OptionSpec init_std{"init-std", T::number, 0.02, "std of the normal initial weights"};
  std::vector<LayerKind> k;
  k.push_back({"layernorm", "layer normalisation over the channels", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> { return std::make_unique<LayerNorm>(a.channels()); },
               true});
  k.push_back({"rmsnorm", "RMS normalisation over the channels (Llama's): x / sqrt(mean(x²) + eps) · weight",
               {{"eps", T::number, 1e-5, "added to the mean square inside the root"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 return std::make_unique<LayerNorm>(a.channels(), NormKind::rms, norm_eps(a));
               },
               true});
  k.push_back({"linear", "y = x W^T + b over the last dimension: (.., in) -> (.., out)",
               {{"out", T::integer, std::nullopt, "output features"},
                {"bias", T::boolean, true, "add a learned bias"},
                init_std,
                {"tie", T::integer, std::int64_t{-1}, "index of an earlier embedding whose token table is this weight"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const std::int64_t in = a.channels(), out = a.integer("out");
                 auto layer = std::make_unique<Linear>(in, out, a.boolean("bias"), static_cast<float>(a.deviation("init-std", false)));
                 const int tie = a.tied_table(out, in, "weight");
                 if (tie >= 0) layer->tie_weight(tie, "wte");
                 return layer;
               },
               true});
  k.push_back({"relu", "max(x, 0)", {}, false, [](const LayerArgs&) -> std::unique_ptr<Layer> { return std::make_unique<ReLU>(); }, true});
  k.push_back({"gelu", "GELU (tanh approximation)", {}, false,
               [](const LayerArgs&) -> std::unique_ptr<Layer> { return std::make_unique<GELU>(); }, true});
  k.push_back({"swiglu", "silu(gate) · up of the halves [gate | up]: (.., 2F) -> (.., F)", {}, false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.channels() % 2 != 0)
                   a.refuse("kind", cat("needs an even width ([gate | up]), gets ", a.input.str()), "put it after a linear layer of out = 2F");
                 return std::make_unique<SwiGLU>();
               },
               true});
  k.push_back({"dropout", "inverted dropout (masks from a counter-based generator, recomputed in backward)",
               {{"p", T::number, std::nullopt, "probability of dropping an element, in [0, 1)"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const double p = a.number("p");
                 if (!(p >= 0 && p < 1)) a.refuse("p", cat("must be in [0, 1), got ", p), "e.g. p = 0.1");
                 return std::make_unique<Dropout>(static_cast<float>(p), 0);
               }});
  return k;
}
}  // namespace mpipe
