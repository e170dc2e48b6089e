// CPU convolution (im2col + BLAS; stride-1 windows over the padded planes in
// conv_shifted.cpp) and pooling over NCHW tensors. Deterministic for any thread count: the
// samples run in order, threads split channels or output planes.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "mpipe/backend/cpu/conv_parts.hpp"
#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

using namespace conv_parts;

namespace {

// The outputs ow of a row whose input column x = ow * stride - padding + kw falls inside
// [0, W): [lo, hi). Outside it the row reads padding.
struct Span {
  int64_t lo, hi;
};
Span inside(int64_t kw, const Window2d& w) {
  const int64_t first = w.padding - kw;  // ow * stride >= first
  const int64_t lo = first <= 0 ? 0 : (first + w.stride - 1) / w.stride;
  const int64_t last = w.W - 1 + w.padding - kw;  // ow * stride <= last
  const int64_t hi = last < 0 ? 0 : std::min(w.OW, last / w.stride + 1);
  return {std::min(lo, hi), hi};
}

// The columns of one sample's group: rows (c, kh, kw) of Cg*KH*KW, columns (oh, ow).
void im2col(float* cols, const float* plane, int64_t Cg, const Window2d& w) {
  const int64_t P = w.OH * w.OW;
  for_each_index(threads_here(), Cg * w.KH * w.KW, [&](int64_t row) {
    const int64_t c = row / (w.KH * w.KW), kh = row / w.KW % w.KH, kw = row % w.KW;
    const float* in = plane + c * w.H * w.W;
    float* dst = cols + row * P;
    const Span s = inside(kw, w);
    for (int64_t oh = 0; oh < w.OH; ++oh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      float* d = dst + oh * w.OW;
      if (h < 0 || h >= w.H) {
        std::fill(d, d + w.OW, 0.0f);
        continue;
      }
      std::fill(d, d + s.lo, 0.0f);
      const float* src = in + h * w.W - w.padding + kw;  // src[ow * stride] is column ow
      if (w.stride == 1) std::copy(src + s.lo, src + s.hi, d + s.lo);
      else
        for (int64_t ow = s.lo; ow < s.hi; ++ow) d[ow] = src[ow * w.stride];
      std::fill(d + s.hi, d + w.OW, 0.0f);
    }
  });
}

// The adjoint: adds each column entry back to its input position. Channels are
// independent, so threads split them and every sum runs in (kh, kw, oh, ow) order.
void col2im_add(float* plane, const float* cols, int64_t Cg, const Window2d& w) {
  const int64_t P = w.OH * w.OW;
  for_each_index(threads_here(), Cg, [&](int64_t c) {
    float* in = plane + c * w.H * w.W;
    for (int64_t k = 0; k < w.KH * w.KW; ++k) {
      const int64_t kh = k / w.KW, kw = k % w.KW;
      const float* src = cols + (c * w.KH * w.KW + k) * P;
      const Span s = inside(kw, w);
      for (int64_t oh = 0; oh < w.OH; ++oh) {
        const int64_t h = oh * w.stride - w.padding + kh;
        if (h < 0 || h >= w.H) continue;
        float* d = in + h * w.W - w.padding + kw;  // d[ow * stride] takes column ow
        const float* from = src + oh * w.OW;
        if (w.stride == 1) {
#pragma omp simd
          for (int64_t ow = s.lo; ow < s.hi; ++ow) d[ow] += from[ow];
        } else {
          for (int64_t ow = s.lo; ow < s.hi; ++ow) d[ow * w.stride] += from[ow];
        }
      }
    }
  });
}

}  // namespace

// This thread's columns among `lanes` (none for a pointwise window), inside the samples' loop.
float* lane_cols(float* cols, int64_t lanes, const Window2d& w) {
  return pointwise(w) ? nullptr : lane_at(cols, lanes, columns(w));
}

bool conv2d_shifted(const Window2d& w) { return shifted(w); }

namespace {

// The bias gradient: dbias[oc] += each sample's sum of its plane (P values, in double, in
// order), the samples in order. Threads split blocks of 8 channels, and a block's 8 sums
// run side by side: 8 chains of additions, so one add's latency hides behind the others
// (one chain at a time was 0.8 ms of the small CNN's 9 ms step at 2 threads, on the
// calling thread while the others waited). Each channel's additions are the same sequence
// as one channel at a time: the same bits for any thread count.
void bias_grad(float* dbias, const float* dout, int64_t N, int64_t OC, int64_t P) {
  constexpr int64_t B = 8;
  const int64_t blocks = (OC + B - 1) / B;
  for_each_index(threads_here() && blocks > 1, blocks, [&](int64_t block) {
    const int64_t o0 = block * B;
    if (o0 + B <= OC) {
      for (int64_t n = 0; n < N; ++n) {
        const float* d = dout + (n * OC + o0) * P;
        double sum[B] = {};
        for (int64_t p = 0; p < P; ++p)
          for (int64_t k = 0; k < B; ++k) sum[k] += d[k * P + p];
        for (int64_t k = 0; k < B; ++k) dbias[o0 + k] += static_cast<float>(sum[k]);
      }
      return;
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t oc = o0; oc < OC; ++oc) {
        const float* d = dout + (n * OC + oc) * P;
        double sum = 0;
        for (int64_t p = 0; p < P; ++p) sum += d[p];
        dbias[oc] += static_cast<float>(sum);
      }
  });
}

}  // namespace

int64_t conv2d_cols(const Window2d& w) {
  if (shifted(w)) return shifted_cols(w);
  return pointwise(w) ? 0 : conv_lanes(w) * columns(w);
}

void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                    const Window2d& w) {
  if (shifted(w)) return shifted_forward(out, inp, weight, bias, cols, w);
  if (pointwise_tiled(w)) return pointwise_forward(out, inp, weight, bias, w);
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, K = Cg * w.KH * w.KW, P = w.OH * w.OW;
  const int64_t lanes = conv_lanes(w);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(lanes)) if (lanes > 1)
  for (int64_t n = 0; n < w.N; ++n) {
    float* lane = lane_cols(cols, lanes, w);
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* x = inp + (n * w.C + g * Cg) * w.H * w.W;
      if (!pointwise(w)) im2col(lane, x, Cg, w);
      const float* c = pointwise(w) ? x : lane;
      float* o = out + (n * w.OC + g * OCg) * P;
      if (bias) {
        for (int64_t oc = 0; oc < OCg; ++oc) std::fill(o + oc * P, o + (oc + 1) * P, bias[g * OCg + oc]);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, OCg, P, K, 1.0f, weight + g * OCg * K, K, c, P,
                  bias ? 1.0f : 0.0f, o, P);
    }
  }
}

void conv2d_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, float* cols, const Window2d& w, GradMode mode) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, K = Cg * w.KH * w.KW, P = w.OH * w.OW;
  // Parameter gradients: the samples in order (the order of every sum), threads inside
  // each sample's im2col and GEMM.
  if (dbias) bias_grad(dbias, dout, w.N, w.OC, P);
  if (dweight && shifted(w) && shifted_weight_tiles(w)) shifted_weight_grad(dweight, dout, inp, cols, w);
  else if (dweight && pointwise_tiled(w) && pointwise_weight_tiles(w)) pointwise_weight_grad(dweight, dout, inp, w);
  else if (dweight)
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t g = 0; g < w.groups; ++g) {
        const float* d = dout + (n * w.OC + g * OCg) * P;
        const float* x = inp + (n * w.C + g * Cg) * w.H * w.W;
        if (!pointwise(w)) im2col(cols, x, Cg, w);
        // dW_g (OCg, K) += dout_g (OCg, P) . cols^T (P, K)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, OCg, K, P, 1.0f, d, P, pointwise(w) ? x : cols, P, 1.0f,
                    dweight + g * OCg * K, K);
      }
  if (!dinp) return;
  if (shifted(w)) return shifted_input_grad(dinp, dout, weight, cols, w, mode);
  if (pointwise_tiled(w)) return pointwise_input_grad(dinp, dout, weight, w, mode);
  // The input gradient: each sample's own, side by side as the forward.
  const int64_t lanes = conv_lanes(w);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(lanes)) if (lanes > 1)
  for (int64_t n = 0; n < w.N; ++n) {
    float* lane = lane_cols(cols, lanes, w);
    if (mode == GradMode::overwrite) std::fill_n(dinp + n * w.C * w.H * w.W, w.C * w.H * w.W, 0.0f);
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* d = dout + (n * w.OC + g * OCg) * P;
      // dcols (K, P) = W_g^T (K, OCg) . dout_g (OCg, P), added back to the input plane
      // (a pointwise window's columns are the plane: the GEMM adds to it).
      float* dx = dinp + (n * w.C + g * Cg) * w.H * w.W;
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, OCg, 1.0f, weight + g * OCg * K, K, d, P,
                  pointwise(w) ? 1.0f : 0.0f, pointwise(w) ? dx : lane, P);
      if (!pointwise(w)) col2im_add(dx, lane, Cg, w);
    }
  }
}

namespace {

// One output of a max pool by the rule the GPU shares (max_window, backend/op_types.hpp).
void max_one(float* out, int32_t* argmax, const float* in, int64_t oh, int64_t ow, const Window2d& w) {
  *out = max_window(in, oh, ow, w, [](float v) { return v; }, argmax);
}

// max_window over outputs [0, count) of one row whose windows lie inside the plane, the
// first at input (h, x), the next S columns on: the same choice as branch-free selects, K
// and S known, so the compiler runs the outputs side by side in vectors.
template <int K, int S>
void max_row(float* out, int32_t* argmax, const float* in, int64_t W, int64_t h, int64_t x, int64_t count) {
  const float* top = in + h * W + x;
  const int32_t first = static_cast<int32_t>(h * W + x);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    float best = top[i * S];
    int32_t at = first + static_cast<int32_t>(i * S);
    for (int kh = 0; kh < K; ++kh)
      for (int kw = 0; kw < K; ++kw) {
        if (kh == 0 && kw == 0) continue;
        const float v = top[kh * W + i * S + kw];
        const bool more = v > best;
        best = more ? v : best;
        at = more ? first + static_cast<int32_t>(kh * W + i * S + kw) : at;
      }
    out[i] = best;
    argmax[i] = at;
  }
}

using MaxRow = void (*)(float*, int32_t*, const float*, int64_t, int64_t, int64_t, int64_t);
// The vector row for the window's size and stride, or none (every output by max_window).
MaxRow max_row_for(const Window2d& w) {
  if (w.KH != w.KW) return nullptr;
  if (w.KH == 2 && w.stride == 2) return max_row<2, 2>;
  if (w.KH == 3 && w.stride == 2) return max_row<3, 2>;
  if (w.KH == 3 && w.stride == 1) return max_row<3, 1>;
  return nullptr;
}

}  // namespace

void maxpool2d_forward(float* out, int32_t* argmax, const float* inp, const Window2d& w) {
  // Outputs whose windows lie inside the plane: rows [oh0, oh1), columns [ow0, ow1).
  const auto inside = [&](int64_t extent, int64_t kernel, int64_t outputs, int64_t& first, int64_t& end) {
    first = std::min(outputs, (w.padding + w.stride - 1) / w.stride);
    end = extent + w.padding - kernel < 0 ? first : std::min(outputs, (extent + w.padding - kernel) / w.stride + 1);
    end = std::max(end, first);
  };
  int64_t oh0, oh1, ow0, ow1;
  inside(w.H, w.KH, w.OH, oh0, oh1);
  inside(w.W, w.KW, w.OW, ow0, ow1);
  const MaxRow row = max_row_for(w);
#pragma omp parallel for schedule(static)
  for (int64_t plane = 0; plane < w.N * w.C; ++plane) {
    const float* in = inp + plane * w.H * w.W;
    for (int64_t oh = 0; oh < w.OH; ++oh) {
      float* o = out + (plane * w.OH + oh) * w.OW;
      int32_t* a = argmax + (plane * w.OH + oh) * w.OW;
      // The vector run over the inside columns, or none (an empty one): max_one the rest.
      const bool vector = row && oh >= oh0 && oh < oh1;
      const int64_t lo = vector ? ow0 : w.OW, hi = vector ? ow1 : w.OW;
      for (int64_t ow = 0; ow < lo; ++ow) max_one(o + ow, a + ow, in, oh, ow, w);
      if (hi > lo) row(o + lo, a + lo, in, w.W, oh * w.stride - w.padding, lo * w.stride - w.padding, hi - lo);
      for (int64_t ow = hi; ow < w.OW; ++ow) max_one(o + ow, a + ow, in, oh, ow, w);
    }
  }
}

void maxpool2d_backward(float* dinp, const float* dout, const int32_t* argmax, const Window2d& w, GradMode mode) {
#pragma omp parallel for schedule(static)
  for (int64_t plane = 0; plane < w.N * w.C; ++plane) {
    float* d = dinp + plane * w.H * w.W;
    if (mode == GradMode::overwrite) std::fill(d, d + w.H * w.W, 0.0f);
    for (int64_t o = 0; o < w.OH * w.OW; ++o) {
      const int32_t at = argmax[plane * w.OH * w.OW + o];
      if (at >= 0) d[at] += dout[plane * w.OH * w.OW + o];
    }
  }
}

void avgpool2d_forward(float* out, const float* inp, const Window2d& w) {
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
#pragma omp parallel for schedule(static)
  for (int64_t plane = 0; plane < w.N * w.C; ++plane) {
    const float* in = inp + plane * w.H * w.W;
    for (int64_t oh = 0; oh < w.OH; ++oh)
      for (int64_t ow = 0; ow < w.OW; ++ow) {
        float sum = 0;
        for (int64_t kh = 0; kh < w.KH; ++kh) {
          const int64_t h = oh * w.stride - w.padding + kh;
          if (h < 0 || h >= w.H) continue;
          for (int64_t kw = 0; kw < w.KW; ++kw) {
            const int64_t x = ow * w.stride - w.padding + kw;
            if (x >= 0 && x < w.W) sum += in[h * w.W + x];
          }
        }
        out[(plane * w.OH + oh) * w.OW + ow] = sum * inv;
      }
  }
}

void avgpool2d_backward(float* dinp, const float* dout, const Window2d& w, GradMode mode) {
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
#pragma omp parallel for schedule(static)
  for (int64_t plane = 0; plane < w.N * w.C; ++plane) {
    float* d = dinp + plane * w.H * w.W;
    if (mode == GradMode::overwrite) std::fill(d, d + w.H * w.W, 0.0f);
    for (int64_t oh = 0; oh < w.OH; ++oh)
      for (int64_t ow = 0; ow < w.OW; ++ow) {
        const float g = dout[(plane * w.OH + oh) * w.OW + ow] * inv;
        for (int64_t kh = 0; kh < w.KH; ++kh) {
          const int64_t h = oh * w.stride - w.padding + kh;
          if (h < 0 || h >= w.H) continue;
          for (int64_t kw = 0; kw < w.KW; ++kw) {
            const int64_t x = ow * w.stride - w.padding + kw;
            if (x >= 0 && x < w.W) d[h * w.W + x] += g;
          }
        }
      }
  }
}

// ---- BatchNorm: channels split among threads; each channel's sums in double, in a fixed
// order of kLanes interleaved partial sums added up in lane order (the same for any thread
// count, and vectorised) --

namespace {
constexpr int kLanes = 16;

// The sum of f(at) (a double) over the flat indices `at` of channel c of (N, C, plane), in
// kLanes interleaved double partial sums added up in lane order. One sum per call: a
// lambda returning two (BatchNorm's backward) compiled to scalar code, 2 ns an element; a
// second pass over a channel's plane finds it in cache.
template <class F>
double channel_sum(int64_t c, int64_t N, int64_t C, int64_t plane, F f) {
  double lane[kLanes] = {};
  for (int64_t n = 0; n < N; ++n) {
    const int64_t base = (n * C + c) * plane;
    int64_t i = 0;
    for (; i + kLanes <= plane; i += kLanes)
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) lane[j] += f(base + i + j);
    for (int j = 0; i < plane; ++i, ++j) lane[j] += f(base + i);
  }
  double sum = 0;
  for (const double v : lane) sum += v;
  return sum;
}

// y = x * scale + shift over channel c of (N, C, plane); with `relu`, then rectified as
// relu_forward does it (a BatchNorm before a ReLU: one pass, the same bits).
void affine_channel(float* out, const float* inp, int64_t c, float scale, float shift, int64_t N, int64_t C, int64_t plane,
                    bool relu = false) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + (n * C + c) * plane;
    float* y = out + (n * C + c) * plane;
    if (relu) {
#pragma omp simd
      for (int64_t i = 0; i < plane; ++i) {
        const float v = x[i] * scale + shift;
        y[i] = v < 0.0f ? 0.0f : v;
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < plane; ++i) y[i] = x[i] * scale + shift;
    }
  }
}
}  // namespace

void batchnorm_forward_train(float* out, float* mean, float* rstd, float* running_mean, float* running_var,
                             double* sums, const float* inp, const float* weight, const float* bias, int64_t N,
                             int64_t C, int64_t plane, float eps, float momentum, bool relu) {
  const double count = static_cast<double>(N * plane);
  if (sums) sums[0] += count;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    const double sum = channel_sum(c, N, C, plane, [inp](int64_t at) { return static_cast<double>(inp[at]); });
    const double m = sum / count;
    const double squares = channel_sum(c, N, C, plane, [inp, m](int64_t at) {
      const double d = static_cast<double>(inp[at]) - m;
      return d * d;
    });
    const double var = squares / count;
    const float r = static_cast<float>(1.0 / std::sqrt(var + eps));
    mean[c] = static_cast<float>(m);
    rstd[c] = r;
    const float scale = weight[c] * r;
    affine_channel(out, inp, c, scale, bias[c] - static_cast<float>(m) * scale, N, C, plane, relu);
    if (running_mean) {
      const double unbiased = count > 1 ? squares / (count - 1) : var;
      running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
      running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
    }
    if (sums) {
      sums[1 + c] += sum;
      sums[1 + C + c] += squares + count * m * m;
    }
  }
}

void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum) {
  const double count = sums[0];
  if (count <= 0) return;  // nothing gathered
  for (int64_t c = 0; c < C; ++c) {
    const double m = sums[1 + c] / count;
    const double squares = std::max(0.0, sums[1 + C + c] - sums[1 + c] * m);
    const double unbiased = count > 1 ? squares / (count - 1) : squares / count;
    running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
    running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
  }
}

void batchnorm_forward_eval(float* out, const float* inp, const float* weight, const float* bias,
                            const float* running_mean, const float* running_var, int64_t N, int64_t C, int64_t plane,
                            float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    const float scale = weight[c] / std::sqrt(running_var[c] + eps);
    affine_channel(out, inp, c, scale, bias[c] - running_mean[c] * scale, N, C, plane);
  }
}

void batchnorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane,
                        GradMode mode) {
  const double count = static_cast<double>(N * plane);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < C; ++c) {
    const float mc = mean[c], rc = rstd[c];
    // sum(dy) and sum(dy * xhat), in one pass.
    const double sum_dy = channel_sum(c, N, C, plane, [dout](int64_t at) { return static_cast<double>(dout[at]); });
    const double sum_dy_xhat = channel_sum(c, N, C, plane, [=](int64_t at) {
      return static_cast<double>(dout[at] * (inp[at] - mc) * rc);
    });
    dweight[c] += static_cast<float>(sum_dy_xhat);
    dbias[c] += static_cast<float>(sum_dy);
    if (!dinp) continue;
    // dx = w * rstd * (dy - mean(dy) - xhat * mean(dy * xhat))
    const float k = weight[c] * rc, a = static_cast<float>(sum_dy / count), b = static_cast<float>(sum_dy_xhat / count);
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + (n * C + c) * plane;
      const float* dy = dout + (n * C + c) * plane;
      float* dx = dinp + (n * C + c) * plane;
      if (mode == GradMode::overwrite) {
#pragma omp simd
        for (int64_t i = 0; i < plane; ++i) dx[i] = k * (dy[i] - a - (x[i] - mc) * rc * b);
      } else {
#pragma omp simd
        for (int64_t i = 0; i < plane; ++i) dx[i] += k * (dy[i] - a - (x[i] - mc) * rc * b);
      }
    }
  }
}

}  // namespace mpipe::cpu
