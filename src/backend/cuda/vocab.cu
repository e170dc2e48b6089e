// CUDA kernels of the language-model head split over the vocabulary
// (nn/vocab_layers.hpp): a chunk's logits folded into per-row online-softmax statistics,
// their backward, and the loss from the last chunk's statistics. Contracts in
// include/mpipe/backend/cuda/ops.hpp; each kernel mirrors the CPU op of the same name in
// src/backend/cpu/ops.cpp, its exponential clamped to the same range.
//
// Determinism: one warp per row, each lane taking the row's entries at a fixed stride
// and the warp combining its lanes by warp_reduce's fixed butterfly, so the bits depend
// on the sizes alone, never on the launch or the timing. The loss sums the rows in one
// block (fixed strided partial sums in double, then a fixed tree), as cross-entropy's
// does (rows.cu). No atomics.
#include <climits>
#include <cmath>
#include <cstdint>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// The CPU's exp_clamped (cpu/vmath.hpp) on the GPU: e^x with x clamped to [-87, 87], so
// an entry far below the maximum adds e^-87, as on the CPU, not zero. Written with
// comparisons, as std::min and std::max, so NaN passes through (fminf would drop it).
__device__ __forceinline__ float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 87.0f ? 87.0f : x;
  return expf(x);
}

// No entry seen yet: a lane beyond a short row.
constexpr long long kNone = LLONG_MAX;

// Row `row`'s statistics from its logits z (V entries): m, s, t, first argmax.
template <int W, class T>
__global__ void vocab_chunk_forward_kernel(float* out, const float* in, const T* z, const int32_t* targets, int64_t N,
                                           int64_t V, int64_t v0) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp
  const T* x = z + row * V;

  // The largest entry and its first index: each lane its strided entries in order (a
  // later entry must be larger to win), then the lanes by the larger value, the smaller
  // index on a tie. That pick is a maximum of a total order, so every lane of the
  // butterfly ends with the same (value, index): the CPU's first largest logit.
  float best = -INFINITY;
  long long at = kNone;
  for (int64_t c = static_cast<int64_t>(lane) * W; c < V; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float f = to_f32(v.v[k]);
      if (at == kNone || f > best) {
        best = f;
        at = c + k;
      }
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, best, offset);
    const long long other_at = __shfl_xor_sync(0xffffffffu, at, offset);
    if (other_at != kNone && (at == kNone || other > best || (other == best && other_at < at))) {
      best = other;
      at = other_at;
    }
  }

  // An earlier chunk's maximum wins a tie (the first largest logit, as argmax).
  const float in_m = in ? in[row] : 0.0f;
  const bool earlier = in && !(best > in_m);
  const float mx = earlier ? in_m : best;
  float sum = 0.0f;
  for (int64_t c = static_cast<int64_t>(lane) * W; c < V; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) sum += exp_clamped(to_f32(v.v[k]) - mx);
  }
  sum = warp_reduce(sum, Sum{});
  if (lane != 0) return;
  const int64_t local = static_cast<int64_t>(targets[row]) - v0;
  const float own = local >= 0 && local < V ? to_f32(x[local]) : 0.0f;
  // Read all of `in` before writing `out`; rounded as the CPU's (no fused multiply-add).
  const float s = in ? __fadd_rn(__fmul_rn(in[N + row], exp_clamped(in_m - mx)), sum) : sum;
  const float t = in ? in[2 * N + row] + own : own;
  const float a = earlier ? in[3 * N + row] : static_cast<float>(v0 + at);
  out[row] = mx;
  out[N + row] = s;
  out[2 * N + row] = t;
  out[3 * N + row] = a;
}

// dz = ds e^(z - m_out), plus dt at the target; each entry of z read before its dz is
// written by the same thread, so dz may be z. Then the statistics' gradient by the row's
// lane 0.
template <int W, class T>
__global__ void vocab_chunk_backward_kernel(T* dz, float* din, const float* dout, const T* z, const float* in,
                                            const float* out, const int32_t* targets, int64_t N, int64_t V, int64_t v0,
                                            bool accumulate) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const float ds = dout[N + row], dt = dout[2 * N + row], mx = out[row];
  const int64_t local = static_cast<int64_t>(targets[row]) - v0;
  const T* x = z + row * V;
  T* d = dz + row * V;
  for (int64_t c = static_cast<int64_t>(lane) * W; c < V; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      float g = __fmul_rn(ds, exp_clamped(to_f32(v.v[k]) - mx));
      if (c + k == local) g = __fadd_rn(g, dt);
      o.v[k] = from_f32<T>(g);
    }
    store_pack<W>(d + c, o);
  }
  if (!din || lane != 0) return;
  // dm and da are zero: m is a stabiliser, the index no function of the logits' values.
  const float g[4] = {0.0f, in ? __fmul_rn(ds, exp_clamped(in[row] - mx)) : 0.0f, dt, 0.0f};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float& x_k = din[k * N + row];
    x_k = accumulate ? x_k + g[k] : g[k];
  }
}

constexpr int kLossThreads = 1024;

// One block: each thread sums a fixed stride of the rows' m + log s - t in order, in
// double, then the block's fixed tree; the sum is added to *loss_sum.
__global__ void vocab_loss_forward_kernel(double* loss_sum, const float* stats, int64_t N) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    const float lse = stats[n] + logf(stats[N + n]);  // in fp32, as the CPU's
    acc += static_cast<double>(lse) - static_cast<double>(stats[2 * N + n]);
  }
  acc = block_reduce(acc, Sum{}, 0.0, shared);
  if (threadIdx.x == 0) *loss_sum += acc;
}

// ds = scale / s (IEEE division, as the CPU's: the same bits), dt = -scale, dm = da = 0.
__global__ void vocab_loss_backward_kernel(float* dstats, const float* stats, float scale, int64_t N) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += stride) {
    dstats[n] = 0.0f;
    dstats[N + n] = scale / stats[N + n];
    dstats[2 * N + n] = -scale;
    dstats[3 * N + n] = 0.0f;
  }
}

// Blocks for one warp per row.
unsigned row_blocks(int64_t N, const char* op) {
  const int64_t blocks = ceil_div(N, kRowsPerBlock);
  MPIPE_CHECK(blocks <= INT32_MAX, op, ": ", N, " rows exceed one grid");
  return static_cast<unsigned>(blocks);
}

}  // namespace

template <class E>
void vocab_chunk_forward(float* out, const float* in, const E* z, const int32_t* targets, int64_t N, int64_t V,
                         int64_t v0) {
  if (N == 0) return;
  MPIPE_CHECK(V > 0, "vocab_chunk_forward: a chunk of ", V, " entries");
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = row_blocks(N, "vocab_chunk_forward");
  cudaStream_t stream = context().compute;
  // Packs need every row 16-byte aligned: V a multiple of the pack and z aligned.
  if (V % W == 0 && aligned(z, 16))
    vocab_chunk_forward_kernel<W><<<blocks, kThreads, 0, stream>>>(out, in, dev(z), targets, N, V, v0);
  else
    vocab_chunk_forward_kernel<1><<<blocks, kThreads, 0, stream>>>(out, in, dev(z), targets, N, V, v0);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void vocab_chunk_backward(E* dz, float* din, const float* dout, const E* z, const float* in, const float* out,
                          const int32_t* targets, int64_t N, int64_t V, int64_t v0, GradMode mode) {
  if (N == 0) return;
  MPIPE_CHECK(V > 0, "vocab_chunk_backward: a chunk of ", V, " entries");
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = row_blocks(N, "vocab_chunk_backward");
  cudaStream_t stream = context().compute;
  const bool accumulate = mode == GradMode::accumulate;
  if (V % W == 0 && all_aligned({dz, z}, 16))
    vocab_chunk_backward_kernel<W><<<blocks, kThreads, 0, stream>>>(dev(dz), din, dout, dev(z), in, out, targets, N, V,
                                                                    v0, accumulate);
  else
    vocab_chunk_backward_kernel<1><<<blocks, kThreads, 0, stream>>>(dev(dz), din, dout, dev(z), in, out, targets, N, V,
                                                                    v0, accumulate);
  CUDA_CHECK_LAUNCH();
}

void vocab_loss_forward(double* loss_sum, const float* stats, int64_t N) {
  if (N == 0 || !loss_sum) return;  // null: a recomputation, whose loss its forward counted
  vocab_loss_forward_kernel<<<1, kLossThreads, 0, context().compute>>>(loss_sum, stats, N);
  CUDA_CHECK_LAUNCH();
}

void vocab_loss_backward(float* dstats, const float* stats, float scale, int64_t N) {
  if (N == 0) return;
  vocab_loss_backward_kernel<<<blocks_for(N, kThreads), kThreads, 0, context().compute>>>(dstats, stats, scale, N);
  CUDA_CHECK_LAUNCH();
}

// ---- instantiations ------------------------------------------------------------------------

#define MPIPE_CUDA_VOCAB_OPS(E)                                                                                   \
  template void vocab_chunk_forward<E>(float*, const float*, const E*, const int32_t*, int64_t, int64_t, int64_t); \
  template void vocab_chunk_backward<E>(E*, float*, const float*, const E*, const float*, const float*,            \
                                        const int32_t*, int64_t, int64_t, int64_t, GradMode);

MPIPE_CUDA_VOCAB_OPS(float)
MPIPE_CUDA_VOCAB_OPS(bf16)
#undef MPIPE_CUDA_VOCAB_OPS

}  // namespace mpipe::cuda
