// CUDA ops: cuBLASLt for the GEMMs, our kernels for the elementwise maps, dropout,
// norms and optimizers (the per-row ops are in rows.cu, attention in attention.cu). See include/mpipe/backend/cuda/ops.hpp for the contracts
// and src/backend/cpu/ops.cpp for the math each kernel mirrors.
//
// Determinism: every sum runs in an order fixed by the sizes alone. Reductions across
// rows are two-stage (fixed row chunks into scratch, then the chunks in order), and the
// only sort (embedding backward) is a stable radix sort.
#include <cmath>
#include <type_traits>

#include "gemm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"
#include "mpipe/core/rng.hpp"

namespace mpipe::cuda {

namespace {

// ---- elementwise maps ----------------------------------------------------------------
// out[i] = f(a[i], b[i], out[i]) for the operands f declares (F::arity inputs, and out
// when F::reads_out), in packs of up to 16 bytes where every pointer allows it.

template <class TOut, class TIn, class F>
struct Map {
  static constexpr int width = pack_width<std::conditional_t<(sizeof(TOut) > sizeof(TIn)), TOut, TIn>>;
  TOut* out;
  const TIn* a;
  const TIn* b;
  F f;

  template <int W>
  __device__ void apply(int64_t i) const {
    Pack<TIn, W> va{}, vb{};
    Pack<TOut, W> vo{};
    if constexpr (F::arity >= 1) va = load_pack<W>(a + i);
    if constexpr (F::arity >= 2) vb = load_pack<W>(b + i);
    if constexpr (F::reads_out) vo = load_pack<W>(out + i);
#pragma unroll
    for (int k = 0; k < W; ++k) vo.v[k] = from_f32<TOut>(f(to_f32(va.v[k]), to_f32(vb.v[k]), to_f32(vo.v[k])));
    store_pack<W>(out + i, vo);
  }
};

template <int W, class Op>
__global__ void elementwise_kernel(Op op, int64_t n) {
  const int64_t packs = n / W;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = first; p < packs; p += stride) op.template apply<W>(p * W);
  if constexpr (W > 1) {
    const int64_t tail = packs * W + first;  // fewer than W elements, one per thread
    if (tail < n) op.template apply<1>(tail);
  }
}

template <class TOut, class TIn, class F>
void map_elements(TOut* out, const TIn* a, const TIn* b, int64_t n, F f) {
  if (n == 0) return;
  const Map<device_t<TOut>, device_t<TIn>, F> op{dev(out), dev(a), dev(b), f};
  constexpr int W = decltype(op)::width;
  if (all_aligned({out, a, b}, 16)) {
    elementwise_kernel<W><<<blocks_for(ceil_div(n, W), kThreads), kThreads, 0, context().compute>>>(op, n);
  } else {
    elementwise_kernel<1><<<blocks_for(n, kThreads), kThreads, 0, context().compute>>>(op, n);
  }
  CUDA_CHECK_LAUNCH();
}

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
  const float u = kGeluScale * (x + 0.044715f * x * x * x);
  const float th = tanhf(u);
  const float sech2 = 1.0f - th * th;
  return 0.5f * (1.0f + th) + 0.5f * x * sech2 * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

struct ReluF {
  static constexpr int arity = 1;
  static constexpr bool reads_out = false;
  __device__ float operator()(float x, float, float) const { return x < 0.0f ? 0.0f : x; }  // NaN passes
};
template <bool Accumulate>
struct ReluBackwardF {  // a = dout, b = out
  static constexpr int arity = 2;
  static constexpr bool reads_out = Accumulate;
  __device__ float operator()(float dout, float out, float old) const {
    const float d = out > 0.0f ? dout : 0.0f;
    return Accumulate ? old + d : d;
  }
};
struct GeluF {
  static constexpr int arity = 1;
  static constexpr bool reads_out = false;
  __device__ float operator()(float x, float, float) const { return gelu(x); }
};
template <bool Accumulate>
struct GeluBackwardF {  // a = dout, b = inp
  static constexpr int arity = 2;
  static constexpr bool reads_out = Accumulate;
  __device__ float operator()(float dout, float x, float old) const {
    const float d = gelu_grad(x) * dout;
    return Accumulate ? old + d : d;
  }
};
struct AddF {
  static constexpr int arity = 1;
  static constexpr bool reads_out = true;
  __device__ float operator()(float x, float, float y) const { return y + x; }
};
struct ScaleF {
  static constexpr int arity = 0;
  static constexpr bool reads_out = true;
  float factor;
  __device__ float operator()(float, float, float y) const { return y * factor; }
};
struct IdentityF {
  static constexpr int arity = 1;
  static constexpr bool reads_out = false;
  __device__ float operator()(float x, float, float) const { return x; }
};

// ---- column sums over rows (dbias, LayerNorm dweight/dbias) ----------------------------
// Stage 1: each thread owns one column of one chunk of rows and sums it in row order;
// stage 2 adds the chunks in order. The chunking depends on N alone.


template <class T>
__global__ void column_sum_partials(float* partial, const T* x, int64_t N, int64_t C, int64_t chunk_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * chunk_rows, r1 = std::min(N, r0 + chunk_rows);
  float acc = 0.0f;
  for (int64_t r = r0; r < r1; ++r) acc += to_f32(x[r * C + c]);
  partial[blockIdx.y * C + c] = acc;  // (chunks, C)
}

__global__ void column_sum_finish(float* out, const float* partial, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float acc = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) acc += partial[k * C + c];
  out[c] += acc;
}

// ---- dropout ---------------------------------------------------------------------------
// Thread per group of 4 elements of one sample: one Philox block gives their 4 words
// (dropout_words, kernels.cuh).

template <bool Packed, class T>
__global__ void dropout_kernel(T* out, const T* inp, int64_t B, int64_t per_sample, DropoutRule rule,
                               RandomStream first) {
  const int64_t groups = ceil_div(per_sample, 4);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < B * groups; g += stride) {
    const int64_t b = g / groups, group = g % groups;
    const Philox4 words = dropout_words(first, b, group);
    const int64_t e0 = b * per_sample + 4 * group;
    if constexpr (Packed) {
      auto v = load_pack<4>(inp + e0);
#pragma unroll
      for (int k = 0; k < 4; ++k)
        v.v[k] = from_f32<T>(words[k] >= rule.threshold ? to_f32(v.v[k]) * rule.keep_scale : 0.0f);
      store_pack<4>(out + e0, v);
    } else {
      const int count = static_cast<int>(std::min<int64_t>(4, per_sample - 4 * group));
      for (int k = 0; k < count; ++k)
        out[e0 + k] = from_f32<T>(words[k] >= rule.threshold ? to_f32(inp[e0 + k]) * rule.keep_scale : 0.0f);
    }
  }
}

// out = base + dropout(branch), as dropout_kernel then AddF: the dropped value rounded to
// T, then the sum. Without Drop, base + branch.
template <bool Packed, bool Drop, class T>
__global__ void add_dropped_kernel(T* out, const T* base, const T* branch, int64_t B, int64_t per_sample,
                                   DropoutRule rule, RandomStream first) {
  const int64_t groups = ceil_div(per_sample, 4);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < B * groups; g += stride) {
    const int64_t b = g / groups, group = g % groups;
    Philox4 words{};
    if constexpr (Drop) words = dropout_words(first, b, group);
    const int64_t e0 = b * per_sample + 4 * group;
    const auto one = [&](float x, float r, int k) {
      const float d = Drop ? dropped<T>(x, words[k], rule.threshold, rule.keep_scale) : x;
      return from_f32<T>(d + r);
    };
    if constexpr (Packed) {
      auto v = load_pack<4>(branch + e0);
      const auto r = load_pack<4>(base + e0);
#pragma unroll
      for (int k = 0; k < 4; ++k) v.v[k] = one(to_f32(v.v[k]), to_f32(r.v[k]), k);
      store_pack<4>(out + e0, v);
    } else {
      const int count = static_cast<int>(std::min<int64_t>(4, per_sample - 4 * group));
      for (int k = 0; k < count; ++k) out[e0 + k] = one(to_f32(branch[e0 + k]), to_f32(base[e0 + k]), k);
    }
  }
}

// ---- sum of squares ----------------------------------------------------------------------
// Each span is cut into kSlices equal slices (by its size alone); a block sums one slice
// in double, then the slices are added in order.

constexpr int kSlices = 64;
constexpr unsigned kMaxGridY = 65535;

__global__ void sum_squares_partials(double* partial, const float* x, const int64_t* offsets, const int64_t* sizes,
                                     int count) {
  __shared__ double shared[32];
  for (int span = blockIdx.y; span < count; span += gridDim.y) {
    const int64_t size = sizes[span];
    const int64_t per = ceil_div(size, kSlices);
    const int64_t begin = blockIdx.x * per, end = std::min(size, begin + per);
    const float* p = x + offsets[span];
    double acc = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) acc += static_cast<double>(p[i]) * p[i];
    acc = block_reduce(acc, Sum{}, 0.0, shared);
    if (threadIdx.x == 0) partial[static_cast<int64_t>(span) * kSlices + blockIdx.x] = acc;
  }
}

__global__ void sum_squares_finish(double* out, const double* partial, int count) {
  const int span = blockIdx.x * blockDim.x + threadIdx.x;
  if (span >= count) return;
  double acc = 0.0;
  for (int k = 0; k < kSlices; ++k) acc += partial[static_cast<int64_t>(span) * kSlices + k];
  out[span] = acc;
}

// ---- optimizers --------------------------------------------------------------------------
// blockIdx.y walks the views, blockIdx.x and the threads the view's elements.

constexpr int64_t kMaxBlocksPerView = 256;

__global__ void adamw_kernel(float* params, const float* grads, float* m, float* v, ViewTable views, float lr,
                             float beta1, float beta2, float eps, float inv_bias1, float inv_bias2,
                             __nv_bfloat16* copy) {
  for (int view = blockIdx.y; view < views.count; view += gridDim.y) {
    const int64_t size = views.sizes[view];
    float* p = params + views.param_offsets[view];
    __nv_bfloat16* c = copy ? copy + views.param_offsets[view] : nullptr;
    const int64_t at = views.offsets[view], state = views.state_offsets[view];
    const float decay = views.weight_decay[view];
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
      const float g = grads[at + i];
      const float mi = beta1 * m[state + i] + (1.0f - beta1) * g;
      const float vi = beta2 * v[state + i] + (1.0f - beta2) * g * g;
      m[state + i] = mi;
      v[state + i] = vi;
      p[i] -= lr * (mi * inv_bias1 / (sqrtf(vi * inv_bias2) + eps) + decay * p[i]);
      if (c) c[i] = __float2bfloat16_rn(p[i]);
    }
  }
}

__global__ void sgd_kernel(float* params, const float* grads, float* velocity, ViewTable views, float lr,
                           float momentum, __nv_bfloat16* copy) {
  for (int view = blockIdx.y; view < views.count; view += gridDim.y) {
    const int64_t size = views.sizes[view];
    float* p = params + views.param_offsets[view];
    __nv_bfloat16* c = copy ? copy + views.param_offsets[view] : nullptr;
    const int64_t at = views.offsets[view], state = views.state_offsets[view];
    const float decay = views.weight_decay[view];
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
      const float vel = momentum * velocity[state + i] + grads[at + i];
      velocity[state + i] = vel;
      p[i] -= lr * (vel + decay * p[i]);
      if (c) c[i] = __float2bfloat16_rn(p[i]);
    }
  }
}

dim3 view_grid(const ViewTable& views) {
  return dim3(static_cast<unsigned>(std::min(ceil_div(views.largest, kThreads), kMaxBlocksPerView)),
              std::min(static_cast<unsigned>(views.count), kMaxGridY));
}

}  // namespace

// ---- matmul ------------------------------------------------------------------------------

template <class E>
void matmul_forward(E* out, const E* inp, const E* weight, const E* bias, int64_t N, int64_t C, int64_t OC) {
  if (N == 0 || OC == 0) return;
  Gemm g;
  g.M = N, g.N = OC, g.K = C;
  g.a = inp, g.lda = C;
  g.b = weight, g.ldb = C, g.trans_b = true;
  g.c = out, g.ldc = OC;
  g.ab_type = g.c_type = data_type<E>();
  g.bias = bias;
  gemm(g);
}

template <class E>
void matmul_gelu_forward(E* out, E* pre, const E* inp, const E* weight, const E* bias, int64_t N, int64_t C,
                         int64_t OC) {
  if (N == 0 || OC == 0) return;
  // The fused epilogue only for bf16: cuBLASLt's GELU is the tanh form, but its tanh is
  // not documented to be exact, and fp32 results must match the CPU to ~1e-6. Its
  // pre-activation buffer needs a leading dimension divisible by 8.
  if constexpr (std::is_same_v<E, bf16>) {
    if (OC % 8 == 0) {
      Gemm g;
      g.M = N, g.N = OC, g.K = C;
      g.a = inp, g.lda = C;
      g.b = weight, g.ldb = C, g.trans_b = true;
      g.c = out, g.ldc = OC;
      g.ab_type = g.c_type = data_type<E>();
      g.bias = bias;
      g.gelu_pre = pre;
      if (try_gemm(g)) return;
    }
  }
  matmul_forward(pre, inp, weight, bias, N, C, OC);
  gelu_forward(out, pre, N * OC);
}

template <class E>
void matmul_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight, int64_t N,
                     int64_t C, int64_t OC, GradMode mode) {
  if (N == 0 || C == 0 || OC == 0) return;
  if (dinp) {
    // dinp (N, C) = dout (N, OC) · weight (OC, C)
    Gemm g;
    g.M = N, g.N = C, g.K = OC;
    g.a = dout, g.lda = OC;
    g.b = weight, g.ldb = C;
    g.c = dinp, g.ldc = C;
    g.ab_type = g.c_type = data_type<E>();
    g.beta = mode == GradMode::accumulate ? 1.0f : 0.0f;
    gemm(g);
  }
  if (!dweight) return;  // split backward: the input gradient alone
  {
    // dweight (OC, C) += dout^T (OC, N) · inp (N, C), in fp32 whatever E is
    Gemm g;
    g.M = OC, g.N = C, g.K = N;
    g.a = dout, g.lda = OC, g.trans_a = true;
    g.b = inp, g.ldb = C;
    g.c = dweight, g.ldc = C;
    g.ab_type = data_type<E>();
    g.c_type = CUDA_R_32F;
    g.beta = 1.0f;
    gemm(g);
  }
  if (dbias) {
    const int64_t chunk_rows = rows_per_chunk(N), chunks = ceil_div(N, chunk_rows);
    auto* partial = static_cast<float*>(scratch(static_cast<std::size_t>(chunks * OC) * sizeof(float)));
    const dim3 grid(static_cast<unsigned>(ceil_div(OC, kThreads)), static_cast<unsigned>(chunks));
    column_sum_partials<<<grid, kThreads, 0, context().compute>>>(partial, dev(dout), N, OC, chunk_rows);
    CUDA_CHECK_LAUNCH();
    column_sum_finish<<<static_cast<unsigned>(ceil_div(OC, kThreads)), kThreads, 0, context().compute>>>(
        dbias, partial, chunks, OC);
    CUDA_CHECK_LAUNCH();
  }
}

// ---- activations -------------------------------------------------------------------------

template <class E>
void relu_forward(E* out, const E* inp, int64_t n) {
  map_elements(out, inp, inp, n, ReluF{});
}

template <class E>
void relu_backward(E* dinp, const E* dout, const E* out, int64_t n, GradMode mode) {
  if (mode == GradMode::accumulate) map_elements(dinp, dout, out, n, ReluBackwardF<true>{});
  else map_elements(dinp, dout, out, n, ReluBackwardF<false>{});
}

template <class E>
void gelu_forward(E* out, const E* inp, int64_t n) {
  map_elements(out, inp, inp, n, GeluF{});
}

template <class E>
void gelu_backward(E* dinp, const E* dout, const E* inp, int64_t n, GradMode mode) {
  if (mode == GradMode::accumulate) map_elements(dinp, dout, inp, n, GeluBackwardF<true>{});
  else map_elements(dinp, dout, inp, n, GeluBackwardF<false>{});
}

// ---- dropout -----------------------------------------------------------------------------

template <class E>
void dropout_apply(E* out, const E* inp, int64_t B, int64_t per_sample, float p, const DropoutKey& key) {
  if (B == 0 || per_sample == 0) return;
  const RandomStream first = first_dropout_stream(key);
  const int64_t groups = B * ceil_div(per_sample, 4);
  cudaStream_t stream = context().compute;
  using T = device_t<E>;
  const DropoutRule rule(p);  // exactly the CPU op's threshold and scale
  if (per_sample % 4 == 0 && all_aligned({out, inp}, 4 * sizeof(T))) {
    dropout_kernel<true><<<blocks_for(groups, kThreads), kThreads, 0, stream>>>(dev(out), dev(inp), B, per_sample,
                                                                                rule, first);
  } else {
    dropout_kernel<false><<<blocks_for(groups, kThreads), kThreads, 0, stream>>>(dev(out), dev(inp), B, per_sample,
                                                                                 rule, first);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void add_dropped(E* out, const E* base, const E* branch, int64_t B, int64_t per_sample, float p,
                 const DropoutKey& key) {
  if (B == 0 || per_sample == 0) return;
  const RandomStream first = first_dropout_stream(key);
  const int64_t groups = B * ceil_div(per_sample, 4);
  using T = device_t<E>;
  const bool packed = per_sample % 4 == 0 && all_aligned({out, base, branch}, 4 * sizeof(T));
  const auto launch = [&](auto packing, auto dropping) {
    add_dropped_kernel<decltype(packing)::value, decltype(dropping)::value>
        <<<blocks_for(groups, kThreads), kThreads, 0, context().compute>>>(dev(out), dev(base), dev(branch), B,
                                                                          per_sample, DropoutRule(p), first);
  };
  if (packed && p > 0.0f) launch(std::true_type{}, std::true_type{});
  else if (packed) launch(std::true_type{}, std::false_type{});
  else if (p > 0.0f) launch(std::false_type{}, std::true_type{});
  else launch(std::false_type{}, std::false_type{});
  CUDA_CHECK_LAUNCH();
}

// ---- elementwise and reductions ------------------------------------------------------------

template <class E>
void add(E* y, const E* x, int64_t n) {
  map_elements(y, x, x, n, AddF{});
}

template <class E>
void copy(E* y, const E* x, int64_t n) {
  if (n == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(y, x, static_cast<std::size_t>(n) * sizeof(E), cudaMemcpyDeviceToDevice,
                             context().compute));
}

template <class E>
void scale(E* y, float factor, int64_t n) {
  map_elements(y, y, y, n, ScaleF{factor});
}

void convert(bf16* y, const float* x, int64_t n) { map_elements(y, x, x, n, IdentityF{}); }
void convert(float* y, const bf16* x, int64_t n) { map_elements(y, x, x, n, IdentityF{}); }

void sum_squares(double* out, const float* x, const int64_t* offsets, const int64_t* sizes, int count) {
  if (count == 0) return;
  cudaStream_t stream = context().compute;
  auto* partial = static_cast<double*>(scratch(static_cast<std::size_t>(count) * kSlices * sizeof(double)));
  const dim3 grid(kSlices, std::min(static_cast<unsigned>(count), kMaxGridY));
  sum_squares_partials<<<grid, kThreads, 0, stream>>>(partial, x, offsets, sizes, count);
  CUDA_CHECK_LAUNCH();
  sum_squares_finish<<<static_cast<unsigned>(ceil_div(count, kThreads)), kThreads, 0, stream>>>(out, partial, count);
  CUDA_CHECK_LAUNCH();
}

// ---- optimizers ----------------------------------------------------------------------------

void adamw_update(float* params, const float* grads, float* m, float* v, const ViewTable& views, float lr,
                  float beta1, float beta2, float eps, int64_t step, bf16* copy) {
  if (views.count == 0 || views.largest == 0) return;
  // As the CPU op computes them.
  const float inv_bias1 = 1.0f / (1.0f - std::pow(beta1, static_cast<float>(step)));
  const float inv_bias2 = 1.0f / (1.0f - std::pow(beta2, static_cast<float>(step)));
  adamw_kernel<<<view_grid(views), kThreads, 0, context().compute>>>(params, grads, m, v, views, lr, beta1, beta2,
                                                                     eps, inv_bias1, inv_bias2, dev(copy));
  CUDA_CHECK_LAUNCH();
}

void sgd_update(float* params, const float* grads, float* velocity, const ViewTable& views, float lr,
                float momentum, bf16* copy) {
  if (views.count == 0 || views.largest == 0) return;
  sgd_kernel<<<view_grid(views), kThreads, 0, context().compute>>>(params, grads, velocity, views, lr, momentum,
                                                                   dev(copy));
  CUDA_CHECK_LAUNCH();
}

// ---- instantiations ------------------------------------------------------------------------

#define MPIPE_CUDA_OPS(E)                                                                                         \
  template void matmul_forward<E>(E*, const E*, const E*, const E*, int64_t, int64_t, int64_t);                   \
  template void matmul_gelu_forward<E>(E*, E*, const E*, const E*, const E*, int64_t, int64_t, int64_t);          \
  template void matmul_backward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t, int64_t,   \
                                   GradMode);                                                                     \
  template void relu_forward<E>(E*, const E*, int64_t);                                                           \
  template void relu_backward<E>(E*, const E*, const E*, int64_t, GradMode);                                      \
  template void gelu_forward<E>(E*, const E*, int64_t);                                                           \
  template void gelu_backward<E>(E*, const E*, const E*, int64_t, GradMode);                                      \
  template void dropout_apply<E>(E*, const E*, int64_t, int64_t, float, const DropoutKey&);                       \
  template void add_dropped<E>(E*, const E*, const E*, int64_t, int64_t, float, const DropoutKey&);               \
  template void add<E>(E*, const E*, int64_t);                                                                    \
  template void copy<E>(E*, const E*, int64_t);                                                                   \
  template void scale<E>(E*, float, int64_t);

MPIPE_CUDA_OPS(float)
MPIPE_CUDA_OPS(bf16)
#undef MPIPE_CUDA_OPS

}  // namespace mpipe::cuda
