// A language-model head split over the vocabulary, so that a pipeline can spread it
// over stages: a head heavier than a stage's share of the model sets the pace as one
// layer (GPT-2 small's on 8 stages: docs/schedules.md).
//
// Chunk c of n computes the logits of vocabulary entries [c V / n, (c + 1) V / n) and
// folds them into per-token statistics of an online softmax (Milakov and Gimelshein
// 2018): the running maximum m, the sum s of e^(z - m), the target's logit t and the
// index of the first largest logit. Its output carries the hidden states on, for the
// next chunk, with the statistics: a (.., C + 8) tensor of the activations' type packed
// as the four statistics first, fp32 as (4, rows) in the first 16 bytes a row, then the
// hidden states (rows, C) at byte 16 rows; 8 extra elements are those 16 bytes in bf16,
// and leave 16 unused (zeroed) bytes a row in fp32, so the shape is one for every type.
// The loss after the last chunk is m + log s - t. Backward is exact: m is only a
// stabiliser (the loss does not depend on it), and the gradient of s carries the
// softmax's normaliser back through the chunks, so each chunk's dz is softmax - onehot
// as in one head; dX sums every chunk's dz W. A chunk keeps its logits (rows x V a
// micro-batch) for the backward, or with logits = "recompute" keeps none between forward
// and backward and computes them again there with the forward's GEMM, bit for bit (one
// more GEMM for rows x V less memory per micro-batch in flight). With `tie`, chunk c's weight is rows of the embedding's token table (GPT-2's tied
// head), its gradient summed into those rows.
#pragma once
#include "mpipe/nn/layer.hpp"

namespace mpipe {

class VocabChunk final : public Layer {
 public:
  // `tie`: the embedding layer whose token table this is a slice of, or -1.
  // `recompute`: the backward computes the logits again instead of keeping them.
  VocabChunk(int64_t vocab, int64_t chunk, int64_t chunks, int64_t channels, float init_std, int tie, bool recompute);
  std::string kind() const override { return "vocab-chunk"; }
  bool defers_weight() const override { return true; }
  bool needs_targets() const override { return true; }
  Shape output_shape(const Shape& in) const override;
  Cost cost(const Shape& in) const override;
  std::vector<ParamSpec> param_specs() const override;
  void bind(std::span<const Tensor> params, std::span<const Tensor> grads) override;
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  // This chunk's logits (rows, V) of the hidden states h (rows, C), in `arena` (generation
  // reads them whole).
  Tensor logits(const Tensor& h, Arena& arena) const;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;
  void backward_weight_impl(Context& ctx, const Pass& pass) override;

 private:
  int64_t chunk_, channels_, begin_, end_;
  float init_std_;
  int tie_;
  bool recompute_;
  Tensor weight_, dweight_;
};

// The loss after the last chunk: sum over tokens of m + log s - t, as CrossEntropyLoss
// (its kind is the same: the model's last layer); backward ignores dy and writes the
// statistics' gradient (ds = loss_scale / s, dt = -loss_scale), the hidden part zero.
class VocabLoss final : public Layer {
 public:
  VocabLoss(int64_t vocab, int64_t channels) : vocab_(vocab), channels_(channels) {}
  std::string kind() const override { return "cross_entropy"; }
  bool needs_targets() const override { return true; }
  Shape output_shape(const Shape& in) const override { return Shape{1}; }
  Cost cost(const Shape& in) const override;

 protected:
  Tensor forward_impl(const Tensor& x, Context& ctx, const Pass& pass) override;
  void backward_impl(Context& ctx, const Tensor& dy, const Tensor& dx, GradMode mode,
                     const Pass& pass) override;

 private:
  int64_t vocab_, channels_;
};

// This file's layer kinds, for the registry (nn/registry.hpp).
struct LayerKind;
std::vector<LayerKind> vocab_layer_kinds();

}  // namespace mpipe
