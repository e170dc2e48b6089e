// CUDA BatchNorm over channels-last activations (train --channels-last on): an image
// (N, C, H, W) lies as (rows, C), rows = N H W, each row a position's C channels side by
// side. The statistics, rules and formulas are batchnorm.cu's; only the walk differs.
//
// Determinism: no atomics. The rows split into S segments (S from the sizes alone); a
// block takes one segment and 32 channels, a warp's lanes 32 consecutive channels of a
// row (coalesced), its 8 warps rows 8 apart, each warp's sums in row order, the 8 added
// in warp order: one partial per (channel, segment). A warp per channel then adds the S
// partials in a fixed order (lanes over segments, then the butterfly). The same bits on
// every run; not those of the channels-first kernels (another order of the same sums).
#include <algorithm>
#include <cmath>

#include "batchnorm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

constexpr int kLanes = 32;      // channels a block takes
constexpr int kWarps = 8;       // row groups a block takes
constexpr int64_t kBlocks = 4096;
constexpr int64_t kMinRows = 256;  // rows a segment has at least (32 a warp)

struct RowShape {
  int64_t rows, C, S, tiles;  // tiles: blocks of 32 channels
};

RowShape row_shape(int64_t rows, int64_t C) {
  const int64_t tiles = ceil_div(C, kLanes);
  const int64_t S = std::clamp<int64_t>(std::min(ceil_div(kBlocks, tiles), rows / kMinRows), 1, rows);
  return {rows, C, S, tiles};
}

// What a pass sums per (channel, segment).
enum class Sums { x, squares, gradients };

// Block (tile, segment): partial_a[c S + s] (and partial_b for the gradients) for its 32
// channels over segment s's rows. `centre` is each channel's mean (squares only).
template <class T, Sums kind>
__global__ void row_sums_kernel(double* partial_a, double* partial_b, const T* x, const T* dy, const double* centre,
                                const float* mean, const float* rstd, RowShape sh) {
  __shared__ double shared_a[kWarps][kLanes], shared_b[kWarps][kLanes];
  const int64_t tile = blockIdx.x / sh.S, s = blockIdx.x % sh.S;
  const int lane = static_cast<int>(threadIdx.x), warp = static_cast<int>(threadIdx.y);
  const int64_t c = tile * kLanes + lane;
  const int64_t r0 = s * sh.rows / sh.S, r1 = (s + 1) * sh.rows / sh.S;
  double a = 0.0, b = 0.0;
  if (c < sh.C) {
    const double m = kind == Sums::squares ? centre[c] : 0.0;
    const float mu = kind == Sums::gradients ? mean[c] : 0.0f, r = kind == Sums::gradients ? rstd[c] : 0.0f;
    for (int64_t row = r0 + warp; row < r1; row += kWarps) {
      const int64_t at = row * sh.C + c;
      if constexpr (kind == Sums::x) {
        a += to_f32(x[at]);
      } else if constexpr (kind == Sums::squares) {
        const double d = to_f32(x[at]) - m;
        a += d * d;
      } else {
        const float d = to_f32(dy[at]);
        a += d;
        b += d * (to_f32(x[at]) - mu) * r;
      }
    }
  }
  shared_a[warp][lane] = a;
  shared_b[warp][lane] = b;
  __syncthreads();
  if (warp != 0 || c >= sh.C) return;
  double sum_a = 0.0, sum_b = 0.0;
  for (int k = 0; k < kWarps; ++k) {
    sum_a += shared_a[k][lane];
    sum_b += shared_b[k][lane];
  }
  partial_a[c * sh.S + s] = sum_a;
  if (kind == Sums::gradients) partial_b[c * sh.S + s] = sum_b;
}

// Channel c's S partials added in a fixed order; the whole warp calls it.
__device__ __forceinline__ double total_of(const double* partial, int64_t c, int64_t S) {
  double sum = 0.0;
  for (int64_t s = threadIdx.x % 32; s < S; s += 32) sum += partial[c * S + s];
  return warp_reduce(sum, Sum{});
}

// A warp per channel: the sum of x (kept) and the mean (the squares' centre).
__global__ void mean_kernel(double* sums, double* centre, const double* partial, RowShape sh) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (c >= sh.C) return;  // the whole warp
  const double sum = total_of(partial, c, sh.S);
  if (threadIdx.x % 32 != 0) return;
  sums[c] = sum;
  centre[c] = sum / static_cast<double>(sh.rows);
}

// A warp per channel: the statistics from both passes, as batchnorm.cu's normalize kernel
// writes them (and the running statistics and deferred sums, once per channel).
__global__ void statistics_kernel(float* mean, float* rstd, float* running_mean, float* running_var, double* sums_out,
                                  const double* sums, const double* partial_squares, RowShape sh, float eps,
                                  float momentum) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (c >= sh.C) return;
  const double sq = total_of(partial_squares, c, sh.S);
  if (threadIdx.x % 32 != 0) return;
  const double n = static_cast<double>(sh.rows), sum = sums[c];
  mean[c] = static_cast<float>(sum / n);
  rstd[c] = static_cast<float>(1.0 / sqrt(sq / n + eps));
  record_statistics(running_mean, running_var, sums_out, c, sh.C, n, sum, sq, momentum);
}

// out = x scale + shift per channel (c = i mod C), rectified as relu_forward would.
template <class T>
__global__ void normalize_last_kernel(T* out, const T* inp, const T* weight, const T* bias, const float* mean,
                                      const float* rstd, int64_t total, int64_t C, bool relu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t c = i % C;
    const float scale = to_f32(weight[c]) * rstd[c], shift = to_f32(bias[c]) - mean[c] * scale;
    T y = from_f32<T>(to_f32(inp[i]) * scale + shift);
    if (relu && to_f32(y) < 0.0f) y = from_f32<T>(0.0f);
    out[i] = y;
  }
}

// A warp per channel: the gradients' two sums; dweight and dbias added once; the
// per-channel means a and b for dx kept.
__global__ void gradient_sums_kernel(float* dweight, float* dbias, float* a, float* b, const double* partial_dy,
                                     const double* partial_dy_xhat, RowShape sh) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  if (c >= sh.C) return;
  const double dy_sum = total_of(partial_dy, c, sh.S), dy_xhat_sum = total_of(partial_dy_xhat, c, sh.S);
  if (threadIdx.x % 32 != 0) return;
  dweight[c] += static_cast<float>(dy_xhat_sum);
  dbias[c] += static_cast<float>(dy_sum);
  const double count = static_cast<double>(sh.rows);
  a[c] = static_cast<float>(dy_sum / count);
  b[c] = static_cast<float>(dy_xhat_sum / count);
}

// dx = w rstd (dy - a - xhat b) per mode.
template <class T>
__global__ void backward_apply_last_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,
                                           const float* rstd, const float* a, const float* b, int64_t total, int64_t C,
                                           bool accumulate) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t c = i % C;
    const float r = rstd[c], k = to_f32(weight[c]) * r;
    const float g = k * (to_f32(dout[i]) - a[c] - (to_f32(inp[i]) - mean[c]) * r * b[c]);
    dinp[i] = from_f32<T>(accumulate ? to_f32(dinp[i]) + g : g);
  }
}

// One call's scratch: two arrays of C S partials, and two of C per-channel values,
// from one scratch() call taken before any launch (a second may move the first).
struct RowScratch {
  double *first, *second, *sums, *centre;
  RowScratch(const RowShape& sh) {
    ScratchPlan plan;
    const std::size_t first_at = plan.reserve<double>(sh.C * sh.S), second_at = plan.reserve<double>(sh.C * sh.S);
    const std::size_t sums_at = plan.reserve<double>(sh.C), centre_at = plan.reserve<double>(sh.C);
    void* base = scratch(plan.bytes());
    first = place<double>(base, first_at);
    second = place<double>(base, second_at);
    sums = place<double>(base, sums_at);
    centre = place<double>(base, centre_at);
  }
};

unsigned sum_blocks(const RowShape& sh) {
  const int64_t blocks = sh.tiles * sh.S;
  MPIPE_CHECK(blocks <= INT32_MAX, "batchnorm: ", sh.C, " channels exceed one launch");
  return static_cast<unsigned>(blocks);
}
unsigned channel_blocks(const RowShape& sh) { return static_cast<unsigned>(ceil_div(sh.C, kRowsPerBlock)); }

}  // namespace

template <class E>
void batchnorm_forward_train_last(E* out, float* mean, float* rstd, float* running_mean, float* running_var,
                                  double* sums, const E* inp, const E* weight, const E* bias, int64_t rows, int64_t C,
                                  float eps, float momentum, bool relu) {
  if (C == 0 || rows == 0) return;
  using T = device_t<E>;
  const RowShape sh = row_shape(rows, C);
  const RowScratch at(sh);
  cudaStream_t stream = context().compute;
  const dim3 block(kLanes, kWarps);
  row_sums_kernel<T, Sums::x><<<sum_blocks(sh), block, 0, stream>>>(at.first, nullptr, dev(inp), nullptr, nullptr,
                                                                     nullptr, nullptr, sh);
  CUDA_CHECK_LAUNCH();
  mean_kernel<<<channel_blocks(sh), kThreads, 0, stream>>>(at.sums, at.centre, at.first, sh);
  CUDA_CHECK_LAUNCH();
  row_sums_kernel<T, Sums::squares><<<sum_blocks(sh), block, 0, stream>>>(at.second, nullptr, dev(inp), nullptr,
                                                                           at.centre, nullptr, nullptr, sh);
  CUDA_CHECK_LAUNCH();
  statistics_kernel<<<channel_blocks(sh), kThreads, 0, stream>>>(mean, rstd, running_mean, running_var, sums, at.sums,
                                                                  at.second, sh, eps, momentum);
  CUDA_CHECK_LAUNCH();
  const int64_t total = rows * C;
  normalize_last_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream>>>(dev(out), dev(inp), dev(weight),
                                                                                dev(bias), mean, rstd, total, C, relu);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_backward_last(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                             const float* mean, const float* rstd, int64_t rows, int64_t C, GradMode mode) {
  if (C == 0 || rows == 0) return;
  using T = device_t<E>;
  const RowShape sh = row_shape(rows, C);
  const RowScratch at(sh);
  // a and b (C floats each) in the per-channel arrays' room (2C doubles).
  auto* a = reinterpret_cast<float*>(at.sums);
  float* b = a + C;
  cudaStream_t stream = context().compute;
  row_sums_kernel<T, Sums::gradients><<<sum_blocks(sh), dim3(kLanes, kWarps), 0, stream>>>(
      at.first, at.second, dev(inp), dev(dout), nullptr, mean, rstd, sh);
  CUDA_CHECK_LAUNCH();
  gradient_sums_kernel<<<channel_blocks(sh), kThreads, 0, stream>>>(dweight, dbias, a, b, at.first, at.second, sh);
  CUDA_CHECK_LAUNCH();
  if (!dinp) return;
  const int64_t total = rows * C;
  backward_apply_last_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream>>>(
      dev(dinp), dev(dout), dev(inp), dev(weight), mean, rstd, a, b, total, C, mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_BATCHNORM_LAST_OPS(E)                                                                                    \
  template void batchnorm_forward_train_last<E>(E*, float*, float*, float*, float*, double*, const E*, const E*,       \
                                                const E*, int64_t, int64_t, float, float, bool);                      \
  template void batchnorm_backward_last<E>(E*, float*, float*, const E*, const E*, const E*, const float*, const float*, \
                                           int64_t, int64_t, GradMode);
MPIPE_BATCHNORM_LAST_OPS(float)
MPIPE_BATCHNORM_LAST_OPS(bf16)
#undef MPIPE_BATCHNORM_LAST_OPS

}  // namespace mpipe::cuda
