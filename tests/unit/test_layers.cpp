// Every layer's backward against finite differences, and the accumulate/overwrite contract.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>

#include "compare.hpp"
#include "gradcheck.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/nn/residual.hpp"
#include "mpipe/nn/transformer_layers.hpp"

using namespace mpipe;
using namespace mpipe::test;

namespace {

struct Input {
  std::vector<float> data;
  Tensor tensor;
  explicit Input(Shape shape, std::uint32_t tag = 3, float scale = 1.0f)
      : data(random_vector(static_cast<std::size_t>(shape.numel()), tag, scale)),
        tensor(make_tensor(data.data(), shape)) {}
};

Pass training_pass() {
  Pass pass;
  pass.seed = 5;
  pass.step = 3;
  pass.sample_begin = 2;
  pass.training = true;
  return pass;
}

}  // namespace

TEST_CASE("linear: gradients match finite differences, with and without bias") {
  Linear with_bias(5, 7, true, 0.3f), without_bias(5, 7, false, 0.3f);
  Input x(Shape{3, 4, 5});
  gradcheck(with_bias, x.tensor);
  gradcheck(without_bias, x.tensor);
}

TEST_CASE("relu: gradients match finite differences away from the kink") {
  ReLU relu;
  Input x(Shape{3, 10});
  for (float& v : x.data) v = v >= 0 ? v + 0.1f : v - 0.1f;  // no element within ε of 0
  gradcheck(relu, x.tensor);
}

TEST_CASE("gelu: gradients match finite differences") {
  GELU gelu;
  Input x(Shape{3, 10}, 3, 2.0f);
  gradcheck(gelu, x.tensor);
}

TEST_CASE("layernorm: gradients match finite differences") {
  LayerNorm ln(8);
  Input x(Shape{4, 8});
  gradcheck(ln, x.tensor);
}

TEST_CASE("dropout: gradients match finite differences and the mask drops about p") {
  Dropout dropout(0.3f, 0);
  dropout.set_global_index(2);
  Input x(Shape{4, 64});
  GradCheckOptions opt;
  opt.pass = training_pass();
  gradcheck(dropout, x.tensor, opt);

  Arena arena;
  Pass pass = training_pass();
  pass.arena = &arena;
  Context ctx;
  Tensor y = dropout.forward(x.tensor, ctx, pass);
  int zeros = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    if (y.f32()[i] == 0.0f) ++zeros;
    else CHECK(y.f32()[i] == doctest::Approx(x.data[i] / 0.7f));
  }
  CHECK(zeros > 0.2 * y.numel());
  CHECK(zeros < 0.4 * y.numel());
}

TEST_CASE("dropout: the mask of a sample does not depend on how the batch is split") {
  Dropout dropout(0.5f, 1);
  dropout.set_global_index(4);
  Input x(Shape{4, 32});
  Arena arena;
  Pass whole = training_pass();
  whole.arena = &arena;
  whole.sample_begin = 0;
  Context c1, c2;
  Tensor all = dropout.forward(x.tensor, c1, whole);
  Pass second_half = whole;
  second_half.sample_begin = 2;
  Tensor half = dropout.forward(make_tensor(x.data.data() + 64, Shape{2, 32}), c2, second_half);
  for (int i = 0; i < 64; ++i) CHECK(half.f32()[i] == all.f32()[64 + i]);
  // Another step or another layer draws another mask.
  Pass next_step = whole;
  next_step.step += 1;
  Context c3;
  Tensor other = dropout.forward(x.tensor, c3, next_step);
  int differ = 0;
  for (int i = 0; i < 128; ++i) differ += (other.f32()[i] == 0.0f) != (all.f32()[i] == 0.0f);
  CHECK(differ > 10);
}

namespace {

// GPT-2's block (LayerNorm, GELU MLP of 4C, biases) and a Llama one (RMSNorm, RoPE over 2
// key/value heads for 4 query heads, SwiGLU of 12, no biases) of 8 channels.
BlockOptions gpt_block(int64_t heads, float dropout) {
  return {.attention = {.heads = heads, .init_std = 0.3f, .proj_std = 0.2f}, .dropout = dropout};
}
BlockOptions llama_block(float dropout) {
  return {.attention = {.heads = 4, .kv_heads = 2, .rope = true, .rope_theta = 100.0f, .bias = false, .init_std = 0.3f,
                        .proj_std = 0.2f},
          .norm = NormKind::rms,
          .norm_eps = 1e-5f,
          .swiglu = true,
          .ffn = 12,
          .dropout = dropout};
}

}  // namespace

TEST_CASE("embedding: parameter gradients match finite differences, dropout on") {
  Embedding embedding(11, 6, 8, 0.1f);
  embedding.set_global_index(0);
  std::vector<std::int32_t> tokens{1, 5, 5, 10, 0, 3, 3, 3, 7, 2};  // repeats exercise accumulation
  GradCheckOptions opt;
  opt.input_gradient = false;
  opt.pass = training_pass();
  gradcheck(embedding, make_tensor(tokens.data(), Shape{2, 5}), opt);
}

TEST_CASE("attention: gradients match finite differences") {
  CausalSelfAttention attention(8, AttentionOptions{.heads = 2, .init_std = 0.3f, .proj_std = 0.3f});
  Input x(Shape{2, 5, 8});
  gradcheck(attention, x.tensor);
}

TEST_CASE("attention: causal, the output at t does not depend on later tokens") {
  CausalSelfAttention attention(8, AttentionOptions{.heads = 2, .init_std = 0.3f, .proj_std = 0.3f});
  LayerHarness h(attention);
  Input x(Shape{1, 6, 8});
  Pass pass = training_pass();
  pass.arena = &h.arena;
  Context c1, c2;
  Tensor y1 = attention.forward(x.tensor, c1, pass);
  std::vector<float> first(y1.f32(), y1.f32() + 3 * 8);
  for (int i = 4 * 8; i < 6 * 8; ++i) x.data[i] += 1.0f;  // change tokens 4 and 5
  Tensor y2 = attention.forward(x.tensor, c2, pass);
  for (int i = 0; i < 3 * 8; ++i) CHECK(y2.f32()[i] == first[i]);
}

TEST_CASE("transformer block: gradients match finite differences, dropout on") {
  TransformerBlock block(8, gpt_block(2, 0.1f));
  block.set_global_index(1);
  Input x(Shape{2, 5, 8});
  GradCheckOptions opt;
  opt.pass = training_pass();
  gradcheck(block, x.tensor, opt);
}

TEST_CASE("llama's parts: RMSNorm, SwiGLU, grouped-query attention with RoPE and no biases, the block: gradients match finite differences") {
  SUBCASE("rmsnorm") {
    LayerNorm rms(8, NormKind::rms, 1e-5f);
    CHECK(rms.kind() == "rmsnorm");
    CHECK(rms.param_specs().size() == 1);  // a weight, no bias
    Input x(Shape{2, 3, 8});
    gradcheck(rms, x.tensor);
  }
  SUBCASE("swiglu") {
    SwiGLU swiglu;
    Input x(Shape{2, 3, 10});
    CHECK(swiglu.output_shape(x.tensor.shape) == Shape{2, 3, 5});
    gradcheck(swiglu, x.tensor);
  }
  SUBCASE("attention: 4 heads over 1 and 2 key/value heads, RoPE, no bias") {
    for (const int64_t kv_heads : {int64_t{1}, int64_t{2}}) {
      CAPTURE(kv_heads);
      CausalSelfAttention attention(
          8, AttentionOptions{.heads = 4, .kv_heads = kv_heads, .rope = true, .rope_theta = 100.0f, .bias = false,
                              .init_std = 0.3f, .proj_std = 0.3f});
      CHECK(attention.qkv_width() == 8 + 2 * kv_heads * 2);
      CHECK(attention.cache_width() == 2 * kv_heads * 2);
      CHECK(attention.param_specs().size() == 2);  // c_attn and c_proj weights alone
      Input x(Shape{2, 5, 8});
      gradcheck(attention, x.tensor);
    }
  }
  SUBCASE("block, dropout on") {
    TransformerBlock block(8, llama_block(0.1f));
    block.set_global_index(1);
    CHECK(block.param_specs().size() == 6);  // ln_1, c_attn, c_proj, ln_2, c_fc, c_proj: weights only
    Input x(Shape{2, 5, 8});
    GradCheckOptions opt;
    opt.pass = training_pass();
    gradcheck(block, x.tensor, opt);
  }
  SUBCASE("embedding without a position table") {
    Embedding embedding(11, 6, 8, 0.0f, false);
    embedding.set_global_index(0);
    CHECK(embedding.param_specs().size() == 1);
    std::vector<std::int32_t> tokens{1, 5, 5, 10, 0, 3, 3, 3, 7, 2};
    GradCheckOptions opt;
    opt.input_gradient = false;
    gradcheck(embedding, make_tensor(tokens.data(), Shape{2, 5}), opt);
  }
}

TEST_CASE("RoPE: the inverse rotation undoes the rotation, and a query-key product depends on their distance alone") {
  const int64_t H = 2, KVH = 1, hs = 8, C = H * hs, W = C + 2 * KVH * hs, T = 6;
  std::vector<float> qkv = random_vector(static_cast<std::size_t>(T * W), 5), rotated = qkv;
  cpu::rope_apply(rotated.data(), 1, T, C, H, KVH, 0, 10000.0f, false);
  // Position 0 is not rotated; every later one is; v never.
  CHECK(std::equal(rotated.begin(), rotated.begin() + W, qkv.begin()));
  CHECK_FALSE(std::equal(rotated.begin() + W, rotated.begin() + W + C, qkv.begin() + W));
  for (int64_t t = 0; t < T; ++t)
    CHECK(std::equal(rotated.begin() + t * W + C + KVH * hs, rotated.begin() + (t + 1) * W, qkv.begin() + t * W + C + KVH * hs));
  std::vector<float> back = rotated;
  cpu::rope_apply(back.data(), 1, T, C, H, KVH, 0, 10000.0f, true);
  for (std::size_t i = 0; i < qkv.size(); ++i) CHECK(back[i] == doctest::Approx(qkv[i]).epsilon(1e-5));
  // The same q and k at positions (p, p + 2), for several p: q·k the same.
  std::vector<float> same(static_cast<std::size_t>(T * W));
  for (int64_t t = 0; t < T; ++t) std::copy_n(qkv.begin(), W, same.begin() + t * W);
  cpu::rope_apply(same.data(), 1, T, C, H, KVH, 0, 10000.0f, false);
  auto dot = [&](int64_t tq, int64_t tk) {
    double d = 0;
    for (int64_t i = 0; i < hs; ++i) d += static_cast<double>(same[static_cast<std::size_t>(tq * W + i)]) * same[static_cast<std::size_t>(tk * W + C + i)];
    return d;
  };
  CHECK(dot(2, 0) == doctest::Approx(dot(3, 1)).epsilon(1e-5));
  CHECK(dot(2, 0) == doctest::Approx(dot(5, 3)).epsilon(1e-5));
  // Hugging Face's pairing: dimension i with i + hs/2, angle p theta^(-2i/hs).
  const double angle = 1.0 * std::pow(10000.0, -2.0 * 1 / hs);
  const float x1 = qkv[static_cast<std::size_t>(W + 1)], x2 = qkv[static_cast<std::size_t>(W + 1 + hs / 2)];
  CHECK(rotated[static_cast<std::size_t>(W + 1)] == doctest::Approx(x1 * std::cos(angle) - x2 * std::sin(angle)).epsilon(1e-6));
  CHECK(rotated[static_cast<std::size_t>(W + 1 + hs / 2)] == doctest::Approx(x2 * std::cos(angle) + x1 * std::sin(angle)).epsilon(1e-6));
}

TEST_CASE("cross-entropy: gradients match finite differences") {
  CrossEntropyLoss loss;
  Input x(Shape{2, 3, 7});
  std::vector<std::int32_t> targets{0, 6, 3, 3, 1, 2};
  GradCheckOptions opt;
  opt.pass.targets = make_tensor(targets.data(), Shape{2, 3});
  opt.pass.loss_scale = 1.0f / 6.0f;
  gradcheck(loss, x.tensor, opt);
}

TEST_CASE("backward: accumulate adds to dx what overwrite writes") {
  LayerNorm ln(8);
  TransformerBlock block(8, gpt_block(2, 0.0f));
  TransformerBlock llama(8, llama_block(0.0f));
  for (Layer* layer : std::initializer_list<Layer*>{&ln, &block, &llama}) {
    LayerHarness h(*layer);
    Input x(Shape{2, 3, 8});
    Pass pass = training_pass();
    pass.arena = &h.arena;
    Context ctx;
    Tensor y = layer->forward(x.tensor, ctx, pass);
    std::vector<float> dy = random_vector(static_cast<std::size_t>(y.numel()), 9);
    std::vector<float> written(x.data.size(), 5.0f), accumulated(x.data.size(), 1.0f);
    layer->backward(ctx, make_tensor(dy.data(), y.shape), make_tensor(written.data(), x.tensor.shape),
                    GradMode::overwrite, pass);
    layer->backward(ctx, make_tensor(dy.data(), y.shape), make_tensor(accumulated.data(), x.tensor.shape),
                    GradMode::accumulate, pass);
    for (std::size_t i = 0; i < written.size(); ++i) CHECK(accumulated[i] == doctest::Approx(written[i] + 1.0f));
  }
}

TEST_CASE("parameter gradients accumulate across calls") {
  Linear linear(4, 3, true, 0.3f);
  LayerHarness h(linear);
  Input x(Shape{2, 4});
  Pass pass = training_pass();
  pass.arena = &h.arena;
  std::vector<float> dy = random_vector(6, 9);
  for (int call = 0; call < 2; ++call) {
    Context ctx;
    linear.forward(x.tensor, ctx, pass);
    linear.backward(ctx, make_tensor(dy.data(), Shape{2, 3}), Tensor{}, GradMode::overwrite, pass);
  }
  // Two identical calls: the gradient is twice one call's.
  std::vector<float> single(12, 0.0f);
  std::vector<float> bias_single(3, 0.0f);
  Linear fresh(4, 3, true, 0.3f);
  fresh.bind(std::vector<Tensor>{make_tensor(h.params[0].data(), Shape{3, 4}), make_tensor(h.params[1].data(), Shape{3})},
             std::vector<Tensor>{make_tensor(single.data(), Shape{3, 4}), make_tensor(bias_single.data(), Shape{3})});
  Context ctx;
  fresh.forward(x.tensor, ctx, pass);
  fresh.backward(ctx, make_tensor(dy.data(), Shape{2, 3}), Tensor{}, GradMode::overwrite, pass);
  for (int i = 0; i < 12; ++i) CHECK(h.grads[0][i] == doctest::Approx(2.0f * single[i]));
  for (int i = 0; i < 3; ++i) CHECK(h.grads[1][i] == doctest::Approx(2.0f * bias_single[i]));
}

// ---- one-pass residual sums (add_dropped, residual_layernorm_forward) ----------------

namespace {

std::vector<float> values(const Tensor& t) { return std::vector<float>(t.f32(), t.f32() + t.numel()); }

}  // namespace

TEST_CASE("add_dropped: base + dropout(branch) in one pass, the bits of dropout_apply then add, into either operand") {
  const DropoutKey key{5, 3, 2, 17};
  // (3, 5, 99): samples of 495 elements, not a multiple of 4 (a group spans two rows).
  for (const Shape shape : {Shape{3, 5, 99}, Shape{2, 4, 64}, Shape{4, 64, 128}}) {
    for (const float p : {0.0f, 0.1f, 0.3f}) {
      CAPTURE(shape.str());
      CAPTURE(p);
      const Input base(shape, 11), branch(shape, 12);
      std::vector<float> expected = branch.data;
      Tensor e = make_tensor(expected.data(), shape);
      if (p > 0.0f) ops::dropout_apply(e, e, p, key);
      ops::add(e, base.tensor);
      std::vector<float> into_branch = branch.data, into_base = base.data, apart(base.data.size(), -1.0f);
      ops::add_dropped(make_tensor(into_branch.data(), shape), base.tensor, make_tensor(into_branch.data(), shape),
                       p, key);
      ops::add_dropped(make_tensor(into_base.data(), shape), make_tensor(into_base.data(), shape), branch.tensor, p,
                       key);
      ops::add_dropped(make_tensor(apart.data(), shape), base.tensor, branch.tensor, p, key);
      CHECK(same_bits(into_branch, expected));
      CHECK(same_bits(into_base, expected));
      CHECK(same_bits(apart, expected));
      // The mask drops about p of the elements: those are the base alone.
      double base_alone = 0;
      for (std::size_t i = 0; i < expected.size(); ++i) base_alone += expected[i] == base.data[i];
      base_alone /= static_cast<double>(expected.size());
      CHECK(base_alone >= 0.5 * p);
      CHECK(base_alone <= 1.5 * p + 0.01);
    }
  }
}

TEST_CASE("residual_layernorm_forward: the sum, its dropout and the LayerNorm after it in one pass, bit for bit") {
  const DropoutKey key{5, 3, 2, 33};
  for (const Shape shape : {Shape{3, 5, 99}, Shape{2, 4, 64}}) {
    for (const float p : {0.0f, 0.3f}) {
      CAPTURE(shape.str());
      CAPTURE(p);
      const int64_t N = shape.rows(), C = shape[-1];
      const Input residual(shape, 21), branch(shape, 22, 2.0f), weight(Shape{C}, 23), bias(Shape{C}, 24);
      // Three passes: dropout, add, LayerNorm.
      std::vector<float> sum = branch.data, out(sum.size()), mean(N), rstd(N);
      Tensor s = make_tensor(sum.data(), shape);
      if (p > 0.0f) ops::dropout_apply(s, s, p, key);
      ops::add(s, residual.tensor);
      ops::layernorm_forward(make_tensor(out.data(), shape), make_tensor(mean.data(), Shape{N}),
                             make_tensor(rstd.data(), Shape{N}), s, weight.tensor, bias.tensor);
      // One.
      std::vector<float> sum1 = branch.data, out1(sum.size(), -1.0f), mean1(N, -1.0f), rstd1(N, -1.0f);
      ops::residual_layernorm_forward(make_tensor(out1.data(), shape), make_tensor(mean1.data(), Shape{N}),
                                      make_tensor(rstd1.data(), Shape{N}), make_tensor(sum1.data(), shape),
                                      residual.tensor, p, key, weight.tensor, bias.tensor);
      CHECK(same_bits(sum1, sum));
      CHECK(same_bits(out1, out));
      CHECK(same_bits(mean1, mean));
      CHECK(same_bits(rstd1, rstd));
    }
  }
}

TEST_CASE("transformer block: the one-pass residual sums give the bits of MPIPE_FUSE=off's, forward and backward") {
  ::setenv("MPIPE_FUSE", "off", 1);
  TransformerBlock apart(16, gpt_block(2, 0.2f));
  ::unsetenv("MPIPE_FUSE");
  TransformerBlock fused(16, gpt_block(2, 0.2f));
  std::vector<float> outputs[2], inputs_grad[2], params_grad[2];
  int i = 0;
  for (TransformerBlock* block : {&apart, &fused}) {
    block->set_global_index(3);
    LayerHarness h(*block);
    const Input x(Shape{3, 5, 16});
    Pass pass = training_pass();
    pass.arena = &h.arena;
    Context ctx;
    const Tensor y = block->forward(x.tensor, ctx, pass);
    outputs[i] = values(y);
    std::vector<float> dy = random_vector(static_cast<std::size_t>(y.numel()), 9);
    inputs_grad[i].assign(x.data.size(), 0.0f);
    block->backward(ctx, make_tensor(dy.data(), y.shape), make_tensor(inputs_grad[i].data(), x.tensor.shape),
                    GradMode::overwrite, pass);
    for (const std::vector<float>& g : h.grads) params_grad[i].insert(params_grad[i].end(), g.begin(), g.end());
    ++i;
  }
  CHECK(same_bits(outputs[0], outputs[1]));
  CHECK(same_bits(inputs_grad[0], inputs_grad[1]));
  CHECK(same_bits(params_grad[0], params_grad[1]));
  CHECK(params_grad[0].size() > 1000);
}

TEST_CASE("crossentropy_backward over its own logits gives the bits of a separate output") {
  // A loss writes its gradient over its logits (gradient_in_place).
  const int64_t N = 6, V = 11;
  const Input logits(Shape{N, V}, 31, 3.0f);
  std::vector<std::int32_t> targets{0, 10, 3, 3, 7, 1};
  std::vector<float> lse(N);
  cpu::crossentropy_forward(lse.data(), logits.data.data(), targets.data(), N, V);
  std::vector<float> apart(logits.data.size()), over = logits.data;
  cpu::crossentropy_backward(apart.data(), logits.data.data(), lse.data(), targets.data(), 0.25f, N, V);
  cpu::crossentropy_backward(over.data(), over.data(), lse.data(), targets.data(), 0.25f, N, V);
  CHECK(same_bits(over, apart));
}

TEST_CASE("crossentropy over planes (outer, V, plane), a row per position, gives the bits of its rows laid out (N, V)") {
  // 2 x V classes x 300 positions: more than one 256-position tile, a partial last one; 5
  // classes (fewer than the 16 running sums) and 37 (sums of three classes and two).
  for (const int64_t V : {int64_t{5}, int64_t{37}}) {
    CAPTURE(V);
    const int64_t outer = 2, plane = 300, rows = outer * plane;
    const Input planes(Shape{outer, V, plane}, 41, 4.0f);
    std::vector<float> flat(planes.data.size());
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t c = 0; c < V; ++c)
        for (int64_t p = 0; p < plane; ++p)
          flat[static_cast<std::size_t>((o * plane + p) * V + c)] = planes.data[static_cast<std::size_t>((o * V + c) * plane + p)];
    std::vector<std::int32_t> targets(static_cast<std::size_t>(rows));
    for (int64_t n = 0; n < rows; ++n) targets[static_cast<std::size_t>(n)] = static_cast<std::int32_t>((n * 7) % V);
    std::vector<float> lse_planes(static_cast<std::size_t>(rows)), lse_rows(lse_planes.size());
    const double loss_planes =
        cpu::crossentropy_forward(lse_planes.data(), planes.data.data(), targets.data(), outer, V, plane);
    const double loss_rows = cpu::crossentropy_forward(lse_rows.data(), flat.data(), targets.data(), rows, V);
    CHECK(loss_planes == loss_rows);
    CHECK(same_bits(lse_planes, lse_rows));
    // The gradient over the logits themselves, as the layer writes it, and apart.
    std::vector<float> over = planes.data, apart(planes.data.size()), drows(flat.size());
    cpu::crossentropy_backward(over.data(), over.data(), lse_planes.data(), targets.data(), 0.5f, outer, V, plane);
    cpu::crossentropy_backward(apart.data(), planes.data.data(), lse_planes.data(), targets.data(), 0.5f, outer, V, plane);
    cpu::crossentropy_backward(drows.data(), flat.data(), lse_rows.data(), targets.data(), 0.5f, rows, V);
    CHECK(same_bits(over, apart));
    int64_t mismatched = 0;
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t c = 0; c < V; ++c)
        for (int64_t p = 0; p < plane; ++p)
          mismatched += std::bit_cast<std::uint32_t>(apart[static_cast<std::size_t>((o * V + c) * plane + p)]) !=
                        std::bit_cast<std::uint32_t>(drows[static_cast<std::size_t>((o * plane + p) * V + c)]);
    CHECK(mismatched == 0);
    const int64_t correct = cpu::count_correct(flat.data(), targets.data(), rows, V);
    CHECK(cpu::count_correct(planes.data.data(), targets.data(), outer, V, plane) == correct);
    CHECK(correct > 0);
    CHECK(correct < rows);
  }
}

TEST_CASE("crossentropy: the loss and gradient of wide rows within 4 ulp-scale of double precision") {
  // 1000 classes: several 256-value chunks, a partial 16-lane maximum; logits up to +-40.
  const int64_t N = 3, V = 1000;
  const Input logits(Shape{N, V}, 43, 20.0f);
  std::vector<std::int32_t> targets{0, 999, 517};
  std::vector<float> lse(N), d(logits.data.size());
  const double loss = cpu::crossentropy_forward(lse.data(), logits.data.data(), targets.data(), N, V);
  cpu::crossentropy_backward(d.data(), logits.data.data(), lse.data(), targets.data(), 1.0f, N, V);
  double want_loss = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float* row = logits.data.data() + n * V;
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t i = 0; i < V; ++i) sum += std::exp(static_cast<double>(row[i]) - mx);
    const double want_lse = mx + std::log(sum);
    CHECK(std::abs(lse[static_cast<std::size_t>(n)] - want_lse) < 4e-6 * std::max(1.0, std::abs(want_lse)));
    want_loss += want_lse - row[targets[static_cast<std::size_t>(n)]];
    for (int64_t i = 0; i < V; ++i) {
      const double p = std::exp(static_cast<double>(row[i]) - want_lse) - (i == targets[static_cast<std::size_t>(n)]);
      CHECK(std::abs(d[static_cast<std::size_t>(n * V + i)] - p) < 1e-6 + 1e-5 * std::abs(p));
    }
  }
  CHECK(std::abs(loss - want_loss) < 1e-5 * std::abs(want_loss));
}
