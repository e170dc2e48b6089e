// Whole models: gradients by finite differences, determinism, micro-batch accumulation,
// tied weights, and that the quickstart configuration learns.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "tiny_gpt.hpp"
#include "compare.hpp"
#include "gradcheck.hpp"
#include "local_trainer.hpp"
#include "temp_dir.hpp"

using namespace mpipe;
using mpipe::test::relative_difference;
using mpipe::test::Trainer;

namespace {

TrainConfig tiny_gpt(int micro_batches = 1, float dropout = 0.1f) {
  return test::tiny_gpt({.layers = 2, .d_model = 16, .heads = 2, .seq_len = 8, .vocab = 13, .dropout = dropout,
                         .batch_size = 4, .micro_batches = micro_batches, .steps = 10, .seed = 7, .lr = 1e-2f});
}

TrainConfig tiny_mlp(int micro_batches = 1) {
  TrainConfig c;
  c.model.kind = "mlp";
  c.model.layers = 2;
  c.model.hidden = 16;
  c.model.inputs = 6;
  c.model.classes = 4;
  c.batch_size = 8;
  c.micro_batches = micro_batches;
  c.steps = 10;
  c.seed = 3;
  return c;
}

// <grad, v> against the central difference of the mean loss along v.
void model_gradcheck(const TrainConfig& config) {
  Trainer trainer(config);
  trainer.compute_gradients(0);
  std::span<float> params = trainer.params().params();
  std::vector<float> grads(trainer.params().grads().begin(), trainer.params().grads().end());
  const std::vector<float> v = test::random_vector(params.size(), 21);
  const std::vector<float> saved(params.begin(), params.end());
  double analytic = 0.0;
  for (std::size_t i = 0; i < params.size(); ++i) analytic += static_cast<double>(grads[i]) * v[i];
  const float eps = 1e-3f;
  for (std::size_t i = 0; i < params.size(); ++i) params[i] = saved[i] + eps * v[i];
  const double plus = trainer.compute_gradients(0);
  for (std::size_t i = 0; i < params.size(); ++i) params[i] = saved[i] - eps * v[i];
  const double minus = trainer.compute_gradients(0);
  std::copy(saved.begin(), saved.end(), params.begin());
  test::check_close(analytic, (plus - minus) / (2.0 * eps), 2e-2, config.model.kind + " model");
}


// Trains config.steps steps; the losses of the first and the last.
std::pair<double, double> first_and_last_loss(const TrainConfig& config) {
  Trainer trainer(config);
  double first = 0, last = 0;
  for (int step = 0; step < config.steps; ++step) {
    last = trainer.step(step).loss;
    if (step == 0) first = last;
  }
  return {first, last};
}

}  // namespace

TEST_CASE("gpt: whole-model gradient matches finite differences (dropout on, tied head)") {
  model_gradcheck(tiny_gpt(1, 0.1f));
}

TEST_CASE("mlp: whole-model gradient matches finite differences") { model_gradcheck(tiny_mlp()); }

TEST_CASE("a model file of every sequence layer kind: whole-model gradient matches finite differences") {
  // Built through the registry: an embedding, a block, an attention layer, layernorm,
  // linear with and without bias, GELU, ReLU and dropout.
  const auto path = mpipe::testing::test_file("every_kind.toml");
  std::ofstream(path) << "tokens = 8\n"
                         "[[layer]]\nkind = \"embedding\"\nvocab = 13\nout = 16\ndropout = 0.1\n"
                         "[[layer]]\nkind = \"block\"\nheads = 2\ndropout = 0.1\n"
                         "[[layer]]\nkind = \"attention\"\nheads = 4\n"
                         "[[layer]]\nkind = \"layernorm\"\n"
                         "[[layer]]\nkind = \"linear\"\nout = 24\n"
                         "[[layer]]\nkind = \"gelu\"\n"
                         "[[layer]]\nkind = \"dropout\"\np = 0.2\n"
                         "[[layer]]\nkind = \"linear\"\nout = 16\nbias = false\n"
                         "[[layer]]\nkind = \"relu\"\n"
                         "[[layer]]\nkind = \"linear\"\nout = 13\n"
                         "[[layer]]\nkind = \"cross_entropy\"\n";
  TrainConfig c = tiny_gpt();
  c.model.kind = path.string();
  model_gradcheck(c);
  std::filesystem::remove(path);
}

TEST_CASE("gpt: the LM head shares the token embedding's values") {
  Trainer trainer(tiny_gpt());
  const auto entries = trainer.params().entries();
  const ParamEntry* wte = nullptr;
  const ParamEntry* head = nullptr;
  for (const ParamEntry& e : entries) {
    if (e.layer == 0 && e.name == "wte") wte = &e;
    if (e.layer == trainer.model().size() - 2 && e.name == "weight") head = &e;
  }
  REQUIRE(wte);
  REQUIRE(head);
  CHECK(head->alias);
  CHECK(head->param_offset == wte->offset);
  CHECK(head->offset != wte->offset);  // its own gradient, summed after backward
  // Parameter count as GPT-2 counts it: wte + wpe + blocks + final LN (head tied).
  const std::size_t C = 16, V = 13, T = 8, N = 2;
  const std::size_t block = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
  CHECK(trainer.params().count() == V * C + T * C + N * block + 2 * C);
}

TEST_CASE("same seed, same run: losses and parameters are bitwise identical") {
  for (const TrainConfig& config : {tiny_gpt(2), tiny_mlp(2)}) {
    Trainer a(config), b(config);
    for (int step = 0; step < 5; ++step) {
      const StepResult ra = a.step(step), rb = b.step(step);
      CHECK(ra.loss == rb.loss);
      CHECK(ra.grad_norm == rb.grad_norm);
    }
    CHECK(std::memcmp(a.params().params().data(), b.params().params().data(),
                      a.params().params().size() * sizeof(float)) == 0);
  }
}

TEST_CASE("another seed gives other initial weights and other data") {
  TrainConfig c1 = tiny_gpt(), c2 = tiny_gpt();
  c2.seed = c1.seed + 1;
  Trainer a(c1), b(c2);
  CHECK(relative_difference(a.params().params(), b.params().params()) > 0.1);
  std::vector<std::int32_t> xa(32), ta(32), xb(32), tb(32);
  a.dataset()->fill(0, 4, make_tensor(xa.data(), Shape{4, 8}), make_tensor(ta.data(), Shape{4, 8}));
  b.dataset()->fill(0, 4, make_tensor(xb.data(), Shape{4, 8}), make_tensor(tb.data(), Shape{4, 8}));
  CHECK(xa != xb);
}

TEST_CASE("micro-batch accumulation equals the single-batch gradient (dropout on)") {
  for (auto make : {+[](int m) { return tiny_gpt(m, 0.1f); }, +[](int m) { return tiny_mlp(m); }}) {
    Trainer whole(make(1)), split(make(4));
    const double loss_whole = whole.compute_gradients(3);
    const double loss_split = split.compute_gradients(3);
    CHECK(loss_split == doctest::Approx(loss_whole).epsilon(1e-6));
    CHECK(relative_difference(whole.params().grads(), split.params().grads()) < 1e-5);
  }
}

TEST_CASE("non-finite gradients skip the update and leave the parameters alone") {
  Trainer trainer(tiny_mlp());
  // A NaN in the output bias poisons the loss and the gradients.
  const ParamEntry& last = trainer.params().entries().back();
  trainer.params().params()[last.offset] = NAN;
  std::vector<float> before(trainer.params().params().begin(), trainer.params().params().end());
  const StepResult r = trainer.step(0);
  CHECK(r.skipped);
  const auto after = trainer.params().params();
  CHECK(std::memcmp(after.data(), before.data(), before.size() * sizeof(float)) == 0);
}

TEST_CASE("clipping bounds the update: the clipped gradient has the clip norm") {
  TrainConfig config = tiny_mlp();
  config.optimizer.kind = "sgd";
  config.optimizer.momentum = 0.0f;
  config.optimizer.clip_grad = 1e-3f;
  config.optimizer.lr = 1.0f;
  config.optimizer.min_lr_ratio = 1.0f;
  Trainer trainer(config);
  std::vector<float> before(trainer.params().params().begin(), trainer.params().params().end());
  const StepResult r = trainer.step(0);
  REQUIRE(r.grad_norm > 1e-3);
  double moved = 0.0;
  const auto after = trainer.params().params();
  for (std::size_t i = 0; i < before.size(); ++i)
    moved += (static_cast<double>(after[i]) - before[i]) * (static_cast<double>(after[i]) - before[i]);
  CHECK(std::sqrt(moved) == doctest::Approx(1e-3).epsilon(1e-3));
}

TEST_CASE("training learns: the mlp loss falls well below chance on its teacher task") {
  TrainConfig config = tiny_mlp();
  config.model.hidden = 64;
  config.batch_size = 64;
  config.steps = 150;
  config.optimizer.lr = 1e-2f;
  const auto [first, last] = first_and_last_loss(config);
  CHECK(first == doctest::Approx(std::log(4.0)).epsilon(0.05));  // chance at init
  CHECK(last < 0.5 * first);
}

TEST_CASE("training learns: the gpt loss falls toward the Markov chain's floor") {
  TrainConfig config = tiny_gpt(1, 0.0f);
  config.model.vocab = 16;
  config.model.seq_len = 16;
  config.model.d_model = 32;
  config.batch_size = 16;
  config.steps = 150;
  config.optimizer.lr = 3e-3f;
  const auto [first, last] = first_and_last_loss(config);
  CHECK(first == doctest::Approx(std::log(16.0)).epsilon(0.05));
  CHECK(last < 1.6);  // below uniform (2.77) and near the bigram bound (~1.47)
}

TEST_CASE("BatchNorm rectifying for the ReLU after it gives the bits of the two apart: ResNet and U-Net, both rules, remat") {
  // The stem's and every block's BatchNorm + ReLU fuse (mark_fusions); MPIPE_FUSE=off
  // runs them apart. Selective remat recomputes the inner pair in backward; the U-Net
  // stashes ReLU outputs its BatchNorms rectified (a stashed BatchNorm: test_skips.cpp).
  for (const std::string what : {"resnet/micro/never", "resnet/deferred/selective", "resnet/micro/always", "unet/micro/never"}) {
    CAPTURE(what);
    TrainConfig c = test::tiny_gpt({.layers = 2, .d_model = 16, .heads = 2, .seq_len = 8, .vocab = 13, .dropout = 0.0f,
                                    .batch_size = 8, .micro_batches = 2, .steps = 4, .seed = 11, .lr = 1e-2f});
    if (what.starts_with("resnet")) {
      c.model.kind = "resnet";
      c.model.layers = 18;
      c.model.image = 16;
      c.model.width = 8;
      c.model.classes = 4;
    } else {
      c.model.kind = MPIPE_TEST_SOURCE_DIR "/reference/unet.toml";
    }
    const auto rule_end = what.find('/', what.find('/') + 1);
    c.pipeline.batchnorm = what.substr(what.find('/') + 1, rule_end - what.find('/') - 1);
    c.pipeline.remat = what.substr(rule_end + 1);
    Trainer fused(c);
    ::setenv("MPIPE_FUSE", "off", 1);
    Trainer apart(c);
    ::unsetenv("MPIPE_FUSE");
    CHECK(fused.model().fusions() > 0);
    CHECK(apart.model().fusions() == 0);
    for (int step = 0; step < c.steps; ++step) {
      const StepResult a = fused.step(step), b = apart.step(step);
      CHECK(a.loss == b.loss);
      CHECK(a.grad_norm == b.grad_norm);
    }
    REQUIRE(fused.params().params().size() == apart.params().params().size());
    CHECK(std::memcmp(fused.params().params().data(), apart.params().params().data(),
                      fused.params().params().size() * sizeof(float)) == 0);
  }
}
