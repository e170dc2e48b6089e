// The layer registry and model files: every kind builds from its options and is the
// layer it names; a preset written as a model file reads back as the same list; the
// options are checked by name and type.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>

#include "mpipe/app/config.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/nn/registry.hpp"
#include "mpipe/nn/transformer_layers.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/run/stage.hpp"
#include "temp_dir.hpp"

using namespace mpipe;

namespace {

bool takes_images(const std::string& kind) {
  return kind == "conv2d" || kind == "maxpool2d" || kind == "avgpool2d" || kind == "global-avgpool" ||
         kind == "residual" || kind == "batchnorm2d" || kind == "upsample2d";
}

// A spec with every required option of `kind` set to something that fits its input:
// tokens (1, 8) for the embedding, images (1, 4, 6, 6) for the convolutional kinds,
// (1, 8, 16) after an embedding for the rest.
ModelSpec one_layer_model(const LayerKind& kind) {
  ModelSpec m;
  m.name = "test";
  LayerSpec l{kind.name, {}};
  for (const OptionSpec& o : kind.options)
    if (!o.fallback) {
      if (o.name == "p") l.options[o.name] = 0.25;
      else if (o.name == "chunk") l.options[o.name] = std::int64_t{0};  // a head of one chunk
      else if (o.name == "chunks") l.options[o.name] = std::int64_t{1};
      else if (o.type == OptionType::text) l.options[o.name] = std::string("skip");  // a join's from
      else l.options[o.name] = std::int64_t{o.name == "heads" ? 4 : o.name == "kernel" ? 3 : 16};
    }
  if (kind.name == "residual")  // a block of one convolution that keeps the shape
    l.children = {{"conv2d", {{"out", std::int64_t{4}}, {"kernel", std::int64_t{3}}, {"padding", std::int64_t{1}}}}};
  if (takes_images(kind.name)) {
    m.input = {4, 6, 6};
    m.layers = {l, {"cross_entropy", {}}};
  } else if (kind.takes_tokens) {
    m.tokens = 8;
    m.layers = {l, {"cross_entropy", {}}};
  } else if (kind.name == "cross_entropy") {
    m.input = {16};
    m.layers = {l};
  } else {
    m.tokens = 8;  // the sequence layers want (B, T, C): an embedding first
    m.layers = {{"embedding", {{"vocab", std::int64_t{16}}, {"out", std::int64_t{16}}}}, l, {"cross_entropy", {}}};
  }
  return m;
}

std::string write_temp(const std::string& name, const std::string& text) {
  const auto path = mpipe::testing::test_file(name);
  std::ofstream(path) << text;
  return path.string();
}

// 0, 1, ..., the model's last layer: a stage of all of it.
std::vector<int> every_layer(const Model& m) {
  std::vector<int> all(static_cast<std::size_t>(m.size()));
  for (int i = 0; i < m.size(); ++i) all[static_cast<std::size_t>(i)] = i;
  return all;
}

// A GPT of one block at d-model 16 (2 heads, 8 tokens, 32-token vocabulary).
ModelConfig one_block_gpt() {
  ModelConfig c;
  c.kind = "gpt";
  c.layers = 1;
  c.d_model = 16;
  c.heads = 2;
  c.seq_len = 8;
  c.vocab = 32;
  return c;
}

}  // namespace

TEST_CASE("a residual block takes the kinds marked nestable inside, and refuses the others by name") {
  int nestable = 0;
  for (const LayerKind& kind : layer_kinds()) {
    INFO(kind.name);
    if (kind.name == "cross_entropy") continue;  // the loss ends a model; it is no layer to nest
    const ModelSpec single = one_layer_model(kind);
    const LayerSpec inner = single.layers[single.layers.size() == 3 ? 1 : 0];
    ModelSpec m = single;
    int at = single.layers.size() == 3 ? 1 : 0;
    if (kind.takes_tokens) {  // the block after an embedding, so that the refusal is the nesting's
      m.layers.insert(m.layers.begin(), {"embedding", {{"vocab", std::int64_t{16}}, {"out", std::int64_t{16}}}});
      at = 1;
    }
    m.layers[static_cast<std::size_t>(at)] = LayerSpec{"residual", {}, {inner}};
    const Shape input = takes_images(kind.name) ? Shape{1, 4, 6, 6} : Shape{1, 8, 16};
    std::string refused;
    try {
      make_layer(m, at, input, "test layer");
    } catch (const UserError& e) {
      refused = e.what();
    }
    const bool said = refused.find("cannot be inside a residual block") != std::string::npos;
    CHECK(said == !kind.nestable);
    if (said) CHECK(refused.find(kind.name) != std::string::npos);  // the message names the kind
    nestable += kind.nestable ? 1 : 0;
  }
  // conv2d, batchnorm2d, relu, gelu, swiglu, maxpool2d, avgpool2d, linear, layernorm, rmsnorm, attention
  CHECK(nestable == 11);
}

TEST_CASE("every registered layer kind builds from its options and is the layer it names") {
  CHECK(layer_kinds().size() >= 16);
  for (const LayerKind& kind : layer_kinds()) {
    INFO(kind.name);
    CHECK_FALSE(kind.help.empty());
    CHECK(find_layer_kind(kind.name) == &kind);
    const ModelSpec m = one_layer_model(kind);
    const int at = kind.takes_tokens || kind.name == "cross_entropy" || takes_images(kind.name) ? 0 : 1;
    const Shape input = takes_images(kind.name) ? Shape{1, 4, 6, 6}
                        : at == 0           ? (m.tokens > 0 ? Shape{1, 8} : Shape{1, 16})
                                            : Shape{1, 8, 16};
    // A join (concat, add) joins a skip of its input's shape, which a model resolves.
    const bool join = kind.name == "concat" || kind.name == "add";
    const auto layer = make_layer(m, at, input, "test layer", join ? input : Shape{});
    CHECK(layer->kind() == kind.name);
    for (const OptionSpec& o : kind.options) CHECK_FALSE(o.help.empty());
  }
  CHECK(find_layer_kind("conv9") == nullptr);
}

TEST_CASE("a preset written as a model file reads back as the same layer list") {
  for (const std::string preset : {"gpt", "llama", "mlp", "resnet"}) {
    ModelConfig c;
    c.kind = preset;
    c.kv_heads = 2;  // llama's: grouped-query attention, the head tied
    c.tie_embeddings = "on";
    c.layers = preset == "resnet" ? 50 : 3;
    c.dropout = preset == "resnet" ? 0.0f : 0.125f;
    const ModelSpec spec = model_spec(c);
    const std::string path = write_temp("mpipe_registry_" + preset + ".toml", spec.to_toml());
    const ModelSpec back = parse_model_file(path);
    std::filesystem::remove(path);
    CHECK(back.tokens == spec.tokens);
    CHECK(back.input == spec.input);
    REQUIRE(back.layers.size() == spec.layers.size());
    for (std::size_t i = 0; i < spec.layers.size(); ++i) {
      CHECK(back.layers[i].kind == spec.layers[i].kind);
      CHECK(back.layers[i].options == spec.layers[i].options);
      REQUIRE(back.layers[i].children.size() == spec.layers[i].children.size());
      for (std::size_t j = 0; j < spec.layers[i].children.size(); ++j) {
        CHECK(back.layers[i].children[j].kind == spec.layers[i].children[j].kind);
        CHECK(back.layers[i].children[j].options == spec.layers[i].children[j].options);
      }
    }
    // And builds the same model: the same layers, parameters and ties.
    ModelConfig from_file;
    from_file.kind = write_temp("mpipe_registry_" + preset + "2.toml", spec.to_toml());
    const Model a(c), b(from_file);
    std::filesystem::remove(from_file.kind);
    REQUIRE(a.size() == b.size());
    CHECK(a.parameter_count() == b.parameter_count());
    CHECK(a.ties().size() == b.ties().size());
    for (int i = 0; i < a.size(); ++i) CHECK(a.layer(i).kind() == b.layer(i).kind());
    CHECK(a.input_shape(2) == b.input_shape(2));
    CHECK(a.classes() == b.classes());
  }
}

TEST_CASE("the resnet preset is He et al.'s ResNet: torchvision's parameter counts and multiply-adds at 224") {
  // torchvision.models.resnetN(num_classes=1000): parameters (BatchNorm's running
  // statistics are buffers, not counted) and forward GMACs from its model table.
  struct Expected {
    int depth;
    std::int64_t params;
    double gmacs;
  };
  for (const Expected e : {Expected{18, 11689512, 1.81}, Expected{34, 21797672, 3.66}, Expected{50, 25557032, 4.09},
                           Expected{101, 44549160, 7.80}, Expected{152, 60192808, 11.51}}) {
    CAPTURE(e.depth);
    ModelConfig c;
    c.kind = "resnet";
    c.layers = e.depth;
    c.image = 224;
    c.classes = 1000;
    const Model m(c);
    std::int64_t params = 0;
    double forward = 0;
    const std::vector<Shape> shapes = m.shapes(1);
    for (int i = 0; i < m.size(); ++i) {
      for (const ParamSpec& p : m.layer(i).param_specs())
        if (!p.buffer) params += p.shape.numel();
      forward += m.layer(i).cost(shapes[static_cast<std::size_t>(i)]).forward_flops;
    }
    CHECK(params == e.params);
    // 2 FLOPs per multiply-add, and BatchNorm, ReLU, the sums and pools on top (~1%).
    CHECK(forward / 2e9 >= e.gmacs * 0.995);
    CHECK(forward / 2e9 <= e.gmacs * 1.03);
  }
  ModelConfig c;
  c.kind = "resnet";
  c.layers = 20;
  CHECK_THROWS_WITH_AS(validate(c), "--layers 20 is not a ResNet depth", UserError);
}

TEST_CASE("layer options are checked by name, type and range") {
  ModelSpec m;
  m.name = "m.toml";
  m.input = {16};
  m.layers = {{"linear", {{"out", std::int64_t{4}}}}, {"cross_entropy", {}}};
  CHECK_NOTHROW(make_layer(m, 0, Shape{1, 16}, "here"));
  m.layers[0].options["bias"] = std::int64_t{1};  // an integer is not true/false
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), "here: 'bias' must be true or false", UserError);
  m.layers[0].options = {{"out", 4.0}};  // nor is a float an integer
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), "here: 'out' must be an integer", UserError);
  m.layers[0].options = {{"out", std::int64_t{4}}, {"init-std", std::int64_t{1}}};  // an integer is a number
  CHECK_NOTHROW(make_layer(m, 0, Shape{1, 16}, "here"));
  m.layers[0].options = {{"out", std::int64_t{0}}};
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), doctest::Contains("'out': must be from 1"), UserError);
  m.layers[0].options = {{"width", std::int64_t{4}}};
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), "here: unknown key 'width'", UserError);
  m.input = {3, 4, 4};
  m.layers[0] = {"batchnorm2d", {{"eps", 0.0}}};
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 3, 4, 4}, "here"), doctest::Contains("'eps': must be positive"), UserError);
  m.layers[0] = {"batchnorm2d", {{"momentum", 1.5}}};
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 3, 4, 4}, "here"), doctest::Contains("'momentum': must be in [0, 1]"), UserError);
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), doctest::Contains("needs images"), UserError);
  m.input = {16};
  m.layers[0] = {"dropout", {{"p", 1.0}}};
  CHECK_THROWS_WITH_AS(make_layer(m, 0, Shape{1, 16}, "here"), doctest::Contains("'p': must be in [0, 1)"), UserError);
}

TEST_CASE("weight-gradient cost: what W runs and keeps is every Linear's and Conv2d's dW and output gradient") {
  // A GPT block at (B, T, C): four Linears (qkv C->3C, proj C->C, fc C->4C, fc_proj 4C->C),
  // each dW a GEMM of 2 * rows * in * out FLOPs, each keeping its output gradient.
  const Model m(one_block_gpt());
  const std::vector<Shape> shapes = m.shapes(2);
  const double rows = 2 * 8, C = 16;
  const Cost block = m.layer(1).cost(shapes[1]);
  CHECK(m.layer(1).kind() == "block");
  CHECK(block.weight_flops == doctest::Approx(2 * rows * C * C * (3 + 1 + 4 + 4)));
  // qkv, proj and fc keep theirs where q, k, v, the residual sum and GELU's input were;
  // fc_proj's (B, T, C) does not fit where the attention's log-sum-exp (B, H, T) was:
  // stash memory.
  CHECK(block.weight_stash_bytes == f32_bytes(rows * C));
  CHECK(block.weight_flops < block.backward_flops);  // the attention core and the rest stay in B
  const Cost norm = m.layer(2).cost(shapes[2]);      // the final LayerNorm: its gradients all in B
  CHECK(norm.weight_flops == 0);
  CHECK(norm.weight_stash_bytes == 0);
}

// One GPT block (dropout 0.1) with its parameters, and a fixed input and output gradient.
// One forward and backward of layer `at` of `m` (input `in`, output `out`): its
// gradients with dx after them, and what the arenas held. `selective`: the forward's
// recomputable part goes to a transient arena, poisoned once the forward returns, so that
// a backward reading it instead of its recomputation fails a comparison. `split`: W after
// B, its dy in a stash.
struct LayerRun {
  std::vector<float> gradients;
  std::size_t kept = 0, stash = 0, scratch = 0, transient = 0;
};
LayerRun run_layer(Model& m, int at, ParamStore& store, const Shape& in, const Shape& out, std::vector<float>& x,
                   std::vector<float>& dy, bool selective, bool split) {
  Arena slot, transient, scratch, stash;
  Pass pass;
  pass.seed = 3;
  pass.step = 1;
  pass.arena = &slot;
  if (selective) pass.transient = &transient;
  store.zero_grads();
  Context ctx;
  m.layer(at).forward(make_tensor(x.data(), in), ctx, pass);
  LayerRun r;
  r.kept = slot.high_water();
  r.transient = transient.high_water();
  transient.reset();
  if (r.transient > 0) {
    const Tensor poison = transient.tensor(Shape{static_cast<int64_t>(r.transient / sizeof(float))});
    std::fill_n(static_cast<float*>(poison.data), poison.numel(), std::numeric_limits<float>::quiet_NaN());
  }
  pass.transient = nullptr;
  pass.arena = &scratch;
  if (split) pass.stash = &stash;
  Tensor dx = scratch.tensor(in);
  m.layer(at).backward(ctx, make_tensor(dy.data(), out), dx, GradMode::overwrite, pass);
  if (split) m.layer(at).backward_weight(ctx, pass);
  r.stash = stash.high_water();
  r.scratch = scratch.high_water();
  r.gradients.assign(store.grads().begin(), store.grads().end());
  const float* d = static_cast<const float*>(dx.data);
  r.gradients.insert(r.gradients.end(), d, d + in.numel());
  return r;
}

struct BlockCase {
  Model m;
  ParamStore store;
  Shape in;
  std::vector<float> x, dy;
  BlockCase() : m(dropout_gpt()), store(m, std::vector<int>{1}, 7), in(m.shapes(2)[1]) {  // in: (2, 8, 16)
    x.resize(static_cast<std::size_t>(in.numel()));
    dy.resize(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = std::sin(0.37f * static_cast<float>(i));
      dy[i] = std::cos(0.11f * static_cast<float>(i)) * 0.1f;
    }
  }
  static ModelConfig dropout_gpt() {
    ModelConfig c = one_block_gpt();
    c.dropout = 0.1f;
    return c;
  }
  using Run = LayerRun;
  Run run(bool selective, bool split) { return run_layer(m, 1, store, in, in, x, dy, selective, split); }
};

TEST_CASE("a GPT block's split backward keeps W's output gradients in dead forward buffers, bitwise the fused one, in the fused one's scratch") {
  BlockCase block;
  const Shape in = block.in;
  const BlockCase::Run fused_run = block.run(false, false), split_run = block.run(false, true);
  const std::vector<float>&fused = fused_run.gradients, &split = split_run.gradients;
  const std::size_t stash_bytes = split_run.stash, fused_scratch = fused_run.scratch, split_scratch = split_run.scratch;
  REQUIRE(fused.size() == split.size());
  CHECK(std::memcmp(fused.data(), split.data(), fused.size() * sizeof(float)) == 0);
  // Only fc_proj's (B, T, C): every other W's output gradient is in a buffer of the
  // forward's that B is done with (the attention keeps no (T, T) probabilities to reuse).
  CHECK(stash_bytes == static_cast<std::size_t>(in.numel()) * sizeof(float));
  // With dropout the MLP's dy waits in the dropout scratch for W; the attention's dy then
  // takes a buffer that is dead by then, not a new one (--in-flight 1f1b: 1F1B's memory).
  CHECK(split_scratch == fused_scratch);
}

TEST_CASE("--remat selective: a GPT block keeps 6 (B, T, C) fewer, recomputes them in backward, bitwise never's gradients, fused and split") {
  BlockCase block;
  Model& m = block.m;
  const Shape in = block.in;
  const BlockCase::Run never = block.run(false, false);
  const std::size_t never_kept = never.kept;
  std::size_t selective_kept = 0;
  for (const bool split : {false, true}) {
    CAPTURE(split);
    const BlockCase::Run selective = block.run(true, split);
    if (!split) selective_kept = selective.kept;
    REQUIRE(selective.gradients.size() == never.gradients.size());
    CHECK(std::memcmp(selective.gradients.data(), never.gradients.data(), never.gradients.size() * sizeof(float)) == 0);
  }
  // LayerNorm's two outputs and GELU's (B, T, 4C), LayerNorm's statistics with them.
  const std::size_t btc = static_cast<std::size_t>(in.numel()) * sizeof(float);
  CHECK(never_kept - selective_kept >= 6 * btc);
  CHECK(m.layer(1).cost(in).recomputable_bytes == doctest::Approx(6.0 * static_cast<double>(btc)));
}

TEST_CASE("--remat selective: a residual block keeps its inner BatchNorm's and ReLU's outputs out, recomputes them in backward, bitwise never's gradients, fused and split") {
  // One thread: with two, the samples' im2col columns side by side are the forward's peak
  // (a test before may have left two: its high water then says nothing of the outputs).
  cpu::set_threads(1);
  ModelConfig c;
  c.kind = "resnet";
  c.layers = 50;  // bottlenecks: two inner BatchNorm + ReLU pairs each
  c.width = 4;
  c.image = 16;
  c.classes = 3;
  Model m(c);
  std::vector<int> blocks;  // the first (a projection: the stage's width grows) and an identity one
  for (int i = 0; i < m.size(); ++i)
    if (m.layer(i).kind() == "residual" && blocks.size() < 2) blocks.push_back(i);
  REQUIRE(blocks.size() == 2);
  c.layers = 18;  // basic blocks: one pair each
  Model basic(c);
  for (int i = 0; i < basic.size(); ++i)
    if (basic.layer(i).kind() == "residual") {
      blocks.push_back(-1 - i);  // basic's, marked negative
      break;
    }
  for (const int tagged : blocks) {
    Model& model = tagged < 0 ? basic : m;
    const int at = tagged < 0 ? -1 - tagged : tagged;
    CAPTURE(at);
    CAPTURE(model.layer(at).kind());
    ParamStore store(model, std::vector<int>{at}, 7);
    const Shape in = model.shapes(2)[static_cast<std::size_t>(at)];
    const Shape out = model.shapes(2)[static_cast<std::size_t>(at) + 1];
    std::vector<float> x(static_cast<std::size_t>(in.numel())), dy(static_cast<std::size_t>(out.numel()));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
    for (std::size_t i = 0; i < dy.size(); ++i) dy[i] = std::cos(0.11f * static_cast<float>(i)) * 0.1f;
    const LayerRun never = run_layer(model, at, store, in, out, x, dy, false, false);
    CHECK(never.transient == 0);
    std::size_t selective_kept = 0;
    for (const bool split : {false, true}) {
      CAPTURE(split);
      const LayerRun selective = run_layer(model, at, store, in, out, x, dy, true, split);
      CHECK(selective.transient > 0);
      if (!split) selective_kept = selective.kept;
      REQUIRE(selective.gradients.size() == never.gradients.size());
      CHECK(std::memcmp(selective.gradients.data(), never.gradients.data(), never.gradients.size() * sizeof(float)) == 0);
    }
    // What the forward let go: each inner BatchNorm's output and statistics (the ReLU
    // after it runs in place); the cost says the same.
    const double recomputable = model.layer(at).cost(in).recomputable_bytes;
    CHECK(recomputable > 0);
    CHECK(static_cast<double>(never.kept - selective_kept) == doctest::Approx(recomputable).epsilon(0.02));
  }
}

TEST_CASE("a stage's split backward keeps a Linear's dy in its output's buffer where no later W reads it, bitwise the fused one") {
  // MLP: every Linear is followed by a ReLU or the loss; GPT: the LM head by the loss;
  // two Linears in a row: the second's W reads the first's output, which must stay.
  const std::string chain = write_temp("mpipe_stage_stash_chain.toml", R"(input = [6]
[[layer]]
kind = "linear"
out = 5
[[layer]]
kind = "linear"
out = 4
[[layer]]
kind = "cross_entropy"
)");
  ModelConfig mlp;
  mlp.kind = "mlp";
  mlp.layers = 2;
  mlp.hidden = 12;
  mlp.inputs = 6;
  mlp.classes = 5;
  ModelConfig linears = mlp;
  linears.kind = chain;
  for (const auto& [name, config, reused] : std::vector<std::tuple<std::string, ModelConfig, bool>>{
           {"mlp", mlp, true}, {"gpt", one_block_gpt(), true}, {"linear, linear", linears, false}}) {
    INFO(name);
    Model m(config);
    const int n = m.size();
    ParamStore store(m, every_layer(m), 5);
    const int64_t batch = 3;
    const std::vector<Shape> shapes = m.shapes(batch);
    const Shape in = m.input_shape(batch);
    std::vector<float> features(static_cast<std::size_t>(in.numel()));
    std::vector<std::int32_t> tokens(features.size()), targets(static_cast<std::size_t>(m.target_shape(batch).numel()));
    for (std::size_t i = 0; i < features.size(); ++i) {
      features[i] = std::sin(0.41f * static_cast<float>(i));
      tokens[i] = static_cast<std::int32_t>((7 * i + 3) % 32);
    }
    for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = static_cast<std::int32_t>((5 * i + 1) % (name == "gpt" ? 32 : 4));
    const Tensor x = m.input_dtype() == DType::i32 ? Tensor{tokens.data(), in, DType::i32, Device::cpu}
                                                    : make_tensor(features.data(), in);
    Progress progress(ProgressMode::layers, 1e-3, 1, false);
    const Stage stage(m, 0, 0, 0, n, 1, 1);
    std::size_t given_back = 0;  // split: what B gave back to the forward's arena
    auto gradients = [&](bool split, std::size_t* stash_bytes) {
      Arena slot, scratch, stash;
      Pass pass;
      pass.seed = 3;
      pass.step = 1;
      pass.arena = &slot;
      pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
      pass.loss_scale = 0.25f;
      store.zero_grads();
      Tensor out;
      Context* contexts = stage.run_forward(pass, x, &out, progress);
      pass.arena = &scratch;
      if (split) pass.stash = &stash;
      static float one = 1.0f;
      const std::size_t forward_bytes = slot.used();
      stage.run_backward(contexts, make_tensor(&one, Shape{1}), Tensor{}, pass, scratch, shapes, DType::f32, nullptr, progress,
                         nullptr, split ? &slot : nullptr);
      if (split) given_back = forward_bytes - slot.used();
      if (split) stage.run_weight(contexts, pass, nullptr, progress);
      if (stash_bytes) *stash_bytes = stash.high_water();
      return std::vector<float>(store.grads().begin(), store.grads().end());
    };
    std::size_t stash_bytes = 0;
    const std::vector<float> fused = gradients(false, nullptr), split = gradients(true, &stash_bytes);
    REQUIRE(fused.size() == split.size());
    CHECK(std::memcmp(fused.data(), split.data(), fused.size() * sizeof(float)) == 0);
    // GPT: only the block's fc_proj dy (B, T, C) (the attention keeps no (T, T) to reuse).
    if (name == "gpt") CHECK(stash_bytes == static_cast<std::size_t>(shapes[1].numel()) * sizeof(float));
    else if (reused) CHECK(stash_bytes == 0);
    else CHECK(stash_bytes > 0);  // the second Linear's input was not overwritten: the sums above agree
    // The top layers whose W is cheap (weights_in_backward_from) computed it in B, the
    // same bits as above, and gave back their forward memory: the loss's at least.
    const int whole_from = weights_in_backward_from(m, 0, n);
    CAPTURE(whole_from);
    CHECK(whole_from < n);
    const std::vector<Shape> one = m.shapes(batch);
    double released = 0;
    for (int i = whole_from; i < n; ++i)
      released += static_cast<double>(Arena::rounded(static_cast<std::size_t>(m.layer(i).cost(one[static_cast<std::size_t>(i)]).activation_bytes)));
    CHECK(static_cast<double>(given_back) >= released);
    if (name == "gpt") CHECK(whole_from == n - 3);  // the final LayerNorm, the head, the loss
  }
}

TEST_CASE("a stage's backward reuses each layer's temporaries for the next, and holds two input gradients in turns: more blocks add nothing") {
  Progress progress(ProgressMode::layers, 1e-3, 1, false);
  const auto scratch_bytes = [&](int blocks) {
    ModelConfig c = one_block_gpt();
    c.layers = blocks;
    Model m(c);
    const int n = m.size();
    ParamStore store(m, every_layer(m), 5);
    const int64_t batch = 2;
    std::vector<std::int32_t> tokens(static_cast<std::size_t>(m.input_shape(batch).numel()), 3), targets = tokens;
    Arena slot, scratch;
    Pass pass;
    pass.arena = &slot;
    pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
    const Stage stage(m, 0, 0, 0, n, 1, 1);
    Tensor out;
    Context* contexts = stage.run_forward(pass, {tokens.data(), m.input_shape(batch), DType::i32, Device::cpu}, &out, progress);
    pass.arena = &scratch;
    static float one = 1.0f;
    stage.run_backward(contexts, make_tensor(&one, Shape{1}), Tensor{}, pass, scratch, m.shapes(batch), DType::f32, nullptr,
                   progress);
    return scratch.high_water();
  };
  // Before the turns, each further block's input gradient added (2, 8, 16) floats.
  CHECK(scratch_bytes(3) == scratch_bytes(1));
}

namespace {
// Model-file text: a 3x3 convolution (padding 1), BatchNorm and ReLU; a residual block of
// two 3x3 convolutions with BatchNorm and a ReLU between (a 1x1 projection on its skip
// path where `stride` or the channels change); a global average pool, a linear layer
// and the loss.
std::string stem(int out) {
  return cat("[[layer]]\nkind = \"conv2d\"\nout = ", out,
             "\nkernel = 3\npadding = 1\n[[layer]]\nkind = \"batchnorm2d\"\n[[layer]]\nkind = \"relu\"\n");
}
std::string basic_block(int out, int stride = 1, bool skip_norm = false) {
  return cat("[[layer]]\nkind = \"residual\"\n", skip_norm ? "skip-norm = true\n" : "", "  [[layer.layer]]\n  kind = \"conv2d\"\n  out = ", out, "\n  kernel = 3\n  stride = ",
             stride, "\n  padding = 1\n  [[layer.layer]]\n  kind = \"batchnorm2d\"\n  [[layer.layer]]\n  kind = \"relu\"\n",
             "  [[layer.layer]]\n  kind = \"conv2d\"\n  out = ", out,
             "\n  kernel = 3\n  padding = 1\n  [[layer.layer]]\n  kind = \"batchnorm2d\"\n");
}
std::string classifier(int classes) {
  return cat("[[layer]]\nkind = \"global-avgpool\"\n[[layer]]\nkind = \"linear\"\nout = ", classes,
             "\n[[layer]]\nkind = \"cross_entropy\"\n");
}
}  // namespace

TEST_CASE("an unsplit backward puts input gradients in spent forward memory: bitwise the turns' gradients, less scratch, a projection's output given back") {
  // A stem, an identity block, a strided block with a projection (its output given back
  // after the sum), one whose projection a BatchNorm follows (skip-norm), then the head.
  const std::string file =
      write_temp("mpipe_spent.toml", "input = [3, 16, 16]\n" + stem(8) + basic_block(8) + "[[layer]]\nkind = \"relu\"\n" +
                                         basic_block(16, 2) + "[[layer]]\nkind = \"relu\"\n" + basic_block(32, 2, true) +
                                         classifier(3));
  ModelConfig config;
  config.kind = file;
  Model m(config);
  const int n = m.size();
  ParamStore store(m, every_layer(m), 5);
  const int64_t batch = 4;
  const std::vector<Shape> shapes = m.shapes(batch);
  std::vector<float> image(static_cast<std::size_t>(m.input_shape(batch).numel()));
  for (std::size_t i = 0; i < image.size(); ++i) image[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<std::int32_t> targets{0, 2, 1, 1};
  Progress progress(ProgressMode::layers, 1e-3, 1, false);
  const Stage stage(m, 0, 0, 0, n, 1, 1);
  std::size_t scratch_peak = 0;
  auto run = [&](bool spent) {
    Arena slot, scratch;
    Pass pass;
    pass.arena = &slot;
    pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
    pass.loss_scale = 1.0f / 4;
    store.zero_grads();
    Tensor out;
    Context* contexts = stage.run_forward(pass, make_tensor(image.data(), m.input_shape(batch)), &out, progress);
    const std::vector<float> forward_bits(static_cast<const float*>(out.data), static_cast<const float*>(out.data) + out.numel());
    Spent memory;
    memory.arena = &slot;
    memory.to = slot.mark();
    memory.live[2] = out;
    pass.arena = &scratch;
    static float one = 1.0f;
    stage.run_backward(contexts, make_tensor(&one, Shape{1}), Tensor{}, pass, scratch, shapes, DType::f32, nullptr, progress,
                       spent ? &memory : nullptr);
    // What leaves the stage (a live tensor) is as the forward left it.
    CHECK(std::memcmp(out.data, forward_bits.data(), out.bytes()) == 0);
    scratch_peak = scratch.high_water();
    return std::vector<float>(store.grads().begin(), store.grads().end());
  };
  const std::vector<float> turns = run(false);
  const std::size_t turns_peak = scratch_peak;
  const std::vector<float> spent = run(true);
  REQUIRE(turns.size() == spent.size());
  CHECK(std::memcmp(turns.data(), spent.data(), turns.size() * sizeof(float)) == 0);
  // At least one (4, 8, 16, 16) input gradient fewer in scratch.
  CHECK(scratch_peak + 4 * 8 * 16 * 16 * sizeof(float) <= turns_peak);
  // The strided block, last on a stage: after its forward, the next allocation takes the
  // memory of its projection's output, given back.
  const Stage blocks(m, 0, 0, 0, 6, 2, 1);
  Arena slot;
  Pass pass;
  pass.arena = &slot;
  Tensor out;
  Context* contexts = blocks.run_forward(pass, make_tensor(image.data(), m.input_shape(batch)), &out, progress);
  const Context& projection = contexts[5].children[5];
  CHECK(slot.tensor(Shape{1}).data == slot.at(projection.begin));
  // The plan counts it out: the block's activations are its parts' less that output.
  const Cost block = m.layer(5).cost(shapes[5]);
  double parts = 0;
  std::vector<Layer*> all;
  m.layer(5).parts(all);
  Shape s = shapes[5];
  for (std::size_t i = 1; i < all.size() - 1; ++i) {
    parts += all[i]->cost(s).activation_bytes;
    s = all[i]->output_shape(s);
  }
  parts += all.back()->cost(shapes[5]).activation_bytes;  // the projection
  CHECK(block.activation_bytes == parts - 4.0 * static_cast<double>(shapes[6].numel()));
  // A skip path of a projection and a BatchNorm (skip-norm): the BatchNorm's statistics
  // come first, its output last, and that output is given back after the sum.
  const Stage normed(m, 0, 0, 0, 8, 2, 1);
  Arena slot2;
  pass.arena = &slot2;
  contexts = normed.run_forward(pass, make_tensor(image.data(), m.input_shape(batch)), &out, progress);
  const Context& norm = contexts[7].children[6];
  // What the BatchNorm still holds is its two statistics alone, its output given back to
  // the next allocation.
  CHECK(slot2.used() - norm.begin.used == 2 * Arena::rounded(norm.saved[0].bytes()));
  CHECK(slot2.tensor(Shape{1}).data == static_cast<std::byte*>(norm.saved[1].data) + Arena::rounded(norm.saved[1].bytes()));
}

TEST_CASE("a ReLU after a layer whose output is dead to it runs in place, bitwise, never over a stage's input") {
  // conv -> batchnorm -> relu (in place), a block whose inner relu runs in place and whose
  // sum goes over its last batchnorm's output, a relu after the block (in place), and a
  // relu after a relu (not in place: the first one's backward reads its output).
  const std::string file = write_temp("mpipe_in_place.toml", "input = [2, 6, 6]\n" + stem(4) + basic_block(4) +
                                                                "[[layer]]\nkind = \"relu\"\n[[layer]]\nkind = \"relu\"\n" +
                                                                classifier(3));
  ModelConfig config;
  config.kind = file;
  Model m(config);
  const int n = m.size();
  CHECK(m.layer(2).writes_over_input());
  CHECK(m.layer(4).writes_over_input());
  CHECK_FALSE(m.layer(5).writes_over_input());
  ParamStore store(m, every_layer(m), 5);
  const int64_t batch = 3;
  const std::vector<Shape> shapes = m.shapes(batch);
  std::vector<float> image(static_cast<std::size_t>(m.input_shape(batch).numel()));
  for (std::size_t i = 0; i < image.size(); ++i) image[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<std::int32_t> targets{0, 2, 1};
  Progress progress(ProgressMode::layers, 1e-3, 1, false);
  const Stage stage(m, 0, 0, 0, n, 1, 1);
  std::size_t peak = 0;
  auto run = [&](std::size_t* kept) {
    Arena slot, scratch;
    Pass pass;
    pass.arena = &slot;
    pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
    pass.loss_scale = 1.0f / 3;
    store.zero_grads();
    Tensor out;
    Context* contexts = stage.run_forward(pass, make_tensor(image.data(), m.input_shape(batch)), &out, progress);
    *kept = slot.used();  // what the forward keeps (a conv's columns were given back)
    peak = slot.high_water();
    pass.arena = &scratch;
    static float one = 1.0f;
    stage.run_backward(contexts, make_tensor(&one, Shape{1}), Tensor{}, pass, scratch, shapes, DType::f32, nullptr, progress);
    return std::vector<float>(store.grads().begin(), store.grads().end());
  };
  std::size_t in_place = 0, apart = 0;
  const std::vector<float> with = run(&in_place);
  // The last conv's columns (one sample's, 4 x 9 x 36 floats) were the forward's peak,
  // and are not kept: the layers after it allocate less than they took.
  CHECK(peak > in_place);
  std::vector<Layer*> parts;
  for (int i = 0; i < n; ++i) m.layer(i).parts(parts);
  for (Layer* part : parts) part->allow_in_place(false);
  const std::vector<float> without = run(&apart);
  REQUIRE(with.size() == without.size());
  CHECK(std::memcmp(with.data(), without.data(), with.size() * sizeof(float)) == 0);
  // Three ReLU outputs of (3, 4, 6, 6) floats fewer (each a multiple of 64 bytes after rounding).
  const std::size_t activation = (3 * 4 * 6 * 6 * sizeof(float) + 63) / 64 * 64;
  CHECK(apart - in_place == 3 * activation);
  // The plan counts what the run keeps: its ReLUs cost nothing, but a stage that begins
  // with one keeps its own output (the stage's input is not written over).
  m.layer(2).allow_in_place(true);
  m.layer(4).allow_in_place(true);
  CHECK(m.layer(2).cost(shapes[2]).activation_bytes == 0);
  const Stage from_relu(m, 1, 1, 4, n, 2, 1);
  std::vector<float> input(static_cast<std::size_t>(shapes[4].numel()));
  for (std::size_t i = 0; i < input.size(); ++i) input[i] = std::cos(0.3f * static_cast<float>(i));
  const std::vector<float> before = input;
  Arena slot;
  Pass pass;
  pass.arena = &slot;
  pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
  Tensor out;
  from_relu.run_forward(pass, make_tensor(input.data(), shapes[4]), &out, progress);
  CHECK(input == before);
}
