// Ops whose contract is more than their gradient: RNG, reductions, optimizers, schedule.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <limits>
#include <vector>

#include "mpipe/app/config.hpp"
#include "mpipe/backend/cpu/blas_core.hpp"
#include "mpipe/backend/cpu/conv_parts.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/backend/cpu/vmath.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/core/rng.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/nn/transformer_layers.hpp"

using namespace mpipe;

TEST_CASE("philox: known-answer vectors of Random123") {
  // Philox4x32-10 test vectors from Random123's kat_vectors.
  CHECK(philox4x32({0, 0, 0, 0}, 0) == Philox4{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u});
  CHECK(philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, 0xffffffffffffffffull) ==
        Philox4{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu});
  CHECK(philox4x32({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, 0x299f31d0a4093822ull) ==
        Philox4{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u});
}

TEST_CASE("random streams: normals have mean 0 and variance 1, below() stays in range") {
  const RandomStream s = make_stream(42, Stream::init, 1, 2, 3);
  double sum = 0, sq = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double x = s.normal(i);
    sum += x;
    sq += x * x;
  }
  CHECK(std::abs(sum / n) < 0.01);
  CHECK(std::abs(sq / n - 1.0) < 0.02);
  for (int i = 0; i < 1000; ++i) CHECK(s.below(i, 7) < 7);
}

TEST_CASE("sum_squares does not depend on the thread count") {
  std::vector<float> x(100003);
  const RandomStream s = make_stream(1, Stream::init, 0, 0, 0);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = s.normal(i);
  cpu::set_threads(1);
  const double one = cpu::sum_squares(x.data(), static_cast<int64_t>(x.size()));
  cpu::set_threads(2);
  const double two = cpu::sum_squares(x.data(), static_cast<int64_t>(x.size()));
  CHECK(one == two);
  double exact = 0;
  for (float v : x) exact += static_cast<double>(v) * v;
  CHECK(one == doctest::Approx(exact).epsilon(1e-12));
  // Every length the chunks and lanes split unevenly, and the empty one.
  for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{64 * 16 + 5}, int64_t{100003}}) {
    long double direct = 0;
    for (int64_t i = 0; i < n; ++i) direct += static_cast<long double>(x[static_cast<std::size_t>(i)]) * x[static_cast<std::size_t>(i)];
    CHECK(cpu::sum_squares(x.data(), n) == doctest::Approx(static_cast<double>(direct)).epsilon(1e-13));
  }
}

TEST_CASE("matmul matches a naive triple loop, bias included") {
  const int64_t N = 5, C = 7, OC = 3;
  std::vector<float> x(N * C), w(OC * C), b(OC), y(N * OC);
  const RandomStream s = make_stream(3, Stream::init, 0, 0, 0);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = s.normal(i);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = s.normal(1000 + i);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = s.normal(2000 + i);
  cpu::matmul_forward(y.data(), x.data(), w.data(), b.data(), N, C, OC);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < OC; ++o) {
      double acc = b[o];
      for (int64_t c = 0; c < C; ++c) acc += static_cast<double>(x[n * C + c]) * w[o * C + c];
      CHECK(y[n * OC + o] == doctest::Approx(acc).epsilon(1e-5));
    }
}

TEST_CASE("adamw: one step from zero state moves each parameter by lr against the gradient sign") {
  std::vector<float> p{1.0f, -2.0f, 0.5f}, g{0.3f, -0.1f, 0.0f}, m(3, 0.0f), v(3, 0.0f);
  cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), 3, 0.1f, 0.9f, 0.999f, 1e-8f, 0.0f, 1);
  CHECK(p[0] == doctest::Approx(0.9f));
  CHECK(p[1] == doctest::Approx(-1.9f));
  CHECK(p[2] == doctest::Approx(0.5f));
  // Decoupled weight decay shrinks by lr * wd * p, independent of the gradient.
  std::vector<float> q{2.0f}, zero{0.0f}, m1{0.0f}, v1{0.0f};
  cpu::adamw_update(q.data(), zero.data(), m1.data(), v1.data(), 1, 0.1f, 0.9f, 0.999f, 1e-8f, 0.5f, 1);
  CHECK(q[0] == doctest::Approx(2.0f - 0.1f * 0.5f * 2.0f));
}

TEST_CASE("sgd with momentum follows the heavy-ball recurrence") {
  std::vector<float> p{1.0f}, g{0.5f}, vel{0.0f};
  cpu::sgd_update(p.data(), g.data(), vel.data(), 1, 0.1f, 0.9f, 0.0f);
  CHECK(p[0] == doctest::Approx(0.95f));
  cpu::sgd_update(p.data(), g.data(), vel.data(), 1, 0.1f, 0.9f, 0.0f);
  CHECK(vel[0] == doctest::Approx(0.95f));
  CHECK(p[0] == doctest::Approx(0.95f - 0.095f));
}

TEST_CASE("learning rate: linear warm-up, then cosine down to lr * min_lr_ratio") {
  OptimizerConfig c;
  c.lr = 1.0f;
  c.warmup = 10;
  c.min_lr_ratio = 0.1f;
  CHECK(learning_rate(c, 0, 110) == doctest::Approx(0.1f));
  CHECK(learning_rate(c, 9, 110) == doctest::Approx(1.0f));
  CHECK(learning_rate(c, 10, 110) == doctest::Approx(1.0f));
  CHECK(learning_rate(c, 60, 110) == doctest::Approx(0.55f));
  CHECK(learning_rate(c, 110, 110) == doctest::Approx(0.1f));
}

TEST_CASE("learning rate schedules: linear, constant, wsd, and a decay decoupled from --steps") {
  OptimizerConfig c;
  c.lr = 1.0f;
  c.warmup = 10;
  c.min_lr_ratio = 0.1f;
  c.lr_schedule = "linear";
  CHECK(learning_rate(c, 5, 110) == doctest::Approx(0.6f));  // warm-up as before
  CHECK(learning_rate(c, 60, 110) == doctest::Approx(0.55f));
  CHECK(learning_rate(c, 85, 110) == doctest::Approx(0.325f));
  CHECK(learning_rate(c, 200, 110) == doctest::Approx(0.1f));  // past the end: the floor
  c.lr_schedule = "constant";
  CHECK(learning_rate(c, 5, 110) == doctest::Approx(0.6f));
  CHECK(learning_rate(c, 109, 110) == doctest::Approx(1.0f));
  c.lr_schedule = "wsd";  // stable for the first 80% of the decay span, then linear
  c.wsd_decay = 0.2f;
  CHECK(learning_rate(c, 90, 110) == doctest::Approx(1.0f));
  CHECK(learning_rate(c, 100, 110) == doctest::Approx(0.55f));
  CHECK(learning_rate(c, 110, 110) == doctest::Approx(0.1f));
  // --lr-decay-steps: the schedule ends at step 1010 whatever the run's length, so a run
  // cut into jobs of 50 and 110 steps follows one curve.
  c.lr_schedule = "cosine";
  c.lr_decay_steps = 1010;
  CHECK(learning_rate(c, 510, 50) == doctest::Approx(0.55f));
  CHECK(learning_rate(c, 510, 50) == learning_rate(c, 510, 2000));
  CHECK(learning_rate(c, 1010, 2000) == doctest::Approx(0.1f));
  c.lr_schedule = "step";
  CHECK_THROWS_WITH_AS(validate(c), "unknown --lr-schedule 'step'", UserError);
  c.lr_schedule = "wsd";
  c.wsd_decay = 0.0f;
  CHECK_THROWS_AS(validate(c), UserError);
  c.wsd_decay = 0.2f;
  c.min_lr_ratio = std::nanf("");
  CHECK_THROWS_WITH_AS(validate(c), doctest::Contains("--min-lr-ratio must be in [0, 1]"), UserError);
}

TEST_CASE("arena: the first step grows it, reset folds the blocks, later steps reuse it") {
  Arena arena;
  for (int step = 0; step < 3; ++step) {
    for (int i = 0; i < 40; ++i) {
      Tensor t = arena.tensor(Shape{1024, 64});
      CHECK(reinterpret_cast<std::uintptr_t>(t.data) % Arena::alignment == 0);
    }
    const std::size_t growths = arena.growths();
    arena.reset();
    if (step == 0) CHECK(arena.growths() == growths + 1);  // the fold
    else CHECK(arena.growths() == growths);
  }
  CHECK(arena.capacity() >= 40u * 1024u * 64u * 4u);
}

TEST_CASE("arena: rewind(mark()) gives what was allocated since to the next allocations, across chained blocks too") {
  Arena arena;
  Tensor kept = arena.tensor(Shape{1024});
  const Arena::Mark mark = arena.mark();
  Tensor a = arena.tensor(Shape{1024, 64});
  arena.tensor(Shape{1024, 1024});  // beyond the first block: a second one is chained
  const std::size_t high = arena.high_water();
  arena.rewind(mark);
  CHECK(arena.used() == mark.used);
  Tensor b = arena.tensor(Shape{1024, 64});
  CHECK(b.data == a.data);  // the same memory again
  CHECK(b.data != kept.data);
  arena.tensor(Shape{1024, 1024});
  CHECK(arena.high_water() == high);  // no more than before the rewind
  const std::size_t growths = arena.growths();
  arena.reset();
  CHECK(arena.growths() == growths + 1);  // the fold, as after any first step
  CHECK(arena.capacity() >= high);
}

TEST_CASE("arena: spent() finds the first run between two marks that no live tensor overlaps") {
  Arena arena;
  arena.tensor(Shape{16});
  const Arena::Mark from = arena.mark();
  const Tensor a = arena.tensor(Shape{256}), b = arena.tensor(Shape{256}), c = arena.tensor(Shape{256});
  const Arena::Mark to = arena.mark();
  arena.tensor(Shape{1024});  // after `to`: never handed out
  const std::size_t bytes = 256 * sizeof(float);
  CHECK(arena.spent(from, to, bytes, {}) == a.data);
  const Tensor live_a[] = {a};
  CHECK(arena.spent(from, to, bytes, live_a) == b.data);
  const Tensor live_ab[] = {b, a};  // in any order
  CHECK(arena.spent(from, to, bytes, live_ab) == c.data);
  CHECK(arena.spent(from, to, 2 * bytes, live_ab) == nullptr);  // c alone is too short
  const Tensor live_b[] = {b};
  CHECK(arena.spent(from, to, 2 * bytes, live_b) == nullptr);  // a, c: room for each, not for both at once
  CHECK(arena.spent(from, to, 3 * bytes, {}) == a.data);
  CHECK(arena.spent(to, to, 1, {}) == nullptr);
  // A live tensor partly inside moves the run past its end, 64-byte aligned.
  const Tensor part = a.head(Shape{3});
  const Tensor live_part[] = {part};
  const void* at = arena.spent(from, to, bytes, live_part);
  CHECK(at == static_cast<std::byte*>(a.data) + Arena::alignment);
}

TEST_CASE("arena: a gauge counts the live bytes of its arenas together, and their peak at once") {
  Gauge gauge;
  {
    Arena one, two;
    one.count_in(&gauge);
    two.count_in(&gauge);
    one.tensor(Shape{1024});  // 4 KiB
    const Arena::Mark mark = one.mark();
    one.tensor(Shape{2048});  // 8 KiB: 12 live
    one.rewind(mark);         // 4 live
    CHECK(gauge.used == 4096);
    two.tensor(Shape{1024});  // 8 live: below the 12 before
    CHECK(gauge.peak == 3 * 4096);
    CHECK(one.high_water() + two.high_water() == 4 * 4096);  // the sum of marks is more
    one.reset();
    CHECK(gauge.used == 4096);
  }
  CHECK(gauge.used == 0);  // gone with its arenas
  CHECK(gauge.peak == 3 * 4096);
}

TEST_CASE("vectorisable exp and GELU: within a few ulp of double precision") {
  // exp over its whole range, every 2^-12 in [-87, 87] (about 713k points).
  double worst_ulp = 0;
  for (double x = -87.0; x <= 87.0; x += 1.0 / 4096) {
    const double exact = std::exp(static_cast<double>(static_cast<float>(x)));
    const double ulp = std::ldexp(1.0, std::ilogb(exact) - 23);
    worst_ulp = std::max(worst_ulp, std::abs(cpu::exp_clamped(static_cast<float>(x)) - exact) / ulp);
  }
  CHECK(worst_ulp <= 2.0);
  // Clamped outside, never infinite, zero or denormal; NaN stays NaN.
  CHECK(cpu::exp_clamped(-1000.0f) == cpu::exp_clamped(-87.0f));
  CHECK(std::isnormal(cpu::exp_clamped(-1000.0f)));
  CHECK(cpu::exp_clamped(1000.0f) == cpu::exp_clamped(87.0f));
  CHECK(std::isfinite(cpu::exp_clamped(std::numeric_limits<float>::infinity())));
  CHECK(std::isnan(cpu::exp_clamped(std::numeric_limits<float>::quiet_NaN())));
  CHECK(cpu::exp_clamped(0.0f) == 1.0f);

  // GELU (tanh form, in double) and its derivative through the kernels, including an
  // accumulating backward.
  std::vector<float> x, dy;
  for (float v = -12.0f; v <= 12.0f; v += 1.0f / 64) x.push_back(v);
  const auto n = static_cast<int64_t>(x.size());
  dy.assign(x.size(), 1.0f);
  std::vector<float> y(x.size()), dx(x.size()), dx2(x.size(), 0.5f);
  cpu::gelu_forward(y.data(), x.data(), n);
  cpu::gelu_backward(dx.data(), dy.data(), x.data(), n, GradMode::overwrite);
  cpu::gelu_backward(dx2.data(), dy.data(), x.data(), n, GradMode::accumulate);
  double worst_rel = 0, worst_abs = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    const double u = std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v);
    const double th = std::tanh(u);
    // 0.5 v (1 + tanh u), written as v / (1 + e^(-2u)): in double too, 1 + tanh u cancels
    // to nothing for v below about -6.
    const double exact = v / (1.0 + std::exp(-2.0 * u));
    const double grad = 0.5 * (1.0 + th) +
                        0.5 * v * (1.0 - th * th) * std::sqrt(2.0 / M_PI) * (1.0 + 3 * 0.044715 * v * v);
    // Relative to the value and to the condition number of e^(-2u) (|2u|: u itself is
    // rounded to float, as in any float GELU), which dominates below x = -3.
    if (std::abs(exact) > 1e-30)
      worst_rel = std::max(worst_rel, std::abs(y[i] - exact) / std::abs(exact) / std::max(1.0, std::abs(2 * u)));
    else
      CHECK(std::abs(y[i]) < 1e-30);  // below x = -10, where e^(-2u) is clamped
    worst_abs = std::max(worst_abs, std::abs(dx[i] - grad));
    CHECK(dx2[i] == 0.5f + dx[i]);
  }
  CHECK(worst_rel < 5e-7);  // a few ulp, for outputs of magnitude 1e-30 to 12
  CHECK(worst_abs < 1e-6);  // the derivative crosses zero near x = -0.75
  MESSAGE("exp worst ", worst_ulp, " ulp; gelu worst relative ", worst_rel, ", derivative worst absolute ", worst_abs);
}

TEST_CASE("the flat-store Tensor ops: transfer copies, scale is cpu::scale, SpanSums each span's cpu::sum_squares") {
  std::vector<float> x(301), y(301, 0.0f);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i)) * 3.0f;
  const Shape all{static_cast<std::int64_t>(x.size())};
  ops::transfer(make_tensor(y.data(), all), make_tensor(x.data(), all));
  CHECK(y == x);
  ops::transfer(make_tensor(y.data(), all), make_tensor(y.data(), all));  // one memory: nothing to do
  CHECK(y == x);
  auto expected = x;
  cpu::scale(expected.data(), 0.37f, static_cast<std::int64_t>(expected.size()));
  ops::scale(make_tensor(y.data(), all), 0.37f);
  CHECK(y == expected);
  const std::vector<std::int64_t> offsets{0, 0, 7, 100}, sizes{0, 5, 93, 201};
  ops::SpanSums sums(Device::cpu, offsets, sizes);
  const std::span<const double> got = sums.sums(make_tensor(x.data(), all));
  REQUIRE(got.size() == offsets.size());
  for (std::size_t i = 0; i < offsets.size(); ++i) CHECK(got[i] == cpu::sum_squares(x.data() + offsets[i], sizes[i]));
  CHECK_THROWS_AS(ops::transfer(make_tensor(y.data(), Shape{3}), make_tensor(x.data(), all)), Error);
}

namespace {
// Causal attention in float64, the whole (T, T) at once: out, each row's log-sum-exp, and
// dqkv for an upstream gradient dout. The definition the tiled CPU kernel must meet.
struct AttentionReference {
  std::vector<double> out, lse, dqkv;
};
// Grouped-query attention in float64: query head h reads key/value head h / (H / KVH);
// rows of W = C + 2 KV (q, k, v).
AttentionReference attention_reference(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B,
                                       int64_t T, int64_t C, int64_t H, int64_t KVH) {
  const int64_t hs = C / H, KV = KVH * hs, W = C + 2 * KV, group = H / KVH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  AttentionReference r{std::vector<double>(B * T * C), std::vector<double>(B * H * T), std::vector<double>(B * T * W)};
  // part 0: query head h; 1 and 2: the key and value head of h's group.
  auto offset = [&](int64_t part, int64_t h) { return part == 0 ? h * hs : C + (part - 1) * KV + (h / group) * hs; };
  auto at = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return static_cast<double>(qkv[static_cast<std::size_t>((b * T + t) * W + offset(part, h) + d)]);
  };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      std::vector<double> p(static_cast<std::size_t>(T * T), 0.0);
      for (int64_t i = 0; i < T; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hs; ++d) dot += at(b, i, 0, h, d) * at(b, j, 1, h, d);
          p[i * T + j] = dot * scale;
          mx = std::max(mx, p[i * T + j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(p[i * T + j] - mx);
        r.lse[static_cast<std::size_t>((b * H + h) * T + i)] = mx + std::log(sum);
        for (int64_t j = 0; j <= i; ++j) p[i * T + j] = std::exp(p[i * T + j] - mx) / sum;
        for (int64_t d = 0; d < hs; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= i; ++j) o += p[i * T + j] * at(b, j, 2, h, d);
          r.out[static_cast<std::size_t>((b * T + i) * C + h * hs + d)] = o;
        }
      }
      auto dy = [&](int64_t t, int64_t d) { return static_cast<double>(dout[static_cast<std::size_t>((b * T + t) * C + h * hs + d)]); };
      auto grad = [&](int64_t t, int64_t part, int64_t d) -> double& {
        return r.dqkv[static_cast<std::size_t>((b * T + t) * W + offset(part, h) + d)];
      };
      for (int64_t i = 0; i < T; ++i) {
        std::vector<double> dp(static_cast<std::size_t>(i + 1));
        double dot = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < hs; ++d) dp[j] += dy(i, d) * at(b, j, 2, h, d);
          dot += p[i * T + j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const double ds = p[i * T + j] * (dp[j] - dot) * scale;
          for (int64_t d = 0; d < hs; ++d) {
            grad(j, 2, d) += p[i * T + j] * dy(i, d);
            grad(i, 0, d) += ds * at(b, j, 1, h, d);
            grad(j, 1, d) += ds * at(b, i, 0, h, d);
          }
        }
      }
    }
  return r;
}

double max_relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0, scale = 1e-3;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]) / scale);
  return worst;
}
}  // namespace

TEST_CASE("attention: the tiled CPU kernel (no T x T stored) meets float64 attention at tile edges, with every head its own keys or grouped, and a sample's result does not depend on its batch") {
  struct Case {
    int64_t B, T, C, H, KVH;
  };
  // One tile, one short of two, two exactly, two and a row, several with a partial last; hs 8, 20 and 64; grouped
  // query heads (2 of 4 key/value heads, multi-query).
  for (const Case c : {Case{2, 1, 16, 2, 2}, Case{1, 63, 16, 2, 2}, Case{2, 64, 40, 2, 2}, Case{1, 65, 16, 2, 2},
                       Case{2, 150, 24, 3, 3}, Case{1, 200, 64, 1, 1}, Case{2, 70, 32, 4, 2}, Case{2, 130, 24, 3, 1}}) {
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.KVH);
    const int64_t B = c.B, T = c.T, C = c.C, H = c.H, KVH = c.KVH, W = C + 2 * KVH * (C / H);
    std::vector<float> qkv(static_cast<std::size_t>(B * T * W)), dout(static_cast<std::size_t>(B * T * C));
    for (std::size_t i = 0; i < qkv.size(); ++i) qkv[i] = 1.5f * std::sin(0.731f * static_cast<float>(i) + 0.3f);
    for (std::size_t i = 0; i < dout.size(); ++i) dout[i] = std::cos(0.417f * static_cast<float>(i));
    std::vector<float> out(static_cast<std::size_t>(B * T * C)), lse(static_cast<std::size_t>(B * H * T)),
        dqkv(qkv.size(), 123.0f);  // overwritten, not accumulated into
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, H, KVH);
    cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B, T, C, H, KVH);
    const AttentionReference want = attention_reference(qkv, dout, B, T, C, H, KVH);
    CHECK(max_relative_error(out, want.out) < 1e-5);
    CHECK(max_relative_error(lse, want.lse) < 1e-5);
    CHECK(max_relative_error(dqkv, want.dqkv) < 1e-5);
    if (B < 2) continue;
    // The second sample alone: bitwise its part of the batch (partition transparency).
    const std::vector<float> qkv1(qkv.begin() + T * W, qkv.end()), dout1(dout.begin() + T * C, dout.end());
    std::vector<float> out1(static_cast<std::size_t>(T * C)), lse1(static_cast<std::size_t>(H * T)), dqkv1(qkv1.size());
    cpu::attention_forward(out1.data(), lse1.data(), qkv1.data(), 1, T, C, H, KVH);
    cpu::attention_backward(dqkv1.data(), dout1.data(), qkv1.data(), out1.data(), lse1.data(), 1, T, C, H, KVH);
    CHECK(std::equal(out1.begin(), out1.end(), out.begin() + T * C));
    CHECK(std::equal(lse1.begin(), lse1.end(), lse.begin() + H * T));
    CHECK(std::equal(dqkv1.begin(), dqkv1.end(), dqkv.begin() + T * W));
  }
}

TEST_CASE("OpenBLAS runs AVX2 or AVX-512 kernels where the CPU has them (the test's main chose them as mpipe's does)") {
  const std::string line = cpu::blas_description();
  INFO(line);
  CHECK(line.rfind("OpenBLAS ", 0) == 0);
  const char* keep = std::getenv("MPIPE_BLAS_CORE");
  const bool users = std::getenv("OPENBLAS_CORETYPE") && !std::getenv("MPIPE_BLAS_CORE_WAS");
  if (users || (keep && std::string(keep) == "keep")) return;  // the user's choice stands
  CHECK(cpu::vector_core("SkylakeX"));
  CHECK_FALSE(cpu::vector_core("Prescott"));
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) CHECK(cpu::vector_core(cpu::blas_core()));
#endif
}
