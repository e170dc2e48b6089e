// Finite-difference gradient checks along random directions, for single layers.
//
// The objective is L = sum(y * r) for a fixed random r (or the scaled loss for the loss
// layer). For the input and every parameter θ, the analytic <dL/dθ, v> for a random
// direction v is compared with (L(θ + εv) - L(θ - εv)) / 2ε.
#pragma once
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "mpipe/core/rng.hpp"
#include "mpipe/nn/layer.hpp"

namespace mpipe::test {

inline std::vector<float> random_vector(std::size_t n, std::uint32_t tag, float scale = 1.0f) {
  const RandomStream s = make_stream(1234, Stream::init, tag, 77, 0);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = scale * s.normal(i);
  return v;
}

// Owns parameters and gradients for one stand-alone layer.
struct LayerHarness {
  Layer& layer;
  std::vector<std::vector<float>> params, grads;
  std::vector<ParamSpec> specs;
  Arena arena;

  explicit LayerHarness(Layer& l) : layer(l), specs(l.param_specs()) {
    std::vector<Tensor> p, g;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto n = static_cast<std::size_t>(specs[i].shape.numel());
      params.push_back(random_vector(n, 100 + static_cast<std::uint32_t>(i), 0.3f));
      if (specs[i].init == Init::ones)
        for (float& x : params.back()) x += 1.0f;
      grads.emplace_back(n, 0.0f);
    }
    for (std::size_t i = 0; i < specs.size(); ++i) {
      p.push_back(make_tensor(params[i].data(), specs[i].shape));
      g.push_back(make_tensor(grads[i].data(), specs[i].shape));
    }
    layer.bind(p, g);
  }
};

struct GradCheckOptions {
  float epsilon = 1e-3f;
  double tolerance = 2e-2;
  bool input_gradient = true;  // false for integer inputs
  Pass pass;
};

// Runs forward at the current parameters and returns the objective.
inline double objective(LayerHarness& h, const Tensor& x, const std::vector<float>& r, Pass pass) {
  pass.arena = &h.arena;
  Context ctx;
  Tensor y = h.layer.forward(x, ctx, pass);
  double total = 0.0;
  if (y.numel() == 1 && r.size() == 1) total = static_cast<double>(y.f32()[0]) * pass.loss_scale;
  else
    for (std::int64_t i = 0; i < y.numel(); ++i) total += static_cast<double>(y.f32()[i]) * r[i];
  h.arena.reset();
  return total;
}

inline void check_close(double analytic, double numeric, double tolerance, const std::string& what) {
  const double scale = std::max({std::abs(analytic), std::abs(numeric), 1e-3});
  INFO(what << ": analytic " << analytic << " numeric " << numeric);
  CHECK(std::abs(analytic - numeric) / scale < tolerance);
}

inline void gradcheck(Layer& layer, Tensor x, GradCheckOptions opt = {}) {
  LayerHarness h(layer);
  Pass pass = opt.pass;
  pass.arena = &h.arena;
  // Analytic gradients.
  Context ctx;
  Tensor y = layer.forward(x, ctx, pass);
  const bool is_loss = y.numel() == 1 && layer.kind() == "cross_entropy";
  std::vector<float> r = is_loss ? std::vector<float>(1, 1.0f) : random_vector(static_cast<std::size_t>(y.numel()), 7);
  Tensor dy = is_loss ? y : make_tensor(r.data(), y.shape);
  std::vector<float> dx_storage(static_cast<std::size_t>(x.numel()), 0.0f);
  Tensor dx = opt.input_gradient ? make_tensor(dx_storage.data(), x.shape) : Tensor{};
  layer.backward(ctx, dy, dx, GradMode::overwrite, pass);
  h.arena.reset();

  auto directional = [&](float* data, std::size_t n, const std::vector<float>& grad, std::uint32_t tag,
                         const std::string& what) {
    const std::vector<float> v = random_vector(n, tag);
    double analytic = 0.0;
    for (std::size_t i = 0; i < n; ++i) analytic += static_cast<double>(grad[i]) * v[i];
    std::vector<float> saved(data, data + n);
    for (std::size_t i = 0; i < n; ++i) data[i] = saved[i] + opt.epsilon * v[i];
    const double plus = objective(h, x, r, pass);
    for (std::size_t i = 0; i < n; ++i) data[i] = saved[i] - opt.epsilon * v[i];
    const double minus = objective(h, x, r, pass);
    std::copy(saved.begin(), saved.end(), data);
    check_close(analytic, (plus - minus) / (2.0 * opt.epsilon), opt.tolerance, layer.kind() + " " + what);
  };
  if (opt.input_gradient) directional(x.f32(), static_cast<std::size_t>(x.numel()), dx_storage, 1, "input");
  for (std::size_t i = 0; i < h.specs.size(); ++i)
    directional(h.params[i].data(), h.params[i].size(), h.grads[i], 10 + static_cast<std::uint32_t>(i),
                h.specs[i].name);
}

}  // namespace mpipe::test
