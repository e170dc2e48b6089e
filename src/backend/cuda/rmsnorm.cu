// CUDA RMSNorm (Llama's norm): the forward, the forward fused with the residual sum
// before it, and the backward with the weight's gradient. See
// include/mpipe/backend/cuda/ops.hpp for the contracts and src/backend/cpu/ops.cpp for
// the math each kernel mirrors; laid out as LayerNorm's kernels (rows.cu), one warp a row.
//
// Where E is bf16 the weight multiplies the normalised value after it is rounded to E,
// out = E(weight · E(x · rstd)), as Hugging Face's LlamaRMSNorm computes it (the
// statistics in fp32, the normalised row cast to the input's type, then the weight); in
// fp32 both roundings are exact, so out = x · rstd · weight in the CPU's order. The
// weight's gradient sums dy · E(x · rstd), the value the forward multiplied.
//
// Determinism: a row's sums are a warp's fixed tree (warp_reduce) over lanes that each
// add their elements in order; the weight's gradient sums fixed chunks of rows into
// scratch, then the chunks in order (as LayerNorm's). No atomics.
#include <cmath>
#include <type_traits>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"
#include "rows.cuh"

namespace mpipe::cuda {

namespace {

// x · rstd rounded to T: what the weight multiplies (and its gradient sums).
template <class T>
__device__ __forceinline__ float normalised(float x, float s) {
  return to_f32(from_f32<T>(x * s));
}

// RMSNorm of row `row` (x, C elements) once each lane has summed the squares of its
// elements (packs of W at lane W, then 32 W on): rstd, then y.
template <int W, class T>
__device__ __forceinline__ void rmsnorm_row(T* y, float* rstd, const T* x, const T* weight, int64_t C, int64_t row,
                                            int lane, float squares, float eps) {
  // The CPU's 1 / sqrt(mean + eps), both IEEE-rounded here (no rsqrtf approximation).
  const float s = 1.0f / sqrtf(warp_reduce(squares, Sum{}) / static_cast<float>(C) + eps);
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
    const auto w = load_pack<W>(weight + c);
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) o.v[k] = from_f32<T>(to_f32(w.v[k]) * normalised<T>(to_f32(v.v[k]), s));
    store_pack<W>(y + c, o);
  }
  if (lane == 0) rstd[row] = s;
}

template <int W, class T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* inp, const T* weight, int64_t N, int64_t C,
                                       float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp
  const T* x = inp + row * C;
  float squares = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) squares = SquareSum{}(squares, to_f32(v.v[k]));
  }
  rmsnorm_row<W>(out + row * C, rstd, x, weight, C, row, lane, squares, eps);
}

// residual_layernorm_forward's sum (residual_sum_row, rows.cuh), its squares summed as
// they are stored (SquareSum, as rmsnorm_forward_kernel sums them when it reads them
// back: the same bits), then the RMSNorm of the row.
template <int W, bool Drop, class T>
__global__ void residual_rmsnorm_forward_kernel(T* out, float* rstd, T* sum_io, const T* residual, const T* weight,
                                                int64_t N, int64_t C, int64_t rows_per_sample, DropoutRule rule,
                                                RandomStream first, bool residual_packed, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp
  T* x = sum_io + row * C;
  const float squares = residual_sum_row<W, Drop>(x, residual + row * C, C, row, rows_per_sample, lane, rule, first,
                                                  residual_packed, SquareSum{});
  rmsnorm_row<W>(out + row * C, rstd, x, weight, C, row, lane, squares, eps);
}

// y = w · x s with s = (mean(x²) + eps)^(-1/2): dx = s (w dy - x s · mean(w dy · x s)),
// the CPU's expression. Accumulate: dinp = base + the gradient, base being dinp itself
// (accumulate mode) or a residual (the same additions as copying it into dinp first).
template <int W, bool Accumulate, class T>
__global__ void rmsnorm_backward_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* rstd,
                                       int64_t N, int64_t C, const T* base, bool base_packed) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  const float s = rstd[row];
  float dnorm_norm_mean = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto xv = load_pack<W>(x + c);
    const auto dv = load_pack<W>(dy + c);
    const auto wv = load_pack<W>(weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) dnorm_norm_mean += to_f32(wv.v[k]) * to_f32(dv.v[k]) * (to_f32(xv.v[k]) * s);
  }
  dnorm_norm_mean = warp_reduce(dnorm_norm_mean, Sum{}) / static_cast<float>(C);
  T* dx = dinp + row * C;
  const T* from = Accumulate ? base + row * C : nullptr;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto xv = load_pack<W>(x + c);
    const auto dv = load_pack<W>(dy + c);
    const auto wv = load_pack<W>(weight + c);
    Pack<T, W> o;
    if constexpr (Accumulate) o = load_run<W>(from + c, base_packed);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float d = (to_f32(wv.v[k]) * to_f32(dv.v[k]) - to_f32(xv.v[k]) * s * dnorm_norm_mean) * s;
      o.v[k] = from_f32<T>(Accumulate ? to_f32(o.v[k]) + d : d);
    }
    store_pack<W>(dx + c, o);
  }
}

// The weight's gradient, stage 1: a thread a column of one chunk of rows, in row order.
template <class T>
__global__ void rmsnorm_weight_partials(float* partial, const T* dout, const T* inp, const float* rstd, int64_t N,
                                        int64_t C, int64_t chunk_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * chunk_rows, r1 = std::min(N, r0 + chunk_rows);
  float dw = 0.0f;
  for (int64_t r = r0; r < r1; ++r) dw += normalised<T>(to_f32(inp[r * C + c]), rstd[r]) * to_f32(dout[r * C + c]);
  partial[blockIdx.y * C + c] = dw;  // (chunks, C)
}

// Stage 2: the chunks in order, added to what dweight holds.
__global__ void rmsnorm_weight_finish(float* dweight, const float* partial, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dw = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) dw += partial[k * C + c];
  dweight[c] += dw;
}

}  // namespace

template <class E>
void rmsnorm_forward(E* out, float* rstd, const E* inp, const E* weight, int64_t N, int64_t C, float eps) {
  if (N == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  if (C % W == 0 && all_aligned({out, inp, weight}, 16)) {
    rmsnorm_forward_kernel<W><<<blocks, kThreads, 0, context().compute>>>(dev(out), rstd, dev(inp), dev(weight), N, C,
                                                                          eps);
  } else {
    rmsnorm_forward_kernel<1><<<blocks, kThreads, 0, context().compute>>>(dev(out), rstd, dev(inp), dev(weight), N, C,
                                                                          eps);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void residual_rmsnorm_forward(E* out, float* rstd, E* sum, const E* residual, const E* weight, int64_t N, int64_t C,
                              int64_t rows_per_sample, float p, const DropoutKey& key, float eps) {
  if (N == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  // The pack width (which lane sums which squares) by rmsnorm_forward's rule on what it
  // reads and writes, so that the statistics are its bits; the residual is read by packs
  // where it is aligned.
  const bool packed = C % W == 0 && all_aligned({out, sum, weight}, 16);
  const bool residual_packed = all_aligned({residual}, 16);
  const RandomStream first = first_dropout_stream(key);
  const auto launch = [&](auto width, auto dropping) {
    residual_rmsnorm_forward_kernel<decltype(width)::value, decltype(dropping)::value>
        <<<blocks, kThreads, 0, context().compute>>>(dev(out), rstd, dev(sum), dev(residual), dev(weight), N, C,
                                                     rows_per_sample, DropoutRule(p), first, residual_packed, eps);
  };
  if (packed && p > 0.0f) launch(std::integral_constant<int, W>{}, std::true_type{});
  else if (packed) launch(std::integral_constant<int, W>{}, std::false_type{});
  else if (p > 0.0f) launch(std::integral_constant<int, 1>{}, std::true_type{});
  else launch(std::integral_constant<int, 1>{}, std::false_type{});
  CUDA_CHECK_LAUNCH();
}

template <class E>
void rmsnorm_backward(E* dinp, float* dweight, const E* dout, const E* inp, const E* weight, const float* rstd,
                      int64_t N, int64_t C, GradMode mode, const E* residual) {
  if (N == 0 || C == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  cudaStream_t stream = context().compute;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  // As layernorm_backward: the pack width from the plain backward's tensors alone, a
  // residual read by packs where it is aligned.
  const bool packed = C % W == 0 && all_aligned({dinp, dout, inp, weight}, 16);
  const bool accumulate = mode == GradMode::accumulate || residual;
  const E* base = residual ? residual : dinp;
  const bool base_packed = all_aligned({base}, 16);
  const auto launch = [&](auto width, auto accumulating) {
    rmsnorm_backward_kernel<decltype(width)::value, decltype(accumulating)::value>
        <<<blocks, kThreads, 0, stream>>>(dev(dinp), dev(dout), dev(inp), dev(weight), rstd, N, C, dev(base),
                                          base_packed);
  };
  if (packed && accumulate) launch(std::integral_constant<int, W>{}, std::true_type{});
  else if (packed) launch(std::integral_constant<int, W>{}, std::false_type{});
  else if (accumulate) launch(std::integral_constant<int, 1>{}, std::true_type{});
  else launch(std::integral_constant<int, 1>{}, std::false_type{});
  CUDA_CHECK_LAUNCH();

  const int64_t chunk_rows = rows_per_chunk(N), chunks = ceil_div(N, chunk_rows);
  auto* partial = static_cast<float*>(scratch(static_cast<std::size_t>(chunks * C) * sizeof(float)));
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kThreads)), static_cast<unsigned>(chunks));
  rmsnorm_weight_partials<<<grid, kThreads, 0, stream>>>(partial, dev(dout), dev(inp), rstd, N, C, chunk_rows);
  CUDA_CHECK_LAUNCH();
  rmsnorm_weight_finish<<<static_cast<unsigned>(ceil_div(C, kThreads)), kThreads, 0, stream>>>(dweight, partial,
                                                                                             chunks, C);
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_CUDA_RMSNORM_OPS(E)                                                                                 \
  template void rmsnorm_forward<E>(E*, float*, const E*, const E*, int64_t, int64_t, float);                      \
  template void residual_rmsnorm_forward<E>(E*, float*, E*, const E*, const E*, int64_t, int64_t, int64_t, float, \
                                            const DropoutKey&, float);                                            \
  template void rmsnorm_backward<E>(E*, float*, const E*, const E*, const E*, const float*, int64_t, int64_t,     \
                                    GradMode, const E*);

MPIPE_CUDA_RMSNORM_OPS(float)
MPIPE_CUDA_RMSNORM_OPS(bf16)
#undef MPIPE_CUDA_RMSNORM_OPS

}  // namespace mpipe::cuda
