// CUDA ops (all but attention, which lives in attention.cu): cuBLASLt for the GEMMs,
// our kernels for the rest. See include/mpipe/backend/cuda/ops.hpp for the contracts
// and src/backend/cpu/ops.cpp for the math each kernel mirrors.
//
// Determinism: every sum runs in an order fixed by the sizes alone. Reductions across
// rows are two-stage (fixed row chunks into scratch, then the chunks in order), and the
// only sort (embedding backward) is a stable radix sort.
#include <cub/device/device_radix_sort.cuh>

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

constexpr int64_t kMaxRowChunks = 128;
int64_t rows_per_chunk(int64_t N) { return std::max<int64_t>(16, ceil_div(N, kMaxRowChunks)); }

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

// ---- layernorm -------------------------------------------------------------------------
// One warp per row, W-element packs along the row.

constexpr float kLayerNormEps = 1e-5f;

template <int W, class T>
__global__ void layernorm_forward_kernel(T* out, float* mean, float* rstd, const T* inp, const T* weight,
                                         const T* bias, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp
  const T* x = inp + row * C;
  float sum = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) sum += to_f32(v.v[k]);
  }
  const float m = warp_reduce(sum, Sum{}) / static_cast<float>(C);
  float var = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float d = to_f32(v.v[k]) - m;
      var += d * d;
    }
  }
  var = warp_reduce(var, Sum{}) / static_cast<float>(C);
  const float s = 1.0f / sqrtf(var + kLayerNormEps);
  T* y = out + row * C;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto v = load_pack<W>(x + c);
    const auto w = load_pack<W>(weight + c);
    const auto b = load_pack<W>(bias + c);
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) o.v[k] = from_f32<T>((to_f32(v.v[k]) - m) * s * to_f32(w.v[k]) + to_f32(b.v[k]));
    store_pack<W>(y + c, o);
  }
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

template <int W, bool Accumulate, class T>
__global__ void layernorm_backward_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,
                                          const float* rstd, int64_t N, int64_t C) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  const float m = mean[row], s = rstd[row];
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto xv = load_pack<W>(x + c);
    const auto dv = load_pack<W>(dy + c);
    const auto wv = load_pack<W>(weight + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float norm = (to_f32(xv.v[k]) - m) * s;
      const float dnorm = to_f32(wv.v[k]) * to_f32(dv.v[k]);
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
  }
  dnorm_mean = warp_reduce(dnorm_mean, Sum{}) / static_cast<float>(C);
  dnorm_norm_mean = warp_reduce(dnorm_norm_mean, Sum{}) / static_cast<float>(C);
  T* dx = dinp + row * C;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto xv = load_pack<W>(x + c);
    const auto dv = load_pack<W>(dy + c);
    const auto wv = load_pack<W>(weight + c);
    Pack<T, W> o;
    if constexpr (Accumulate) o = load_pack<W>(dx + c);
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const float norm = (to_f32(xv.v[k]) - m) * s;
      const float d = (to_f32(wv.v[k]) * to_f32(dv.v[k]) - dnorm_mean - norm * dnorm_norm_mean) * s;
      o.v[k] = from_f32<T>(Accumulate ? to_f32(o.v[k]) + d : d);
    }
    store_pack<W>(dx + c, o);
  }
}

template <class T>
__global__ void layernorm_param_partials(float* partial, const T* dout, const T* inp, const float* mean,
                                         const float* rstd, int64_t N, int64_t C, int64_t chunk_rows) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t r0 = blockIdx.y * chunk_rows, r1 = std::min(N, r0 + chunk_rows);
  float dw = 0.0f, db = 0.0f;
  for (int64_t r = r0; r < r1; ++r) {
    const float dy = to_f32(dout[r * C + c]);
    dw += (to_f32(inp[r * C + c]) - mean[r]) * rstd[r] * dy;
    db += dy;
  }
  partial[(2 * blockIdx.y) * C + c] = dw;  // (chunks, 2, C)
  partial[(2 * blockIdx.y + 1) * C + c] = db;
}

__global__ void layernorm_param_finish(float* dweight, float* dbias, const float* partial, int64_t chunks, int64_t C) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float dw = 0.0f, db = 0.0f;
  for (int64_t k = 0; k < chunks; ++k) {
    dw += partial[(2 * k) * C + c];
    db += partial[(2 * k + 1) * C + c];
  }
  dweight[c] += dw;
  dbias[c] += db;
}

// ---- embedding -------------------------------------------------------------------------

template <int W, class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t BT,
                                         int64_t T_, int64_t C) {
  const int64_t packs_per_row = C / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < BT * packs_per_row;
       p += stride) {
    const int64_t row = p / packs_per_row, c = (p % packs_per_row) * W;
    const auto te = load_pack<W>(wte + static_cast<int64_t>(tokens[row]) * C + c);
    const auto pe = load_pack<W>(wpe + (row % T_) * C + c);
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) o.v[k] = from_f32<T>(to_f32(te.v[k]) + to_f32(pe.v[k]));
    store_pack<W>(out + row * C + c, o);
  }
}

__global__ void iota_kernel(int32_t* out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = static_cast<int32_t>(i);
}

// Block j owns the run of equal tokens starting at sorted position j (other blocks
// return at once) and adds its rows of dout to the token's row of dwte in position
// order, continuing from dwte's value: the CPU op's order of additions.
template <class T>
__global__ void embedding_token_grads(float* dwte, const T* dout, const uint32_t* sorted_tokens,
                                      const int32_t* sorted_positions, int64_t BT, int64_t C) {
  const int64_t j = blockIdx.x;
  const uint32_t token = sorted_tokens[j];
  if (j > 0 && sorted_tokens[j - 1] == token) return;
  float* te = dwte + static_cast<int64_t>(token) * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float acc = te[c];
    for (int64_t k = j; k < BT && sorted_tokens[k] == token; ++k)
      acc += to_f32(dout[static_cast<int64_t>(sorted_positions[k]) * C + c]);
    te[c] = acc;
  }
}

// dwpe[t, c] continues from its value over b in order.
template <class T>
__global__ void embedding_position_grads(float* dwpe, const T* dout, int64_t B, int64_t T_, int64_t C) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < T_ * C; i += stride) {
    float acc = dwpe[i];
    for (int64_t b = 0; b < B; ++b) acc += to_f32(dout[b * T_ * C + i]);
    dwpe[i] = acc;
  }
}

// ---- cross-entropy ---------------------------------------------------------------------
// One block per row; two passes over the row (max, then the sum of exponentials), as on
// the CPU.

constexpr int kRowThreads = 512;

template <class T>
__global__ void crossentropy_forward_kernel(float* lse, double* row_loss, const T* logits, const int32_t* targets,
                                            int64_t V) {
  __shared__ float shared[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * V;
  float mx = -INFINITY;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, to_f32(x[i]));
  mx = block_reduce(mx, Max{}, -INFINITY, shared);
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) sum += expf(to_f32(x[i]) - mx);
  sum = block_reduce(sum, Sum{}, 0.0f, shared);
  if (threadIdx.x == 0) {
    const float l = mx + logf(sum);
    lse[row] = l;
    row_loss[row] = static_cast<double>(l) - static_cast<double>(to_f32(x[targets[row]]));
  }
}

constexpr int kFinishThreads = 1024;

// One block: each thread sums a fixed stride of the rows in order, then the block.
__global__ void loss_finish(double* loss_sum, const double* row_loss, int64_t N) {
  __shared__ double shared[32];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) acc += row_loss[i];
  acc = block_reduce(acc, Sum{}, 0.0, shared);
  if (threadIdx.x == 0) *loss_sum += acc;
}

template <class T>
__global__ void crossentropy_backward_kernel(T* dlogits, const T* logits, const float* lse, const int32_t* targets,
                                             float scale, int64_t V) {
  const int64_t row = blockIdx.x;
  const float l = lse[row];
  const int64_t target = targets[row];
  for (int64_t i = threadIdx.x; i < V; i += blockDim.x) {
    float d = scale * expf(to_f32(logits[row * V + i]) - l);
    if (i == target) d -= scale;
    dlogits[row * V + i] = from_f32<T>(d);
  }
}

// ---- dropout ---------------------------------------------------------------------------
// Thread per group of 4 elements of one sample: one Philox block gives their 4 words.
// The words are RandomStream::block() of make_stream(seed, Stream::dropout,
// sample_begin + b, site, step), rebuilt here from the stream of sample 0: only `a`
// differs between samples.

template <bool Packed, class T>
__global__ void dropout_kernel(T* out, const T* inp, int64_t B, int64_t per_sample, uint32_t threshold,
                               float keep_scale, RandomStream first) {
  const int64_t groups = ceil_div(per_sample, 4);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < B * groups; g += stride) {
    const int64_t b = g / groups, group = g % groups;
    const auto i = static_cast<uint64_t>(group);
    const Philox4 words = philox4x32({static_cast<uint32_t>(i), first.a + static_cast<uint32_t>(b),
                                      first.b ^ static_cast<uint32_t>(i >> 32), first.c},
                                     first.key);
    const int64_t e0 = b * per_sample + 4 * group;
    if constexpr (Packed) {
      auto v = load_pack<4>(inp + e0);
#pragma unroll
      for (int k = 0; k < 4; ++k) v.v[k] = from_f32<T>(words[k] >= threshold ? to_f32(v.v[k]) * keep_scale : 0.0f);
      store_pack<4>(out + e0, v);
    } else {
      const int count = static_cast<int>(std::min<int64_t>(4, per_sample - 4 * group));
      for (int k = 0; k < count; ++k)
        out[e0 + k] = from_f32<T>(words[k] >= threshold ? to_f32(inp[e0 + k]) * keep_scale : 0.0f);
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
                             float beta1, float beta2, float eps, float inv_bias1, float inv_bias2) {
  for (int view = blockIdx.y; view < views.count; view += gridDim.y) {
    const int64_t size = views.sizes[view];
    float* p = params + views.param_offsets[view];
    const int64_t at = views.offsets[view];
    const float decay = views.weight_decay[view];
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
      const float g = grads[at + i];
      const float mi = beta1 * m[at + i] + (1.0f - beta1) * g;
      const float vi = beta2 * v[at + i] + (1.0f - beta2) * g * g;
      m[at + i] = mi;
      v[at + i] = vi;
      p[i] -= lr * (mi * inv_bias1 / (sqrtf(vi * inv_bias2) + eps) + decay * p[i]);
    }
  }
}

__global__ void sgd_kernel(float* params, const float* grads, float* velocity, ViewTable views, float lr,
                           float momentum) {
  for (int view = blockIdx.y; view < views.count; view += gridDim.y) {
    const int64_t size = views.sizes[view];
    float* p = params + views.param_offsets[view];
    const int64_t at = views.offsets[view];
    const float decay = views.weight_decay[view];
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < size; i += stride) {
      const float vel = momentum * velocity[at + i] + grads[at + i];
      velocity[at + i] = vel;
      p[i] -= lr * (vel + decay * p[i]);
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

// ---- layernorm ---------------------------------------------------------------------------

template <class E>
void layernorm_forward(E* out, float* mean, float* rstd, const E* inp, const E* weight, const E* bias, int64_t N,
                       int64_t C) {
  if (N == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  if (C % W == 0 && all_aligned({out, inp, weight, bias}, 16)) {
    layernorm_forward_kernel<W><<<blocks, kThreads, 0, context().compute>>>(dev(out), mean, rstd, dev(inp),
                                                                            dev(weight), dev(bias), N, C);
  } else {
    layernorm_forward_kernel<1><<<blocks, kThreads, 0, context().compute>>>(dev(out), mean, rstd, dev(inp),
                                                                            dev(weight), dev(bias), N, C);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, GradMode mode) {
  if (N == 0 || C == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  cudaStream_t stream = context().compute;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  const bool packed = C % W == 0 && all_aligned({dinp, dout, inp, weight}, 16);
  const bool accumulate = mode == GradMode::accumulate;
  const auto launch = [&](auto width, auto accumulating) {
    layernorm_backward_kernel<decltype(width)::value, decltype(accumulating)::value>
        <<<blocks, kThreads, 0, stream>>>(dev(dinp), dev(dout), dev(inp), dev(weight), mean, rstd, N, C);
  };
  if (packed && accumulate) launch(std::integral_constant<int, W>{}, std::true_type{});
  else if (packed) launch(std::integral_constant<int, W>{}, std::false_type{});
  else if (accumulate) launch(std::integral_constant<int, 1>{}, std::true_type{});
  else launch(std::integral_constant<int, 1>{}, std::false_type{});
  CUDA_CHECK_LAUNCH();

  const int64_t chunk_rows = rows_per_chunk(N), chunks = ceil_div(N, chunk_rows);
  auto* partial = static_cast<float*>(scratch(static_cast<std::size_t>(2 * chunks * C) * sizeof(float)));
  const dim3 grid(static_cast<unsigned>(ceil_div(C, kThreads)), static_cast<unsigned>(chunks));
  layernorm_param_partials<<<grid, kThreads, 0, stream>>>(partial, dev(dout), dev(inp), mean, rstd, N, C,
                                                          chunk_rows);
  CUDA_CHECK_LAUNCH();
  layernorm_param_finish<<<static_cast<unsigned>(ceil_div(C, kThreads)), kThreads, 0, stream>>>(dweight, dbias,
                                                                                               partial, chunks, C);
  CUDA_CHECK_LAUNCH();
}

// ---- embedding ---------------------------------------------------------------------------

template <class E>
void embedding_forward(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t B, int64_t T, int64_t C,
                       int64_t) {
  const int64_t BT = B * T;
  if (BT == 0 || C == 0) return;
  using D = device_t<E>;
  constexpr int W = pack_width<D>;
  cudaStream_t stream = context().compute;
  if (C % W == 0 && all_aligned({out, wte, wpe}, 16)) {
    embedding_forward_kernel<W><<<blocks_for(BT * C / W, kThreads), kThreads, 0, stream>>>(
        dev(out), tokens, dev(wte), dev(wpe), BT, T, C);
  } else {
    embedding_forward_kernel<1><<<blocks_for(BT * C, kThreads), kThreads, 0, stream>>>(dev(out), tokens, dev(wte),
                                                                                     dev(wpe), BT, T, C);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void embedding_backward(float* dwte, float* dwpe, const E* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V) {
  const int64_t BT = B * T;
  if (BT == 0 || C == 0) return;
  MPIPE_CHECK(BT <= INT32_MAX, "embedding_backward: ", BT, " positions do not fit the sort's int32 indices");
  cudaStream_t stream = context().compute;
  const int n = static_cast<int>(BT);
  int key_bits = 1;  // tokens are < V, so the sort needs only the low bits
  while (key_bits < 32 && (int64_t{1} << key_bits) < V) ++key_bits;
  // Tokens are non-negative, so they sort as unsigned keys.
  const auto* keys_in = reinterpret_cast<const uint32_t*>(tokens);

  std::size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, keys_in, static_cast<uint32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), n,
                                             0, key_bits, stream));
  ScratchPlan plan;
  const std::size_t positions_at = plan.reserve<int32_t>(BT);
  const std::size_t sorted_positions_at = plan.reserve<int32_t>(BT);
  const std::size_t sorted_tokens_at = plan.reserve<uint32_t>(BT);
  const std::size_t sort_at = plan.reserve<char>(static_cast<int64_t>(sort_bytes));
  void* base = scratch(plan.bytes());
  auto* positions = place<int32_t>(base, positions_at);
  auto* sorted_positions = place<int32_t>(base, sorted_positions_at);
  auto* sorted_tokens = place<uint32_t>(base, sorted_tokens_at);

  iota_kernel<<<blocks_for(BT, kThreads), kThreads, 0, stream>>>(positions, BT);
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(place<char>(base, sort_at), sort_bytes, keys_in, sorted_tokens,
                                             positions, sorted_positions, n, 0, key_bits, stream));
  embedding_token_grads<<<static_cast<unsigned>(BT), kThreads, 0, stream>>>(dwte, dev(dout), sorted_tokens,
                                                                            sorted_positions, BT, C);
  CUDA_CHECK_LAUNCH();
  embedding_position_grads<<<blocks_for(T * C, kThreads), kThreads, 0, stream>>>(dwpe, dev(dout), B, T, C);
  CUDA_CHECK_LAUNCH();
}

// ---- cross-entropy -----------------------------------------------------------------------

template <class E>
void crossentropy_forward(float* lse, double* loss_sum, const E* logits, const int32_t* targets, int64_t N,
                          int64_t V) {
  if (N == 0) return;
  MPIPE_CHECK(N <= INT32_MAX, "crossentropy_forward: ", N, " rows exceed one grid");
  cudaStream_t stream = context().compute;
  auto* row_loss = static_cast<double*>(scratch(static_cast<std::size_t>(N) * sizeof(double)));
  crossentropy_forward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(lse, row_loss, dev(logits),
                                                                                   targets, V);
  CUDA_CHECK_LAUNCH();
  if (loss_sum) {  // null for a recomputation, whose loss was counted in its forward
    loss_finish<<<1, kFinishThreads, 0, stream>>>(loss_sum, row_loss, N);
    CUDA_CHECK_LAUNCH();
  }
}

template <class E>
void crossentropy_backward(E* dlogits, const E* logits, const float* lse, const int32_t* targets, float scale,
                           int64_t N, int64_t V) {
  if (N == 0) return;
  MPIPE_CHECK(N <= INT32_MAX, "crossentropy_backward: ", N, " rows exceed one grid");
  crossentropy_backward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, context().compute>>>(
      dev(dlogits), dev(logits), lse, targets, scale, V);
  CUDA_CHECK_LAUNCH();
}

// ---- dropout -----------------------------------------------------------------------------

template <class E>
void dropout_apply(E* out, const E* inp, int64_t B, int64_t per_sample, float p, const DropoutKey& key) {
  if (B == 0 || per_sample == 0) return;
  // Exactly the CPU op's threshold and scale.
  const float keep_scale = 1.0f / (1.0f - p);
  const auto threshold = static_cast<uint32_t>(std::min(4294967295.0, std::ldexp(static_cast<double>(p), 32)));
  const RandomStream first = make_stream(key.seed, Stream::dropout, static_cast<uint32_t>(key.sample_begin),
                                         key.site, static_cast<uint32_t>(key.step));
  const int64_t groups = B * ceil_div(per_sample, 4);
  cudaStream_t stream = context().compute;
  using T = device_t<E>;
  if (per_sample % 4 == 0 && all_aligned({out, inp}, 4 * sizeof(T))) {
    dropout_kernel<true><<<blocks_for(groups, kThreads), kThreads, 0, stream>>>(dev(out), dev(inp), B, per_sample,
                                                                                threshold, keep_scale, first);
  } else {
    dropout_kernel<false><<<blocks_for(groups, kThreads), kThreads, 0, stream>>>(dev(out), dev(inp), B, per_sample,
                                                                                 threshold, keep_scale, first);
  }
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
                  float beta1, float beta2, float eps, int64_t step) {
  if (views.count == 0 || views.largest == 0) return;
  // As the CPU op computes them.
  const float inv_bias1 = 1.0f / (1.0f - std::pow(beta1, static_cast<float>(step)));
  const float inv_bias2 = 1.0f / (1.0f - std::pow(beta2, static_cast<float>(step)));
  adamw_kernel<<<view_grid(views), kThreads, 0, context().compute>>>(params, grads, m, v, views, lr, beta1, beta2,
                                                                     eps, inv_bias1, inv_bias2);
  CUDA_CHECK_LAUNCH();
}

void sgd_update(float* params, const float* grads, float* velocity, const ViewTable& views, float lr,
                float momentum) {
  if (views.count == 0 || views.largest == 0) return;
  sgd_kernel<<<view_grid(views), kThreads, 0, context().compute>>>(params, grads, velocity, views, lr, momentum);
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
  template void layernorm_forward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t);         \
  template void layernorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,             \
                                      const float*, int64_t, int64_t, GradMode);                                  \
  template void embedding_forward<E>(E*, const int32_t*, const E*, const E*, int64_t, int64_t, int64_t, int64_t); \
  template void embedding_backward<E>(float*, float*, const E*, const int32_t*, int64_t, int64_t, int64_t,        \
                                      int64_t);                                                                   \
  template void crossentropy_forward<E>(float*, double*, const E*, const int32_t*, int64_t, int64_t);             \
  template void crossentropy_backward<E>(E*, const E*, const float*, const int32_t*, float, int64_t, int64_t);    \
  template void dropout_apply<E>(E*, const E*, int64_t, int64_t, float, const DropoutKey&);                       \
  template void add<E>(E*, const E*, int64_t);                                                                    \
  template void copy<E>(E*, const E*, int64_t);                                                                   \
  template void scale<E>(E*, float, int64_t);

MPIPE_CUDA_OPS(float)
MPIPE_CUDA_OPS(bf16)
#undef MPIPE_CUDA_OPS

}  // namespace mpipe::cuda
