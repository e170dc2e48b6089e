// CUDA convolution, pooling and BatchNorm over NCHW: the CPU ops of src/backend/cpu/conv.cpp
// on the GPU (contracts in include/mpipe/backend/cuda/ops.hpp).
//
// Convolution's forward and input gradient run on cuDNN where it offers a deterministic
// algorithm for the shape (conv_dnn.cu). The weight gradient, which cuDNN would round to
// the weights' type, and every shape cuDNN declines, run as one GEMM
// per group over the whole micro-batch: the input unfolded into columns (C/g x KH x KW,
// N x OH x OW) whose column index runs over samples and positions together, so the weight
// gradient sums all samples inside one fp32-accumulating GEMM. Columns and products live
// in scratch() for the call only: nothing is held between a forward and its backward.
//
// Determinism: no atomics. The input gradient of the GEMM path is gathered (each input
// element sums the columns that read it, in a fixed order), pooling backward likewise,
// and every channel sum of BatchNorm runs in one block in an order fixed by the sizes.
#include <cmath>

#include "conv_dnn.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// Threads per BatchNorm channel block: one channel's N x plane elements each.
constexpr int kChannelThreads = 512;

// ---- unfolding -------------------------------------------------------------------------

// cols (C KH KW, N OH OW): row (c, kh, kw), column (n, oh, ow) = inp (n, c, oh s - p + kh,
// ow s - p + kw), zero outside the plane.
template <class T>
__global__ void im2col_kernel(T* cols, const T* inp, Window2d w) {
  const int64_t P = w.N * w.OH * w.OW, total = w.C * w.KH * w.KW * P;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t q = i % P, row = i / P;
    const int64_t ow = q % w.OW, oh = (q / w.OW) % w.OH, n = q / (w.OW * w.OH);
    const int64_t kw = row % w.KW, kh = (row / w.KW) % w.KH, c = row / (w.KW * w.KH);
    const int64_t h = oh * w.stride - w.padding + kh, x = ow * w.stride - w.padding + kw;
    cols[i] = h >= 0 && h < w.H && x >= 0 && x < w.W ? inp[((n * w.C + c) * w.H + h) * w.W + x] : from_f32<T>(0.0f);
  }
}

// The first and one-past-last output index along one axis whose window covers input
// position `at`: o s - p <= at <= o s - p + k - 1, within [0, outputs).
__device__ __forceinline__ void covering(int64_t at, int64_t kernel, int64_t stride, int64_t padding, int64_t outputs,
                                         int64_t& first, int64_t& end) {
  const int64_t low = at + padding - kernel + 1;  // o s >= low
  first = low <= 0 ? 0 : (low + stride - 1) / stride;
  const int64_t last = (at + padding) / stride + 1;
  end = last < outputs ? last : outputs;
}

// dinp (n, c, h, x) (+)= the sum, over the windows that read it (kh, kw in order), of the
// columns' gradient dcols (C KH KW, N OH OW), fp32.
template <class T>
__global__ void col2im_kernel(T* dinp, const float* dcols, Window2d w, bool accumulate) {
  const int64_t P = w.N * w.OH * w.OW, total = w.N * w.C * w.H * w.W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, c = (i / (w.W * w.H)) % w.C, n = i / (w.W * w.H * w.C);
    float sum = 0.0f;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t oh_scaled = h + w.padding - kh;
      if (oh_scaled < 0 || oh_scaled % w.stride != 0) continue;
      const int64_t oh = oh_scaled / w.stride;
      if (oh >= w.OH) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t ow_scaled = x + w.padding - kw;
        if (ow_scaled < 0 || ow_scaled % w.stride != 0) continue;
        const int64_t ow = ow_scaled / w.stride;
        if (ow >= w.OW) continue;
        sum += dcols[((c * w.KH + kh) * w.KW + kw) * P + (n * w.OH + oh) * w.OW + ow];
      }
    }
    dinp[i] = from_f32<T>(accumulate ? to_f32(dinp[i]) + sum : sum);
  }
}

// out (N, OC, OHW) = product (OC, N, OHW) + bias (OC; may be null).
template <class T>
__global__ void fold_output(T* out, const float* product, const T* bias, int64_t N, int64_t OC, int64_t plane) {
  const int64_t total = N * OC * plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t p = i % plane, oc = (i / plane) % OC, n = i / (plane * OC);
    const float v = product[(oc * N + n) * plane + p];
    out[i] = from_f32<T>(bias ? v + to_f32(bias[oc]) : v);
  }
}

// dst (OC, N, OHW) = src (N, OC, OHW): the output gradient with samples and positions as
// one GEMM dimension.
template <class T>
__global__ void channels_first(T* dst, const T* src, int64_t N, int64_t OC, int64_t plane) {
  const int64_t total = N * OC * plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t p = i % plane, n = (i / plane) % N, oc = i / (plane * N);
    dst[i] = src[(n * OC + oc) * plane + p];
  }
}

// dbias[oc] += the sum of row oc of dout_t (OC, P): one block per channel.
template <class T>
__global__ void bias_grad(float* dbias, const T* dout_t, int64_t P) {
  __shared__ float shared[32];
  const int64_t oc = blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) sum += to_f32(dout_t[oc * P + i]);
  sum = block_reduce(sum, Sum{}, 0.0f, shared);
  if (threadIdx.x == 0) dbias[oc] += sum;
}

// ---- pooling -----------------------------------------------------------------------------

template <class T>
__global__ void maxpool_forward_kernel(T* out, int32_t* argmax, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t ow = i % w.OW, oh = (i / w.OW) % w.OH, plane = i / (w.OW * w.OH);
    const T* in = inp + plane * w.H * w.W;
    float best = -INFINITY;
    int32_t at = -1;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h < 0 || h >= w.H) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t x = ow * w.stride - w.padding + kw;
        if (x < 0 || x >= w.W) continue;
        const float v = to_f32(in[h * w.W + x]);
        if (at < 0 || v > best) {  // the first of equal maxima, as the CPU and PyTorch
          best = v;
          at = static_cast<int32_t>(h * w.W + x);
        }
      }
    }
    out[i] = from_f32<T>(best);
    argmax[i] = at;
  }
}

// Each input element sums, in (oh, ow) order as the CPU, the gradients of the windows
// whose maximum it was.
template <class T>
__global__ void maxpool_backward_kernel(T* dinp, const T* dout, const int32_t* argmax, Window2d w, bool accumulate) {
  const int64_t total = w.N * w.C * w.H * w.W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, plane = i / (w.W * w.H);
    const int32_t self = static_cast<int32_t>(h * w.W + x);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t o = (plane * w.OH + oh) * w.OW + ow;
        if (argmax[o] == self) sum += to_f32(dout[o]);
      }
    dinp[i] = from_f32<T>(sum);
  }
}

template <class T>
__global__ void avgpool_forward_kernel(T* out, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t ow = i % w.OW, oh = (i / w.OW) % w.OH, plane = i / (w.OW * w.OH);
    const T* in = inp + plane * w.H * w.W;
    float sum = 0.0f;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h < 0 || h >= w.H) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t x = ow * w.stride - w.padding + kw;
        if (x >= 0 && x < w.W) sum += to_f32(in[h * w.W + x]);
      }
    }
    out[i] = from_f32<T>(sum * inv);
  }
}

// A plane's mean (global average pooling, one window per plane): one warp per plane, so a
// 56 x 56 plane is not one thread's serial loop. Lanes sum fixed strides, then the warp.
template <class T>
__global__ void plane_mean_kernel(T* out, const T* inp, int64_t planes, int64_t plane_size) {
  const int64_t plane = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (plane >= planes) return;  // the whole warp
  float sum = 0.0f;
  for (int64_t i = lane; i < plane_size; i += 32) sum += to_f32(inp[plane * plane_size + i]);
  sum = warp_reduce(sum, Sum{});
  if (lane == 0) out[plane] = from_f32<T>(sum * (1.0f / static_cast<float>(plane_size)));
}

template <class T>
__global__ void avgpool_backward_kernel(T* dinp, const T* dout, Window2d w, bool accumulate) {
  const int64_t total = w.N * w.C * w.H * w.W;
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, plane = i / (w.W * w.H);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) sum += to_f32(dout[(plane * w.OH + oh) * w.OW + ow]) * inv;
    dinp[i] = from_f32<T>(sum);
  }
}

// ---- BatchNorm ---------------------------------------------------------------------------
// One block per channel. Its N x plane elements, element e = (n, i), are summed by thread
// e mod blockDim in double, then across the block: an order fixed by the sizes.

__device__ __forceinline__ int64_t channel_at(int64_t e, int64_t c, int64_t C, int64_t plane) {
  return ((e / plane) * C + c) * plane + e % plane;
}

template <class T>
__global__ void batchnorm_train_kernel(T* out, float* mean, float* rstd, float* running_mean, float* running_var,
                                       double* sums, const T* inp, const T* weight, const T* bias, int64_t N,
                                       int64_t C, int64_t plane, float eps, float momentum) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x, count = N * plane;
  const double n = static_cast<double>(count);
  double sum = 0.0;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) sum += to_f32(inp[channel_at(e, c, C, plane)]);
  sum = block_reduce(sum, Sum{}, 0.0, shared);
  const double m = sum / n;
  double squares = 0.0;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const double d = to_f32(inp[channel_at(e, c, C, plane)]) - m;
    squares += d * d;
  }
  squares = block_reduce(squares, Sum{}, 0.0, shared);
  const double var = squares / n;
  const float r = static_cast<float>(1.0 / sqrt(var + eps));
  const float scale = to_f32(weight[c]) * r, shift = to_f32(bias[c]) - static_cast<float>(m) * scale;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t at = channel_at(e, c, C, plane);
    out[at] = from_f32<T>(to_f32(inp[at]) * scale + shift);
  }
  if (threadIdx.x != 0) return;
  mean[c] = static_cast<float>(m);
  rstd[c] = r;
  if (running_mean) {
    const double unbiased = n > 1 ? squares / (n - 1) : var;
    running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
    running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
  }
  if (sums) {
    if (c == 0) sums[0] += n;
    sums[1 + c] += sum;
    sums[1 + C + c] += squares + n * m * m;
  }
}

__global__ void batchnorm_apply_sums_kernel(float* running_mean, float* running_var, const double* sums, int64_t C,
                                            float momentum) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const double count = sums[0];
  if (c >= C || count <= 0) return;  // nothing gathered
  const double m = sums[1 + c] / count;
  const double squares = fmax(0.0, sums[1 + C + c] - sums[1 + c] * m);
  const double unbiased = count > 1 ? squares / (count - 1) : squares / count;
  running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
  running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
}

template <class T>
__global__ void batchnorm_eval_kernel(T* out, const T* inp, const T* weight, const T* bias, const float* running_mean,
                                      const float* running_var, int64_t N, int64_t C, int64_t plane, float eps) {
  const int64_t total = N * C * plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t c = (i / plane) % C;
    const float scale = to_f32(weight[c]) / sqrtf(running_var[c] + eps);
    out[i] = from_f32<T>(to_f32(inp[i]) * scale + (to_f32(bias[c]) - running_mean[c] * scale));
  }
}

template <class T>
__global__ void batchnorm_backward_kernel(T* dinp, float* dweight, float* dbias, const T* dout, const T* inp,
                                          const T* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                                          int64_t plane, bool accumulate) {
  __shared__ double shared[32];
  const int64_t c = blockIdx.x, count = N * plane;
  const float mu = mean[c], r = rstd[c];
  double sum_dy = 0.0, sum_dy_xhat = 0.0;
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t at = channel_at(e, c, C, plane);
    const float dy = to_f32(dout[at]);
    sum_dy += dy;
    sum_dy_xhat += dy * (to_f32(inp[at]) - mu) * r;
  }
  sum_dy = block_reduce(sum_dy, Sum{}, 0.0, shared);
  sum_dy_xhat = block_reduce(sum_dy_xhat, Sum{}, 0.0, shared);
  if (threadIdx.x == 0) {
    dweight[c] += static_cast<float>(sum_dy_xhat);
    dbias[c] += static_cast<float>(sum_dy);
  }
  if (!dinp) return;
  // dx = w rstd (dy - mean(dy) - xhat mean(dy xhat))
  const float k = to_f32(weight[c]) * r, a = static_cast<float>(sum_dy / static_cast<double>(count)),
              b = static_cast<float>(sum_dy_xhat / static_cast<double>(count));
  for (int64_t e = threadIdx.x; e < count; e += blockDim.x) {
    const int64_t at = channel_at(e, c, C, plane);
    const float g = k * (to_f32(dout[at]) - a - (to_f32(inp[at]) - mu) * r * b);
    dinp[at] = from_f32<T>(accumulate ? to_f32(dinp[at]) + g : g);
  }
}

unsigned grid_for(int64_t total) { return blocks_for(total, kThreads); }

// The batched per-group GEMM of a convolution: c = alpha op(a) op(b) (+ beta c) for each
// of `groups` matrices at the given strides (elements).
Gemm per_group(int64_t groups, int64_t M, int64_t N, int64_t K, const void* a, bool trans_a, int64_t lda,
               int64_t stride_a, const void* b, bool trans_b, int64_t ldb, int64_t stride_b, void* c, int64_t ldc,
               int64_t stride_c, cudaDataType_t ab_type, float beta) {
  MPIPE_CHECK(groups <= INT32_MAX, "conv2d: ", groups, " groups exceed one batched GEMM");
  Gemm g;
  g.M = M, g.N = N, g.K = K;
  g.a = a, g.lda = lda, g.trans_a = trans_a;
  g.b = b, g.ldb = ldb, g.trans_b = trans_b;
  g.c = c, g.ldc = ldc;
  g.ab_type = ab_type, g.c_type = CUDA_R_32F;
  g.beta = beta;
  g.batch = static_cast<int>(groups);
  g.stride_a = stride_a, g.stride_b = stride_b, g.stride_c = stride_c;
  return g;
}

}  // namespace

// ---- convolution -------------------------------------------------------------------------

template <class E>
void conv2d_forward(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w) {
  const int64_t P = w.N * w.OH * w.OW, plane = w.OH * w.OW;
  if (P == 0 || w.OC == 0) return;
  cudaStream_t stream = context().compute;
  if (dnn_conv_forward(out, inp, weight, bias, w)) return;
  const int64_t G = w.groups, Cg = w.C / G, OCg = w.OC / G, Kg = Cg * w.KH * w.KW;

  ScratchPlan plan;
  const std::size_t cols_at = plan.reserve<E>(w.C * w.KH * w.KW * P);  // (C KH KW, N OH OW)
  const std::size_t product_at = plan.reserve<float>(w.OC * P);         // (OC, N OH OW)
  void* base = scratch(plan.bytes());
  E* cols = place<E>(base, cols_at);
  auto* product = place<float>(base, product_at);

  im2col_kernel<<<grid_for(w.C * w.KH * w.KW * P), kThreads, 0, stream>>>(dev(cols), dev(inp), w);
  CUDA_CHECK_LAUNCH();
  // product_g (OCg, P) = weight_g (OCg, Kg) · cols_g (Kg, P)
  gemm(per_group(G, OCg, P, Kg, weight, false, Kg, OCg * Kg, cols, false, P, Kg * P, product, P, OCg * P,
                 data_type<E>(), 0.0f));
  fold_output<<<grid_for(w.N * w.OC * plane), kThreads, 0, stream>>>(dev(out), product, bias ? dev(bias) : nullptr,
                                                                       w.N, w.OC, plane);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void conv2d_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     const Window2d& w, GradMode mode) {
  const int64_t P = w.N * w.OH * w.OW, plane = w.OH * w.OW;
  if (P == 0 || w.OC == 0) return;
  // cuDNN's input gradient first: its workspace may grow scratch(), which the GEMM path
  // then carves.
  if (dinp && dnn_conv_input_gradient(dinp, dout, weight, w, mode)) dinp = nullptr;
  if (!dinp && !dweight && !dbias) return;
  const int64_t G = w.groups, Cg = w.C / G, OCg = w.OC / G, Kg = Cg * w.KH * w.KW;
  cudaStream_t stream = context().compute;

  ScratchPlan plan;
  const std::size_t dout_at = plan.reserve<E>(w.OC * P);                         // (OC, N OH OW)
  const std::size_t cols_at = plan.reserve<E>(dweight ? w.C * w.KH * w.KW * P : 0);       // (C KH KW, N OH OW)
  const std::size_t dcols_at = plan.reserve<float>(dinp ? w.C * w.KH * w.KW * P : 0);     // (C KH KW, N OH OW)
  void* base = scratch(plan.bytes());
  E* dout_t = place<E>(base, dout_at);
  E* cols = place<E>(base, cols_at);
  auto* dcols = place<float>(base, dcols_at);

  channels_first<<<grid_for(w.OC * P), kThreads, 0, stream>>>(dev(dout_t), dev(dout), w.N, w.OC, plane);
  CUDA_CHECK_LAUNCH();
  if (dbias) {
    bias_grad<<<static_cast<unsigned>(w.OC), kChannelThreads, 0, stream>>>(dbias, dev(dout_t), P);
    CUDA_CHECK_LAUNCH();
  }
  if (dweight) {
    im2col_kernel<<<grid_for(w.C * w.KH * w.KW * P), kThreads, 0, stream>>>(dev(cols), dev(inp), w);
    CUDA_CHECK_LAUNCH();
    // dweight_g (OCg, Kg) += dout_g (OCg, P) · cols_g (Kg, P)^T
    gemm(per_group(G, OCg, Kg, P, dout_t, false, P, OCg * P, cols, true, P, Kg * P, dweight, Kg, OCg * Kg,
                   data_type<E>(), 1.0f));
  }
  if (dinp) {
    // dcols_g (Kg, P) = weight_g (OCg, Kg)^T · dout_g (OCg, P)
    gemm(per_group(G, Kg, P, OCg, weight, true, Kg, OCg * Kg, dout_t, false, P, OCg * P, dcols, P, Kg * P,
                   data_type<E>(), 0.0f));
    col2im_kernel<<<grid_for(w.N * w.C * w.H * w.W), kThreads, 0, stream>>>(dev(dinp), dcols, w,
                                                                               mode == GradMode::accumulate);
    CUDA_CHECK_LAUNCH();
  }
}

// ---- pooling -----------------------------------------------------------------------------

template <class E>
void maxpool2d_forward(E* out, int32_t* argmax, const E* inp, const Window2d& w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  if (total == 0) return;
  maxpool_forward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(out), argmax, dev(inp), w);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void maxpool2d_backward(E* dinp, const E* dout, const int32_t* argmax, const Window2d& w, GradMode mode) {
  const int64_t total = w.N * w.C * w.H * w.W;
  if (total == 0) return;
  maxpool_backward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), argmax, w,
                                                                                mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void avgpool2d_forward(E* out, const E* inp, const Window2d& w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  if (total == 0) return;
  if (w.OH == 1 && w.OW == 1 && w.KH == w.H && w.KW == w.W && w.padding == 0) {  // global average pooling
    const int64_t planes = w.N * w.C;
    plane_mean_kernel<<<static_cast<unsigned>(ceil_div(planes, kRowsPerBlock)), kThreads, 0, context().compute>>>(
        dev(out), dev(inp), planes, w.H * w.W);
  } else {
    avgpool_forward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(out), dev(inp), w);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void avgpool2d_backward(E* dinp, const E* dout, const Window2d& w, GradMode mode) {
  const int64_t total = w.N * w.C * w.H * w.W;
  if (total == 0) return;
  avgpool_backward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), w,
                                                                                mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

// ---- BatchNorm ---------------------------------------------------------------------------

template <class E>
void batchnorm_forward_train(E* out, float* mean, float* rstd, float* running_mean, float* running_var, double* sums,
                             const E* inp, const E* weight, const E* bias, int64_t N, int64_t C, int64_t plane,
                             float eps, float momentum) {
  if (C == 0 || N * plane == 0) return;
  batchnorm_train_kernel<<<static_cast<unsigned>(C), kChannelThreads, 0, context().compute>>>(
      dev(out), mean, rstd, running_mean, running_var, sums, dev(inp), dev(weight), dev(bias), N, C, plane, eps,
      momentum);
  CUDA_CHECK_LAUNCH();
}

void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum) {
  if (C == 0) return;
  batchnorm_apply_sums_kernel<<<grid_for(C), kThreads, 0, context().compute>>>(running_mean, running_var, sums, C,
                                                                               momentum);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_forward_eval(E* out, const E* inp, const E* weight, const E* bias, const float* running_mean,
                            const float* running_var, int64_t N, int64_t C, int64_t plane, float eps) {
  const int64_t total = N * C * plane;
  if (total == 0) return;
  batchnorm_eval_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(
      dev(out), dev(inp), dev(weight), dev(bias), running_mean, running_var, N, C, plane, eps);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane, GradMode mode) {
  if (C == 0 || N * plane == 0) return;
  batchnorm_backward_kernel<<<static_cast<unsigned>(C), kChannelThreads, 0, context().compute>>>(
      dinp ? dev(dinp) : nullptr, dweight, dbias, dev(dout), dev(inp), dev(weight), mean, rstd, N, C, plane,
      mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_CONV_OPS(E)                                                                                          \
  template void conv2d_forward<E>(E*, const E*, const E*, const E*, const Window2d&);                           \
  template void conv2d_backward<E>(E*, float*, float*, const E*, const E*, const E*, const Window2d&, GradMode);  \
  template void maxpool2d_forward<E>(E*, int32_t*, const E*, const Window2d&);                                   \
  template void maxpool2d_backward<E>(E*, const E*, const int32_t*, const Window2d&, GradMode);                  \
  template void avgpool2d_forward<E>(E*, const E*, const Window2d&);                                             \
  template void avgpool2d_backward<E>(E*, const E*, const Window2d&, GradMode);                                  \
  template void batchnorm_forward_train<E>(E*, float*, float*, float*, float*, double*, const E*, const E*,      \
                                           const E*, int64_t, int64_t, int64_t, float, float);                  \
  template void batchnorm_forward_eval<E>(E*, const E*, const E*, const E*, const float*, const float*, int64_t, \
                                          int64_t, int64_t, float);                                              \
  template void batchnorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,            \
                                      const float*, int64_t, int64_t, int64_t, GradMode);
MPIPE_CONV_OPS(float)
MPIPE_CONV_OPS(bf16)
#undef MPIPE_CONV_OPS

}  // namespace mpipe::cuda
