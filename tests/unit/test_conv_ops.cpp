// The CPU's convolution, pooling and batch normalisation ops against direct sums in double
// precision, for every path a window takes (im2col, the shifted planes, pointwise tiles).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "mpipe/backend/cpu/conv_parts.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/rng.hpp"

using namespace mpipe;

namespace {
std::vector<float> normals(std::size_t n, std::uint32_t key) {
  std::vector<float> v(n);
  const RandomStream s = make_stream(7, Stream::init, key, 0, 0);
  for (std::size_t i = 0; i < n; ++i) v[i] = s.normal(i);
  return v;
}

// The direct sums of a grouped convolution, and of its gradients, in double.
struct DirectConv {
  Window2d w;
  std::vector<double> out, dinp, dweight, dbias;
  DirectConv(const Window2d& win, const std::vector<float>& x, const std::vector<float>& k, const std::vector<float>& b,
             const std::vector<float>& dy)
      : w(win) {
    const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups;
    out.assign(static_cast<std::size_t>(w.N * w.OC * w.OH * w.OW), 0.0);
    dinp.assign(x.size(), 0.0);
    dweight.assign(k.size(), 0.0);
    dbias.assign(static_cast<std::size_t>(w.OC), 0.0);
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t oc = 0; oc < w.OC; ++oc)
        for (int64_t oh = 0; oh < w.OH; ++oh)
          for (int64_t ow = 0; ow < w.OW; ++ow) {
            const std::size_t o = static_cast<std::size_t>(((n * w.OC + oc) * w.OH + oh) * w.OW + ow);
            double sum = b[static_cast<std::size_t>(oc)];
            dbias[static_cast<std::size_t>(oc)] += dy[o];
            for (int64_t c = 0; c < Cg; ++c)
              for (int64_t kh = 0; kh < w.KH; ++kh)
                for (int64_t kw = 0; kw < w.KW; ++kw) {
                  const int64_t h = oh * w.stride - w.padding + kh, x_at = ow * w.stride - w.padding + kw;
                  if (h < 0 || h >= w.H || x_at < 0 || x_at >= w.W) continue;
                  const int64_t ic = oc / OCg * Cg + c;
                  const std::size_t xi = static_cast<std::size_t>(((n * w.C + ic) * w.H + h) * w.W + x_at);
                  const std::size_t ki = static_cast<std::size_t>(((oc * Cg + c) * w.KH + kh) * w.KW + kw);
                  sum += static_cast<double>(x[xi]) * k[ki];
                  dinp[xi] += static_cast<double>(dy[o]) * k[ki];
                  dweight[ki] += static_cast<double>(dy[o]) * x[xi];
                }
            out[o] = sum;
          }
  }
};

void check_close(const std::vector<float>& got, const std::vector<double>& want, const char* what) {
  REQUIRE(got.size() == want.size());
  double worst = 0, scale = 1e-6;
  for (double v : want) scale = std::max(scale, std::abs(v));
  for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::abs(got[i] - want[i]));
  INFO(what, ": worst error ", worst, " at scale ", scale);
  CHECK(worst <= 2e-5 * scale);
}
}  // namespace

TEST_CASE("conv2d on the CPU: the direct sums, forward and backward, for every window im2col treats apart") {
  struct Case {
    int64_t C, OC, H, W, K, stride, padding, groups;
  };
  // 3x3 s1 p1 (stride 1's copies), s2 (strided), 1x1 s1 p0 (the pointwise path: no columns),
  // 1x1 s2 (a projection), 7x7 s2 p3 (a stem), 3x3 p0, grouped 5x5, and planes narrower than the kernel;
  // then stride 1 over 16 channels or more a group (shifted planes): 3x3 p1, 3x3 p0, grouped, 5x5 p2,
  // a plane shorter than the kernel, one of 1024 positions (the weight gradient summed in tiles), and
  // 128 channels at 3x3 (1152 taps, the most the path takes) against 129 (im2col again);
  // then 1x1 over planes of whole vectors (pointwise tiles): 32 positions (a 16-wide tile),
  // 48 (a 48-wide one) over 13 rows (tiles of 8, 4 and 1), and 1024 positions grouped (the
  // weight gradient in tiles, partial ones: 5 rows, 12 channels a group); last 20 output
  // channels (the bias gradient's two blocks of 8 and a remainder of 4).
  for (const Case k : {Case{3, 4, 9, 7, 3, 1, 1, 1}, Case{4, 6, 9, 8, 3, 2, 1, 1}, Case{5, 3, 6, 7, 1, 1, 0, 1},
                       Case{4, 8, 7, 7, 1, 2, 0, 1}, Case{3, 4, 13, 12, 7, 2, 3, 1}, Case{2, 3, 6, 5, 3, 1, 0, 1},
                       Case{4, 6, 9, 9, 5, 2, 2, 2}, Case{2, 2, 2, 3, 3, 1, 1, 1}, Case{16, 8, 9, 9, 3, 1, 1, 1},
                       Case{16, 5, 6, 10, 3, 1, 0, 1}, Case{32, 6, 7, 9, 3, 1, 1, 2}, Case{16, 4, 8, 16, 5, 1, 2, 1},
                       Case{17, 3, 2, 12, 3, 1, 1, 1}, Case{17, 5, 30, 32, 3, 1, 1, 1}, Case{128, 4, 6, 10, 3, 1, 1, 1},
                       Case{129, 3, 5, 9, 3, 1, 1, 1}, Case{5, 3, 4, 8, 1, 1, 0, 1}, Case{9, 13, 8, 6, 1, 1, 0, 1},
                       Case{24, 10, 32, 32, 1, 1, 0, 2}, Case{3, 20, 8, 8, 3, 1, 1, 1}}) {
    Window2d w;
    w.N = 3, w.C = k.C, w.H = k.H, w.W = k.W, w.OC = k.OC, w.KH = w.KW = k.K, w.stride = k.stride, w.padding = k.padding;
    w.groups = k.groups;
    w.OH = (w.H + 2 * w.padding - w.KH) / w.stride + 1;
    w.OW = (w.W + 2 * w.padding - w.KW) / w.stride + 1;
    CAPTURE(k.C);
    CAPTURE(k.K);
    CAPTURE(k.stride);
    CAPTURE(k.padding);
    CAPTURE(k.groups);
    CHECK(cpu::conv2d_shifted(w) == (k.K > 1 && k.stride == 1 && k.C / k.groups >= 16 && k.C / k.groups * k.K * k.K <= 1152));
    const bool tiles_1x1 = cpu::conv_parts::pointwise_tiled(w);
    CHECK(tiles_1x1 == (k.K == 1 && k.stride == 1 && k.H * k.W % 16 == 0));
    const auto x = normals(static_cast<std::size_t>(w.N * w.C * w.H * w.W), 1);
    const auto kernel = normals(static_cast<std::size_t>(w.OC * (w.C / w.groups) * w.KH * w.KW), 2);
    const auto bias = normals(static_cast<std::size_t>(w.OC), 3);
    const auto dy = normals(static_cast<std::size_t>(w.N * w.OC * w.OH * w.OW), 4);
    const DirectConv want(w, x, kernel, bias, dy);
    // One thread, then two (samples side by side), then four (more threads than the 3
    // samples: each sample on all of them, one after another): the same bits, but for a
    // weight gradient over im2col's columns, OpenBLAS's GEMM threaded by OpenBLAS, whose
    // edge kernels may then sum otherwise (1 and 2 threads differ at 128 channels over 6x10).
    const bool blas_threads_dw = !(cpu::conv2d_shifted(w) && cpu::conv_parts::shifted_weight_tiles(w)) &&
                                 !(tiles_1x1 && cpu::conv_parts::pointwise_weight_tiles(w));
    // The bias gradient's rule, bit for bit at any thread count: per channel, the samples in
    // order, each sample's plane summed in double in order, rounded, then added.
    std::vector<float> rule_dbias(bias.size(), 0.0f);
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t oc = 0; oc < w.OC; ++oc) {
        double sum = 0;
        for (int64_t p = 0; p < w.OH * w.OW; ++p) sum += dy[static_cast<std::size_t>((n * w.OC + oc) * w.OH * w.OW + p)];
        rule_dbias[static_cast<std::size_t>(oc)] += static_cast<float>(sum);
      }
    std::vector<float> first_out, first_dinp, first_dweight;
    for (const int threads : {1, 2, 4}) {
      CAPTURE(threads);
      cpu::set_threads(threads);
      std::vector<float> cols(static_cast<std::size_t>(std::max<int64_t>(1, cpu::conv2d_cols(w))));
      std::vector<float> out(want.out.size());
      cpu::conv2d_forward(out.data(), x.data(), kernel.data(), bias.data(), cols.data(), w);
      check_close(out, want.out, "out");
      // Input gradient overwritten, then accumulated; parameter gradients accumulate.
      std::vector<float> dinp(x.size(), 7.0f), dweight(kernel.size(), 0.0f), dbias(bias.size(), 0.0f);
      cpu::conv2d_backward(dinp.data(), dweight.data(), dbias.data(), dy.data(), x.data(), kernel.data(), cols.data(), w,
                           GradMode::overwrite);
      check_close(dinp, want.dinp, "dinp");
      check_close(dweight, want.dweight, "dweight");
      check_close(dbias, want.dbias, "dbias");
      CHECK(dbias == rule_dbias);
      if (threads == 1) {
        first_out = out, first_dinp = dinp, first_dweight = dweight;
      } else {
        CHECK(out == first_out);
        CHECK(dinp == first_dinp);
        if (!blas_threads_dw) CHECK(dweight == first_dweight);
      }
      cpu::conv2d_backward(dinp.data(), nullptr, nullptr, dy.data(), x.data(), kernel.data(), cols.data(), w,
                           GradMode::accumulate);
      std::vector<double> twice = want.dinp;
      for (double& v : twice) v *= 2;
      check_close(dinp, twice, "dinp accumulated");
    }
    cpu::set_threads(1);
  }
}

TEST_CASE("maxpool on the CPU: the first of equal maxima and its place, at borders and inside, NaN as PyTorch") {
  // Inputs of a few integer values (many ties), one NaN first in a window and one later.
  struct Case {
    int64_t H, W, K, stride, padding;
  };
  for (const Case k : {Case{8, 8, 2, 2, 0}, Case{9, 7, 2, 2, 0}, Case{11, 13, 3, 2, 1}, Case{10, 10, 3, 2, 0},
                       Case{7, 9, 3, 1, 1}, Case{6, 6, 3, 1, 0}, Case{5, 5, 2, 1, 0}, Case{4, 4, 3, 2, 1}, Case{2, 2, 3, 1, 1}}) {
    CAPTURE(k.H);
    CAPTURE(k.W);
    CAPTURE(k.K);
    CAPTURE(k.stride);
    CAPTURE(k.padding);
    Window2d w;
    w.N = 2, w.C = 3, w.H = k.H, w.W = k.W, w.OC = 3, w.KH = w.KW = k.K, w.stride = k.stride, w.padding = k.padding;
    w.OH = (w.H + 2 * w.padding - w.KH) / w.stride + 1;
    w.OW = (w.W + 2 * w.padding - w.KW) / w.stride + 1;
    const RandomStream r = make_stream(7, Stream::data, static_cast<std::uint32_t>(k.H * 100 + k.W), 0, 0);
    std::vector<float> x(static_cast<std::size_t>(w.N * w.C * w.H * w.W));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(r.word(i) % 4);
    x[0] = std::numeric_limits<float>::quiet_NaN();            // first in its window: stays
    x[x.size() / 2] = std::numeric_limits<float>::quiet_NaN();  // passed over where not first
    std::vector<float> out(static_cast<std::size_t>(w.N * w.C * w.OH * w.OW));
    std::vector<int32_t> at(out.size());
    cpu::maxpool2d_forward(out.data(), at.data(), x.data(), w);
    for (int64_t p = 0; p < w.N * w.C; ++p)
      for (int64_t oh = 0; oh < w.OH; ++oh)
        for (int64_t ow = 0; ow < w.OW; ++ow) {
          float best = 0;
          int32_t where = -1;
          for (int64_t kh = 0; kh < w.KH; ++kh)
            for (int64_t kw = 0; kw < w.KW; ++kw) {
              const int64_t h = oh * w.stride - w.padding + kh, c = ow * w.stride - w.padding + kw;
              if (h < 0 || h >= w.H || c < 0 || c >= w.W) continue;
              const float v = x[static_cast<std::size_t>((p * w.H + h) * w.W + c)];
              if (where < 0 || v > best) best = v, where = static_cast<int32_t>(h * w.W + c);
            }
          const std::size_t o = static_cast<std::size_t>((p * w.OH + oh) * w.OW + ow);
          CAPTURE(o);
          CHECK(at[o] == where);
          CHECK(std::memcmp(&out[o], &best, sizeof(float)) == 0);
        }
  }
}

TEST_CASE("batchnorm on the CPU: statistics and gradients in double, and the same bits for 1 and 2 threads") {
  const int64_t N = 3, C = 5, plane = 37;  // a plane that is not a multiple of the lanes
  const auto x = normals(static_cast<std::size_t>(N * C * plane), 5);
  const auto dy = normals(x.size(), 6);
  std::vector<float> weight(C), bias(C);
  for (int64_t c = 0; c < C; ++c) weight[c] = 0.5f + 0.25f * static_cast<float>(c), bias[c] = 0.1f * static_cast<float>(c);
  const auto run = [&](int threads, std::vector<float>& out, std::vector<float>& dx, std::vector<float>& dw) {
    cpu::set_threads(threads);
    std::vector<float> mean(C), rstd(C), db(C, 0.0f);
    out.assign(x.size(), 0.0f);
    dx.assign(x.size(), 0.0f);
    dw.assign(C, 0.0f);
    cpu::batchnorm_forward_train(out.data(), mean.data(), rstd.data(), nullptr, nullptr, nullptr, x.data(), weight.data(),
                                 bias.data(), N, C, plane, 1e-5f, 0.1f);
    cpu::batchnorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), weight.data(), mean.data(), rstd.data(),
                            N, C, plane, GradMode::overwrite);
    cpu::set_threads(1);
  };
  std::vector<float> out1, dx1, dw1, out2, dx2, dw2;
  run(1, out1, dx1, dw1);
  run(2, out2, dx2, dw2);
  CHECK(out1 == out2);
  CHECK(dx1 == dx2);
  CHECK(dw1 == dw2);
  // The same in double: y = w (x - m) / sqrt(v + eps) + b; dx = w rstd (dy - mean(dy) - xhat mean(dy xhat)).
  std::vector<double> want_out(x.size()), want_dx(x.size()), want_dw(C);
  const double count = static_cast<double>(N * plane);
  for (int64_t c = 0; c < C; ++c) {
    double m = 0, v = 0, sdy = 0, sdyx = 0;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < plane; ++i) m += x[static_cast<std::size_t>((n * C + c) * plane + i)];
    m /= count;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < plane; ++i) v += std::pow(x[static_cast<std::size_t>((n * C + c) * plane + i)] - m, 2);
    const double r = 1 / std::sqrt(v / count + 1e-5);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < plane; ++i) {
        const std::size_t at = static_cast<std::size_t>((n * C + c) * plane + i);
        want_out[at] = weight[c] * (x[at] - m) * r + bias[c];
        sdy += dy[at];
        sdyx += dy[at] * (x[at] - m) * r;
      }
    want_dw[c] = sdyx;
    for (int64_t n = 0; n < N; ++n)
      for (int64_t i = 0; i < plane; ++i) {
        const std::size_t at = static_cast<std::size_t>((n * C + c) * plane + i);
        want_dx[at] = weight[c] * r * (dy[at] - sdy / count - (x[at] - m) * r * sdyx / count);
      }
  }
  check_close(out1, want_out, "out");
  check_close(dx1, want_dx, "dx");
  check_close(dw1, want_dw, "dweight");
}

TEST_CASE("batchnorm on the CPU rectifying as it writes gives the bits of batchnorm then relu") {
  const int64_t N = 2, C = 3, plane = 41;
  const auto x = normals(static_cast<std::size_t>(N * C * plane), 8);
  const std::vector<float> weight{0.7f, 1.3f, -0.4f}, bias{0.2f, -0.1f, 0.05f};
  std::vector<float> apart(x.size()), fused(x.size()), mean(C), rstd(C), rm(C, 0.0f), rv(C, 1.0f), rm2 = rm, rv2 = rv;
  cpu::batchnorm_forward_train(apart.data(), mean.data(), rstd.data(), rm.data(), rv.data(), nullptr, x.data(), weight.data(),
                               bias.data(), N, C, plane, 1e-5f, 0.1f);
  cpu::relu_forward(apart.data(), apart.data(), static_cast<int64_t>(apart.size()));
  cpu::batchnorm_forward_train(fused.data(), mean.data(), rstd.data(), rm2.data(), rv2.data(), nullptr, x.data(),
                               weight.data(), bias.data(), N, C, plane, 1e-5f, 0.1f, true);
  CHECK(std::memcmp(apart.data(), fused.data(), apart.size() * sizeof(float)) == 0);
  CHECK(rm == rm2);
  CHECK(rv == rv2);
  // Both sides of the kink are there: about half the outputs were negative.
  const auto zeros = std::count(fused.begin(), fused.end(), 0.0f);
  CHECK(zeros > static_cast<long>(fused.size() / 4));
  CHECK(zeros < static_cast<long>(3 * fused.size() / 4));
}
