// CUDA per-row ops: LayerNorm, the token and position embedding, and cross-entropy over
// logits (RMSNorm is in rmsnorm.cu, sharing rows.cuh's residual sum). See
// include/mpipe/backend/cuda/ops.hpp for the contracts and src/backend/cpu/ops.cpp for
// the math each kernel mirrors.
//
// Determinism: every sum runs in an order fixed by the sizes alone. Reductions across
// rows are two-stage (fixed row chunks into scratch, then the chunks in order), and the
// only sort (embedding backward) is a stable radix sort.
#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <type_traits>

#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"
#include "rows.cuh"

namespace mpipe::cuda {

namespace {

// ---- layernorm -------------------------------------------------------------------------
// One warp per row, W-element packs along the row.

constexpr float kLayerNormEps = 1e-5f;

// LayerNorm of row `row` (x, C elements) once each lane has summed its elements (packs
// of W at lane W, then 32 W on): the mean, the variance, y and the statistics.
template <int W, class T>
__device__ __forceinline__ void layernorm_row(T* y, float* mean, float* rstd, const T* x, const T* weight,
                                              const T* bias, int64_t C, int64_t row, int lane, float sum) {
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
  layernorm_row<W>(out + row * C, mean, rstd, x, weight, bias, C, row, lane, sum);
}

// The residual sum first (residual_sum_row, rows.cuh), then the LayerNorm of the row,
// which reads back what this lane stored.
template <int W, bool Drop, class T>
__global__ void residual_layernorm_forward_kernel(T* out, float* mean, float* rstd, T* sum_io, const T* residual,
                                                  const T* weight, const T* bias, int64_t N, int64_t C,
                                                  int64_t rows_per_sample, DropoutRule rule, RandomStream first,
                                                  bool residual_packed) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= N) return;  // the whole warp
  T* x = sum_io + row * C;
  const float sum = residual_sum_row<W, Drop>(x, residual + row * C, C, row, rows_per_sample, lane, rule, first,
                                              residual_packed, ValueSum{});
  layernorm_row<W>(out + row * C, mean, rstd, x, weight, bias, C, row, lane, sum);
}

// Accumulate: dinp = base + the gradient, base being dinp itself (accumulate mode) or a
// residual (the same additions as copying it into dinp first).
template <int W, bool Accumulate, class T>
__global__ void layernorm_backward_kernel(T* dinp, const T* dout, const T* inp, const T* weight, const float* mean,
                                          const float* rstd, int64_t N, int64_t C, const T* base,
                                          bool base_packed) {
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
  const T* from = Accumulate ? base + row * C : nullptr;
  for (int64_t c = lane * W; c < C; c += 32 * W) {
    const auto xv = load_pack<W>(x + c);
    const auto dv = load_pack<W>(dy + c);
    const auto wv = load_pack<W>(weight + c);
    Pack<T, W> o;
    if constexpr (Accumulate) o = load_run<W>(from + c, base_packed);
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

// With Drop, dropout_kernel's mask after the sum: element e = t C + c of sample b (row
// b T + t) takes word e % 4 of Philox block e / 4, the sum rounded to T before it is
// scaled (the bits of the two kernels in turn). wpe null (no position table: RoPE
// rotates inside attention): the token's row as it is, the CPU's copy (te + 0 would turn
// a -0 into +0).
template <int W, bool Drop, class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const T* wte, const T* wpe, int64_t BT,
                                         int64_t T_, int64_t C, DropoutRule rule, RandomStream first) {
  const int64_t packs_per_row = C / W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < BT * packs_per_row;
       p += stride) {
    const int64_t row = p / packs_per_row, c = (p % packs_per_row) * W;
    const auto te = load_pack<W>(wte + static_cast<int64_t>(tokens[row]) * C + c);
    Pack<T, W> pe{};
    if (wpe) pe = load_pack<W>(wpe + (row % T_) * C + c);
    const int64_t b = row / T_, e0 = (row % T_) * C + c;  // the pack's first element in its sample
    Philox4 words{};
    Pack<T, W> o;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      o.v[k] = wpe ? from_f32<T>(to_f32(te.v[k]) + to_f32(pe.v[k])) : te.v[k];
      if constexpr (Drop && W >= 4) {  // C and c multiples of W: the pack starts a group
        if (k % 4 == 0) words = dropout_words(first, b, (e0 + k) / 4);
        o.v[k] = from_f32<T>(dropped<T>(to_f32(o.v[k]), words[k % 4], rule.threshold, rule.keep_scale));
      } else if constexpr (Drop) {
        words = dropout_words(first, b, (e0 + k) / 4);
        o.v[k] = from_f32<T>(dropped<T>(to_f32(o.v[k]), words[(e0 + k) % 4], rule.threshold, rule.keep_scale));
      }
    }
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

// A thread per position of planes (outer, V, plane), its classes plane apart: the
// maximum, then the exponentials summed in class order (the CPU's 16 running sums and
// exp_clamped give other bits; the cuda tests compare within tolerance).
template <class T>
__global__ void crossentropy_planes_forward_kernel(float* lse, double* row_loss, const T* logits,
                                                   const int32_t* targets, int64_t outer, int64_t V, int64_t plane) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= outer * plane) return;
  const T* x = logits + (row / plane) * V * plane + row % plane;
  float mx = to_f32(x[0]);
  for (int64_t c = 1; c < V; ++c) mx = fmaxf(mx, to_f32(x[c * plane]));
  float sum = 0.0f;
  for (int64_t c = 0; c < V; ++c) sum += expf(to_f32(x[c * plane]) - mx);
  const float l = mx + logf(sum);
  lse[row] = l;
  row_loss[row] = static_cast<double>(l) - static_cast<double>(to_f32(x[targets[row] * plane]));
}

template <class T>
__global__ void crossentropy_planes_backward_kernel(T* dlogits, const T* logits, const float* lse,
                                                    const int32_t* targets, float scale, int64_t outer, int64_t V,
                                                    int64_t plane) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (row >= outer * plane) return;
  const int64_t at = (row / plane) * V * plane + row % plane, target = targets[row];
  const float l = lse[row];
  for (int64_t c = 0; c < V; ++c) {
    float d = scale * expf(to_f32(logits[at + c * plane]) - l);
    if (c == target) d -= scale;
    dlogits[at + c * plane] = from_f32<T>(d);
  }
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

}  // namespace

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
void residual_layernorm_forward(E* out, float* mean, float* rstd, E* sum, const E* residual, const E* weight,
                                const E* bias, int64_t N, int64_t C, int64_t rows_per_sample, float p,
                                const DropoutKey& key) {
  if (N == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  // The pack width decides which lane sums which elements: layernorm_forward's rule on
  // what it reads and writes (the residual, read by packs where it is aligned), so that
  // the statistics are its bits.
  const bool packed = C % W == 0 && all_aligned({out, sum, weight, bias}, 16);
  const bool residual_packed = all_aligned({residual}, 16);
  const RandomStream first = first_dropout_stream(key);
  const auto launch = [&](auto width, auto dropping) {
    residual_layernorm_forward_kernel<decltype(width)::value, decltype(dropping)::value>
        <<<blocks, kThreads, 0, context().compute>>>(dev(out), mean, rstd, dev(sum), dev(residual), dev(weight),
                                                     dev(bias), N, C, rows_per_sample, DropoutRule(p), first,
                                                     residual_packed);
  };
  if (packed && p > 0.0f) launch(std::integral_constant<int, W>{}, std::true_type{});
  else if (packed) launch(std::integral_constant<int, W>{}, std::false_type{});
  else if (p > 0.0f) launch(std::integral_constant<int, 1>{}, std::true_type{});
  else launch(std::integral_constant<int, 1>{}, std::false_type{});
  CUDA_CHECK_LAUNCH();
}

template <class E>
void layernorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, GradMode mode,
                        const E* residual) {
  if (N == 0 || C == 0) return;
  using T = device_t<E>;
  constexpr int W = pack_width<T>;
  cudaStream_t stream = context().compute;
  const unsigned blocks = static_cast<unsigned>(ceil_div(N, kRowsPerBlock));
  // The pack width (which lane sums what) from the tensors of the plain backward alone;
  // a residual is read by packs where it is aligned.
  const bool packed = C % W == 0 && all_aligned({dinp, dout, inp, weight}, 16);
  const bool accumulate = mode == GradMode::accumulate || residual;
  const E* base = residual ? residual : dinp;
  const bool base_packed = all_aligned({base}, 16);
  const auto launch = [&](auto width, auto accumulating) {
    layernorm_backward_kernel<decltype(width)::value, decltype(accumulating)::value>
        <<<blocks, kThreads, 0, stream>>>(dev(dinp), dev(dout), dev(inp), dev(weight), mean, rstd, N, C, dev(base),
                                          base_packed);
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
                       int64_t, float p, const DropoutKey& key) {
  const int64_t BT = B * T;
  if (BT == 0 || C == 0) return;
  using D = device_t<E>;
  constexpr int W = pack_width<D>;
  const bool packed = C % W == 0 && all_aligned({out, wte, wpe}, 16);
  const RandomStream first = first_dropout_stream(key);
  const auto launch = [&](auto width, auto dropping) {
    constexpr int w = decltype(width)::value;
    embedding_forward_kernel<w, decltype(dropping)::value><<<blocks_for(BT * C / w, kThreads), kThreads, 0,
                                                             context().compute>>>(
        dev(out), tokens, dev(wte), dev(wpe), BT, T, C, DropoutRule(p), first);
  };
  if (packed && p > 0.0f) launch(std::integral_constant<int, W>{}, std::true_type{});
  else if (packed) launch(std::integral_constant<int, W>{}, std::false_type{});
  else if (p > 0.0f) launch(std::integral_constant<int, 1>{}, std::true_type{});
  else launch(std::integral_constant<int, 1>{}, std::false_type{});
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
  if (!dwpe) return;  // no position table
  embedding_position_grads<<<blocks_for(T * C, kThreads), kThreads, 0, stream>>>(dwpe, dev(dout), B, T, C);
  CUDA_CHECK_LAUNCH();
}

// ---- cross-entropy -----------------------------------------------------------------------

// Whether a row of V classes (plane apart) takes one thread (the planes kernels) rather
// than a block of kRowThreads: planes (a per-pixel loss as it lies), and rows of at most a
// warp's classes (a classifier's, a channels-last per-pixel loss's), where a block would
// leave most of its threads idle.
namespace {
bool thread_per_row(int64_t V, int64_t plane) { return plane > 1 || V <= 32; }
}  // namespace

template <class E>
void crossentropy_forward(float* lse, double* loss_sum, const E* logits, const int32_t* targets, int64_t outer,
                          int64_t V, int64_t plane) {
  const int64_t N = outer * plane;
  if (N == 0) return;
  MPIPE_CHECK(N <= INT32_MAX, "crossentropy_forward: ", N, " rows exceed one grid");
  cudaStream_t stream = context().compute;
  auto* row_loss = static_cast<double*>(scratch(static_cast<std::size_t>(N) * sizeof(double)));
  if (!thread_per_row(V, plane)) {
    crossentropy_forward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(lse, row_loss, dev(logits),
                                                                                     targets, V);
  } else {
    crossentropy_planes_forward_kernel<<<blocks_for(N, kThreads), kThreads, 0, stream>>>(
        lse, row_loss, dev(logits), targets, outer, V, plane);
  }
  CUDA_CHECK_LAUNCH();
  if (loss_sum) {  // null for a recomputation, whose loss was counted in its forward
    loss_finish<<<1, kFinishThreads, 0, stream>>>(loss_sum, row_loss, N);
    CUDA_CHECK_LAUNCH();
  }
}

template <class E>
void crossentropy_backward(E* dlogits, const E* logits, const float* lse, const int32_t* targets, float scale,
                           int64_t outer, int64_t V, int64_t plane) {
  const int64_t N = outer * plane;
  if (N == 0) return;
  MPIPE_CHECK(N <= INT32_MAX, "crossentropy_backward: ", N, " rows exceed one grid");
  if (!thread_per_row(V, plane)) {
    crossentropy_backward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, context().compute>>>(
        dev(dlogits), dev(logits), lse, targets, scale, V);
  } else {
    crossentropy_planes_backward_kernel<<<blocks_for(N, kThreads), kThreads, 0, context().compute>>>(
        dev(dlogits), dev(logits), lse, targets, scale, outer, V, plane);
  }
  CUDA_CHECK_LAUNCH();
}

// ---- instantiations ------------------------------------------------------------------------

#define MPIPE_CUDA_ROW_OPS(E)                                                                                     \
  template void layernorm_forward<E>(E*, float*, float*, const E*, const E*, const E*, int64_t, int64_t);         \
  template void residual_layernorm_forward<E>(E*, float*, float*, E*, const E*, const E*, const E*, int64_t,       \
                                              int64_t, int64_t, float, const DropoutKey&);                       \
  template void layernorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,             \
                                      const float*, int64_t, int64_t, GradMode, const E*);                        \
  template void embedding_forward<E>(E*, const int32_t*, const E*, const E*, int64_t, int64_t, int64_t, int64_t,  \
                                     float, const DropoutKey&);                                                     \
  template void embedding_backward<E>(float*, float*, const E*, const int32_t*, int64_t, int64_t, int64_t,        \
                                      int64_t);                                                                   \
  template void crossentropy_forward<E>(float*, double*, const E*, const int32_t*, int64_t, int64_t, int64_t);    \
  template void crossentropy_backward<E>(E*, const E*, const float*, const int32_t*, float, int64_t, int64_t,     \
                                         int64_t);

MPIPE_CUDA_ROW_OPS(float)
MPIPE_CUDA_ROW_OPS(bf16)
#undef MPIPE_CUDA_ROW_OPS

}  // namespace mpipe::cuda
