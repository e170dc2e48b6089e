// The head split over the vocabulary: views of the packed (statistics, hidden) tensor,
// the logits' GEMMs through ops, the online softmax in the backend's vocab ops.
#include "mpipe/nn/vocab_layers.hpp"

#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/registry.hpp"

namespace mpipe {

namespace {

// m, s, t and the first largest logit's index per token: four fp32 whatever the
// activations' type, since a bf16 running sum or target logit would lose the loss.
constexpr int64_t stats = 4;
constexpr std::size_t stats_bytes = stats * word_bytes;  // 16 per row
// Elements a packed row adds to the hidden states: 16 bytes are 8 bf16 exactly, or 4 fp32
// and 16 unused bytes. One width for every type, because shapes are the model's (plans,
// messages, the registry's checks), not the precision's.
constexpr int64_t packed_extra = 8;

bool packed(const Tensor& t, int64_t C) { return t.shape[-1] != C; }
int64_t packed_rows(const Tensor& t, int64_t C) { return t.numel() / (C + packed_extra); }

// The hidden states (rows, C) of a packed (.., C + 8) tensor, after its statistics, or
// all of a (.., C) one. The statistics' 16 bytes a row keep them 16-byte aligned.
Tensor hidden(const Tensor& t, int64_t C) {
  Tensor h = t;
  if (!packed(t, C)) {
    h.shape = Shape{t.numel() / C, C};
    return h;
  }
  const int64_t rows = packed_rows(t, C);
  h.data = static_cast<std::byte*>(t.data) + static_cast<std::size_t>(rows) * stats_bytes;
  h.shape = Shape{rows, C};
  return h;
}

// The statistics (4, rows), fp32, at the start of a packed tensor; empty for a (.., C) one.
Tensor statistics(const Tensor& t, int64_t C) {
  if (t.empty() || !packed(t, C)) return Tensor{};
  Tensor s = t;
  s.dtype = DType::f32;
  s.shape = Shape{stats, packed_rows(t, C)};
  return s;
}

// What a packed tensor holds beyond its statistics and hidden states (16 bytes a row in
// fp32, nothing in bf16): zeroed where the tensor is written, so that its bytes, which
// travel between stages with the rest, are never stale memory.
void zero_padding(const Tensor& t, int64_t C) {
  if (t.empty() || !packed(t, C)) return;
  const Tensor h = hidden(t, C);
  const std::size_t used = static_cast<std::size_t>(packed_rows(t, C)) * stats_bytes + h.bytes();
  if (t.bytes() == used) return;
  Tensor rest = t;
  rest.data = static_cast<std::byte*>(t.data) + used;
  rest.dtype = DType::f32;
  rest.shape = Shape{static_cast<int64_t>((t.bytes() - used) / word_bytes)};
  ops::zero(rest);
}

}  // namespace

VocabChunk::VocabChunk(int64_t vocab, int64_t chunk, int64_t chunks, int64_t channels, float init_std, int tie,
                       bool recompute)
    : chunk_(chunk), channels_(channels), begin_(chunk * vocab / chunks), end_((chunk + 1) * vocab / chunks),
      init_std_(init_std), tie_(tie), recompute_(recompute) {}

Shape VocabChunk::output_shape(const Shape& in) const {
  Shape out = in;
  out[-1] = channels_ + packed_extra;
  return out;
}

Cost VocabChunk::cost(const Shape& in) const {
  const double rows = static_cast<double>(in.rows()), V = static_cast<double>(end_ - begin_), C = static_cast<double>(channels_);
  Cost c;
  c.forward_flops = 2.0 * rows * C * V + 4.0 * rows * V;   // logits, then max, exp and sum
  // dz, dX and dW, and with recompute the logits again.
  c.backward_flops = (recompute_ ? 6.0 : 4.0) * rows * C * V + 3.0 * rows * V;
  c.param_bytes = 4.0 * V * C;
  // The output (statistics and hidden states), and unless recomputed the logits.
  c.activation_bytes = f32_bytes(rows * static_cast<double>(channels_ + packed_extra) + (recompute_ ? 0.0 : rows * V));
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
  Tensor y = pass.arena->tensor(output_shape(x.shape), x.dtype);
  ops::copy(hidden(y, channels_), h);
  zero_padding(y, channels_);
  const Arena::Mark before_logits = pass.arena->mark();
  const Tensor z = logits(h, *pass.arena);
  ops::vocab_chunk_forward(statistics(y, channels_), statistics(x, channels_), z, pass.targets, begin_);
  ctx.saved[0] = statistics(y, channels_);  // backward reads m; y lives as long as this context
  ctx.saved[1] = pass.targets;
  // Recomputed, the logits die here: the arena takes their memory back (a GPU stream
  // reuses it only after the statistics' kernel, in stream order).
  if (recompute_) pass.arena->rewind(before_logits);
  else ctx.saved[2] = z;
  return y;
}

Tensor VocabChunk::logits(const Tensor& h, Arena& arena) const {
  Tensor z = arena.tensor(Shape{h.shape[0], end_ - begin_}, h.dtype);  // (rows, V)
  ops::matmul_forward(z, h, weight_, Tensor{});
  return z;
}

void VocabChunk::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  const Tensor h = hidden(ctx.input, channels_);
  // The forward's logits, kept or again bit for bit: the same GEMM on the same operands.
  const Tensor z = recompute_ ? logits(h, *pass.arena) : ctx.saved[2];
  // dz goes where the weight gradient will read it: the stash when that is later; else
  // over recomputed logits, which it replaces entry by entry (the ops read each entry
  // before writing it), or beside kept ones, which stay the forward's.
  const Tensor dz = pass.stash ? pass.stash->tensor(z.shape, z.dtype)
                    : recompute_ ? z
                                 : pass.arena->tensor(z.shape, z.dtype);
  ops::vocab_chunk_backward(dz, statistics(dx, channels_), statistics(dy, channels_), z, statistics(ctx.input, channels_),
                            ctx.saved[0], ctx.saved[1], begin_, mode);
  if (!dx.empty()) {
    // dX = dY's hidden part (this chunk passes the hidden states on) + dz W.
    const Tensor dh = hidden(dx, channels_);
    if (mode == GradMode::overwrite) {
      ops::copy(dh, hidden(dy, channels_));
      zero_padding(dx, channels_);
    } else {
      ops::add(dh, hidden(dy, channels_));
    }
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
  ctx.value = ops::vocab_loss_forward(s, pass.targets, vocab_, pass.device_loss_sum);
  if (!pass.training) ctx.correct = static_cast<double>(ops::vocab_count_correct(s, pass.targets));
  // On a GPU the sum went to pass.device_loss_sum (as cross-entropy's) and this is zero.
  Tensor loss = pass.arena->zeros(Shape{1});
  if (loss.device == Device::cpu) loss.f32()[0] = static_cast<float>(ctx.value);
  return loss;
}

void VocabLoss::backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode, const Pass& pass) {
  MPIPE_CHECK(mode == GradMode::overwrite, "cross-entropy writes its gradient");
  ops::zero(dx);  // the hidden part (and any padding); the statistics' gradient is written next
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
               "(.., C + 8) -> (.., C + 8), the statistics (four fp32 per token) before the hidden states; the loss "
               "follows the last chunk",
               {{"vocab", T::integer, std::nullopt, "tokens in the whole vocabulary"},
                {"chunk", T::integer, std::nullopt, "which chunk, from 0; chunk c covers [c vocab / n, (c + 1) vocab / n)"},
                {"chunks", T::integer, std::nullopt, "chunks the vocabulary is split into"},
                init_std,
                {"tie", T::integer, std::int64_t{-1}, "index of an earlier embedding whose token table's rows this weight is"},
                {"logits", T::text, std::string("keep"),
                 "keep the chunk's logits (rows x its vocabulary) for the backward, or recompute them there (one more GEMM)"}},
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
                 const std::int64_t C = chunk == 0 ? a.input[-1] : a.input[-1] - packed_extra;
                 const int tie = a.tied_table(vocab, C, "head's");
                 const std::string& kept = a.text("logits");
                 if (kept != "keep" && kept != "recompute")
                   a.refuse("logits", cat("must be keep or recompute, got '", kept, "'"), "e.g. logits = \"recompute\"");
                 return std::make_unique<VocabChunk>(vocab, chunk, chunks, C, static_cast<float>(a.deviation("init-std", false)), tie,
                                                     kept == "recompute");
               }});
  k.push_back({"cross_entropy",
               "the loss: softmax cross-entropy of logits (.., classes) against targets, or of the statistics of a "
               "head split over the vocabulary (after its last vocab-chunk); the last layer",
               {}, false, [](const LayerArgs& a) -> std::unique_ptr<Layer> {
                 const LayerSpec* before = a.index > 0 ? &a.model.layers[static_cast<std::size_t>(a.index - 1)] : nullptr;
                 if (before && before->kind == "vocab-chunk") {
                   const auto chunk = std::get<std::int64_t>(before->options.at("chunk")),
                              chunks = std::get<std::int64_t>(before->options.at("chunks"));
                   if (chunk != chunks - 1) a.refuse("kind", cat("follows chunk ", chunk, " of ", chunks, ", not the last"), "give every chunk of the head");
                   return std::make_unique<VocabLoss>(std::get<std::int64_t>(before->options.at("vocab")), a.input[-1] - packed_extra);
                 }
                 return std::make_unique<CrossEntropyLoss>();
               }});
  return k;
}

}  // namespace mpipe
