// The transformer's layers (embedding, attention, block) and their kinds.
#include "mpipe/nn/transformer_layers.hpp"

#include <cmath>

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

// ---- Embedding ---------------------------------------------------------------------

Embedding::Embedding(int64_t vocab, int64_t max_seq, int64_t channels, float dropout, bool learned_positions)
    : vocab_(vocab), max_seq_(max_seq), channels_(channels), dropout_(dropout), learned_positions_(learned_positions),
      fuse_(fusions_on()) {}

Shape Embedding::output_shape(const Shape& in) const { return Shape{in[0], in[1], channels_}; }

Cost Embedding::cost(const Shape& in) const {
  const double n = static_cast<double>(in.numel()) * channels_;
  const double rows = static_cast<double>(vocab_ + (learned_positions_ ? max_seq_ : 0));
  return {n, 2 * n, f32_bytes(rows * channels_), f32_bytes(n)};
}

std::vector<ParamSpec> Embedding::param_specs() const {
  std::vector<ParamSpec> specs{{"wte", Shape{vocab_, channels_}, Init::normal, 0.02f, true}};
  if (learned_positions_) specs.push_back({"wpe", Shape{max_seq_, channels_}, Init::normal, 0.02f, true});
  return specs;
}

void Embedding::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  wte_ = params[0];
  dwte_ = grads[0];
  if (!learned_positions_) return;
  wpe_ = params[1];
  dwpe_ = grads[1];
}

Tensor Embedding::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const int64_t B = x.shape[0], T = x.shape[1], position = pass.decode ? pass.decode->position : 0;
  MPIPE_CHECK(x.shape.rank == 2 && position + T <= max_seq_, "embedding: tokens ", x.shape.str(), " at position ",
              position);
  Tensor y = pass.arena->tensor(Shape{B, T, channels_}, pass.dtype);  // (B, T, C)
  // The rows of the tokens' positions: from `position` on (none without a table).
  const Tensor rows = learned_positions_ ? Tensor{static_cast<std::byte*>(wpe_.data) + position * channels_ * dtype_size(wpe_.dtype),
                                                  Shape{max_seq_ - position, channels_}, wpe_.dtype, wpe_.device}
                                         : Tensor{};
  // Training with dropout: the mask in the same pass on a GPU (MPIPE_FUSE=off: apart).
  const bool drop = pass.training && dropout_ > 0.0f;
  const DropoutKey key = dropout_key(pass, global_index(), 0);
  ops::embedding_forward(y, x, wte_, rows, drop && fuse_ ? dropout_ : 0.0f, key);
  if (drop && !fuse_) ops::dropout_apply(y, y, dropout_, key);
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

CausalSelfAttention::CausalSelfAttention(int64_t channels, const AttentionOptions& o)
    : channels_(channels), heads_(o.heads), kv_heads_(o.kv_heads > 0 ? o.kv_heads : o.heads), rope_(o.rope),
      rope_theta_(o.rope_theta), qkv_(channels, qkv_width(), o.bias, o.init_std),
      proj_(channels, channels, o.bias, o.proj_std) {
  MPIPE_CHECK(channels % heads_ == 0 && heads_ % kv_heads_ == 0 && (!rope_ || (channels / heads_) % 2 == 0),
              "channels ", channels, " heads ", heads_, " kv heads ", kv_heads_);
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
  Cost c{a.forward_flops + b.forward_flops + core,
         a.backward_flops + b.backward_flops + 2 * core,
         a.param_bytes + b.param_bytes,
         a.activation_bytes + b.activation_bytes + f32_bytes(B * heads_ * T) + f32_bytes(B * T * C),
         a.weight_flops + b.weight_flops,
         b.weight_stash_bytes,  // the qkv projection keeps its dy where q, k, v were
         0,
         0,
         f32_bytes(B * T * (C + static_cast<double>(qkv_width())))};  // backward: d(att) (B, T, C) and dqkv (B, T, C + 2 KV)
  c.fixed_bytes = f32_bytes(B * heads_ * T);  // the log-sum-exp, fp32
  return c;
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
  Tensor qkv = qkv_.forward(x, ctx.children[0], pass);                // (B, T, C + 2 KV)
  const int64_t position = pass.decode ? pass.decode->position : 0;
  if (rope_) ops::rope_apply(qkv, heads_, kv_heads_, position, rope_theta_, false);  // the keys cached rotated
  if (pass.decode) {
    // Generation: the new keys and values join the cache's, and the queries meet every key so far.
    const Tensor& cache = pass.decode->caches[static_cast<std::size_t>(global_index())];  // (B, capacity, 2 KV)
    const int64_t capacity = cache.shape[1], width = qkv_width(), kv = width - C;
    MPIPE_CHECK(cache.shape.rank == 3 && cache.shape[0] == B && cache.shape[2] == kv && position + T <= capacity,
                "attention cache ", cache.shape.str(), " for ", T, " tokens at position ", position);
    for (int64_t b = 0; b < B; ++b)
      ops::copy_runs(cache, qkv, Runs{.count = T, .length = kv, .dst_stride = kv, .dst_offset = (b * capacity + position) * kv,
                                      .src_stride = width, .src_offset = b * T * width + C});
    Tensor att = pass.arena->tensor(Shape{B, T, C}, pass.dtype);     // (B, T, C)
    ops::attention_decode(att, qkv, cache, position, heads_);
    return proj_.forward(att, ctx.children[1], pass);
  }
  Tensor att = pass.arena->tensor(Shape{B, T, C}, pass.dtype);       // (B, T, C)
  // (B, H, T) log-sum-exp, fp32: no (T, T) probabilities are kept.
  Tensor state = pass.arena->tensor(ops::attention_state_shape(B, heads_, T));
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
  Tensor dqkv = pass.arena->tensor(Shape{B, T, qkv_width()}, pass.dtype);  // (B, T, C + 2 KV)
  // The attention output is the projection's input, which its context keeps.
  ops::attention_backward(dqkv, datt, ctx.saved[0], ctx.children[1].input, ctx.saved[1]);
  if (rope_) ops::rope_apply(dqkv, heads_, kv_heads_, 0, rope_theta_, true);  // the projection's dy: rotated back
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

TransformerBlock::TransformerBlock(int64_t channels, const BlockOptions& o)
    : channels_(channels), ffn_(o.ffn > 0 ? o.ffn : 4 * channels), swiglu_(o.swiglu), ln1_(channels, o.norm, o.norm_eps),
      ln2_(channels, o.norm, o.norm_eps), attn_(channels, o.attention),
      fc_(channels, (o.swiglu ? 2 : 1) * ffn_, o.attention.bias, o.attention.init_std),
      fc_proj_(ffn_, channels, o.attention.bias, o.attention.proj_std), dropout_(o.dropout), fuse_(fusions_on()) {}

void TransformerBlock::set_global_index(int index) {
  Layer::set_global_index(index);
  for (Layer* part : std::initializer_list<Layer*>{&ln1_, &attn_, &ln2_, &fc_, &gelu_, &swiglu_act_, &fc_proj_})
    part->set_global_index(index);
}

Cost TransformerBlock::cost(const Shape& in) const {
  Shape wide = in, fc_out = in;  // (B, T, F): the activation's output; (B, T, F or 2F): fc's
  wide[-1] = ffn_;
  fc_out[-1] = (swiglu_ ? 2 : 1) * ffn_;
  const Cost act = swiglu_ ? swiglu_act_.cost(fc_out) : gelu_.cost(wide);
  Cost total;
  for (const Cost& c : {ln1_.cost(in), attn_.cost(in), ln2_.cost(in), fc_.cost(in), act, fc_proj_.cost(wide)})
    total += c;
  total.backward_scratch_bytes = 0;  // set below: the parts' do not add up
  const double n = static_cast<double>(in.numel()), f = static_cast<double>(wide.numel());
  total.activation_bytes += f32_bytes(n);  // the residual sum
  // --remat selective: the two norms' outputs (B, T, C) and the activation's (B, T, F)
  // are recomputed from what is kept (their inputs; the norms' statistics with them).
  total.recomputable_bytes = f32_bytes(2 * n + f);
  total.recompute_flops = ln1_.cost(in).forward_flops + ln2_.cost(in).forward_flops + act.forward_flops;
  // Its backward's temporaries, alive together: dg (B, T, F) (and SwiGLU's gradient of
  // [gate | up], (B, T, 2F)), dh and dx2 (B, T, C), the dropout scratch (B, T, C) with
  // dropout, and the attention's inside.
  total.backward_scratch_bytes = f32_bytes(f * (swiglu_ ? 3 : 1) + n * (2 + (dropout_ > 0 ? 1 : 0))) +
                                 attn_.cost(in).backward_scratch_bytes;
  // W keeps every dy in buffers B is done with: fc's where GELU's input was, the
  // attention's qkv and output projection theirs where q, k, v and the residual sum were,
  // fc_proj's (B, T, C) where the attention's log-sum-exp (B, H, T) was when H >= C;
  // otherwise (every real model) it takes stash memory.
  total.weight_stash_bytes = attn_.heads() >= channels_ ? 0.0 : fc_proj_.cost(wide).weight_stash_bytes;
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
  // --remat selective: LayerNorm's and GELU's outputs (and LayerNorm's statistics) into
  // the transient arena; the backward recomputes them (recompute_parts below).
  Pass light = pass;
  if (pass.transient) light.arena = pass.transient;
  ctx.recompute_parts = pass.transient != nullptr;
  Tensor h1 = ln1_.forward(x, c[0], light);
  Tensor a = attn_.forward(h1, c[1], pass);  // (B, T, C), owned by this call
  // a becomes x2 = x + drop(attn(ln1(x))) and h2 = ln2(x2), in one pass over the rows
  // (MPIPE_FUSE=off: in three).
  const float p = drop ? dropout_ : 0.0f;
  Tensor h2;
  if (fuse_) {
    h2 = ln2_.forward_sum(a, x, p, dropout_key(pass, global_index(), 1), c[2], light);
  } else {
    if (drop) ops::dropout_apply(a, a, dropout_, dropout_key(pass, global_index(), 1));
    ops::add(a, x);
    h2 = ln2_.forward(a, c[2], light);
  }
  // GELU(fc(h2)): one GEMM epilogue on a GPU; under selective GELU apart, as its
  // recomputation will be (bf16 on a GPU: the epilogue's rounding is cuBLASLt's own).
  // SwiGLU's after its GEMM.
  Tensor g = ctx.recompute_parts || swiglu_ ? activation().forward(fc_.forward(h2, c[3], pass), c[4], light)
                                            : fc_.forward_gelu(h2, c[3], c[4], pass);
  Tensor f = fc_proj_.forward(g, c[5], pass);
  // y = x2 + drop(mlp(ln2(x2))): one pass (MPIPE_FUSE=off: two with dropout).
  if (fuse_) {
    ops::add_dropped(f, a, f, p, dropout_key(pass, global_index(), 2));
  } else {
    if (drop) ops::dropout_apply(f, f, dropout_, dropout_key(pass, global_index(), 2));
    ops::add(f, a);
  }
  return f;
}

void TransformerBlock::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx,
                                     GradMode mode, const Pass& pass) {
  const bool drop = pass.training && dropout_ > 0.0f;
  Context* c = ctx.children;
  if (ctx.recompute_parts) {
    // --remat selective: what the forward let go, recomputed from what it kept, with the
    // same ops on the same inputs (the same bits). Until W where split (the stash), else
    // the backward's scratch.
    Pass again = pass;
    again.recompute = true;
    again.stash = nullptr;
    if (pass.stash) again.arena = pass.stash;
    CausalSelfAttention::rebind_input(c[1], ln1_.forward(c[0].input, c[0], again));
    c[3].input = ln2_.forward(c[2].input, c[2], again);
    c[5].input = activation().forward(c[4].input, c[4], again);
  }
  Tensor scratch = drop ? pass.arena->tensor(dy.shape, pass.dtype) : Tensor{};  // (B, T, C)
  // MLP branch.
  Tensor df = dy;
  if (drop) {
    ops::dropout_apply(scratch, dy, dropout_, dropout_key(pass, global_index(), 2));
    df = scratch;
  }
  Tensor dg = pass.arena->tensor(c[5].input.shape, pass.dtype);      // (B, T, F)
  // A split backward: fc_proj's dy stays where it is (df, the caller's or our scratch,
  // untouched until this call returns) until the attention's state is dead, below.
  Pass fc_proj_pass = pass;
  fc_proj_pass.stash_into = pass.stash ? df : Tensor{};
  fc_proj_.backward(c[5], df, dg, GradMode::overwrite, fc_proj_pass);
  if (swiglu_) {
    Tensor du = pass.arena->tensor(c[4].input.shape, pass.dtype);    // (B, T, 2F): d[gate | up]
    swiglu_act_.backward(c[4], dg, du, GradMode::overwrite, pass);
    dg = du;
  } else {
    gelu_.backward(c[4], dg, dg, GradMode::overwrite, pass);          // elementwise, in place
  }
  Tensor dh = pass.arena->tensor(dy.shape, pass.dtype);               // (B, T, C)
  // The activation's saved input (fc's output) is dead now: a split backward keeps fc's
  // dy for W in its place.
  Pass fc_pass = pass;
  fc_pass.stash_into = pass.stash ? c[4].input : Tensor{};
  fc_.backward(c[3], dg, dh, GradMode::overwrite, fc_pass);
  Tensor dx2 = pass.arena->tensor(dy.shape, pass.dtype);              // (B, T, C)
  ln2_.backward_onto(c[2], dh, dx2, dy);                              // dx2 = dy + ln2's gradient
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
    // written, which a caller may have given as dy), or, where the state is smaller (its
    // log-sum-exp, unless H >= C), into the stash.
    Tensor& kept = c[5].output_grad;
    const Tensor& state = CausalSelfAttention::state(c[1]);
    const Tensor into = state.bytes() >= kept.bytes() ? Tensor{state.data, kept.shape, kept.dtype, kept.device}
                                                      : pass.stash->tensor(kept.shape, kept.dtype);
    ops::copy(into, kept);
    kept = into;
  }
  if (mode == GradMode::accumulate) {
    ops::add(dx, dx2);
    ln1_.backward(c[0], dh, dx, GradMode::accumulate, pass);
  } else {
    ln1_.backward_onto(c[0], dh, dx, dx2);  // dx = dx2 + ln1's gradient
  }
}

void TransformerBlock::backward_weight_impl(Context& ctx, const Pass& pass) {
  fc_proj_.backward_weight(ctx.children[5], pass);
  fc_.backward_weight(ctx.children[3], pass);
  attn_.backward_weight(ctx.children[1], pass);
}

// ---- registry entries ----------------------------------------------------------------

namespace {

// What the attention layers take: a (B, T, C) input, heads dividing C, key/value heads
// dividing heads, an even head size under RoPE, the weights' init-std and proj-std (-1:
// GPT-2's init-std / sqrt(2 N), N the model's blocks).
AttentionOptions attention_args(const LayerArgs& a) {
  if (a.input.rank != 3)
    a.refuse("kind", cat("needs a sequence (batch, tokens, channels), gets ", a.input.str()), "put it after an embedding");
  AttentionOptions o;
  const std::int64_t c = a.input[-1];
  o.heads = a.integer("heads");
  if (c % o.heads != 0) a.refuse("heads", cat(o.heads, " does not divide the ", c, " channels coming in"), "pick heads dividing the channels");
  o.kv_heads = a.integer("kv-heads", 0);
  if (o.kv_heads == 0) o.kv_heads = o.heads;
  if (o.kv_heads > o.heads || o.heads % o.kv_heads != 0)
    a.refuse("kv-heads", cat(o.kv_heads, " does not divide the ", o.heads, " heads"),
             "give key/value heads dividing heads (1: multi-query; heads: multi-head; 0: as heads)");
  const std::string& positions = a.text("positions");
  if (positions != "learned" && positions != "rope")
    a.refuse("positions", cat("must be \"learned\" (the embedding's table) or \"rope\", got \"", positions, "\""), "e.g. positions = \"rope\"");
  o.rope = positions == "rope";
  if (o.rope && (c / o.heads) % 2 != 0)
    a.refuse("positions", cat("RoPE needs an even head size, and ", c, " channels over ", o.heads, " heads give ", c / o.heads),
             "pick heads giving an even head size");
  const double theta = a.number("rope-theta");
  if (!(theta > 1.0 && theta <= 1e9)) a.refuse("rope-theta", cat("must be in (1, 1e9], got ", theta), "e.g. rope-theta = 10000 (Llama 2) or 500000 (Llama 3)");
  o.rope_theta = static_cast<float>(theta);
  o.bias = a.boolean("bias");
  int blocks = 0;
  for (const LayerSpec& l : a.model.layers) blocks += l.kind == "block" ? 1 : 0;
  const double init = a.deviation("init-std", false), proj = a.deviation("proj-std", true);
  o.init_std = static_cast<float>(init);
  o.proj_std = static_cast<float>(proj < 0 ? init / std::sqrt(2.0 * std::max(blocks, 1)) : proj);
  return o;
}

}  // namespace

std::vector<LayerKind> transformer_layer_kinds() {
  using T = OptionType;
  const OptionSpec init_std{"init-std", T::number, 0.02, "std of the normal initial weights"};
  // The attention's options, shared by block and attention.
  const std::vector<OptionSpec> attention_options{
      {"heads", T::integer, std::nullopt, "attention heads (dividing C)"},
      {"kv-heads", T::integer, std::int64_t{0}, "key/value heads, dividing heads (grouped-query attention; 1: multi-query; 0: as heads)"},
      {"positions", T::text, std::string("learned"), "\"learned\" (the embedding's position table) or \"rope\" (rotary, on q and k; rope-theta)"},
      {"rope-theta", T::number, 10000.0, "RoPE's base: angle p · theta^(-2i/d) at position p"},
      {"bias", T::boolean, true, "biases on the projections"},
      init_std};
  std::vector<LayerKind> k;
  k.push_back({"embedding", "token embedding (+ a learned position embedding), then dropout: tokens (B, T) -> (B, T, out)",
               {{"vocab", T::integer, std::nullopt, "tokens in the vocabulary"},
                {"out", T::integer, std::nullopt, "channels"},
                {"positions", T::text, std::string("learned"), "\"learned\" (a position table) or \"none\" (RoPE's models)"},
                {"dropout", T::number, 0.0, "dropout probability after the embedding"}},
               true,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 if (a.input.rank != 2) a.refuse("kind", cat("takes token ids (batch, tokens), gets ", a.input.str()), "put it first, in a model of tokens");
                 const std::string& positions = a.text("positions");
                 if (positions != "learned" && positions != "none")
                   a.refuse("positions", cat("must be \"learned\" or \"none\", got \"", positions, "\""), "e.g. positions = \"none\" with RoPE blocks");
                 return std::make_unique<Embedding>(a.integer("vocab"), a.input[1], a.integer("out"),
                                                    static_cast<float>(a.number("dropout")), positions == "learned");
               }});
  std::vector<OptionSpec> block_options = attention_options;
  for (const OptionSpec& o : std::initializer_list<OptionSpec>{
           {"norm", T::text, std::string("layer"), "\"layer\" (LayerNorm) or \"rms\" (RMSNorm; eps)"},
           {"eps", T::number, 1e-5, "RMSNorm's eps"},
           {"mlp", T::text, std::string("gelu"), "\"gelu\" (fc, GELU, proj) or \"swiglu\" (down(silu(gate) · up))"},
           {"ffn", T::integer, std::int64_t{0}, "the MLP's hidden width (0: 4C for gelu, Llama's 8C/3 rounded up to 256 for swiglu)"},
           {"dropout", T::number, 0.0, "dropout probability"},
           {"proj-std", T::number, -1.0, "std of the residual projections; -1: init-std / sqrt(2 x blocks), as GPT-2"}})
    block_options.push_back(o);
  k.push_back({"block", "transformer block (pre-norm attention and MLP, residual): (B, T, C) -> (B, T, C)",
               block_options,
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 BlockOptions o;
                 o.attention = attention_args(a);
                 const std::string& norm = a.text("norm");
                 if (norm != "layer" && norm != "rms") a.refuse("norm", cat("must be \"layer\" or \"rms\", got \"", norm, "\""), "e.g. norm = \"rms\"");
                 o.norm = norm == "rms" ? NormKind::rms : NormKind::layer;
                 o.norm_eps = norm_eps(a);
                 const std::string& mlp = a.text("mlp");
                 if (mlp != "gelu" && mlp != "swiglu") a.refuse("mlp", cat("must be \"gelu\" or \"swiglu\", got \"", mlp, "\""), "e.g. mlp = \"swiglu\"");
                 o.swiglu = mlp == "swiglu";
                 o.ffn = a.integer("ffn", 0);
                 if (o.ffn == 0) o.ffn = o.swiglu ? llama_ffn(a.input[-1]) : 4 * a.input[-1];
                 const double dropout = a.number("dropout");
                 if (!(dropout >= 0 && dropout < 1)) a.refuse("dropout", cat("must be in [0, 1), got ", dropout), "e.g. dropout = 0.1");
                 o.dropout = static_cast<float>(dropout);
                 return std::make_unique<TransformerBlock>(a.input[-1], o);
               }});
  std::vector<OptionSpec> only_attention = attention_options;
  only_attention.push_back({"proj-std", T::number, -1.0, "std of the output projection; -1: init-std / sqrt(2 x blocks), as GPT-2"});
  k.push_back({"attention", "causal self-attention with its input and output projections: (B, T, C) -> (B, T, C)",
               only_attention,
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 return std::make_unique<CausalSelfAttention>(a.input[-1], attention_args(a));
               },
               true});
  return k;
}

std::int64_t llama_ffn(std::int64_t channels) {
  constexpr std::int64_t multiple = 256;  // Llama's multiple_of
  const std::int64_t f = 8 * channels / 3;  // int(2 · 4C / 3), as Meta's and torchtitan's args
  return (f + multiple - 1) / multiple * multiple;
}
}  // namespace mpipe
