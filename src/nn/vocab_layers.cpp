// The head split over the vocabulary: views of the packed (hidden, statistics) tensor,
// the logits' GEMMs through ops, the online softmax in backend/cpu.
#include "mpipe/nn/vocab_layers.hpp"

namespace mpipe {

namespace {

constexpr int64_t stats = 4;  // m, s, t, argmax per token

// The hidden states (rows, C) of a packed (.., C + 4) tensor, or all of a (.., C) one.
Tensor hidden(const Tensor& t, int64_t C) {
  Tensor h = t;
  h.shape = Shape{t.numel() / (t.shape[-1] == C ? C : C + stats), C};
  return h;
}

// The statistics (4, rows) after the hidden states; empty for a (.., C) tensor.
Tensor statistics(const Tensor& t, int64_t C) {
  if (t.empty() || t.shape[-1] == C) return Tensor{};
  const int64_t rows = t.numel() / (C + stats);
  Tensor s = t;
  s.data = static_cast<float*>(t.data) + rows * C;
  s.shape = Shape{stats, rows};
  return s;
}

}  // namespace

VocabChunk::VocabChunk(int64_t vocab, int64_t chunk, int64_t chunks, int64_t channels, float init_std, int tie)
    : chunk_(chunk), channels_(channels), begin_(chunk * vocab / chunks), end_((chunk + 1) * vocab / chunks),
      init_std_(init_std), tie_(tie) {}

Shape VocabChunk::output_shape(const Shape& in) const {
  Shape out = in;
  out[-1] = channels_ + stats;
  return out;
}

Cost VocabChunk::cost(const Shape& in) const {
  const double rows = static_cast<double>(in.rows()), V = static_cast<double>(end_ - begin_), C = static_cast<double>(channels_);
  Cost c;
  c.forward_flops = 2.0 * rows * C * V + 4.0 * rows * V;   // logits, then max, exp and sum
  c.backward_flops = 4.0 * rows * C * V + 3.0 * rows * V;  // dz, dX and dW
  c.param_bytes = 4.0 * V * C;
  c.activation_bytes = 4.0 * (rows * V + rows * (C + stats));  // the logits and the output
  c.weight_flops = 2.0 * rows * C * V;
  c.weight_stash_bytes = 4.0 * rows * V;  // dz
  return c;
}

std::vector<ParamSpec> VocabChunk::param_specs() const {
  ParamSpec w{"weight", Shape{end_ - begin_, channels_}, Init::normal, init_std_, true};
  if (tie_ >= 0) {
    w.tied_layer = tie_;
    w.tied_name = "wte";
    w.tied_rows_begin = begin_;
    w.tied_rows_end = end_;
  }
  return {w};
}

void VocabChunk::bind(std::span<const Tensor> params, std::span<const Tensor> grads) {
  weight_ = params[0];
  dweight_ = grads[0];
}

Tensor VocabChunk::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const Tensor h = hidden(x, channels_);
  const int64_t rows = h.shape[0];
  MPIPE_CHECK(pass.targets.numel() == rows, "vocab-chunk layer ", global_index(), ": ", pass.targets.numel(),
              " targets for ", rows, " rows");
  Tensor y = pass.arena->tensor(output_shape(x.shape), pass.dtype);
  ops::copy(hidden(y, channels_), h);
  Tensor z = pass.arena->tensor(Shape{rows, end_ - begin_});
  ops::matmul_forward(z, h, weight_, Tensor{});
  ops::vocab_chunk_forward(statistics(y, channels_), statistics(x, channels_), z, pass.targets, begin_);
  ctx.saved[0] = z;
  ctx.saved[1] = statistics(y, channels_);  // backward reads m; y lives as long as this context
  ctx.saved[2] = pass.targets;
  return y;
}

void VocabChunk::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  const Tensor& z = ctx.saved[0];
  // dz goes where the weight gradient will read it: the stash when that is later.
  Tensor dz = (pass.stash ? pass.stash : pass.arena)->tensor(z.shape);
  ops::vocab_chunk_backward(dz, statistics(dx, channels_), statistics(dy, channels_), z, statistics(ctx.input, channels_),
                            ctx.saved[1], ctx.saved[2], begin_, mode);
  const Tensor h = hidden(ctx.input, channels_);
  if (!dx.empty()) {
    // dX = dY's hidden part (this chunk passes the hidden states on) + dz W.
    const Tensor dh = hidden(dx, channels_);
    if (mode == GradMode::overwrite) ops::copy(dh, hidden(dy, channels_));
    else ops::add(dh, hidden(dy, channels_));
    ops::matmul_backward(dh, Tensor{}, Tensor{}, dz, h, weight_, GradMode::accumulate);
  }
  if (pass.stash) ctx.output_grad = dz;
  else ops::matmul_backward(Tensor{}, dweight_, Tensor{}, dz, h, weight_, GradMode::accumulate);
}

void VocabChunk::backward_weight_impl(Context& ctx, const Pass& pass) {
  MPIPE_CHECK(!ctx.output_grad.empty(), "vocab-chunk layer ", global_index(), ": weight gradient without a split backward");
  ops::matmul_backward(Tensor{}, dweight_, Tensor{}, ctx.output_grad, hidden(ctx.input, channels_), weight_,
                       GradMode::accumulate);
  ctx.output_grad = Tensor{};
}

Cost VocabLoss::cost(const Shape& in) const {
  const double rows = static_cast<double>(in.rows());
  return {4 * rows, 3 * rows, 0, 4.0 * rows};
}

Tensor VocabLoss::forward_impl(const Tensor& x, Context& ctx, const Pass& pass) {
  const Tensor s = statistics(x, channels_);
  const int64_t rows = s.shape[1];
  MPIPE_CHECK(pass.targets.numel() == rows, "cross-entropy: ", pass.targets.numel(), " targets for ", rows, " rows");
  ctx.value = ops::vocab_loss_forward(s, pass.targets, vocab_);
  if (!pass.training) ctx.correct = static_cast<double>(ops::vocab_count_correct(s, pass.targets));
  Tensor loss = pass.arena->zeros(Shape{1});
  loss.f32()[0] = static_cast<float>(ctx.value);
  return loss;
}

void VocabLoss::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, "cross-entropy writes its gradient");
  ops::zero(hidden(dx, channels_));
  ops::vocab_loss_backward(statistics(dx, channels_), statistics(ctx.input, channels_), pass.loss_scale);
}

}  // namespace mpipe
