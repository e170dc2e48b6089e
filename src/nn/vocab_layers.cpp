// The head split over the vocabulary: views of the packed (hidden, statistics) tensor,
// the logits' GEMMs through ops, the online softmax in backend/cpu.
#include "mpipe/nn/vocab_layers.hpp"

#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/registry.hpp"

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

// ---- registry entries ----------------------------------------------------------------

// The head split over the vocabulary, and the loss (after a head's last chunk, or after
// logits).
std::vector<LayerKind> vocab_layer_kinds() {
  using T = OptionType;
  const OptionSpec init_std{"init-std", T::number, 0.02, "std of the normal initial weights"};
  std::vector<LayerKind> k;
  k.push_back({"vocab-chunk",
               "chunk c of n of a language-model head split over the vocabulary (an online softmax carried from "
               "chunk to chunk, so a pipeline can spread the head over stages): (.., C) or the previous chunk's "
               "(.., C + 4) -> (.., C + 4); the loss follows the last chunk",
               {{"vocab", T::integer, std::nullopt, "tokens in the whole vocabulary"},
                {"chunk", T::integer, std::nullopt, "which chunk, from 0; chunk c covers [c vocab / n, (c + 1) vocab / n)"},
                {"chunks", T::integer, std::nullopt, "chunks the vocabulary is split into"},
                init_std,
                {"tie", T::integer, std::int64_t{-1}, "index of an earlier embedding whose token table's rows this weight is"}},
               false,
               [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const std::int64_t vocab = a.integer("vocab"), chunks = a.integer("chunks"), chunk = a.integer("chunk", 0);
                 if (chunks > vocab) a.refuse("chunks", cat(chunks, " is more than the ", vocab, " tokens"), "give at most vocab chunks");
                 if (chunk >= chunks) a.refuse("chunk", cat(chunk, " is not below chunks = ", chunks), "number the chunks from 0");
                 // The chunks come in order, one after another, then the loss.
                 const LayerSpec* before = a.index > 0 ? &a.model.layers[static_cast<std::size_t>(a.index - 1)] : nullptr;
                 const bool follows = before && before->kind == "vocab-chunk" &&
                                      std::get<std::int64_t>(before->options.at("vocab")) == vocab &&
                                      std::get<std::int64_t>(before->options.at("chunks")) == chunks &&
                                      std::get<std::int64_t>(before->options.at("chunk")) == chunk - 1;
                 if (chunk > 0 && !follows)
                   a.refuse("chunk", cat(chunk, " does not follow chunk ", chunk - 1, " of the same vocab and chunks"), "put the chunks in order, one after another");
                 if (chunk == 0 && before && before->kind == "vocab-chunk")
                   a.refuse("chunk", "0 follows another chunk", "one head's chunks are 0 .. chunks - 1 in order");
                 const std::size_t next = static_cast<std::size_t>(a.index + 1);
                 const bool last = chunk == chunks - 1;
                 if (next < a.model.layers.size() && a.model.layers[next].kind != (last ? "cross_entropy" : "vocab-chunk"))
                   a.refuse("chunk", last ? "the last chunk must be followed by the loss (cross_entropy)" : cat("must be followed by chunk ", chunk + 1),
                            "put the chunks in order, then the loss");
                 if (a.input.rank < 2) a.refuse("kind", cat("needs (batch, …, channels), gets ", a.input.str()), "put it after a layer that makes channels");
                 const std::int64_t C = chunk == 0 ? a.input[-1] : a.input[-1] - 4;
                 const int tie = a.tied_table(vocab, C, "head's");
                 return std::make_unique<VocabChunk>(vocab, chunk, chunks, C, static_cast<float>(a.number("init-std")), tie);
               },
               false});
  k.push_back({"cross_entropy",
               "the loss: softmax cross-entropy of logits (.., classes) against targets, or of the statistics of a "
               "head split over the vocabulary (after its last vocab-chunk); the last layer",
               {}, false, [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const LayerSpec* before = a.index > 0 ? &a.model.layers[static_cast<std::size_t>(a.index - 1)] : nullptr;
                 if (before && before->kind == "vocab-chunk") {
                   const auto chunk = std::get<std::int64_t>(before->options.at("chunk")),
                              chunks = std::get<std::int64_t>(before->options.at("chunks"));
                   if (chunk != chunks - 1) a.refuse("kind", cat("follows chunk ", chunk, " of ", chunks, ", not the last"), "give every chunk of the head");
                   return std::make_unique<VocabLoss>(std::get<std::int64_t>(before->options.at("vocab")), a.input[-1] - 4);
                 }
                 return std::make_unique<CrossEntropyLoss>();
               }});
  return k;
}

}  // namespace mpipe
