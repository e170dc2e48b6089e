// CUDA layout ops: the CPU ops of src/backend/cpu/layout.cpp on the GPU (contracts in
// include/mpipe/backend/cuda/ops.hpp). Each output element is written by one thread and
// each upsampling gradient sums its block in the CPU's order: the same bits. Upsampling
// takes channels-last images too (`inner` values an element), and images swap their inner
// two axes (NCHW <-> NHWC) through 32 x 32 tiles in shared memory.
#include <algorithm>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

unsigned grid_of(int64_t total) { return blocks_for(total, kThreads); }

template <class T>
__global__ void copy_runs_kernel(T* dst, const T* src, Runs runs) {
  const int64_t total = runs.count * runs.length;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t run = i / runs.length, at = i % runs.length;
    dst[run * runs.dst_stride + runs.dst_offset + at] = src[run * runs.src_stride + runs.src_offset + at];
  }
}

// Planes of H x W elements, each `inner` values side by side (1: channels first, an
// element a value; C: channels last, an element a position's channels).
template <class T>
__global__ void upsample_forward_kernel(T* out, const T* inp, int64_t planes, int64_t H, int64_t W, int64_t scale,
                                        int64_t inner) {
  const int64_t OH = H * scale, OW = W * scale, total = planes * OH * OW * inner;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % inner, ow = (i / inner) % OW, oh = (i / (inner * OW)) % OH, p = i / (inner * OW * OH);
    out[i] = inp[((p * H + oh / scale) * W + ow / scale) * inner + c];
  }
}

// Each input value sums its block in (row, column) order.
template <class T>
__global__ void upsample_backward_kernel(T* dinp, const T* dout, int64_t planes, int64_t H, int64_t W, int64_t scale,
                                         int64_t inner) {
  const int64_t OW = W * scale, total = planes * H * W * inner;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i % inner, w = (i / inner) % W, h = (i / (inner * W)) % H, p = i / (inner * W * H);
    float sum = 0.0f;
    for (int64_t r = 0; r < scale; ++r) {
      const T* row = dout + ((p * H * scale + h * scale + r) * OW + w * scale) * inner + c;
      for (int64_t k = 0; k < scale; ++k) sum += to_f32(row[k * inner]);
    }
    dinp[i] = from_f32<T>(sum);
  }
}

// dst (N, B, A) = (or +=) src (N, A, B), a 32 x 32 tile per block turn: read along B
// (coalesced), written along A (coalesced), through shared memory (padded against bank
// conflicts). Pure copies (bf16 is exact in float).
constexpr int kTile = 32, kTileRows = 8;
template <class T>
__global__ void swap_inner_kernel(T* dst, const T* src, int64_t N, int64_t A, int64_t B, bool accumulate) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t ta_count = ceil_div(A, kTile), tb_count = ceil_div(B, kTile), tiles = N * ta_count * tb_count;
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t tb = t % tb_count, ta = (t / tb_count) % ta_count, n = t / (tb_count * ta_count);
    const T* in = src + n * A * B;
    T* out = dst + n * A * B;
    for (int k = ty; k < kTile; k += kTileRows) {
      const int64_t a = ta * kTile + k, b = tb * kTile + tx;
      if (a < A && b < B) tile[k][tx] = to_f32(in[a * B + b]);
    }
    __syncthreads();
    for (int k = ty; k < kTile; k += kTileRows) {
      const int64_t b = tb * kTile + k, a = ta * kTile + tx;
      if (a < A && b < B) {
        const float v = tile[tx][k];
        out[b * A + a] = from_f32<T>(accumulate ? to_f32(out[b * A + a]) + v : v);
      }
    }
    __syncthreads();
  }
}

}  // namespace

template <class E>
void swap_inner(E* dst, const E* src, int64_t N, int64_t A, int64_t B, bool accumulate) {
  const int64_t tiles = N * ceil_div(A, kTile) * ceil_div(B, kTile);
  if (tiles == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(tiles, int64_t{1} << 20));
  swap_inner_kernel<<<blocks, dim3(kTile, kTileRows), 0, context().compute>>>(dev(dst), dev(src), N, A, B, accumulate);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void copy_runs(E* dst, const E* src, const Runs& runs) {
  const int64_t total = runs.count * runs.length;
  if (total == 0) return;
  copy_runs_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(dst), dev(src), runs);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void upsample_nearest_forward(E* out, const E* inp, int64_t planes, int64_t H, int64_t W, int64_t scale, int64_t inner) {
  const int64_t total = planes * H * W * scale * scale * inner;
  if (total == 0) return;
  upsample_forward_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(out), dev(inp), planes, H, W, scale,
                                                                               inner);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void upsample_nearest_backward(E* dinp, const E* dout, int64_t planes, int64_t H, int64_t W, int64_t scale,
                               int64_t inner) {
  const int64_t total = planes * H * W * inner;
  if (total == 0) return;
  upsample_backward_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), planes, H, W, scale,
                                                                                inner);
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_LAYOUT_OPS(E)                                                                   \
  template void copy_runs<E>(E*, const E*, const Runs&);                                      \
  template void upsample_nearest_forward<E>(E*, const E*, int64_t, int64_t, int64_t, int64_t, int64_t);  \
  template void upsample_nearest_backward<E>(E*, const E*, int64_t, int64_t, int64_t, int64_t, int64_t); \
  template void swap_inner<E>(E*, const E*, int64_t, int64_t, int64_t, bool);
MPIPE_LAYOUT_OPS(float)
MPIPE_LAYOUT_OPS(bf16)
#undef MPIPE_LAYOUT_OPS

}  // namespace mpipe::cuda
