// Every image op of backend/conv_ops.hpp run once, in either memory layout, on whatever
// device a Memory policy allocates on: convolutions (padded 3 x 3 with a bias, a strided
// grouped 1 x 1 without), max, average and global pooling, BatchNorm (training with
// running statistics and the ReLU fused, backward, evaluation), nearest upsampling and the
// layout swap itself. The results come back by name, images in channels-first order, so a
// channels-last run compares with a channels-first one element by element: on the CPU
// bit for bit (unit), on a GPU against the CPU (cuda).
//
// A Memory gives: Tensor image(values, shape) (activations, in the run's element type;
// values channels-first, laid out by the caller), Tensor floats(values, shape) (fp32:
// parameter gradients, statistics), Tensor indices(shape) (int32), Tensor scratch(n) (the
// CPU's convolution columns; empty on a GPU), std::vector<float> read(tensor) (memory
// order), and float round(float) (what an element of the run's type holds).
#pragma once
#include <doctest/doctest.h>

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "mpipe/backend/conv_ops.hpp"
#include "mpipe/core/rng.hpp"

namespace mpipe::test {

// x (N, A, B) with its inner two axes swapped, (N, B, A), element by element.
inline std::vector<float> swapped(const std::vector<float>& x, std::int64_t N, std::int64_t A, std::int64_t B) {
  std::vector<float> y(x.size());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t a = 0; a < A; ++a)
      for (std::int64_t b = 0; b < B; ++b)
        y[static_cast<std::size_t>((n * B + b) * A + a)] = x[static_cast<std::size_t>((n * A + a) * B + b)];
  return y;
}
// (N, C, P) channels first -> (N, P, C) channels last, and back.
inline std::vector<float> to_last(const std::vector<float>& x, std::int64_t N, std::int64_t C, std::int64_t P) {
  return swapped(x, N, C, P);
}
inline std::vector<float> to_first(const std::vector<float>& y, std::int64_t N, std::int64_t C, std::int64_t P) {
  return swapped(y, N, P, C);
}

// The Memory of a CPU run: fp32 everywhere, each drawn value as `rounding` leaves it
// (null: as drawn; a GPU test's twin: what its element type holds).
struct HostMemory {
  float (*rounding)(float) = nullptr;
  std::deque<std::vector<float>> values;
  std::deque<std::vector<std::int32_t>> ints;
  Tensor image(const std::vector<float>& v, Shape s) { return floats(v, s); }
  Tensor floats(const std::vector<float>& v, Shape s) {
    REQUIRE(static_cast<std::int64_t>(v.size()) == s.numel());
    values.push_back(v);
    return Tensor{values.back().data(), s, DType::f32, Device::cpu};
  }
  Tensor indices(Shape s) {
    ints.emplace_back(static_cast<std::size_t>(s.numel()), -7);
    return Tensor{ints.back().data(), s, DType::i32, Device::cpu};
  }
  Tensor scratch(std::int64_t n) { return floats(std::vector<float>(static_cast<std::size_t>(n)), Shape{n}); }
  std::vector<float> read(const Tensor& t) { return {t.f32(), t.f32() + t.numel()}; }
  float round(float v) const { return rounding ? rounding(v) : v; }
};

template <class Memory>
std::map<std::string, std::vector<float>> run_image_ops(Memory& m, bool last) {
  std::map<std::string, std::vector<float>> r;
  std::uint32_t tag = 0;
  const auto values = [&](std::int64_t n, float scale = 1.0f) {
    std::vector<float> v(static_cast<std::size_t>(n));
    make_stream(20261130, Stream::init, ++tag, 0, 0).fill_normal(v.data(), v.size(), scale);
    for (float& e : v) e = m.round(e);
    return v;
  };
  // An image tensor of the given channels-first values, laid out for the run.
  const auto image = [&](const std::vector<float>& x, Shape s) {
    return m.image(last ? to_last(x, s[0], s[1], s[2] * s[3]) : x, s);
  };
  const auto read_image = [&](const Tensor& t) {
    const std::vector<float> v = m.read(t);
    return last ? to_first(v, t.shape[0], t.shape[1], t.shape[2] * t.shape[3]) : v;
  };
  const std::int64_t N = 2, C = 16, H = 9, W = 9;
  const std::vector<float> x = values(N * C * H * W);
  const Tensor input = image(x, Shape{N, C, H, W});
  const auto window = [&](std::int64_t OC, std::int64_t kernel, std::int64_t stride, std::int64_t padding,
                          std::int64_t groups) {
    Window2d w;
    w.N = N, w.C = C, w.H = H, w.W = W, w.OC = OC;
    w.KH = w.KW = kernel;
    w.stride = stride, w.padding = padding, w.groups = groups;
    w.OH = (H + 2 * padding - kernel) / stride + 1;
    w.OW = (W + 2 * padding - kernel) / stride + 1;
    w.channels_last = last;
    return w;
  };

  // Convolutions: forward, then every gradient accumulated onto nonzero values.
  struct Conv {
    const char* name;
    std::int64_t OC, kernel, stride, padding, groups;
    bool bias;
  };
  for (const Conv& k : {Conv{"conv 3x3", 16, 3, 1, 1, 1, true}, Conv{"conv 1x1/2 groups", 8, 1, 2, 0, 2, false}}) {
    const Window2d w = window(k.OC, k.kernel, k.stride, k.padding, k.groups);
    const std::string at = k.name;
    const Shape out_shape{N, k.OC, w.OH, w.OW};
    const Tensor weight = m.image(values(k.OC * (C / k.groups) * k.kernel * k.kernel, 0.2f),
                                  Shape{k.OC, C / k.groups, k.kernel, k.kernel});
    const Tensor bias = k.bias ? m.image(values(k.OC), Shape{k.OC}) : Tensor{};
    const Tensor cols = m.scratch(ops::conv2d_scratch(w, input.device));
    const Tensor out = image(std::vector<float>(static_cast<std::size_t>(out_shape.numel())), out_shape);
    ops::conv2d_forward(out, input, weight, bias, cols, w);
    r[at + " out"] = read_image(out);
    const Tensor dy = image(values(out_shape.numel()), out_shape);
    const Tensor dx = image(values(N * C * H * W), Shape{N, C, H, W});
    const Tensor dw = m.floats(values(weight.numel()), weight.shape);
    const Tensor db = k.bias ? m.floats(values(k.OC), Shape{k.OC}) : Tensor{};
    ops::conv2d_backward(dx, dw, db, dy, input, weight, cols, w, GradMode::accumulate);
    r[at + " dinp"] = read_image(dx);
    r[at + " dweight"] = m.read(dw);
    if (k.bias) r[at + " dbias"] = m.read(db);
  }

  // Pooling: a padded 3 x 3 / 2 max pool, a 2 x 2 / 2 average pool (over 8 x 8 of the
  // 9 x 9), and the global average (N, C).
  {
    Window2d w = window(C, 3, 2, 1, 1);
    const Shape out_shape{N, C, w.OH, w.OW};
    const Tensor out = image(std::vector<float>(static_cast<std::size_t>(out_shape.numel())), out_shape);
    const Tensor argmax = m.indices(out_shape);
    ops::maxpool2d_forward(out, argmax, input, w);
    r["maxpool out"] = read_image(out);
    const Tensor dy = image(values(out_shape.numel()), out_shape);
    const Tensor dx = image(values(N * C * H * W), Shape{N, C, H, W});
    ops::maxpool2d_backward(dx, dy, argmax, w, GradMode::accumulate);
    r["maxpool dinp"] = read_image(dx);

    w = window(C, 2, 2, 0, 1);
    const Shape avg_shape{N, C, w.OH, w.OW};
    const Tensor avg = image(std::vector<float>(static_cast<std::size_t>(avg_shape.numel())), avg_shape);
    ops::avgpool2d_forward(avg, input, w);
    r["avgpool out"] = read_image(avg);
    const Tensor davg = image(values(avg_shape.numel()), avg_shape);
    const Tensor dx2 = image(std::vector<float>(static_cast<std::size_t>(N * C * H * W)), Shape{N, C, H, W});
    ops::avgpool2d_backward(dx2, davg, w, GradMode::overwrite);
    r["avgpool dinp"] = read_image(dx2);

    w = window(C, 9, 1, 0, 1);  // global: one window a plane, (N, C) either way
    const Tensor mean = m.image(std::vector<float>(static_cast<std::size_t>(N * C)), Shape{N, C});
    ops::avgpool2d_forward(mean, input, w);
    r["global out"] = m.read(mean);
    const Tensor dmean = m.image(values(N * C), Shape{N, C});
    const Tensor dx3 = image(std::vector<float>(static_cast<std::size_t>(N * C * H * W)), Shape{N, C, H, W});
    ops::avgpool2d_backward(dx3, dmean, w, GradMode::overwrite);
    r["global dinp"] = read_image(dx3);
  }

  // BatchNorm: training (running statistics moved, the ReLU fused), backward onto nonzero
  // values, evaluation with the moved statistics.
  {
    const Shape s{N, C, H, W};
    const Tensor weight = m.image(values(C, 0.5f), Shape{C}), bias = m.image(values(C, 0.5f), Shape{C});
    const Tensor mean = m.floats(std::vector<float>(C), Shape{C}), rstd = m.floats(std::vector<float>(C), Shape{C});
    const Tensor running_mean = m.floats(values(C), Shape{C}), running_var = m.floats(std::vector<float>(C, 1.5f), Shape{C});
    const Tensor out = image(std::vector<float>(static_cast<std::size_t>(s.numel())), s);
    ops::batchnorm_forward_train(out, mean, rstd, running_mean, running_var, {}, input, weight, bias, 1e-5f, 0.1f,
                                 nullptr, true, last);
    r["batchnorm out"] = read_image(out);
    r["batchnorm mean"] = m.read(mean);
    r["batchnorm rstd"] = m.read(rstd);
    r["batchnorm running mean"] = m.read(running_mean);
    r["batchnorm running var"] = m.read(running_var);
    const Tensor dy = image(values(s.numel()), s), dx = image(values(s.numel()), s);
    const Tensor dw = m.floats(values(C), Shape{C}), db = m.floats(values(C), Shape{C});
    ops::batchnorm_backward(dx, dw, db, dy, input, weight, mean, rstd, GradMode::accumulate, last);
    r["batchnorm dinp"] = read_image(dx);
    r["batchnorm dweight"] = m.read(dw);
    r["batchnorm dbias"] = m.read(db);
    const Tensor eval = image(std::vector<float>(static_cast<std::size_t>(s.numel())), s);
    ops::batchnorm_forward_eval(eval, input, weight, bias, running_mean, running_var, 1e-5f, last);
    r["batchnorm eval"] = read_image(eval);
  }

  // Nearest upsampling by 2 and its gradient.
  {
    const Shape up{N, C, 2 * H, 2 * W};
    const Tensor out = image(std::vector<float>(static_cast<std::size_t>(up.numel())), up);
    ops::upsample_nearest_forward(out, input, 2, last);
    r["upsample out"] = read_image(out);
    const Tensor dy = image(values(up.numel()), up);
    const Tensor dx = image(std::vector<float>(static_cast<std::size_t>(N * C * H * W)), Shape{N, C, H, W});
    ops::upsample_nearest_backward(dx, dy, 2, last);
    r["upsample dinp"] = read_image(dx);
  }

  // The swap: the input to the other layout, then added back onto itself.
  {
    const Tensor other = m.image(std::vector<float>(x.size()), Shape{N, C, H, W});
    ops::change_layout(other, input, !last);
    r["swapped"] = last ? m.read(other) : to_first(m.read(other), N, C, H * W);
    const Tensor twice = image(x, Shape{N, C, H, W});
    ops::change_layout(twice, other, last, GradMode::accumulate);
    r["swapped back, added"] = read_image(twice);
  }
  return r;
}

}  // namespace mpipe::test
