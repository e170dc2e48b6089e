// CUDA layout ops: the CPU ops of src/backend/cpu/layout.cpp on the GPU (contracts in
// include/mpipe/backend/cuda/ops.hpp). Each output element is written by one thread and
// each upsampling gradient sums its block in the CPU's order: the same bits.
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

template <class T>
__global__ void upsample_forward_kernel(T* out, const T* inp, int64_t planes, int64_t H, int64_t W, int64_t scale) {
  const int64_t OH = H * scale, OW = W * scale, total = planes * OH * OW;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t ow = i % OW, oh = (i / OW) % OH, p = i / (OW * OH);
    out[i] = inp[(p * H + oh / scale) * W + ow / scale];
  }
}

template <class T>
__global__ void upsample_backward_kernel(T* dinp, const T* dout, int64_t planes, int64_t H, int64_t W, int64_t scale) {
  const int64_t OW = W * scale, total = planes * H * W;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t w = i % W, h = (i / W) % H, p = i / (W * H);
    float sum = 0.0f;
    for (int64_t r = 0; r < scale; ++r) {
      const T* row = dout + (p * H * scale + h * scale + r) * OW + w * scale;
      for (int64_t c = 0; c < scale; ++c) sum += to_f32(row[c]);
    }
    dinp[i] = from_f32<T>(sum);
  }
}

}  // namespace

template <class E>
void copy_runs(E* dst, const E* src, const Runs& runs) {
  const int64_t total = runs.count * runs.length;
  if (total == 0) return;
  copy_runs_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(dst), dev(src), runs);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void upsample_nearest_forward(E* out, const E* inp, int64_t planes, int64_t H, int64_t W, int64_t scale) {
  const int64_t total = planes * H * W * scale * scale;
  if (total == 0) return;
  upsample_forward_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(out), dev(inp), planes, H, W, scale);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void upsample_nearest_backward(E* dinp, const E* dout, int64_t planes, int64_t H, int64_t W, int64_t scale) {
  const int64_t total = planes * H * W;
  if (total == 0) return;
  upsample_backward_kernel<<<grid_of(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), planes, H, W, scale);
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_LAYOUT_OPS(E)                                                                   \
  template void copy_runs<E>(E*, const E*, const Runs&);                                      \
  template void upsample_nearest_forward<E>(E*, const E*, int64_t, int64_t, int64_t, int64_t);  \
  template void upsample_nearest_backward<E>(E*, const E*, int64_t, int64_t, int64_t, int64_t);
MPIPE_LAYOUT_OPS(float)
MPIPE_LAYOUT_OPS(bf16)
#undef MPIPE_LAYOUT_OPS

}  // namespace mpipe::cuda
