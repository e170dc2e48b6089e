// CPU convolution (im2col + BLAS) and pooling over NCHW tensors. Deterministic for any
// thread count: the samples run in order, threads split channels or output planes.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <limits>

#include "mpipe/backend/cpu/ops.hpp"

namespace mpipe::cpu {

namespace {

// The columns of one sample's group: rows (c, kh, kw) of Cg*KH*KW, columns (oh, ow).
void im2col(float* cols, const float* plane, int64_t Cg, const Window2d& w) {
  const int64_t P = w.OH * w.OW;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < Cg * w.KH * w.KW; ++row) {
    const int64_t c = row / (w.KH * w.KW), kh = row / w.KW % w.KH, kw = row % w.KW;
    const float* in = plane + c * w.H * w.W;
    float* dst = cols + row * P;
    for (int64_t oh = 0; oh < w.OH; ++oh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      for (int64_t ow = 0; ow < w.OW; ++ow) {
        const int64_t x = ow * w.stride - w.padding + kw;
        dst[oh * w.OW + ow] = (h >= 0 && h < w.H && x >= 0 && x < w.W) ? in[h * w.W + x] : 0.0f;
      }
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
      for (int64_t oh = 0; oh < w.OH; ++oh) {
        const int64_t h = oh * w.stride - w.padding + kh;
        if (h < 0 || h >= w.H) continue;
        for (int64_t ow = 0; ow < w.OW; ++ow) {
          const int64_t x = ow * w.stride - w.padding + kw;
          if (x >= 0 && x < w.W) in[h * w.W + x] += src[oh * w.OW + ow];
        }
      }
    }
  }
}

}  // namespace

int64_t conv2d_cols(const Window2d& w) { return w.C / w.groups * w.KH * w.KW * w.OH * w.OW; }

void conv2d_forward(float* out, const float* inp, const float* weight, const float* bias, float* cols,
                    const Window2d& w) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, K = Cg * w.KH * w.KW, P = w.OH * w.OW;
  for (int64_t n = 0; n < w.N; ++n)
    for (int64_t g = 0; g < w.groups; ++g) {
      im2col(cols, inp + (n * w.C + g * Cg) * w.H * w.W, Cg, w);
      float* o = out + (n * w.OC + g * OCg) * P;
      if (bias) {
        for (int64_t oc = 0; oc < OCg; ++oc) std::fill(o + oc * P, o + (oc + 1) * P, bias[g * OCg + oc]);
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, OCg, P, K, 1.0f, weight + g * OCg * K, K, cols, P,
                  bias ? 1.0f : 0.0f, o, P);
    }
}

void conv2d_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, float* cols, const Window2d& w, GradMode mode) {
  const int64_t Cg = w.C / w.groups, OCg = w.OC / w.groups, K = Cg * w.KH * w.KW, P = w.OH * w.OW;
  if (dinp && mode == GradMode::overwrite) std::memset(dinp, 0, sizeof(float) * static_cast<size_t>(w.N * w.C * w.H * w.W));
  for (int64_t n = 0; n < w.N; ++n)
    for (int64_t g = 0; g < w.groups; ++g) {
      const float* d = dout + (n * w.OC + g * OCg) * P;
      if (dbias)
        for (int64_t oc = 0; oc < OCg; ++oc) {
          double sum = 0;
          for (int64_t p = 0; p < P; ++p) sum += d[oc * P + p];
          dbias[g * OCg + oc] += static_cast<float>(sum);
        }
      im2col(cols, inp + (n * w.C + g * Cg) * w.H * w.W, Cg, w);
      // dW_g (OCg, K) += dout_g (OCg, P) . cols^T (P, K)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, OCg, K, P, 1.0f, d, P, cols, P, 1.0f,
                  dweight + g * OCg * K, K);
      if (!dinp) continue;
      // dcols (K, P) = W_g^T (K, OCg) . dout_g (OCg, P), added back to the input plane.
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, K, P, OCg, 1.0f, weight + g * OCg * K, K, d, P, 0.0f,
                  cols, P);
      col2im_add(dinp + (n * w.C + g * Cg) * w.H * w.W, cols, Cg, w);
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

}  // namespace mpipe::cpu
