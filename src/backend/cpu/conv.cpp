// CPU convolution (im2col + BLAS) and pooling over NCHW tensors. Deterministic for any
// thread count: the samples run in order, threads split channels or output planes.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

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

// A 1x1 window with stride 1 and no padding: the columns are the input plane itself.
bool pointwise(const Window2d& w) { return w.KH == 1 && w.KW == 1 && w.stride == 1 && w.padding == 0; }

// The columns of one sample's group: rows (c, kh, kw) of Cg*KH*KW, columns (oh, ow).
void im2col(float* cols, const float* plane, int64_t Cg, const Window2d& w) {
  const int64_t P = w.OH * w.OW;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < Cg * w.KH * w.KW; ++row) {
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
  }
}

// The adjoint: adds each column entry back to its input position. Channels are
// independent, so threads split them and every sum runs in (kh, kw, oh, ow) order.
void col2im_add(float* plane, const float* cols, int64_t Cg, const Window2d& w) {
  const int64_t P = w.OH * w.OW;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < Cg; ++c) {
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
  }
}

// Samples run side by side, one per thread, each with its own columns (a sample's output
// and input gradient are its own: the same bits for any thread count); one sample, or one
// thread, runs its im2col and GEMMs on every thread instead.
int64_t conv_lanes(const Window2d& w) { return std::max<int64_t>(1, std::min<int64_t>(threads(), w.N)); }

// ---- stride 1: shifted planes ----------------------------------------------------------
// A stride-1 window over 16 or more channels per group needs no (Cg KH KW, OH OW) columns.
// With the input zero-padded to (Hp, Wp) planes and the output computed over OH rows of the
// padded width Wp (its last KW - 1 columns of each row are junk, dropped), tap (kh, kw)
// reads the padded plane shifted by kh Wp + kw. So KW copies of each padded plane, shifted
// by kw ("rows" (c, kw) of Hp Wp floats), serve all KH tap rows: tap row kh is the same
// rows read from column kh Wp, a matrix with the constant stride Hp Wp. The forward is KH
// GEMMs of (OCg, Cg KW) . (Cg KW, OH Wp); the weight gradient the same transposed; the
// input gradient their adjoint, into the shifted rows, added back along kw. KW (not
// KH KW) copies of the input, and GEMMs of KW Cg deep. The junk columns cost (KW - 1) / Wp
// of the work: planes of 4 (KW - 1) columns and more (8 for 3x3) take this path, where it
// beat im2col's here (1.1-1.7x the forward's speed, 1.1-1.8x the input gradient's, at 16 to
// 64 channels on 64x64 to 16x16 planes); fewer than 16 channels a group keep im2col's, and
// so do windows whose scratch (the weights reordered, and one lane's rows) would exceed
// one lane's columns (deep layers on small planes: 128 channels on 8x8). One lane's, not
// every thread's: the path, and so the bits, are the same for any thread count.
struct Shift {
  int64_t Cg, OCg, Wp, plane, L, taps;  // taps: one kh's weights, OCg * Cg * KW
  explicit Shift(const Window2d& w)
      : Cg(w.C / w.groups), OCg(w.OC / w.groups), Wp(w.W + 2 * w.padding), plane((w.H + 2 * w.padding) * Wp),
        L(w.OH * Wp), taps(OCg * Cg * w.KW) {}
  int64_t rows() const { return taps / OCg; }  // Cg KW
  // A lane's floats: the shifted rows, then the output (or its gradient) in the padded width.
  int64_t lane() const { return rows() * plane + OCg * L; }
  // The weights as [g][kh] (OCg, Cg KW) blocks, before the lanes.
  int64_t weights(const Window2d& w) const { return w.groups * w.KH * taps; }
  // This thread's rows among `lanes`, inside the samples' loop; its wide output follows them.
  float* lane_rows(float* cols, const Window2d& w, int64_t lanes) const {
    return cols + weights(w) + (lanes > 1 ? omp_get_thread_num() : 0) * lane();
  }
  float* wide(float* lane_rows) const { return lane_rows + rows() * plane; }
};

bool shifted(const Window2d& w) {
  if (w.stride != 1 || pointwise(w) || w.C / w.groups < 16 || w.OW < 4 * (w.KW - 1)) return false;
  const Shift s(w);
  return s.weights(w) + s.lane() <= w.C / w.groups * w.KH * w.KW * w.OH * w.OW;
}

// rows (c, kw) of one sample's group: row (c, 0) the zero-padded plane of channel c,
// row (c, kw) the same shifted left by kw (its last kw floats zero).
void shift_rows(float* rows, const float* plane, const Shift& s, const Window2d& w) {
#pragma omp parallel for schedule(static) if (omp_get_level() == 0)
  for (int64_t c = 0; c < s.Cg; ++c) {
    float* r0 = rows + c * w.KW * s.plane;
    const float* in = plane + c * w.H * w.W;
    std::fill(r0, r0 + w.padding * s.Wp, 0.0f);
    for (int64_t h = 0; h < w.H; ++h) {
      float* d = r0 + (h + w.padding) * s.Wp;
      std::fill(d, d + w.padding, 0.0f);
      std::copy(in + h * w.W, in + (h + 1) * w.W, d + w.padding);
      std::fill(d + w.padding + w.W, d + s.Wp, 0.0f);
    }
    std::fill(r0 + (w.H + w.padding) * s.Wp, r0 + s.plane, 0.0f);
    for (int64_t kw = 1; kw < w.KW; ++kw) {
      float* r = r0 + kw * s.plane;
      std::copy(r0 + kw, r0 + s.plane, r);
      std::fill(r + s.plane - kw, r + s.plane, 0.0f);
    }
  }
}

// The weights (OC, Cg, KH, KW) as [g][kh] blocks (OCg, Cg KW): (oc, c, kw) at oc Cg KW + c KW + kw.
void shift_weights(float* to, const float* weight, const Shift& s, const Window2d& w) {
  for (int64_t g = 0; g < w.groups; ++g)
    for (int64_t kh = 0; kh < w.KH; ++kh)
      for (int64_t oc = 0; oc < s.OCg; ++oc)
        for (int64_t c = 0; c < s.Cg; ++c)
          for (int64_t kw = 0; kw < w.KW; ++kw)
            to[(g * w.KH + kh) * s.taps + (oc * s.Cg + c) * w.KW + kw] =
                weight[(((g * s.OCg + oc) * s.Cg + c) * w.KH + kh) * w.KW + kw];
}

// An output gradient (OCg, OH, OW) in the padded width (OCg, OH Wp), its junk columns zero
// (they meet real input positions in the adjoint).
void widen(float* wide, const float* d, const Shift& s, const Window2d& w) {
  for (int64_t r = 0; r < s.OCg * w.OH; ++r) {
    std::copy(d + r * w.OW, d + (r + 1) * w.OW, wide + r * s.Wp);
    std::fill(wide + r * s.Wp + w.OW, wide + (r + 1) * s.Wp, 0.0f);
  }
}

// The weights reordered into cols, then body(n, g, rows, wide) for every sample and group,
// samples side by side (each thread its own rows): the forward's and input gradient's loop.
template <class Body>
void each_sample(const Shift& s, const Window2d& w, const float* weight, float* cols, Body body) {
  const int64_t lanes = conv_lanes(w);
  shift_weights(cols, weight, s, w);
#pragma omp parallel for schedule(static) num_threads(static_cast<int>(lanes)) if (lanes > 1)
  for (int64_t n = 0; n < w.N; ++n) {
    float* rows = s.lane_rows(cols, w, lanes);
    for (int64_t g = 0; g < w.groups; ++g) body(n, g, rows, s.wide(rows));
  }
}

void shifted_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                     const Window2d& w) {
  const Shift s(w);
  const int64_t P = w.OH * w.OW;
  each_sample(s, w, weight, cols, [&](int64_t n, int64_t g, float* rows, float* wide) {
    shift_rows(rows, inp + (n * w.C + g * s.Cg) * w.H * w.W, s, w);
    for (int64_t kh = 0; kh < w.KH; ++kh)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.OCg, s.L, s.rows(), 1.0f,
                  cols + (g * w.KH + kh) * s.taps, s.rows(), rows + kh * s.Wp, s.plane, kh ? 1.0f : 0.0f, wide, s.L);
    float* o = out + (n * w.OC + g * s.OCg) * P;
    for (int64_t oc = 0; oc < s.OCg; ++oc) {
      const float b = bias ? bias[g * s.OCg + oc] : 0.0f;
      for (int64_t oh = 0; oh < w.OH; ++oh) {
        const float* from = wide + oc * s.L + oh * s.Wp;
        float* to = o + oc * P + oh * w.OW;
        if (bias) {
#pragma omp simd
          for (int64_t ow = 0; ow < w.OW; ++ow) to[ow] = from[ow] + b;
        } else {
          std::copy(from, from + w.OW, to);
        }
      }
    }
  });
}

// dweight accumulates (OCg, Cg KW) blocks over the samples in order, in the weights' place
// of cols, then adds them in.
void shifted_weight_grad(float* dweight, const float* dout, const float* inp, float* cols, const Window2d& w) {
  const Shift s(w);
  float* blocks = cols;
  float* rows = s.lane_rows(cols, w, 1);
  float* wide = s.wide(rows);
  std::fill(blocks, blocks + s.weights(w), 0.0f);
  for (int64_t n = 0; n < w.N; ++n)
    for (int64_t g = 0; g < w.groups; ++g) {
      shift_rows(rows, inp + (n * w.C + g * s.Cg) * w.H * w.W, s, w);
      widen(wide, dout + (n * w.OC + g * s.OCg) * w.OH * w.OW, s, w);
      for (int64_t kh = 0; kh < w.KH; ++kh)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.OCg, s.rows(), s.L, 1.0f, wide, s.L,
                    rows + kh * s.Wp, s.plane, 1.0f, blocks + (g * w.KH + kh) * s.taps, s.rows());
    }
  for (int64_t g = 0; g < w.groups; ++g)
    for (int64_t kh = 0; kh < w.KH; ++kh)
      for (int64_t oc = 0; oc < s.OCg; ++oc)
        for (int64_t c = 0; c < s.Cg; ++c)
          for (int64_t kw = 0; kw < w.KW; ++kw)
            dweight[(((g * s.OCg + oc) * s.Cg + c) * w.KH + kh) * w.KW + kw] +=
                blocks[(g * w.KH + kh) * s.taps + (oc * s.Cg + c) * w.KW + kw];
}

// The input gradient: per sample (side by side), the shifted rows' gradient (Cg KW, Hp Wp)
// = sum over kh of the weights' block transposed times the widened output gradient, at
// column kh Wp; then padded position p of channel c takes row (c, kw) at p - kw, kw in order.
void shifted_input_grad(float* dinp, const float* dout, const float* weight, float* cols, const Window2d& w,
                        GradMode mode) {
  const Shift s(w);
  each_sample(s, w, weight, cols, [&](int64_t n, int64_t g, float* rows, float* wide) {
    widen(wide, dout + (n * w.OC + g * s.OCg) * w.OH * w.OW, s, w);
    // kh = 0 overwrites columns [0, L) of each row, the later kh add from kh Wp on: past L
    // they add to zeros.
    for (int64_t r = 0; r < s.rows(); ++r) std::fill(rows + r * s.plane + s.L, rows + (r + 1) * s.plane, 0.0f);
    for (int64_t kh = 0; kh < w.KH; ++kh)
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.rows(), s.L, s.OCg, 1.0f,
                  cols + (g * w.KH + kh) * s.taps, s.rows(), wide, s.L, kh ? 1.0f : 0.0f, rows + kh * s.Wp, s.plane);
    for (int64_t c = 0; c < s.Cg; ++c) {
      float* dx = dinp + (n * w.C + g * s.Cg + c) * w.H * w.W;
      const float* r0 = rows + c * w.KW * s.plane;
      for (int64_t h = 0; h < w.H; ++h) {
        const int64_t p0 = (h + w.padding) * s.Wp + w.padding;  // padded position of (h, 0)
        float* d = dx + h * w.W;
        if (mode == GradMode::overwrite) std::fill(d, d + w.W, 0.0f);
        for (int64_t kw = 0; kw < w.KW; ++kw) {
          const float* r = r0 + kw * s.plane + p0 - kw;
          const int64_t lo = p0 - kw < 0 ? kw - p0 : 0;  // positions before the row's start read nothing
#pragma omp simd
          for (int64_t x = lo; x < w.W; ++x) d[x] += r[x];
        }
      }
    }
  });
}

}  // namespace

// This thread's columns among `lanes` (none for a pointwise window), inside the samples' loop.
float* lane_cols(float* cols, int64_t lanes, const Window2d& w) {
  if (pointwise(w)) return nullptr;
  return cols + (lanes > 1 ? omp_get_thread_num() : 0) * (w.C / w.groups * w.KH * w.KW * w.OH * w.OW);
}

bool conv2d_shifted(const Window2d& w) { return shifted(w); }

int64_t conv2d_cols(const Window2d& w) {
  if (shifted(w)) {
    const Shift s(w);
    return s.weights(w) + conv_lanes(w) * s.lane();
  }
  return pointwise(w) ? 0 : conv_lanes(w) * (w.C / w.groups * w.KH * w.KW * w.OH * w.OW);
}

void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                    const Window2d& w) {
  if (shifted(w)) return shifted_forward(out, inp, weight, bias, cols, w);
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
  if (dbias)
    for (int64_t n = 0; n < w.N; ++n)
      for (int64_t oc = 0; oc < w.OC; ++oc) {
        const float* d = dout + (n * w.OC + oc) * P;
        double sum = 0;
        for (int64_t p = 0; p < P; ++p) sum += d[p];
        dbias[oc] += static_cast<float>(sum);
      }
  if (dweight && shifted(w)) shifted_weight_grad(dweight, dout, inp, cols, w);
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

void maxpool2d_forward(float* out, int32_t* argmax, const float* inp, const Window2d& w) {
#pragma omp parallel for schedule(static)
  for (int64_t plane = 0; plane < w.N * w.C; ++plane) {
    const float* in = inp + plane * w.H * w.W;
    for (int64_t oh = 0; oh < w.OH; ++oh)
      for (int64_t ow = 0; ow < w.OW; ++ow) {
        float best = -std::numeric_limits<float>::infinity();
        int32_t at = -1;
        for (int64_t kh = 0; kh < w.KH; ++kh) {
          const int64_t h = oh * w.stride - w.padding + kh;
          if (h < 0 || h >= w.H) continue;
          for (int64_t kw = 0; kw < w.KW; ++kw) {
            const int64_t x = ow * w.stride - w.padding + kw;
            if (x < 0 || x >= w.W) continue;
            const float v = in[h * w.W + x];
            if (at < 0 || v > best) {  // the first of equal maxima, as PyTorch
              best = v;
              at = static_cast<int32_t>(h * w.W + x);
            }
          }
        }
        out[(plane * w.OH + oh) * w.OW + ow] = best;
        argmax[(plane * w.OH + oh) * w.OW + ow] = at;
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

// y = x * scale + shift over channel c of (N, C, plane).
void affine_channel(float* out, const float* inp, int64_t c, float scale, float shift, int64_t N, int64_t C, int64_t plane) {
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + (n * C + c) * plane;
    float* y = out + (n * C + c) * plane;
#pragma omp simd
    for (int64_t i = 0; i < plane; ++i) y[i] = x[i] * scale + shift;
  }
}
}  // namespace

void batchnorm_forward_train(float* out, float* mean, float* rstd, float* running_mean, float* running_var,
                             double* sums, const float* inp, const float* weight, const float* bias, int64_t N,
                             int64_t C, int64_t plane, float eps, float momentum) {
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
    affine_channel(out, inp, c, scale, bias[c] - static_cast<float>(m) * scale, N, C, plane);
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
