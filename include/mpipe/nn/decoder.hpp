// Generation from a model of tokens (`mpipe generate`): a range of a model's layers (all
// of them on one process, a stage's under mpirun) run forward over new tokens of several
// sequences, each with its own key/value caches (Decode in nn/layer.hpp), so that a new
// token costs one position's work, not the whole prefix's; and the sampling of the next
// token from the logits.
//
// The layers the model's training forward runs, with the same ops: a sequence's logits
// at a position equal those of a full forward over its prefix up to the attention's
// order of summation. Past the model's context (the embedding's positions) a sequence
// keeps its last half and runs it again from position 0 (Decoder::next_feed): learned
// positions do not shift, so every cached row would change; nor do RoPE's rotated keys.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "mpipe/core/arena.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/nn/model.hpp"

namespace mpipe {

// Whether `model` can generate (a model of tokens made of the layer kinds generation
// runs: embedding, block, attention, layernorm, linear, gelu, relu, dropout, the head as
// a linear layer or vocabulary chunks, the loss); the problem, or empty.
std::string generation_problem(const Model& model);

// The split of [0, model.size()) into `stages` contiguous ranges for generation: the
// layers' one-token forward FLOPs balanced, the head (the layers after the last one that
// looks across positions) kept whole on the last stage. `stages` boundaries: the first
// layer of each stage, then model.size().
std::vector<int> generation_stages(const Model& model, int stages);

class Decoder {
 public:
  // Layers [begin, end) of `model`, their parameters bound already (a ParamStore of
  // them), for `sequences` sequences of up to the model's context each, on `device` in
  // `dtype` (the store's compute type).
  Decoder(Model& model, int begin, int end, int sequences, Device device, DType dtype);

  int begin() const { return begin_; }
  int end() const { return end_; }
  std::int64_t context() const { return capacity_; }
  // What the range takes in for t new tokens: (1, t) int32 tokens on the first stage,
  // else (1, t, C) activations of the stage's type.
  Shape input_shape(std::int64_t t) const;
  DType input_dtype() const;
  // Room for t new tokens' input on the decoder's device (the prompt's, or a message's).
  Tensor input(std::int64_t t) const { return input_.head(input_shape(t)); }
  // Whether the range ends with the head: forward() then returns the logits.
  bool has_head() const { return end_ == model_.size(); }
  std::int64_t vocab() const { return vocab_; }

  // Which of a sequence's tokens its next forward takes, at which position: the last
  // `count` of its `size`, at `position`. Its prompt (`fresh`) from position 0, its last
  // context's worth; then its newest token; with the caches full, its last half again
  // from position 0 (learned positions do not shift). Notes the caches' fill.
  struct Feed {
    std::int64_t count, position;
  };
  Feed next_feed(int sequence, std::int64_t size, bool fresh);

  // Forward of x (input_shape(t)) for sequence `sequence` at positions [position,
  // position + t): its caches take the new rows. Returns the range's output (1, t, C)
  // or, with the head, the logits (V) fp32 of the last position; valid until the next
  // call.
  Tensor forward(int sequence, const Tensor& x, std::int64_t position);

 private:
  Model& model_;
  int begin_, end_, head_;  // head_: the first layer past the last that looks across positions
  std::int64_t capacity_, vocab_;
  Device device_;
  DType dtype_;
  Arena caches_arena_, work_;
  std::vector<std::int64_t> filled_;         // [sequence]: positions in its caches (next_feed)
  std::vector<std::vector<Tensor>> caches_;  // [sequence][global layer]: (1, capacity, 2 KV) or empty
  Tensor input_;  // input_shape(context) of input_dtype()
  std::vector<float> logit_values_;
  Tensor logits_;  // (V) fp32 on the host, over logit_values_ (a GPU's copied there)
};

// How the next token is drawn from the logits: greedy (temperature 0: the first
// largest), else softmax(logits / temperature) cut to the top_k largest (0: all) and to
// the smallest set of the largest whose probability reaches top_p (1: all).
struct Sampling {
  double temperature = 1.0;
  std::int64_t top_k = 0;
  double top_p = 1.0;
};
// The token drawn from `logits` with the uniform number u in [0, 1). `order` is scratch
// (V indices, kept between calls: no allocation per token).
std::int32_t sample_token(std::span<const float> logits, const Sampling& sampling, float u,
                          std::vector<std::int32_t>& order, std::vector<double>& weights);
// The uniform number of sequence `sequence`'s token `index` under `seed`: the same seed,
// the same text, whatever the ranks.
inline float sampling_uniform(std::uint64_t seed, int sequence, std::int64_t index) {
  return make_stream(seed, Stream::sampling, static_cast<std::uint32_t>(sequence), 0, 0).uniform(static_cast<std::uint64_t>(index));
}

}  // namespace mpipe
