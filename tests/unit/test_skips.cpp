// Skips (nn/skip_layers.hpp): concat, add and upsample2d element by element, the per-pixel
// loss against its rows, a U-Net's gradients through its skips against finite
// differences, and per-pixel data (synthetic segmentation, HDF5 label maps).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include <hdf5.h>

#include "mpipe/core/error.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/nn/dense_layers.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/nn/skip_layers.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/run/stage.hpp"
#include "hdf5_data_file.hpp"
#include "temp_dir.hpp"
#include "unet_model.hpp"

using namespace mpipe;

namespace {

std::vector<float> ramp(std::size_t n, float scale = 1.0f, float offset = 0.0f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = offset + scale * static_cast<float>(i);
  return v;
}

std::string model_file(const char* name, const char* text) {
  const auto path = mpipe::testing::test_file(name);
  std::ofstream(path) << text;
  return path.string();
}

// A U-Net in small, no BatchNorm: "top" (layer 0) joined by add at 7, "low" (layer 1)
// by concat at 5, a stashed output that a ReLU follows (it must not write over it).
constexpr const char* small_unet = R"(input = [2, 4, 4]
[[layer]]
kind = "conv2d"
out = 3
kernel = 3
padding = 1
stash = "top"
[[layer]]
kind = "relu"
stash = "low"
[[layer]]
kind = "maxpool2d"
kernel = 2
[[layer]]
kind = "conv2d"
out = 4
kernel = 3
padding = 1
[[layer]]
kind = "upsample2d"
[[layer]]
kind = "concat"
from = "low"
[[layer]]
kind = "conv2d"
out = 3
kernel = 1
[[layer]]
kind = "add"
from = "top"
[[layer]]
kind = "gelu"
[[layer]]
kind = "conv2d"
out = 3
kernel = 1
[[layer]]
kind = "cross_entropy"
)";

}  // namespace

TEST_CASE("concat and add join a skip element by element, and their backward hands each part its gradient") {
  for (const bool images : {true, false}) {
    INFO((images ? "images (N, C, H, W): channels are dim 1" : "(N, T, C): channels are the last"));
    const Shape in = images ? Shape{2, 2, 1, 3} : Shape{2, 3, 2}, skip = images ? Shape{2, 1, 1, 3} : Shape{2, 3, 1};
    Shape skip1 = skip;
    skip1[0] = 1;
    SkipJoin concat(SkipJoin::Op::concat, "s", skip1);
    concat.set_skip(0);
    const Shape out = concat.output_shape(in);
    CHECK(out[join_axis(in)] == in[join_axis(in)] + skip[join_axis(skip)]);
    std::vector<float> x = ramp(static_cast<std::size_t>(in.numel())), s = ramp(static_cast<std::size_t>(skip.numel()), 1.0f, 100.0f);
    const Tensor st = make_tensor(s.data(), skip);
    Arena arena;
    Pass pass;
    pass.arena = &arena;
    pass.skips = {&st, 1};
    Context ctx;
    const Tensor y = concat.forward(make_tensor(x.data(), in), ctx, pass);
    // Each run (a sample's channels, or a row's) is x's run, then the skip's.
    const std::int64_t runs = images ? 2 : 6, xr = in.numel() / runs, sr = skip.numel() / runs;
    for (std::int64_t r = 0; r < runs; ++r) {
      for (std::int64_t i = 0; i < xr; ++i) CHECK(y.f32()[r * (xr + sr) + i] == x[static_cast<std::size_t>(r * xr + i)]);
      for (std::int64_t i = 0; i < sr; ++i) CHECK(y.f32()[r * (xr + sr) + xr + i] == s[static_cast<std::size_t>(r * sr + i)]);
    }
    std::vector<float> dy = ramp(static_cast<std::size_t>(out.numel()), 0.5f, -3.0f), dx(x.size()), ds(s.size(), -1.0f);
    const Tensor dst = make_tensor(ds.data(), skip);
    pass.skip_grads = {&dst, 1};
    concat.backward(ctx, make_tensor(dy.data(), out), make_tensor(dx.data(), in), GradMode::overwrite, pass);
    for (std::int64_t r = 0; r < runs; ++r) {
      for (std::int64_t i = 0; i < xr; ++i) CHECK(dx[static_cast<std::size_t>(r * xr + i)] == dy[static_cast<std::size_t>(r * (xr + sr) + i)]);
      for (std::int64_t i = 0; i < sr; ++i) CHECK(ds[static_cast<std::size_t>(r * sr + i)] == dy[static_cast<std::size_t>(r * (xr + sr) + xr + i)]);
    }
  }
  // add: y = x + s; both gradients are dy.
  const Shape in{2, 3};
  SkipJoin add(SkipJoin::Op::add, "s", Shape{1, 3});
  add.set_skip(0);
  std::vector<float> x = ramp(6), s = ramp(6, 2.0f, 1.0f), dy = ramp(6, -1.0f, 4.0f), dx(6), ds(6);
  const Tensor st = make_tensor(s.data(), in), dst = make_tensor(ds.data(), in);
  Arena arena;
  Pass pass;
  pass.arena = &arena;
  pass.skips = {&st, 1};
  pass.skip_grads = {&dst, 1};
  Context ctx;
  const Tensor y = add.forward(make_tensor(x.data(), in), ctx, pass);
  add.backward(ctx, make_tensor(dy.data(), in), make_tensor(dx.data(), in), GradMode::overwrite, pass);
  for (std::size_t i = 0; i < 6; ++i) {
    CHECK(y.f32()[i] == x[i] + s[i]);
    CHECK(dx[i] == dy[i]);
    CHECK(ds[i] == dy[i]);
  }
  // A join without its skip is an error, not a read of nothing.
  Pass bare;
  bare.arena = &arena;
  Context c2;
  CHECK_THROWS_AS(add.forward(make_tensor(x.data(), in), c2, bare), Error);
}

TEST_CASE("a stashed BatchNorm output is never rectified for the ReLU after it: only unstashed pairs fuse") {
  // BatchNorm 1 is stashed (its join reads it unrectified), so ReLU 2 keeps its own output;
  // BatchNorm 4 -> ReLU 5 fuses.
  const std::string file = model_file("stashed_batchnorm.toml", R"(input = [2, 4, 4]
[[layer]]
kind = "conv2d"
out = 3
kernel = 3
padding = 1
[[layer]]
kind = "batchnorm2d"
stash = "normed"
[[layer]]
kind = "relu"
[[layer]]
kind = "conv2d"
out = 3
kernel = 3
padding = 1
[[layer]]
kind = "batchnorm2d"
[[layer]]
kind = "relu"
[[layer]]
kind = "add"
from = "normed"
[[layer]]
kind = "conv2d"
out = 2
kernel = 1
[[layer]]
kind = "cross_entropy"
)");
  ModelConfig config;
  config.kind = file;
  const Model model(config);
  CHECK(model.fusions() == 1);
  CHECK_FALSE(model.layer(2).writes_over_input());
  CHECK(model.layer(5).writes_over_input());
}

TEST_CASE("upsample2d: each element fills its scale x scale block, and the gradient sums the block") {
  for (const std::int64_t scale : {2, 3}) {
    const Shape in{2, 1, 2, 3};
    Upsample2d up(scale);
    const Shape out = up.output_shape(in);
    CHECK(out == Shape{2, 1, 2 * scale, 3 * scale});
    std::vector<float> x = ramp(12);
    Arena arena;
    Pass pass;
    pass.arena = &arena;
    Context ctx;
    const Tensor y = up.forward(make_tensor(x.data(), in), ctx, pass);
    for (std::int64_t p = 0; p < 2; ++p)
      for (std::int64_t h = 0; h < out[2]; ++h)
        for (std::int64_t w = 0; w < out[3]; ++w)
          CHECK(y.f32()[(p * out[2] + h) * out[3] + w] == x[static_cast<std::size_t>((p * 2 + h / scale) * 3 + w / scale)]);
    std::vector<float> dy = ramp(static_cast<std::size_t>(out.numel()), 0.25f), dx(12);
    up.backward(ctx, make_tensor(dy.data(), out), make_tensor(dx.data(), in), GradMode::overwrite, pass);
    for (std::int64_t p = 0; p < 2; ++p)
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t w = 0; w < 3; ++w) {
          float sum = 0;
          for (std::int64_t i = 0; i < scale; ++i)
            for (std::int64_t j = 0; j < scale; ++j) sum += dy[static_cast<std::size_t>((p * out[2] + h * scale + i) * out[3] + w * scale + j)];
          CHECK(dx[static_cast<std::size_t>((p * 2 + h) * 3 + w)] == sum);
        }
  }
}

TEST_CASE("cross_entropy on (N, classes, H, W): a label per pixel, the loss and gradient of its rows (N H W, classes)") {
  const std::int64_t N = 2, C = 3, H = 2, W = 2;
  std::vector<float> nchw(static_cast<std::size_t>(N * C * H * W)), rows(nchw.size());
  for (std::size_t i = 0; i < nchw.size(); ++i) nchw[i] = std::sin(0.7f * static_cast<float>(i));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t p = 0; p < H * W; ++p) rows[static_cast<std::size_t>((n * H * W + p) * C + c)] = nchw[static_cast<std::size_t>((n * C + c) * H * W + p)];
  std::vector<std::int32_t> labels{0, 2, 1, 1, 2, 0, 0, 1};
  CrossEntropyLoss pixels, plain;
  Arena arena;
  Pass pass;
  pass.arena = &arena;
  pass.loss_scale = 1.0f / 8;
  pass.targets = {labels.data(), Shape{N, H, W}, DType::i32, Device::cpu};
  Context a, b;
  pixels.forward(make_tensor(nchw.data(), Shape{N, C, H, W}), a, pass);
  Pass flat = pass;
  flat.targets = {labels.data(), Shape{N * H * W}, DType::i32, Device::cpu};
  plain.forward(make_tensor(rows.data(), Shape{N * H * W, C}), b, flat);
  CHECK(a.value == b.value);
  std::vector<float> dx(nchw.size()), drows(rows.size());
  float one = 1.0f;
  pixels.backward(a, make_tensor(&one, Shape{1}), make_tensor(dx.data(), Shape{N, C, H, W}), GradMode::overwrite, pass);
  plain.backward(b, make_tensor(&one, Shape{1}), make_tensor(drows.data(), Shape{N * H * W, C}), GradMode::overwrite, flat);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t p = 0; p < H * W; ++p)
        CHECK(dx[static_cast<std::size_t>((n * C + c) * H * W + p)] == drows[static_cast<std::size_t>((n * H * W + p) * C + c)]);
  // The model's targets and rows follow the loss's input.
  ModelConfig config;
  config.kind = model_file("skips_unet_small.toml", small_unet);
  const Model m(config);
  CHECK(m.target_shape(5) == Shape{5, 4, 4});
  CHECK(m.rows_per_sample() == 16);
  CHECK(m.classes() == 3);
  REQUIRE(m.skips().size() == 2);
  CHECK((m.skips()[0].name == "top" && m.skips()[0].producer == 0 && m.skips()[0].consumer == 7));
  CHECK((m.skips()[1].name == "low" && m.skips()[1].producer == 1 && m.skips()[1].consumer == 5));
  // The model file reads back to the same spec, stashes included.
  CHECK(parse_model_text(m.spec().to_toml(), "again").layers[1].stash == "low");
}

TEST_CASE("a U-Net's parameter gradients, through skips within a stage, match finite differences") {
  ModelConfig config;
  config.kind = model_file("skips_unet_fd.toml", small_unet);
  Model m(config);
  std::vector<int> all(static_cast<std::size_t>(m.size()));
  for (int i = 0; i < m.size(); ++i) all[static_cast<std::size_t>(i)] = i;
  ParamStore store(m, all, 9);
  const std::int64_t batch = 2;
  const std::vector<Shape> shapes = m.shapes(batch);
  std::vector<float> x(static_cast<std::size_t>(m.input_shape(batch).numel()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.37f * static_cast<float>(i));
  std::vector<std::int32_t> targets(static_cast<std::size_t>(m.target_shape(batch).numel()));
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = static_cast<std::int32_t>((7 * i + 2) % 3);
  Progress progress(ProgressMode::layers, 1e-3, 1, false);
  const Stage stage(m, 0, 0, 0, m.size(), 1, 1);
  auto loss = [&](bool backward) {
    Arena slot, scratch;
    Pass pass;
    pass.arena = &slot;
    pass.targets = {targets.data(), m.target_shape(batch), DType::i32, Device::cpu};
    pass.loss_scale = 1.0f / static_cast<float>(targets.size());
    Tensor out;
    Context* contexts = stage.run_forward(pass, make_tensor(x.data(), m.input_shape(batch)), &out, progress);
    const double value = contexts[m.size() - 1].value * pass.loss_scale;
    if (backward) {
      store.zero_grads();
      pass.arena = &scratch;
      static float one = 1.0f;
      stage.run_backward(contexts, make_tensor(&one, Shape{1}), Tensor{}, pass, scratch, shapes, DType::f32, nullptr, progress);
    }
    return value;
  };
  loss(true);
  const std::vector<float> grads(store.grads().begin(), store.grads().end());
  std::span<float> params = store.params();
  // Along three random directions over every parameter at once.
  for (std::uint32_t trial = 0; trial < 3; ++trial) {
    const RandomStream r = make_stream(17, Stream::init, trial, 3, 0);
    std::vector<float> v(params.size());
    double analytic = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      v[i] = r.normal(i);
      analytic += static_cast<double>(grads[i]) * v[i];
    }
    const float eps = 1e-3f;
    for (std::size_t i = 0; i < v.size(); ++i) params[i] += eps * v[i];
    const double up = loss(false);
    for (std::size_t i = 0; i < v.size(); ++i) params[i] -= 2 * eps * v[i];
    const double down = loss(false);
    for (std::size_t i = 0; i < v.size(); ++i) params[i] += eps * v[i];
    const double numeric = (up - down) / (2 * eps);
    INFO("trial " << trial << ": analytic " << analytic << ", numeric " << numeric);
    CHECK(std::abs(analytic - numeric) <= 2e-2 * std::max(1e-3, std::abs(numeric)));
  }
  // Without the skips' gradients the check above fails: the producers' gradients are not
  // the chain's alone (the skip into layer 0 carries most of conv 0's).
  CHECK(std::abs(grads[0]) > 0.0f);
}

TEST_CASE("synthetic segmentation: a label per pixel, every class drawn, the same however the batch is split") {
  ModelConfig config;
  config.kind = model_file("skips_unet_data.toml", small_unet);
  const Model m(config);
  auto data = make_dataset("synthetic", m, 5);
  CHECK(data->describe().find("synthetic segmentation") != std::string::npos);
  const std::int64_t n = 16, per_x = 2 * 4 * 4, per_y = 16;
  std::vector<float> x(static_cast<std::size_t>(n * per_x)), x2(x.size());
  std::vector<std::int32_t> y(static_cast<std::size_t>(n * per_y)), y2(y.size());
  data->fill(100, n, make_tensor(x.data(), Shape{n, 2, 4, 4}), {y.data(), Shape{n, 4, 4}, DType::i32, Device::cpu});
  data->fill(100, n / 2, make_tensor(x2.data(), Shape{n / 2, 2, 4, 4}), {y2.data(), Shape{n / 2, 4, 4}, DType::i32, Device::cpu});
  data->fill(100 + n / 2, n / 2, make_tensor(x2.data() + n / 2 * per_x, Shape{n / 2, 2, 4, 4}),
             {y2.data() + n / 2 * per_y, Shape{n / 2, 4, 4}, DType::i32, Device::cpu});
  CHECK(x == x2);
  CHECK(y == y2);
  std::vector<int> seen(3, 0);
  for (const std::int32_t label : y) {
    REQUIRE((label >= 0 && label < 3));
    ++seen[static_cast<std::size_t>(label)];
  }
  for (const int count : seen) CHECK(count > 0);
  // The last stage reads labels alone.
  CHECK(data->targets_alone());
  std::vector<std::int32_t> alone(y.size());
  data->fill(100, n, Tensor{}, {alone.data(), Shape{n, 4, 4}, DType::i32, Device::cpu});
  CHECK(alone == y);
}

TEST_CASE("hdf5 label maps: /labels (N, H, W) read a map per sample, and a map of the wrong size or class refused") {
  ModelConfig config;
  config.kind = model_file("skips_unet_h5.toml", small_unet);
  const Model m(config);
  const auto write = [](const std::string& path, hsize_t h, std::int32_t bad) {
    constexpr hsize_t N = 3;
    std::vector<float> pixels(N * 2 * 4 * 4, 0.5f);
    std::vector<std::int32_t> labels(N * h * 4);
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % 3);
    labels.back() = bad;
    mpipe::testing::write_data_file(path, {N, 2, 4, 4}, pixels, {N, h, 4}, labels);
  };
  const std::string good = mpipe::testing::test_file("maps.h5").string();
  write(good, 4, 2);
  auto data = make_dataset("hdf5:" + good, m, 1, /*held_out=*/true);
  CHECK(data->size() == 3);
  std::vector<float> x(2 * 32);
  std::vector<std::int32_t> y(2 * 16);
  data->fill(1, 2, make_tensor(x.data(), Shape{2, 2, 4, 4}), {y.data(), Shape{2, 4, 4}, DType::i32, Device::cpu});
  for (std::size_t i = 0; i < y.size(); ++i) CHECK(y[i] == static_cast<std::int32_t>((16 + i) % 3));  // samples 1 and 2, in file order
  const std::string short_maps = mpipe::testing::test_file("maps_short.h5").string(), bad_class = mpipe::testing::test_file("maps_class.h5").string();
  write(short_maps, 3, 2);
  write(bad_class, 4, 7);
  CHECK_THROWS_WITH_AS(make_dataset("hdf5:" + short_maps, m, 1), doctest::Contains("/labels is (3, 3, 4); the model's loss takes a label per pixel"), UserError);
  CHECK_THROWS_WITH_AS(make_dataset("hdf5:" + bad_class, m, 1), doctest::Contains("label 7 of sample 2 is out of range"), UserError);
}

TEST_CASE("the U-Net text of the mpi and cuda tests is tests/reference/unet.toml") {
  const ModelSpec file = parse_model_file(MPIPE_TEST_SOURCE_DIR "/reference/unet.toml");
  const ModelSpec text = parse_model_text(mpipe::test::unet_text, MPIPE_TEST_SOURCE_DIR "/reference/unet.toml");
  CHECK(text.to_toml() == file.to_toml());
}
