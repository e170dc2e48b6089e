// CUDA rotary position embedding (RoPE, in place over qkv's queries and keys) and SwiGLU
// (Llama's MLP gate), the CPU ops' math (src/backend/cpu/ops.cpp) element for element.
// See include/mpipe/backend/cuda/ops.hpp for the contracts. Neither sums anything across
// elements: every output is a function of its own inputs, the same bits on every run.
#include <cmath>
#include <type_traits>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// ---- RoPE --------------------------------------------------------------------------------
// A table of each position's cosines and sines first, (T, half) of each, computed as the
// CPU computes them: the angle (position + t) · theta^(-2i/hs) in double, its cos and sin
// in double, rounded to fp32. Double costs nothing here (T x hs/2 entries, once per call,
// not per head or sample), and it keeps the angle exact to fp32 at long positions, where
// an fp32 angle of thousands of radians would already be off in its third digit. CUDA's
// double pow, cos and sin are within 2 ulps of double, so the table is the CPU's to the
// last fp32 bit but in the rarest ties.
__global__ void rope_table_kernel(float* cosines, float* sines, int64_t T_, int64_t half, int64_t hs,
                                  int64_t position, double theta) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < T_ * half; e += stride) {
    const int64_t t = e / half, i = e % half;
    const double angle = static_cast<double>(position + t) *
                         pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(hs));
    cosines[e] = static_cast<float>(cos(angle));
    sines[e] = static_cast<float>(sin(angle));
  }
}

// Then a thread for W neighbouring pairs (x_i, x_{i+hs/2}), i = W j .. W j + W - 1, of one
// head of one row: the H query heads and the KVH key heads lie side by side at the row's
// start (head h at h hs), v after them is left alone. The rotation in fp32 with each
// product and the sum rounded on its own (no fused multiply-add), the CPU's expression:
// x1 cos - x2 sin, x2 cos + x1 sin; the inverse negates the sine (its rounding is the
// CPU's, -float(sin) = float(-sin)).
template <int W, class T>
__global__ void rope_apply_kernel(T* qkv, const float* cosines, const float* sines, int64_t rows, int64_t T_,
                                  int64_t heads, int64_t hs, int64_t ld, bool inverse) {
  const int64_t half = hs / 2, packs = half / W;
  const int64_t total = rows * heads * packs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < total; p += stride) {
    const int64_t j = p % packs, head = (p / packs) % heads, row = p / (packs * heads);
    const int64_t i = j * W, at = (row % T_) * half + i;  // the pack's first pair, its table entry
    T* x = qkv + row * ld + head * hs + i;
    auto lo = load_pack<W>(x);
    auto hi = load_pack<W>(x + half);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float c = cosines[at + k], s = inverse ? -sines[at + k] : sines[at + k];
      const float x1 = to_f32(lo.v[k]), x2 = to_f32(hi.v[k]);
      lo.v[k] = from_f32<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
      hi.v[k] = from_f32<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
    store_pack<W>(x, lo);
    store_pack<W>(x + half, hi);
  }
}

// ---- SwiGLU ------------------------------------------------------------------------------
// Rows of inp (N, 2F): the gate's F values, then the up projection's F. A thread for W
// neighbouring columns of one row (F % W == 0: a pack never leaves its row or its half).

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <int W, class T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t F) {
  const int64_t packs = F / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < N * packs; p += stride) {
    const int64_t row = p / packs, f = (p % packs) * W;
    const auto g = load_pack<W>(inp + row * 2 * F + f);
    const auto u = load_pack<W>(inp + row * 2 * F + F + f);
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float gate = to_f32(g.v[k]);
      o.v[k] = from_f32<T>(gate * sigmoid(gate) * to_f32(u.v[k]));  // the CPU's (g sigmoid(g)) u
    }
    store_pack<W>(out + row * F + f, o);
  }
}

// dgate = dout · up · silu'(gate), silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))); dup =
// dout · silu(gate). Accumulate: added to what dinp holds.
template <int W, bool Accumulate, class T>
__global__ void swiglu_backward_kernel(T* dinp, const T* dout, const T* inp, int64_t N, int64_t F) {
  const int64_t packs = F / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < N * packs; p += stride) {
    const int64_t row = p / packs, f = (p % packs) * W;
    const int64_t at = row * 2 * F + f;
    const auto g = load_pack<W>(inp + at);
    const auto u = load_pack<W>(inp + at + F);
    const auto dy = load_pack<W>(dout + row * F + f);
    Pack<T, W> dg, du;
    if constexpr (Accumulate) {
      dg = load_pack<W>(dinp + at);
      du = load_pack<W>(dinp + at + F);
    }
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float gate = to_f32(g.v[k]), sg = sigmoid(gate), silu = gate * sg, d = to_f32(dy.v[k]);
      const float d_gate = d * to_f32(u.v[k]) * (sg * (1.0f + gate * (1.0f - sg))), d_up = d * silu;
      dg.v[k] = from_f32<T>(Accumulate ? to_f32(dg.v[k]) + d_gate : d_gate);
      du.v[k] = from_f32<T>(Accumulate ? to_f32(du.v[k]) + d_up : d_up);
    }
    store_pack<W>(dinp + at, dg);
    store_pack<W>(dinp + at + F, du);
  }
}

}  // namespace

template <class E>
void rope_apply(E* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t position, float theta,
                bool inverse) {
  if (B == 0 || T == 0) return;
  MPIPE_CHECK(H > 0 && KVH > 0 && C % H == 0 && (C / H) % 2 == 0, "rope: ", C, " channels in ", H,
              " heads (an even head size)");
  using D = device_t<E>;
  cudaStream_t stream = context().compute;
  const int64_t hs = C / H, half = hs / 2, ld = C + 2 * KVH * hs;
  ScratchPlan plan;
  const std::size_t cos_at = plan.reserve<float>(T * half), sin_at = plan.reserve<float>(T * half);
  void* base = scratch(plan.bytes());
  auto* cosines = place<float>(base, cos_at);
  auto* sines = place<float>(base, sin_at);
  rope_table_kernel<<<blocks_for(T * half, kThreads), kThreads, 0, stream>>>(cosines, sines, T, half, hs, position,
                                                                            static_cast<double>(theta));
  CUDA_CHECK_LAUNCH();
  // Packs of pairs where half a head is whole packs (every head, both halves and every
  // row then start on a pack, the rows being hs apart) and qkv is aligned to them.
  const int width = all_aligned({qkv}, 16) ? width_for<D>(half) : 1;
  with_width<D>(width, [&](auto w) {
    constexpr int W = decltype(w)::value;
    rope_apply_kernel<W><<<blocks_for(B * T * (H + KVH) * (half / W), kThreads), kThreads, 0, stream>>>(
        dev(qkv), cosines, sines, B * T, T, H + KVH, hs, ld, inverse);
  });
  CUDA_CHECK_LAUNCH();
}

template <class E>
void swiglu_forward(E* out, const E* inp, int64_t N, int64_t F) {
  if (N == 0 || F == 0) return;
  using D = device_t<E>;
  const int width = all_aligned({out, inp}, 16) ? width_for<D>(F) : 1;
  with_width<D>(width, [&](auto w) {
    constexpr int W = decltype(w)::value;
    swiglu_forward_kernel<W><<<blocks_for(N * (F / W), kThreads), kThreads, 0, context().compute>>>(
        dev(out), dev(inp), N, F);
  });
  CUDA_CHECK_LAUNCH();
}

template <class E>
void swiglu_backward(E* dinp, const E* dout, const E* inp, int64_t N, int64_t F, GradMode mode) {
  if (N == 0 || F == 0) return;
  using D = device_t<E>;
  const int width = all_aligned({dinp, dout, inp}, 16) ? width_for<D>(F) : 1;
  with_width<D>(width, [&](auto w) {
    constexpr int W = decltype(w)::value;
    const unsigned blocks = blocks_for(N * (F / W), kThreads);
    if (mode == GradMode::accumulate)
      swiglu_backward_kernel<W, true><<<blocks, kThreads, 0, context().compute>>>(dev(dinp), dev(dout), dev(inp), N, F);
    else
      swiglu_backward_kernel<W, false><<<blocks, kThreads, 0, context().compute>>>(dev(dinp), dev(dout), dev(inp), N,
                                                                                    F);
  });
  CUDA_CHECK_LAUNCH();
}

#define MPIPE_CUDA_LLAMA_OPS(E)                                                                                   \
  template void rope_apply<E>(E*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, bool);             \
  template void swiglu_forward<E>(E*, const E*, int64_t, int64_t);                                                \
  template void swiglu_backward<E>(E*, const E*, const E*, int64_t, int64_t, GradMode);

MPIPE_CUDA_LLAMA_OPS(float)
MPIPE_CUDA_LLAMA_OPS(bf16)
#undef MPIPE_CUDA_LLAMA_OPS

}  // namespace mpipe::cuda
