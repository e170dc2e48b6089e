// The layers: shape checks in Layer, the math in backend/ops (CPU or GPU, picked by
// where the tensors live), composition here.
#include "mpipe/nn/layer.hpp"

#include <cmath>

namespace mpipe {

namespace {

// Parameters of composite layers are their parts' parameters under a prefix.
void append_specs(std::vector<ParamSpec>& out, const std::string& prefix, const Layer& part) {
  for (ParamSpec spec : part.param_specs()) {
    spec.name = prefix + spec.name;
    out.push_back(std::move(spec));
  }
}

// Hands consecutive slices of params/grads to the parts, in param_specs() order.
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::span<Layer* const> parts) {
  std::size_t at = 0;
  for (Layer* part : parts) {
    const std::size_t n = part->param_specs().size();
    part->bind(params.subspan(at, n), grads.subspan(at, n));
    at += n;
  }
  MPIPE_CHECK(at == params.size(), "bound ", at, " of ", params.size(), " parameters");
}
void bind_parts(std::span<const Tensor> params, std::span<const Tensor> grads, std::initializer_list<Layer*> parts) {
  bind_parts(params, grads, std::span<Layer* const>(parts.begin(), parts.size()));
}

double f32_bytes(double elements) { return 4.0 * elements; }

}  // namespace

// ---- Layer -------------------------------------------------------------------------

Tensor Layer::forward(const Tensor& x, Context& ctx, const Pass& pass) {
  const DType expected = input_dtype() == DType::i32 ? DType::i32 : pass.dtype;
  MPIPE_CHECK(x.dtype == expected, kind(), " layer ", global_index_, ": input is ", to_string(x.dtype), ", expected ",
              to_string(expected));
  ctx.input = x;
  Tensor y = forward_impl(x, ctx, pass);
  MPIPE_CHECK(y.shape == output_shape(x.shape), kind(), " layer ", global_index_, ": output ",
              y.shape.str(), " expected ", output_shape(x.shape).str());
  return y;
}

void Layer::backward(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) {
  MPIPE_CHECK(dy.shape == output_shape(ctx.input.shape), kind(), " layer ", global_index_,
              ": dy ", dy.shape.str(), " expected ", output_shape(ctx.input.shape).str());
  MPIPE_CHECK(dx.empty() || dx.shape == ctx.input.shape, kind(), " layer ", global_index_,
              ": dx ", dx.shape.str(), " expected ", ctx.input.shape.str());
  backward_impl(ctx, dy, dx, mode, pass);
}

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

void bind_weight_bias(std::span<const Tensor> params, std::span<const Tensor> grads, Tensor& weight, Tensor& dweight,
                      Tensor& bias, Tensor& dbias) {
  weight = params[0];
  dweight = grads[0];
  if (params.size() > 1) {
    bias = params[1];
    dbias = grads[1];
  }
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
  return {n, n, 0, f32_bytes(n)};
}

Tensor ReLU::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
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

Cost LayerNorm::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  return {8 * n, 12 * n, f32_bytes(2.0 * channels_), f32_bytes(n + 2.0 * in.rows())};
}

std::vector<ParamSpec> LayerNorm::param_specs() const {
  return {{"weight", Shape{channels_}, Init::ones, 0.0f, false},
          {"bias", Shape{channels_}, Init::zeros, 0.0f, false}};
}

void LayerNorm::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  weight_ = params[0];
  bias_ = params[1];
  dweight_ = grads[0];
  dbias_ = grads[1];
}

Tensor LayerNorm::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  MPIPE_CHECK(x.shape[-1] == channels_, "layernorm: input ", x.shape.str());
  const int64_t rows = x.shape.rows();
  Tensor y = pass.arena->tensor(x.shape, pass.dtype);
  ctx.saved[0] = pass.arena->tensor(Shape{rows});  // mean (N), fp32
  ctx.saved[1] = pass.arena->tensor(Shape{rows});  // rstd (N), fp32
  ops::layernorm_forward(y, ctx.saved[0], ctx.saved[1], x, weight_, bias_);
  return y;
}

void LayerNorm::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                              GradMode mode, const Pass& pass) {
  ops::layernorm_backward(dx, dweight_, dbias_, dy, ctx.input, weight_, ctx.saved[0], ctx.saved[1], mode);
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
    Tensor tmp = pass.arena->tensor(dy.shape, pass.dtype);
    ops::dropout_apply(tmp, dy, p_, dropout_key(pass, global_index(), site_));
    ops::add(dx, tmp);
  }
}

// ---- Embedding ---------------------------------------------------------------------

Embedding::Embedding(int64_t vocab, int64_t max_seq, int64_t channels, float dropout)
    : vocab_(vocab), max_seq_(max_seq), channels_(channels), dropout_(dropout) {}

Shape Embedding::output_shape(const Shape& in) const { return Shape{in[0], in[1], channels_}; }

Cost Embedding::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel()) * channels_;
  return {n, 2 * n, f32_bytes(static_cast<double>(vocab_ + max_seq_) * channels_), f32_bytes(n)};
}

std::vector<ParamSpec> Embedding::param_specs() const {
  return {{"wte", Shape{vocab_, channels_}, Init::normal, 0.02f, true},
          {"wpe", Shape{max_seq_, channels_}, Init::normal, 0.02f, true}};
}

void Embedding::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  wte_ = params[0];
  wpe_ = params[1];
  dwte_ = grads[0];
  dwpe_ = grads[1];
}

Tensor Embedding::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const int64_t B = x.shape[0], T = x.shape[1];
  MPIPE_CHECK(x.shape.rank == 2 && T <= max_seq_, "embedding: tokens ", x.shape.str());
  Tensor y = pass.arena->tensor(Shape{B, T, channels_}, pass.dtype);  // (B, T, C)
  ops::embedding_forward(y, x, wte_, wpe_.view(Shape{max_seq_, channels_}));
  if (pass.training && dropout_ > 0.0f) ops::dropout_apply(y, y, dropout_, dropout_key(pass, global_index(), 0));
  return y;
}

void Embedding::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                              GradMode mode, const Pass& pass) {
  Tensor grad = dy;
  if (pass.training && dropout_ > 0.0f) {
    grad = pass.arena->tensor(dy.shape, pass.dtype);
    ops::dropout_apply(grad, dy, dropout_, dropout_key(pass, global_index(), 0));
  }
  ops::embedding_backward(dwte_, dwpe_, grad, ctx.input);
}

// ---- CausalSelfAttention -------------------------------------------------------------

CausalSelfAttention::CausalSelfAttention(int64_t channels, int64_t heads, float init_std, float proj_std)
    : channels_(channels), heads_(heads), qkv_(channels, 3 * channels, true, init_std),
      proj_(channels, channels, true, proj_std) {
  MPIPE_CHECK(channels % heads == 0, "channels ", channels, " heads ", heads);
}

void CausalSelfAttention::set_global_index(int index) {
  Layer::set_global_index(index);
  qkv_.set_global_index(index);
  proj_.set_global_index(index);
}

Cost CausalSelfAttention::cost(const Shape& in) const {
  const double B = static_cast<double>(in[0]), T = static_cast<double>(in[1]), C = static_cast<double>(channels_);
  const Cost a = qkv_.cost(in), b = proj_.cost(in);
  const double core = 4.0 * B * T * T * C;  // QK^T and PV
  return {a.forward_flops + b.forward_flops + core,
          a.backward_flops + b.backward_flops + 2 * core,
          a.param_bytes + b.param_bytes,
          a.activation_bytes + b.activation_bytes + f32_bytes(B * heads_ * T * T + B * T * C),
          a.weight_flops + b.weight_flops,
          b.weight_stash_bytes};  // the qkv projection keeps its dy where q, k, v were
}

std::vector<ParamSpec> CausalSelfAttention::param_specs() const {
  std::vector<ParamSpec> specs;
  append_specs(specs, "c_attn.", qkv_);
  append_specs(specs, "c_proj.", proj_);
  return specs;
}

void CausalSelfAttention::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_parts(params, grads, {&qkv_, &proj_});
}

Tensor CausalSelfAttention::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const int64_t B = x.shape[0], T = x.shape[1], C = channels_;
  ctx.children = pass.arena->objects<Context>(2);
  Tensor qkv = qkv_.forward(x, ctx.children[0], pass);                // (B, T, 3C)
  Tensor att = pass.arena->tensor(Shape{B, T, C}, pass.dtype);       // (B, T, C)
  // (B, H, T, T) probabilities on the CPU, (B, H, T) log-sum-exp on the GPU; fp32.
  Tensor state = pass.arena->tensor(ops::attention_state_shape(x.device, B, heads_, T));
  ops::attention_forward(att, state, qkv, heads_);
  ctx.saved[0] = qkv;
  ctx.saved[1] = state;
  return proj_.forward(att, ctx.children[1], pass);
}

void CausalSelfAttention::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                                        GradMode mode, const Pass& pass) {
  const int64_t B = dy.shape[0], T = dy.shape[1], C = channels_;
  Tensor datt = pass.arena->tensor(Shape{B, T, C}, pass.dtype);      // (B, T, C)
  proj_.backward(ctx.children[1], dy, datt, GradMode::overwrite, pass);
  Tensor dqkv = pass.arena->tensor(Shape{B, T, 3 * C}, pass.dtype);  // (B, T, 3C)
  // The attention output is the projection's input, which its context keeps.
  ops::attention_backward(dqkv, datt, ctx.saved[0], ctx.children[1].input, ctx.saved[1], heads_, *pass.arena);
  // q, k, v are dead now: a split backward keeps dqkv for W in their place. (The output
  // projection above kept its dy where the caller's stash_into said, if it did.)
  Pass qkv_pass = pass;
  qkv_pass.stash_into = pass.stash ? ctx.saved[0] : Tensor{};
  qkv_.backward(ctx.children[0], dqkv, dx, mode, qkv_pass);
}

void CausalSelfAttention::backward_weight_impl(Context& ctx, const Pass& pass) {
  proj_.backward_weight(ctx.children[1], pass);
  qkv_.backward_weight(ctx.children[0], pass);
}

// ---- TransformerBlock ----------------------------------------------------------------

TransformerBlock::TransformerBlock(int64_t channels, int64_t heads, float dropout, float init_std,
                                   float proj_std)
    : channels_(channels), ln1_(channels), ln2_(channels),
      attn_(channels, heads, init_std, proj_std), fc_(channels, 4 * channels, true, init_std),
      fc_proj_(4 * channels, channels, true, proj_std), dropout_(dropout) {}

void TransformerBlock::set_global_index(int index) {
  Layer::set_global_index(index);
  for (Layer* part : std::initializer_list<Layer*>{&ln1_, &attn_, &ln2_, &fc_, &gelu_, &fc_proj_})
    part->set_global_index(index);
}

Cost TransformerBlock::cost(const Shape& in) const {
  Shape wide = in;
  wide[-1] = 4 * channels_;
  Cost total;
  for (const Cost& c : {ln1_.cost(in), attn_.cost(in), ln2_.cost(in), fc_.cost(in), gelu_.cost(wide),
                        fc_proj_.cost(wide)})
    total += c;
  total.activation_bytes += f32_bytes(static_cast<double>(in.numel()));  // the residual sum
  // W keeps every dy in buffers B is done with: fc's where GELU's input was, the
  // attention's qkv and output projection theirs where q, k, v and the residual sum were,
  // fc_proj's where the attention's probabilities were (the CPU's (B, H, T, T), when
  // H·T >= C; otherwise it takes stash memory).
  total.weight_stash_bytes = attn_.heads() * in[1] >= channels_ ? 0.0 : fc_proj_.cost(wide).weight_stash_bytes;
  return total;
}

std::vector<ParamSpec> TransformerBlock::param_specs() const {
  std::vector<ParamSpec> specs;
  append_specs(specs, "ln_1.", ln1_);
  append_specs(specs, "attn.", attn_);
  append_specs(specs, "ln_2.", ln2_);
  append_specs(specs, "mlp.c_fc.", fc_);
  append_specs(specs, "mlp.c_proj.", fc_proj_);
  return specs;
}

void TransformerBlock::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  bind_parts(params, grads, {&ln1_, &attn_, &ln2_, &fc_, &fc_proj_});
}

// Children: 0 ln1, 1 attn, 2 ln2, 3 fc, 4 gelu, 5 fc_proj. Dropout sites 1 (attention
// output) and 2 (MLP output) are applied in place on buffers no context keeps.
Tensor TransformerBlock::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const bool drop = pass.training && dropout_ > 0.0f;
  Context* c = ctx.children = pass.arena->objects<Context>(6);
  Tensor h1 = ln1_.forward(x, c[0], pass);
  Tensor a = attn_.forward(h1, c[1], pass);  // (B, T, C), owned by this call
  if (drop) ops::dropout_apply(a, a, dropout_, dropout_key(pass, global_index(), 1));
  ops::add(a, x);                            // a is now x2 = x + drop(attn(ln1(x)))
  Tensor h2 = ln2_.forward(a, c[2], pass);
  Tensor g = fc_.forward_gelu(h2, c[3], c[4], pass);  // GELU(fc(h2)), one GEMM epilogue on a GPU
  Tensor f = fc_proj_.forward(g, c[5], pass);
  if (drop) ops::dropout_apply(f, f, dropout_, dropout_key(pass, global_index(), 2));
  ops::add(f, a);                            // y = x2 + drop(mlp(ln2(x2)))
  return f;
}

void TransformerBlock::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                                     GradMode mode, const Pass& pass) {
  const bool drop = pass.training && dropout_ > 0.0f;
  Context* c = ctx.children;
  Tensor scratch = drop ? pass.arena->tensor(dy.shape, pass.dtype) : Tensor{};  // (B, T, C)
  // MLP branch.
  Tensor df = dy;
  if (drop) {
    ops::dropout_apply(scratch, dy, dropout_, dropout_key(pass, global_index(), 2));
    df = scratch;
  }
  Tensor dg = pass.arena->tensor(c[5].input.shape, pass.dtype);      // (B, T, 4C)
  // A split backward: fc_proj's dy stays where it is (df, the caller's or our scratch,
  // untouched until this call returns) until the attention's state is dead, below.
  Pass fc_proj_pass = pass;
  fc_proj_pass.stash_into = pass.stash ? df : Tensor{};
  fc_proj_.backward(c[5], df, dg, GradMode::overwrite, fc_proj_pass);
  gelu_.backward(c[4], dg, dg, GradMode::overwrite, pass);            // elementwise, in place
  Tensor dh = pass.arena->tensor(dy.shape, pass.dtype);               // (B, T, C)
  // GELU's saved input is dead now: a split backward keeps fc's dy for W in its place.
  Pass fc_pass = pass;
  fc_pass.stash_into = pass.stash ? c[4].input : Tensor{};
  fc_.backward(c[3], dg, dh, GradMode::overwrite, fc_pass);
  Tensor dx2 = pass.arena->tensor(dy.shape, pass.dtype);              // (B, T, C)
  ops::copy(dx2, dy);
  ln2_.backward(c[2], dh, dx2, GradMode::accumulate, pass);
  // Attention branch.
  Tensor da = dx2;
  if (drop) {
    // Split: `scratch` may hold fc_proj's dy until the end; da goes to dh, dead since ln2's
    // backward and written again by the attention's only once it has read da (no more
    // scratch than the fused backward takes).
    const Tensor into = pass.stash && df.data == scratch.data ? dh : scratch;
    ops::dropout_apply(into, dx2, dropout_, dropout_key(pass, global_index(), 1));
    da = into;
  }
  // The residual sum x2 (ln2's input) is dead now: the attention's output projection keeps
  // its dy for W there in a split backward.
  Pass attn_pass = pass;
  if (pass.stash) attn_pass.stash_into = c[2].input;
  attn_.backward(c[1], da, dh, GradMode::overwrite, attn_pass);       // dh is now d(h1)
  if (pass.stash) {
    // The attention's state is dead now: fc_proj's dy moves there for W (before dx is
    // written, which a caller may have given as dy), or, where the state is smaller (a
    // GPU's log-sum-exp), into the stash.
    Tensor& kept = c[5].output_grad;
    const Tensor& state = CausalSelfAttention::state(c[1]);
    const Tensor into = state.bytes() >= kept.bytes() ? Tensor{state.data, kept.shape, kept.dtype, kept.device}
                                                      : pass.stash->tensor(kept.shape, kept.dtype);
    ops::copy(into, kept);
    kept = into;
  }
  if (mode == GradMode::accumulate) ops::add(dx, dx2);
  else ops::copy(dx, dx2);
  ln1_.backward(c[0], dh, dx, GradMode::accumulate, pass);
}

// ---- Residual ------------------------------------------------------------------------

Residual::Residual(std::vector<std::unique_ptr<Layer>> inner, std::vector<std::unique_ptr<Layer>> skip)
    : inner_(std::move(inner)), skip_(std::move(skip)) {}

void Residual::set_global_index(int index) {
  Layer::set_global_index(index);
  for (auto& part : inner_) part->set_global_index(index);
  for (auto& part : skip_) part->set_global_index(index);
}

Shape Residual::output_shape(const Shape& in) const {
  Shape s = in;
  for (const auto& part : inner_) s = part->output_shape(s);
  return s;
}

Cost Residual::cost(const Shape& in) const {
  Cost total;
  Shape s = in;
  for (const auto& part : inner_) {
    total += part->cost(s);
    s = part->output_shape(s);
  }
  Shape k = in;
  for (const auto& part : skip_) {
    total += part->cost(k);
    k = part->output_shape(k);
  }
  const double out = static_cast<double>(s.numel());
  total.forward_flops += out;
  total.backward_flops += out;
  total.activation_bytes += 4 * out;  // the sum
  return total;
}

std::vector<ParamSpec> Residual::param_specs() const {
  std::vector<ParamSpec> specs;
  for (std::size_t i = 0; i < inner_.size(); ++i) append_specs(specs, cat(i, "."), *inner_[i]);
  for (std::size_t i = 0; i < skip_.size(); ++i) append_specs(specs, i == 0 ? "skip." : "skip_norm.", *skip_[i]);
  return specs;
}

void Residual::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  std::vector<Layer*> parts;
  for (auto& part : inner_) parts.push_back(part.get());
  for (auto& part : skip_) parts.push_back(part.get());
  bind_parts(params, grads, parts);
}

void Residual::parts(std::vector<Layer*>& out) {
  out.push_back(this);
  for (auto& part : inner_) part->parts(out);
  for (auto& part : skip_) part->parts(out);
}

// Children: the inner layers in order, then the skip path's.
Tensor Residual::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const std::size_t n = inner_.size();
  Context* c = ctx.children = pass.arena->objects<Context>(n + skip_.size());
  Tensor h = x;
  for (std::size_t i = 0; i < n; ++i) h = inner_[i]->forward(h, c[i], pass);
  Tensor skip = x;
  for (std::size_t j = 0; j < skip_.size(); ++j) skip = skip_[j]->forward(skip, c[n + j], pass);
  // A fresh sum: an inner layer's context may keep its own output (ReLU does).
  Tensor y = pass.arena->tensor(h.shape, pass.dtype);
  ops::copy(y, h);
  ops::add(y, skip);
  return y;
}

// Runs layers[count-1] .. layers[0] backward from dy, the first into dx by `mode`.
static void backward_chain(std::span<const std::unique_ptr<Layer>> layers, Context* c, const Tensor& dy, const Tensor& dx,
                    GradMode mode, const Pass& pass) {
  Tensor g = dy;
  for (std::size_t i = layers.size(); i-- > 1;) {
    Tensor d = pass.arena->tensor(c[i].input.shape, pass.dtype);
    layers[i]->backward(c[i], g, d, GradMode::overwrite, pass);
    g = d;
  }
  layers[0]->backward(c[0], g, dx, mode, pass);  // dx may be empty: weight gradients only
}

void TransformerBlock::backward_weight_impl(Context& ctx, const Pass& pass) {
  fc_proj_.backward_weight(ctx.children[5], pass);
  fc_.backward_weight(ctx.children[3], pass);
  attn_.backward_weight(ctx.children[1], pass);
}

void Residual::backward_weight_impl(Context& ctx, const Pass& pass) {
  for (std::size_t i = inner_.size(); i-- > 0;) inner_[i]->backward_weight(ctx.children[i], pass);
  for (std::size_t j = skip_.size(); j-- > 0;) skip_[j]->backward_weight(ctx.children[inner_.size() + j], pass);
}

void Residual::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  Context* c = ctx.children;
  backward_chain(inner_, c, dy, dx, mode, pass);
  if (!skip_.empty()) backward_chain(skip_, c + inner_.size(), dy, dx, GradMode::accumulate, pass);
  else if (!dx.empty()) ops::add(dx, dy);
}

// ---- CrossEntropyLoss --------------------------------------------------------------

Cost CrossEntropyLoss::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel());
  return {4 * n, 3 * n, 0, f32_bytes(static_cast<double>(in.rows()))};
}

Tensor CrossEntropyLoss::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const int64_t rows = x.shape.rows();
  MPIPE_CHECK(pass.targets.numel() == rows, "cross-entropy: ", pass.targets.numel(),
              " targets for ", rows, " rows");
  ctx.saved[0] = pass.arena->tensor(Shape{rows});  // log-sum-exp (N), fp32
  ctx.saved[1] = pass.targets;
  ctx.value = ops::crossentropy_forward(ctx.saved[0], x, pass.targets, pass.device_loss_sum);
  if (!pass.training) ctx.correct = static_cast<double>(ops::count_correct(x, pass.targets));
  // The summed loss on the CPU. On a GPU the sum went to pass.device_loss_sum, which the
  // executor reads once per step, and this output is zero.
  Tensor loss = pass.arena->zeros(Shape{1});
  if (loss.device == Device::cpu) loss.f32()[0] = static_cast<float>(ctx.value);
  return loss;
}

void CrossEntropyLoss::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                                     GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, "cross-entropy writes its gradient");
  ops::crossentropy_backward(dx, ctx.input, ctx.saved[0], ctx.saved[1], pass.loss_scale);
}

}  // namespace mpipe
