// The language-model head split over the vocabulary (nn/vocab_layers.hpp): the chunks
// and their loss compute what one linear head and cross-entropy compute, for any
// chunking; the split backward is the full one; ties to rows of the token table.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "gradcheck.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/nn/registry.hpp"
#include "mpipe/nn/transformer_layers.hpp"
#include "mpipe/nn/vocab_layers.hpp"

using namespace mpipe;
using mpipe::test::random_vector;

namespace {

constexpr std::int64_t B = 2, T = 5, C = 12, V = 37, N = B * T;

Tensor tokens(std::vector<std::int32_t>& t) { return {t.data(), Shape{B, T}, DType::i32, Device::cpu}; }

double largest(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

double worst_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i) d = std::max(d, static_cast<double>(std::fabs(a[i] - b[i])));
  return d;
}

struct Head {
  double loss = 0, correct = 0;
  std::vector<float> dx, dw;
};

// One linear head and cross-entropy over x (B, T, C), weight (V, C).
Head one_head(const std::vector<float>& x, std::vector<float>& w, std::vector<std::int32_t>& targets, bool training) {
  Arena arena;
  Pass pass;
  pass.arena = &arena;
  pass.training = training;
  pass.targets = tokens(targets);
  pass.loss_scale = 1.0f / N;
  Head out;
  out.dx.assign(x.size(), 0.0f);
  out.dw.assign(w.size(), 0.0f);
  Linear head(C, V, false, 0.02f);
  head.bind(std::vector<Tensor>{make_tensor(w.data(), Shape{V, C})}, std::vector<Tensor>{make_tensor(out.dw.data(), Shape{V, C})});
  CrossEntropyLoss loss;
  Context hc, lc;
  const Tensor logits = head.forward(make_tensor(const_cast<float*>(x.data()), Shape{B, T, C}), hc, pass);
  loss.forward(logits, lc, pass);
  out.loss = lc.value;
  out.correct = lc.correct;
  if (!training) return out;
  const Tensor dlogits = arena.tensor(logits.shape);
  float one = 1.0f;
  loss.backward(lc, make_tensor(&one, Shape{1}), dlogits, GradMode::overwrite, pass);
  head.backward(hc, dlogits, make_tensor(out.dx.data(), Shape{B, T, C}), GradMode::overwrite, pass);
  return out;
}

// The same head as `chunks` vocabulary chunks and their loss; `split`: the weight
// gradients through the stash and backward_weight().
Head chunked_head(const std::vector<float>& x, std::vector<float>& w, std::vector<std::int32_t>& targets, int chunks,
                  bool training, bool split = false) {
  Arena arena, stash;
  Pass pass;
  pass.arena = &arena;
  pass.training = training;
  pass.targets = tokens(targets);
  pass.loss_scale = 1.0f / N;
  if (split) pass.stash = &stash;
  Head out;
  out.dx.assign(x.size(), 0.0f);
  out.dw.assign(w.size(), 0.0f);
  std::vector<std::unique_ptr<VocabChunk>> layers;
  for (int c = 0; c < chunks; ++c) {
    // Chunks alternately keep and recompute their logits: the same bits either way.
    layers.push_back(std::make_unique<VocabChunk>(V, c, chunks, C, 0.02f, -1, c % 2 == 1));
    VocabChunk& l = *layers.back();
    const Shape rows{l.end() - l.begin(), C};
    l.bind(std::vector<Tensor>{make_tensor(w.data() + l.begin() * C, rows)},
           std::vector<Tensor>{make_tensor(out.dw.data() + l.begin() * C, rows)});
  }
  VocabLoss loss(V, C);
  std::vector<Context> ctx(static_cast<std::size_t>(chunks + 1));
  Tensor y = make_tensor(const_cast<float*>(x.data()), Shape{B, T, C});
  for (int c = 0; c < chunks; ++c) y = layers[static_cast<std::size_t>(c)]->forward(y, ctx[static_cast<std::size_t>(c)], pass);
  CHECK(y.shape == Shape{B, T, C + 8});
  loss.forward(y, ctx.back(), pass);
  out.loss = ctx.back().value;
  out.correct = ctx.back().correct;
  if (!training) return out;
  float one = 1.0f;
  Tensor dy = arena.tensor(y.shape);
  loss.backward(ctx.back(), make_tensor(&one, Shape{1}), dy, GradMode::overwrite, pass);
  for (int c = chunks; c-- > 0;) {
    const Tensor dx = c == 0 ? make_tensor(out.dx.data(), Shape{B, T, C}) : arena.tensor(Shape{B, T, C + 8});
    layers[static_cast<std::size_t>(c)]->backward(ctx[static_cast<std::size_t>(c)], dy, dx, GradMode::overwrite, pass);
    dy = dx;
  }
  if (split)
    for (int c = 0; c < chunks; ++c) layers[static_cast<std::size_t>(c)]->backward_weight(ctx[static_cast<std::size_t>(c)], pass);
  return out;
}

}  // namespace

TEST_CASE("a head split over the vocabulary computes one linear head's loss, dX, dW and accuracy, for any chunking") {
  const std::vector<float> x = random_vector(static_cast<std::size_t>(N * C), 1, 1.0f);
  std::vector<float> w = random_vector(static_cast<std::size_t>(V * C), 2, 0.7f);
  // Targets at the edges of the chunks of several chunkings, and the two ends.
  std::vector<std::int32_t> targets{0, 36, 9, 10, 11, 18, 19, 24, 25, 5};
  const Head ref = one_head(x, w, targets, true);
  const Head ref_eval = one_head(x, w, targets, false);
  CHECK(ref.loss > 0);
  for (const int chunks : {1, 2, 3, 4, 7, 37}) {
    INFO("chunks " << chunks);
    const Head h = chunked_head(x, w, targets, chunks, true);
    CHECK(h.loss == doctest::Approx(ref.loss).epsilon(1e-6));
    CHECK(worst_difference(h.dx, ref.dx) <= 1e-6 * largest(ref.dx));
    CHECK(worst_difference(h.dw, ref.dw) <= 1e-6 * largest(ref.dw));
    const Head e = chunked_head(x, w, targets, chunks, false);
    CHECK(e.correct == ref_eval.correct);
    // The weight gradient later (zero-bubble schedules) is the same arithmetic.
    const Head s = chunked_head(x, w, targets, chunks, true, true);
    CHECK(s.loss == h.loss);
    CHECK(std::memcmp(s.dx.data(), h.dx.data(), h.dx.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(s.dw.data(), h.dw.data(), h.dw.size() * sizeof(float)) == 0);
  }
  // Some rows predicted right, so the accuracy is tested: the weight rows of the targets
  // made large.
  std::vector<float> sharp = w;
  for (std::int64_t n = 0; n < 6; ++n)
    for (std::int64_t c = 0; c < C; ++c) sharp[static_cast<std::size_t>(targets[n] * C + c)] = 3.0f * x[static_cast<std::size_t>(n * C + c)];
  const Head sharp_ref = one_head(x, sharp, targets, false);
  CHECK(sharp_ref.correct >= 4);
  for (const int chunks : {2, 5}) CHECK(chunked_head(x, sharp, targets, chunks, false).correct == sharp_ref.correct);
}

TEST_CASE("vocabulary chunks: the first largest logit wins a tie across chunks, and the statistics fold as one softmax") {
  // Chunk 0 covers entries 0-2, chunk 1 entries 3-4; the largest logit 3 is at 1, 2 and 3.
  const std::vector<float> z0{1.0f, 3.0f, 3.0f}, z1{3.0f, 2.0f};
  std::vector<std::int32_t> target{4};
  std::vector<float> s0(4), s1(4);
  cpu::vocab_chunk_forward(s0.data(), nullptr, z0.data(), target.data(), 1, 3, 0);
  cpu::vocab_chunk_forward(s1.data(), s0.data(), z1.data(), target.data(), 1, 2, 3);
  CHECK(s1[0] == 3.0f);  // m
  CHECK(s1[1] == doctest::Approx(std::exp(-2.0) + 3 + std::exp(-1.0)).epsilon(1e-6));  // s
  CHECK(s1[2] == 2.0f);  // the target's logit, entry 4
  CHECK(s1[3] == 1.0f);  // the first largest
  const double loss = cpu::vocab_loss_forward(s1.data(), target.data(), 1, 5);
  CHECK(loss == doctest::Approx(std::log(std::exp(1.0) + 3 * std::exp(3.0) + std::exp(2.0)) - 2.0).epsilon(1e-6));
  CHECK(cpu::vocab_count_correct(s1.data(), target.data(), 1) == 0);
  target[0] = 1;
  CHECK(cpu::vocab_count_correct(s1.data(), target.data(), 1) == 1);
  std::vector<std::int32_t> outside{5};
  CHECK_THROWS_AS(cpu::vocab_loss_forward(s1.data(), outside.data(), 1, 5), Error);
}

TEST_CASE("vocabulary chunks: backward accumulates into dX what it overwrites, the statistics' part too") {
  for (const bool recompute : {false, true}) {
    CAPTURE(recompute);
    VocabChunk chunk(V, 1, 3, C, 0.3f, -1, recompute);
    mpipe::test::LayerHarness h(chunk);
    std::vector<std::int32_t> targets{0, 36, 9, 12, 13, 18, 19, 24, 25, 5};
    // Packed: the statistics (4, N), the hidden states (N, C), 4 N unused floats.
    std::vector<float> x = random_vector(static_cast<std::size_t>(N * (C + 8)), 4);
    for (std::int64_t n = 0; n < N; ++n) {  // statistics a chunk 0 could have made: s >= 1
      x[static_cast<std::size_t>(N + n)] = 1.5f + 0.1f * static_cast<float>(n);
      x[static_cast<std::size_t>(3 * N + n)] = 2.0f;
    }
    Pass pass;
    pass.arena = &h.arena;
    pass.targets = tokens(targets);
    Context ctx;
    const Tensor y = chunk.forward(make_tensor(x.data(), Shape{B, T, C + 8}), ctx, pass);
    std::vector<float> dy = random_vector(static_cast<std::size_t>(y.numel()), 9);
    std::vector<float> written(x.size(), 5.0f), accumulated(x.size(), 1.0f);
    chunk.backward(ctx, make_tensor(dy.data(), y.shape), make_tensor(written.data(), y.shape), GradMode::overwrite, pass);
    chunk.backward(ctx, make_tensor(dy.data(), y.shape), make_tensor(accumulated.data(), y.shape), GradMode::accumulate, pass);
    for (std::size_t i = 0; i < written.size(); ++i) CHECK(accumulated[i] == doctest::Approx(written[i] + 1.0f));
    // m is a stabiliser: its gradient is zero; so is the index's.
    for (std::int64_t n = 0; n < N; ++n) {
      CHECK(written[static_cast<std::size_t>(n)] == 0.0f);
      CHECK(written[static_cast<std::size_t>(3 * N + n)] == 0.0f);
    }
    // The unused floats after the hidden states: written as zero, accumulated as zero.
    for (std::int64_t i = N * (C + 4); i < N * (C + 8); ++i) CHECK(written[static_cast<std::size_t>(i)] == 0.0f);
  }
}

TEST_CASE("vocabulary chunks: the output packs four fp32 statistics a row first, then the hidden states, and keeps no logits") {
  // Two chunks of V over x (N, C), each against the CPU ops called directly on the
  // forward's own logits, bit for bit.
  const std::vector<float> x = random_vector(static_cast<std::size_t>(N * C), 21, 1.0f);
  std::vector<float> w = random_vector(static_cast<std::size_t>(V * C), 22, 0.7f);
  std::vector<float> dw(w.size(), 0.0f);
  std::vector<std::int32_t> targets{0, 36, 9, 12, 13, 18, 19, 24, 25, 5};
  VocabChunk first(V, 0, 2, C, 0.02f, -1, true), second(V, 1, 2, C, 0.02f, -1, true);
  for (VocabChunk* l : {&first, &second}) {
    const Shape rows{l->end() - l->begin(), C};
    l->bind(std::vector<Tensor>{make_tensor(w.data() + l->begin() * C, rows)},
            std::vector<Tensor>{make_tensor(dw.data() + l->begin() * C, rows)});
  }
  Arena arena;
  Pass pass;
  pass.arena = &arena;
  pass.targets = tokens(targets);
  Context c0, c1;
  const std::size_t before = arena.used();
  const Tensor y0 = first.forward(make_tensor(const_cast<float*>(x.data()), Shape{B, T, C}), c0, pass);
  // The arena holds the output alone: the logits (N, V / 2) went back when the forward ended.
  CHECK(arena.used() - before == (y0.bytes() + Arena::alignment - 1) / Arena::alignment * Arena::alignment);
  const Tensor y1 = second.forward(y0, c1, pass);
  REQUIRE(y1.shape == Shape{B, T, C + 8});

  std::vector<float> z0(static_cast<std::size_t>(N * first.end())), z1(static_cast<std::size_t>(N * (V - second.begin())));
  std::vector<float> s0(4 * N), s1(4 * N);
  cpu::matmul_forward(z0.data(), x.data(), w.data(), nullptr, N, C, first.end());
  cpu::matmul_forward(z1.data(), x.data(), w.data() + second.begin() * C, nullptr, N, C, V - second.begin());
  cpu::vocab_chunk_forward(s0.data(), nullptr, z0.data(), targets.data(), N, first.end(), 0);
  cpu::vocab_chunk_forward(s1.data(), s0.data(), z1.data(), targets.data(), N, V - second.begin(), second.begin());
  for (const auto& [y, s] : {std::pair{y0, &s0}, std::pair{y1, &s1}}) {
    const float* packed = y.f32();
    CHECK(std::memcmp(packed, s->data(), s->size() * sizeof(float)) == 0);  // (4, N) first
    CHECK(std::memcmp(packed + 4 * N, x.data(), x.size() * sizeof(float)) == 0);  // then (N, C)
    for (std::int64_t i = N * (C + 4); i < N * (C + 8); ++i) CHECK(packed[i] == 0.0f);  // then unused
  }

  // Backward recomputes the logits: what the CPU ops give from the forward's, bit for bit.
  std::vector<float> dy = random_vector(static_cast<std::size_t>(y1.numel()), 23);
  for (std::int64_t n = 0; n < N; ++n) dy[static_cast<std::size_t>(N + n)] = 0.25f + 0.01f * static_cast<float>(n);
  std::vector<float> dx1(static_cast<std::size_t>(y0.numel()), 7.0f);
  second.backward(c1, make_tensor(dy.data(), y1.shape), make_tensor(dx1.data(), y0.shape), GradMode::overwrite, pass);
  std::vector<float> dz(z1.size()), din(4 * N), dh(x.begin(), x.end()), dw_want(w.size(), 0.0f);
  cpu::vocab_chunk_backward(dz.data(), din.data(), dy.data(), z1.data(), s0.data(), s1.data(), targets.data(), N,
                            V - second.begin(), second.begin(), GradMode::overwrite);
  std::copy(dy.begin() + 4 * N, dy.begin() + 4 * N + N * C, dh.begin());
  cpu::matmul_backward(dh.data(), dw_want.data() + second.begin() * C, nullptr, dz.data(), x.data(),
                       w.data() + second.begin() * C, N, C, V - second.begin(), GradMode::accumulate);
  CHECK(std::memcmp(dx1.data(), din.data(), din.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(dx1.data() + 4 * N, dh.data(), dh.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(dw.data(), dw_want.data(), dw.size() * sizeof(float)) == 0);

  // What the partitioner and the memory plan count.
  const double rows = N, width = V - second.begin();
  const Cost cost = second.cost(Shape{B, T, C + 8});
  CHECK(cost.activation_bytes == 4.0 * rows * (C + 8));
  CHECK(cost.backward_flops == 6.0 * rows * C * width + 3.0 * rows * width);
  CHECK(cost.weight_flops == 2.0 * rows * C * width);
}

TEST_CASE("a GPT with its head in vocabulary chunks: ties to rows of the token table, stored and summed by rows") {
  ModelConfig c;
  c.kind = "gpt";
  c.layers = 1;
  c.d_model = 6;  // rows of 6: chunk 2 begins at element 126, inside a block of 4 draws
  c.heads = 2;
  c.seq_len = 4;
  c.vocab = 32;
  ModelConfig one = c;
  c.head_chunks = 3;
  Model model(c), single(one);
  REQUIRE(model.size() == 7);  // embedding, block, layernorm, 3 chunks, loss
  CHECK(model.shapes(1)[4] == Shape{1, 4, 6 + 8});  // chunk 0's: statistics and hidden states
  CHECK(model.layer(3).kind() == "vocab-chunk");
  CHECK(model.layer(6).kind() == "cross_entropy");
  CHECK(model.parameter_count() == single.parameter_count());
  CHECK(model.classes() == 32);
  const auto ties = model.ties_of(0, "wte");
  REQUIRE(ties.size() == 3);
  const std::int64_t bounds[4] = {0, 10, 21, 32};
  for (int i = 0; i < 3; ++i) {
    CHECK(ties[static_cast<std::size_t>(i)]->copy_layer == 3 + i);
    CHECK(ties[static_cast<std::size_t>(i)]->rows_begin == bounds[i]);
    CHECK(ties[static_cast<std::size_t>(i)]->rows_end == bounds[i + 1]);
    CHECK_FALSE(ties[static_cast<std::size_t>(i)]->whole);
  }

  // One store: the chunks see the owner's rows.
  ParamStore all(model, 0, model.size(), 7);
  const ParamEntry* wte = nullptr;
  std::vector<const ParamEntry*> copies;
  for (const ParamEntry& e : all.entries()) {
    if (e.layer == 0 && e.name == "wte") wte = &e;
    if (e.tied_copy) copies.push_back(&e);
  }
  REQUIRE(wte);
  REQUIRE(copies.size() == 3);
  for (int i = 0; i < 3; ++i) {
    CHECK(copies[static_cast<std::size_t>(i)]->alias);
    CHECK(copies[static_cast<std::size_t>(i)]->param_offset == wte->offset + static_cast<std::size_t>(bounds[i] * 6));
  }
  // Gradients of the copies go into their rows of the owner's.
  for (int i = 0; i < 3; ++i) {
    const Tensor g = all.grad(*copies[static_cast<std::size_t>(i)]);
    std::fill(g.f32(), g.f32() + g.numel(), static_cast<float>(i + 1));
  }
  all.sum_local_tied_grads();
  const float* owner = all.grad(*wte).f32();
  for (std::int64_t r = 0; r < 32; ++r) CHECK(owner[r * 6] == (r < 10 ? 1.0f : r < 21 ? 2.0f : 3.0f));
  for (const ParamEntry* e : copies) CHECK(all.grad(*e).f32()[0] == 0.0f);

  // A store of the chunks alone (another stage) draws the owner's rows, bitwise.
  ParamStore head(model, 3, 7, 7);
  int held = 0;
  for (const ParamEntry& e : head.entries()) {
    REQUIRE(e.tied_copy);
    CHECK_FALSE(e.alias);
    ++held;
    CHECK(std::memcmp(head.param(e).f32(), all.param(*wte).f32() + e.owner_element, static_cast<std::size_t>(e.numel()) * sizeof(float)) == 0);
  }
  CHECK(held == 3);
}

TEST_CASE("vocabulary chunks are refused out of order, without their loss, or tied to a table of another shape") {
  auto refused = [](std::vector<LayerSpec> layers, int index, const char* text) {
    ModelSpec m;
    m.name = "test";
    m.tokens = 8;
    m.layers = std::move(layers);
    Shape in{1, 8, 16};
    for (int i = 1; i < index; ++i) in = make_layer(m, i, in, "layer")->output_shape(in);
    try {
      make_layer(m, index, in, "layer");
      FAIL("accepted: ", text);
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find(text) != std::string::npos);
    }
  };
  using O = std::map<std::string, OptionValue>;
  const LayerSpec embedding{"embedding", O{{"vocab", std::int64_t{16}}, {"out", std::int64_t{16}}}};
  auto chunk = [](std::int64_t i, std::int64_t n, std::int64_t tie = -1, std::int64_t vocab = 16) {
    return LayerSpec{"vocab-chunk", O{{"vocab", vocab}, {"chunk", i}, {"chunks", n}, {"tie", tie}}};
  };
  const LayerSpec loss{"cross_entropy", {}};
  refused({embedding, chunk(1, 2), loss}, 1, "does not follow chunk 0");
  refused({embedding, chunk(0, 2), loss}, 1, "must be followed by chunk 1");
  refused({embedding, chunk(0, 2), chunk(0, 2), loss}, 2, "0 follows another chunk");
  refused({embedding, chunk(2, 2), loss}, 1, "is not below chunks = 2");
  refused({embedding, chunk(0, 17), loss}, 1, "is more than the 16 tokens");
  refused({embedding, chunk(0, 1, 0, 12), loss}, 1, "the embedding's table is 16 x 16");
  refused({embedding, chunk(0, 1, 1), loss}, 1, "is not an earlier embedding layer");
  ModelConfig bad;
  bad.head_chunks = 0;
  CHECK_THROWS_AS(model_spec(bad), UserError);
  bad.head_chunks = bad.vocab + 1;
  CHECK_THROWS_AS(model_spec(bad), UserError);
}
