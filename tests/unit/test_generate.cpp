// Generation (nn/decoder.hpp): the attention over a key/value cache against the training
// forward's, a model's logits token by token against one forward over the whole
// sequence (a linear head and one in vocabulary chunks), the sampling rules, and the
// split of the layers over ranks.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "gradcheck.hpp"
#include "mpipe/app/sample.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/nn/decoder.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/nn/vocab_layers.hpp"
#include "tiny_gpt.hpp"

using namespace mpipe;
using mpipe::test::random_vector;

namespace {

double worst(const float* a, const float* b, std::size_t n) {
  double d = 0;
  for (std::size_t i = 0; i < n; ++i) d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

// Logits (T, V) of one eval forward of the whole model but the loss over tokens (1, T),
// or, for a head in vocabulary chunks, each chunk's logits of the final LayerNorm's output.
std::vector<float> full_logits(Model& model, const std::vector<std::int32_t>& tokens) {
  const auto T = static_cast<std::int64_t>(tokens.size());
  std::vector<std::int32_t> ids = tokens;
  Arena arena;
  Pass pass;
  pass.arena = &arena;
  pass.training = false;
  Tensor y{ids.data(), Shape{1, T}, DType::i32, Device::cpu};
  std::vector<float> out;
  for (int i = 0; i + 1 < model.size(); ++i) {
    if (model.layer(i).kind() == "vocab-chunk") {
      const std::int64_t V = model.classes();
      out.assign(static_cast<std::size_t>(T * V), 0.0f);
      for (; model.layer(i).kind() == "vocab-chunk"; ++i) {
        const auto& chunk = static_cast<const VocabChunk&>(model.layer(i));
        const Tensor z = chunk.logits(y.view(Shape{T, y.shape[-1]}), arena);
        for (std::int64_t t = 0; t < T; ++t)
          std::copy_n(z.f32() + t * z.shape[1], z.shape[1], out.data() + t * V + chunk.begin());
      }
      return out;
    }
    Context ctx;
    y = model.layer(i).forward(y, ctx, pass);
  }
  return {y.f32(), y.f32() + y.numel()};
}

void check_decoder_matches_full_forward(int head_chunks) {
  TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 16, .heads = 2, .seq_len = 12, .vocab = 40, .dropout = 0.0f});
  c.model.head_chunks = head_chunks;
  Model model(c.model);
  ParamStore store(model, 0, model.size(), 3);
  const std::vector<std::int32_t> tokens = {3, 17, 5, 39, 0, 22, 8, 8, 31, 2, 11, 6};
  const auto T = static_cast<std::int64_t>(tokens.size());
  const std::int64_t V = model.classes();
  const std::vector<float> full = full_logits(model, tokens);
  Decoder decoder(model, 0, model.size(), 2, Device::cpu, DType::f32);
  CHECK(decoder.has_head());
  CHECK(decoder.context() == 12);
  // Sequence 1: a prompt of 4, then a token at a time; sequence 0 in between, to show the
  // caches are the sequences' own.
  std::vector<std::int32_t> ids = tokens;
  auto forward = [&](int sequence, std::int64_t from, std::int64_t count) {
    const Tensor x = decoder.input(count);
    std::copy_n(ids.data() + from, count, x.i32());
    return decoder.forward(sequence, x, from);
  };
  double diff = 0;
  Tensor z = forward(1, 0, 4);
  diff = std::max(diff, worst(z.f32(), full.data() + 3 * V, static_cast<std::size_t>(V)));
  for (std::int64_t t = 4; t < T; ++t) {
    forward(0, 0, 1 + t % 3);  // another sequence's prompt, over and over
    z = forward(1, t, 1);
    CHECK(z.shape == Shape{V});
    diff = std::max(diff, worst(z.f32(), full.data() + t * V, static_cast<std::size_t>(V)));
  }
  CHECK(diff < 1e-5);
  // Nothing trivially equal: the logits vary.
  CHECK(*std::max_element(full.begin(), full.end()) - *std::min_element(full.begin(), full.end()) > 1e-3);
  // Past the context: refused, not written out of bounds.
  CHECK_THROWS(decoder.forward(1, decoder.input(1), T));
}

}  // namespace

TEST_CASE("attention over a key/value cache equals the training forward's rows") {
  // Every head its own keys (3C wide rows), and grouped-query attention (1 key/value head
  // for 3 query heads: multi-query).
  for (const std::int64_t KVH : {std::int64_t{3}, std::int64_t{1}}) {
    INFO("key/value heads " << KVH);
    const std::int64_t B = 2, T = 150, H = 3, hs = 16, C = H * hs, KV = KVH * hs, W = C + 2 * KV;  // keys over two blocks of 128
    const std::vector<float> qkv = random_vector(static_cast<std::size_t>(B * T * W), 41);
    std::vector<float> full(static_cast<std::size_t>(B * T * C)), lse(static_cast<std::size_t>(B * H * T));
    cpu::attention_forward(full.data(), lse.data(), qkv.data(), B, T, C, H, KVH);
    // The cache: each row's keys and values (B, T, 2 KV).
    std::vector<float> cache(static_cast<std::size_t>(B * T * 2 * KV));
    for (std::int64_t r = 0; r < B * T; ++r)
      std::copy_n(qkv.begin() + r * W + C, 2 * KV, cache.begin() + r * 2 * KV);
    // The whole sequence at once (a prompt), then row by row (a token at a time).
    std::vector<float> prompt(full.size());
    cpu::attention_decode(prompt.data(), qkv.data(), cache.data(), B, T, 0, T, C, H, KVH);
    CHECK(worst(prompt.data(), full.data(), full.size()) < 1e-5);
    std::vector<float> row(static_cast<std::size_t>(B * C)), queries(static_cast<std::size_t>(B * W));
    double diff = 0;
    for (std::int64_t p = 0; p < T; ++p) {
      for (std::int64_t b = 0; b < B; ++b) std::copy_n(qkv.begin() + (b * T + p) * W, W, queries.begin() + b * W);
      cpu::attention_decode(row.data(), queries.data(), cache.data(), B, 1, p, T, C, H, KVH);
      for (std::int64_t b = 0; b < B; ++b)
        diff = std::max(diff, worst(row.data() + b * C, full.data() + (b * T + p) * C, static_cast<std::size_t>(C)));
    }
    CHECK(diff < 1e-5);
  }
}

TEST_CASE("generation: logits token by token equal one forward over the sequence (linear head)") {
  check_decoder_matches_full_forward(1);
}

TEST_CASE("generation: logits token by token equal one forward over the sequence (head in chunks)") {
  check_decoder_matches_full_forward(3);
}

TEST_CASE("sampling: greedy, temperature, top-k, top-p, the draw's number") {
  std::vector<std::int32_t> order;
  std::vector<double> weights;
  const std::vector<float> logits = {1.0f, 3.0f, 3.0f, -2.0f, std::log(3.0f) + 1.0f};
  // Greedy: the first largest, whatever the number.
  CHECK(sample_token(logits, {0.0, 0, 1.0}, 0.99f, order, weights) == 1);
  // Top-1 and a tiny top-p are greedy too.
  CHECK(sample_token(logits, {1.0, 1, 1.0}, 0.99f, order, weights) == 1);
  CHECK(sample_token(logits, {1.0, 0, 1e-6}, 0.99f, order, weights) == 1);
  // Two tokens of weights 1 and 3: the number's first quarter draws the first.
  const std::vector<float> two = {0.0f, std::log(3.0f)};
  CHECK(sample_token(two, {1.0, 0, 1.0}, 0.24f, order, weights) == 0);
  CHECK(sample_token(two, {1.0, 0, 1.0}, 0.26f, order, weights) == 1);
  // A high temperature flattens: weights 1 and 3^(1/100), about even.
  CHECK(sample_token(two, {100.0, 0, 1.0}, 0.49f, order, weights) == 0);
  // Top-k 3 keeps 1, 2 and 4 (3 and e·3 and e·3 ... by logit), never 0 or 3.
  for (float u = 0.0f; u < 1.0f; u += 0.01f) {
    const std::int32_t t = sample_token(logits, {1.0, 3, 1.0}, u, order, weights);
    CHECK((t == 1 || t == 2 || t == 4));
  }
  // Top-p 0.5 of {0.25, 0.75}... the larger alone reaches it.
  for (float u : {0.0f, 0.3f, 0.9f}) CHECK(sample_token(two, {1.0, 0, 0.5}, u, order, weights) == 1);
  // The numbers: a pure function of (seed, sequence, index).
  CHECK(sampling_uniform(1, 0, 5) == sampling_uniform(1, 0, 5));
  CHECK(sampling_uniform(1, 0, 5) != sampling_uniform(2, 0, 5));
  CHECK(sampling_uniform(1, 0, 5) != sampling_uniform(1, 1, 5));
}

TEST_CASE("generation: the layers split over ranks, the head on the last") {
  TrainConfig c = test::tiny_gpt({.layers = 6, .d_model = 16, .heads = 2, .seq_len = 8, .vocab = 32});
  c.model.head_chunks = 2;
  Model model(c.model);  // embedding, 6 blocks, layernorm, 2 chunks, loss: 11 layers
  CHECK(generation_problem(model).empty());
  CHECK(generation_stages(model, 1) == std::vector<int>{0, 11});
  const std::vector<int> three = generation_stages(model, 3);
  REQUIRE(three.size() == 4);
  CHECK(three.front() == 0);
  CHECK(three.back() == 11);
  CHECK(three[2] <= 7);  // the last stage holds the last block and the head
  for (std::size_t s = 0; s + 1 < three.size(); ++s) CHECK(three[s] < three[s + 1]);
  CHECK(generation_stages(model, 7).size() == 8);  // one layer a stage before the head
  CHECK_THROWS_AS(generation_stages(model, 8), UserError);
  TrainConfig mlp;
  mlp.model.kind = "mlp";
  CHECK(generation_problem(Model(mlp.model)).find("not a model of tokens") != std::string::npos);
}

TEST_CASE("--sample-every's log line: bytes quoted and escaped, ids for a wider vocabulary") {
  CHECK(quoted_tokens({'h', 'i', '\n', '"', '\\', 7, 200}, 256) == "\"hi\\n\\\"\\\\\\x07\\xc8\"");
  CHECK(quoted_tokens({3, 50000}, 50257) == "3 50000");
  TrainConfig c = test::tiny_gpt({.vocab = 32});
  const Model model(c.model);
  c.sample_prompt.assign(1, '\n');  // (assigning a literal trips GCC 12's -Wrestrict)
  CHECK(sampling_problem(c, model).empty());
  c.sample_prompt.assign(1, 'A');  // 65: past 32 tokens
  CHECK(sampling_problem(c, model).find("not below the vocabulary's 32") != std::string::npos);
}
