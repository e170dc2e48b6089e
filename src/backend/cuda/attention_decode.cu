// Generation's attention: a few new queries (the prompt's, then one a token) against a
// key/value cache, the CPU's attention_decode (src/backend/cpu/decode.cpp). See
// include/mpipe/backend/cuda/ops.hpp for the contract.
//
// One block per (sequence, head, query row): its threads take the keys in turn for the
// scores (kept in shared memory), then the channels for the weighted sum of values. The
// reductions are block_reduce's fixed trees: the same bits on every run.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// qkv (B, rows, C + 2 KV): row i's queries are its first C values (head h at h hs); cache
// (B, capacity, 2 KV): key head j at j hs, value head j at KV + j hs. Query head h reads
// key/value head h / (H / KVH).
template <class T>
__global__ void attention_decode_kernel(T* out, const T* qkv, const T* cache, int64_t rows, int64_t position,
                                        int64_t capacity, int64_t C, int64_t H, int64_t KVH) {
  extern __shared__ float scores[];  // (keys)
  __shared__ float reduce[32];
  const int64_t i = blockIdx.x % rows, bh = blockIdx.x / rows, b = bh / H, h = bh % H;
  const int64_t hs = C / H, KV = KVH * hs, ld = 2 * KV, row = position + i, keys = row + 1;
  const T* q = qkv + (b * rows + i) * (C + 2 * KV) + h * hs;
  const T* base = cache + b * capacity * ld + (h / (H / KVH)) * hs;  // key row j at j ld, its values KV on
  const float scale = rsqrtf(static_cast<float>(hs));
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) {
    const T* k = base + j * ld;
    float dot = 0.0f;
    for (int64_t c = 0; c < hs; ++c) dot += to_f32(q[c]) * to_f32(k[c]);
    scores[j] = dot * scale;
    mx = fmaxf(mx, scores[j]);
  }
  mx = block_reduce(mx, Max{}, -INFINITY, reduce);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) {
    scores[j] = __expf(scores[j] - mx);
    sum += scores[j];
  }
  sum = block_reduce(sum, Sum{}, 0.0f, reduce);  // its __syncthreads also publishes the weights
  const float inv = 1.0f / sum;
  T* o = out + (b * rows + i) * C + h * hs;
  for (int64_t c = threadIdx.x; c < hs; c += blockDim.x) {
    float acc = 0.0f;
    for (int64_t j = 0; j < keys; ++j) acc += scores[j] * to_f32(base[j * ld + KV + c]);
    o[c] = from_f32<T>(acc * inv);
  }
}

}  // namespace

template <class E>
void attention_decode(E* out, const E* qkv, const E* cache, int64_t B, int64_t rows, int64_t position,
                      int64_t capacity, int64_t C, int64_t H, int64_t KVH) {
  if (B == 0 || rows == 0) return;
  MPIPE_CHECK(H > 0 && C % H == 0, "attention: ", C, " channels do not split into ", H, " heads");
  MPIPE_CHECK(KVH > 0 && H % KVH == 0, "attention: ", KVH, " key/value heads do not divide ", H, " heads");
  MPIPE_CHECK(position + rows <= kMaxDecodeKeys, "attention decode: ", position + rows, " positions; the GPU takes up to ",
              kMaxDecodeKeys);
  const std::size_t shared = static_cast<std::size_t>(position + rows) * sizeof(float);
  attention_decode_kernel<<<static_cast<unsigned>(B * H * rows), 128, shared, context().compute>>>(
      dev(out), dev(qkv), dev(cache), rows, position, capacity, C, H, KVH);
  CUDA_CHECK_LAUNCH();
}

template void attention_decode<float>(float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                      int64_t, int64_t);
template void attention_decode<bf16>(bf16*, const bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t,
                                     int64_t, int64_t);

}  // namespace mpipe::cuda
