// The tests' tiny GPT: one fixture, each test giving the sizes its checks were made for.
#pragma once
#include <cstdint>

#include "mpipe/app/config.hpp"

namespace mpipe::test {

struct TinyGpt {
  int layers = 2;  // transformer blocks: the model has layers + 4 (embedding, layernorm, head, loss)
  int d_model = 16, heads = 2, seq_len = 8, vocab = 32;
  float dropout = 0.1f;
  int batch_size = 8, micro_batches = 2, steps = 4;
  std::uint64_t seed = 1;
  float lr = 1e-2f, weight_decay = 0.0f;
};

inline TrainConfig tiny_gpt(const TinyGpt& g = {}) {
  TrainConfig c;
  c.model.kind = "gpt";
  c.model.layers = g.layers;
  c.model.d_model = g.d_model;
  c.model.heads = g.heads;
  c.model.seq_len = g.seq_len;
  c.model.vocab = g.vocab;
  c.model.dropout = g.dropout;
  c.batch_size = g.batch_size;
  c.micro_batches = g.micro_batches;
  c.steps = g.steps;
  c.seed = g.seed;
  c.optimizer.lr = g.lr;
  c.optimizer.weight_decay = g.weight_decay;
  return c;
}

}  // namespace mpipe::test
