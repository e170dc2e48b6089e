// Causal self-attention, the ops: attention_forward and attention_backward pick a path
// per call, and the backward first computes D = rowsum(dO * O). Every path takes
// grouped-query attention (KVH key/value heads, qkv (B, T, C + 2 KV)); with KVH = H each
// runs the kernels and the order of sums it ran before groups existed.
//
//   bf16              cuDNN's fused attention (attention_dnn.cu) where it builds a
//                     deterministic plan for the shape and, at the shape's first call,
//                     agrees with the FlashAttention-2 kernel below; MPIPE_ATTENTION=flash
//                     or set_attention_engine(kernel) turns it off.
//   bf16, hs <= 128   FlashAttention-2 on tensor cores (flash_bf16.cu).
//   fp32, hs <= 128   FlashAttention-2 on CUDA-core FMAs (flash_f32.cu): the
//                     reference-precision path.
//   hs > 128, or a    the unfused cuBLASLt path (gemm_attention_*, here): the full
//   GPU whose shared  scores in scratch, correct but O(T^2) memory.
//   memory is short
//
// Generation's attention over a key/value cache is attention_decode.cu's.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <utility>

#include "attention_dnn.cuh"
#include "flash.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

using flash::Flash;
using flash::Fused;
using flash::kBlockRows;
using flash::kF32Rows;
using flash::kLog2e;
using flash::kMaxTiles;
using flash::padded_head_dim;

// ---- D = rowsum(dO * O) ------------------------------------------------------------------

// D (B, H, T) = per head, the dot product of dout and out over the head's channels:
// sum_j P_ij dP_ij, which the softmax gradient subtracts.
template <class T>
__global__ void attention_row_dots(float* D, const T* dout, const T* out, int64_t B, int64_t T_, int64_t H,
                                   int64_t hs) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;  // (b, h, t)
  const int lane = threadIdx.x % 32;
  if (row >= B * H * T_) return;
  const int64_t t = row % T_, h = (row / T_) % H, b = row / (T_ * H);
  const int64_t at = (b * T_ + t) * H * hs + h * hs;
  float dot = 0.0f;
  for (int64_t d = lane; d < hs; d += 32) dot += to_f32(dout[at + d]) * to_f32(out[at + d]);
  dot = warp_reduce(dot, Sum{});
  if (lane == 0) D[row] = dot;
}

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)); }

// ---- unfused fallback (hs > 128) ---------------------------------------------------------
// cuBLASLt batched GEMMs, one batch entry per (b, h), with the softmax and its gradient as
// row kernels in between. q, k, v are first split into contiguous heads (B, H, T, hs),
// each query head given its own copy of the key and value head it reads; the scores S
// (B, H, T, T) are fp32, the probabilities P are E for the P·V GEMM. All temporaries live
// in one scratch() region, and the full T x T products are computed (the masked half is
// set to zero). Under grouped-query attention dK and dV come out per query head in fp32
// and a key/value head's are summed over its group in ascending order (reduce_kv_heads).

// Where matrix m (0 q, 1 k, 2 v) of query head h lies in a row of H query heads, then
// KV = H / group key heads and as many value heads: a key/value head serves `group` query
// heads side by side. group 1: m C + h hs, the (B, T, 3, H, hs) layout.
__device__ __forceinline__ int64_t head_column(int64_t m, int64_t h, int64_t H, int64_t hs, int64_t group) {
  return m == 0 ? h * hs : H * hs + ((m - 1) * (H / group) + h / group) * hs;
}

// src rows of ld elements (B, T, ld) -> dst (mats, B, H, T, hs); W elements at a time
// (hs % W == 0).
template <int W, class T>
__global__ void split_heads(T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats, int64_t ld,
                            int64_t group) {
  const int64_t total = mats * B * H * T_ * hs;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) * W;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W; i < total; i += stride) {
    const int64_t d = i % hs, t = (i / hs) % T_, h = (i / (hs * T_)) % H, b = (i / (hs * T_ * H)) % B,
                  m = i / (hs * T_ * H * B);
    store_pack<W>(dst + i, load_pack<W>(src + (b * T_ + t) * ld + head_column(m, h, H, hs, group) + d));
  }
}

// The inverse (each query head's own matrices: group 1): src (mats, B, H, T, hs) -> dst
// rows of ld.
template <int W, class T>
__global__ void merge_heads(T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats,
                            int64_t ld) {
  const int64_t total = mats * B * H * T_ * hs;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) * W;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W; i < total; i += stride) {
    const int64_t d = i % hs, t = (i / hs) % T_, h = (i / (hs * T_)) % H, b = (i / (hs * T_ * H)) % B,
                  m = i / (hs * T_ * H * B);
    store_pack<W>(dst + (b * T_ + t) * ld + head_column(m, h, H, hs, 1) + d, load_pack<W>(src + i));
  }
}

// dst (B, T, ld) rows, ld = mats C: the (B, T, mats, H, hs) layout; split reads key and
// value heads a group of query heads share (ld = C + 2 KV).
template <class T>
void rearrange_heads(bool split, T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats,
                     int64_t ld, int64_t group = 1) {
  using D = device_t<T>;
  constexpr int W = pack_width<D>;
  cudaStream_t stream = context().compute;
  const int64_t total = mats * B * H * T_ * hs;
  if (hs % W == 0 && all_aligned({dst, src}, 16)) {
    const unsigned blocks = blocks_for(total / W, kThreads);
    if (split) split_heads<W><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats, ld, group);
    else merge_heads<W><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats, ld);
  } else {
    const unsigned blocks = blocks_for(total, kThreads);
    if (split) split_heads<1><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats, ld, group);
    else merge_heads<1><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats, ld);
  }
  CUDA_CHECK_LAUNCH();
}

// Grouped-query attention's dK and dV: src (2, B, H, T, hs) fp32, each query head's
// share, -> dqkv's key and value heads (B, T, C + 2 KV), each the sum of its group's
// `group` query heads in ascending order, rounded to T once. Every element of them is
// written.
template <class T>
__global__ void reduce_kv_heads(T* dqkv, const float* src, int64_t B, int64_t T_, int64_t H, int64_t hs,
                                int64_t group) {
  const int64_t KVH = H / group, C = H * hs, KV = KVH * hs, ld = C + 2 * KV;
  const int64_t total = 2 * B * KVH * T_ * hs, per = B * H * T_ * hs;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t d = i % hs, t = (i / hs) % T_, j = (i / (hs * T_)) % KVH, b = (i / (hs * T_ * KVH)) % B,
                  m = i / (hs * T_ * KVH * B);
    const float* from = src + m * per + ((b * H + j * group) * T_ + t) * hs + d;
    float acc = 0.0f;
    for (int64_t g = 0; g < group; ++g) acc += from[g * T_ * hs];
    dqkv[(b * T_ + t) * ld + C + m * KV + j * hs + d] = from_f32<T>(acc);
  }
}

// Row i of S (rows = B*H*T, each of length T) -> its log-sum-exp over j <= i and
// P[j] = exp(S[j] - lse) there, 0 beyond.
template <class T>
__global__ void causal_softmax(T* P, float* lse, const float* S, int64_t rows, int64_t T_) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // the whole warp
  const int64_t i = row % T_;
  const float* s = S + row * T_;
  float mx = -INFINITY;
  for (int64_t j = lane; j <= i; j += 32) mx = fmaxf(mx, s[j]);
  mx = warp_reduce(mx, Max{});
  float sum = 0.0f;
  for (int64_t j = lane; j <= i; j += 32) sum += expf(s[j] - mx);
  sum = warp_reduce(sum, Sum{});
  const float l = mx + logf(sum);
  T* p = P + row * T_;
  for (int64_t j = lane; j < T_; j += 32) p[j] = from_f32<T>(j <= i ? expf(s[j] - l) : 0.0f);
  if (lane == 0) lse[row] = l;
}

// P recomputed from S and the forward's lse, exactly as causal_softmax writes it.
template <class T>
__global__ void causal_probs(T* P, const float* S, const float* lse, int64_t rows, int64_t T_) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % T_;
  const float l = lse[row];
  const float* s = S + row * T_;
  T* p = P + row * T_;
  for (int64_t j = lane; j < T_; j += 32) p[j] = from_f32<T>(j <= i ? expf(s[j] - l) : 0.0f);
}

// dS = P * (dP - D) on j <= i, 0 beyond; in place over P.
template <class T>
__global__ void causal_softmax_backward(T* P, const float* dP, const float* D, int64_t rows, int64_t T_) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t i = row % T_;
  const float dot = D[row];
  const float* dp = dP + row * T_;
  T* p = P + row * T_;
  for (int64_t j = lane; j < T_; j += 32) p[j] = from_f32<T>(j <= i ? to_f32(p[j]) * (dp[j] - dot) : 0.0f);
}

// c = alpha * op(a) · op(b) for each of `heads` contiguous row-major matrices:
// op(a) (M, K), op(b) (K, N), c (M, N).
Gemm per_head(int64_t heads, int64_t M, int64_t N, int64_t K, const void* a, bool trans_a, const void* b,
              bool trans_b, void* c, cudaDataType_t ab_type, cudaDataType_t c_type, float alpha) {
  MPIPE_CHECK(heads <= INT32_MAX, "attention: ", heads, " (batch, head) pairs exceed one batched GEMM");
  Gemm g;
  g.M = M, g.N = N, g.K = K;
  g.a = a, g.lda = trans_a ? M : K, g.trans_a = trans_a;
  g.b = b, g.ldb = trans_b ? K : N, g.trans_b = trans_b;
  g.c = c, g.ldc = N;
  g.ab_type = ab_type, g.c_type = c_type;
  g.alpha = alpha;
  g.batch = static_cast<int>(heads);
  g.stride_a = M * K, g.stride_b = K * N, g.stride_c = M * N;
  return g;
}

template <class E>
void gemm_attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t H, int64_t KVH,
                            int64_t hs) {
  const int64_t BH = B * H, per = BH * T * hs, rows = BH * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  constexpr cudaDataType_t e_type = data_type<E>();
  cudaStream_t stream = context().compute;

  ScratchPlan plan;
  const std::size_t heads_at = plan.reserve<E>(3 * per);   // q, k, v (B, H, T, hs)
  const std::size_t o_at = plan.reserve<E>(per);           // (B, H, T, hs)
  const std::size_t s_at = plan.reserve<float>(rows * T);  // (B, H, T, T)
  const std::size_t p_at = plan.reserve<E>(rows * T);      // (B, H, T, T)
  void* base = scratch(plan.bytes());
  E* q = place<E>(base, heads_at);
  E* k = q + per;
  E* v = k + per;
  E* o = place<E>(base, o_at);
  auto* S = place<float>(base, s_at);
  E* P = place<E>(base, p_at);

  const int64_t C = H * hs, ld = C + 2 * KVH * hs;
  rearrange_heads(true, q, qkv, B, T, H, hs, 3, ld, H / KVH);
  gemm(per_head(BH, T, T, hs, q, false, k, true, S, e_type, CUDA_R_32F, scale));  // S = q k^T / sqrt(hs)
  causal_softmax<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), lse, S, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, false, v, false, o, e_type, e_type, 1.0f));  // O = P v
  rearrange_heads(false, out, static_cast<const E*>(o), B, T, H, hs, 1, C);
}

template <class E>
void gemm_attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B,
                             int64_t T, int64_t H, int64_t KVH, int64_t hs) {
  const int64_t BH = B * H, per = BH * T * hs, rows = BH * T, group = H / KVH, C = H * hs, ld = C + 2 * KVH * hs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  constexpr cudaDataType_t e_type = data_type<E>();
  cudaStream_t stream = context().compute;

  ScratchPlan plan;
  const std::size_t heads_at = plan.reserve<E>(3 * per);   // q, k, v (B, H, T, hs)
  const std::size_t dout_at = plan.reserve<E>(per);        // dO (B, H, T, hs)
  const std::size_t dheads_at = plan.reserve<E>(3 * per);  // dq, dk, dv (B, H, T, hs)
  const std::size_t dots_at = plan.reserve<float>(rows);   // D (B, H, T)
  const std::size_t s_at = plan.reserve<float>(rows * T);  // S, then dP (B, H, T, T)
  const std::size_t p_at = plan.reserve<E>(rows * T);      // P, then dS (B, H, T, T)
  // Grouped: dK, dV per query head (2, B, H, T, hs), fp32 until their group is summed.
  const std::size_t dkv_at = group > 1 ? plan.reserve<float>(2 * per) : 0;
  void* base = scratch(plan.bytes());
  E* q = place<E>(base, heads_at);
  E* k = q + per;
  E* v = k + per;
  E* dO = place<E>(base, dout_at);
  E* dq = place<E>(base, dheads_at);
  E* dk = dq + per;
  E* dv = dk + per;
  auto* dots = place<float>(base, dots_at);
  auto* S = place<float>(base, s_at);
  E* P = place<E>(base, p_at);

  float* dkv = group > 1 ? place<float>(base, dkv_at) : nullptr;
  // dK and dV: E straight into place (one head each), or fp32 per query head (grouped).
  void* dk_out = group > 1 ? static_cast<void*>(dkv) : dk;
  void* dv_out = group > 1 ? static_cast<void*>(dkv + per) : dv;
  const cudaDataType_t dkv_type = group > 1 ? CUDA_R_32F : e_type;

  rearrange_heads(true, q, qkv, B, T, H, hs, 3, ld, group);
  rearrange_heads(true, dO, dout, B, T, H, hs, 1, C);
  attention_row_dots<<<row_blocks(rows), kThreads, 0, stream>>>(dots, dev(dout), dev(out), B, T, H, hs);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, T, hs, q, false, k, true, S, e_type, CUDA_R_32F, scale));  // S = q k^T / sqrt(hs)
  causal_probs<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), S, lse, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, true, dO, false, dv_out, e_type, dkv_type, 1.0f));  // dV = P^T dO
  gemm(per_head(BH, T, T, hs, dO, false, v, true, S, e_type, CUDA_R_32F, 1.0f));     // dP = dO V^T
  causal_softmax_backward<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), S, dots, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, false, k, false, dq, e_type, e_type, scale));       // dQ = dS K / sqrt(hs)
  gemm(per_head(BH, T, hs, T, P, true, q, false, dk_out, e_type, dkv_type, scale));  // dK = dS^T Q / sqrt(hs)
  if (group == 1) {
    rearrange_heads(false, dqkv, static_cast<const E*>(dq), B, T, H, hs, 3, ld);
    return;
  }
  rearrange_heads(false, dqkv, static_cast<const E*>(dq), B, T, H, hs, 1, ld);
  reduce_kv_heads<<<blocks_for(2 * B * KVH * T * hs, kThreads), kThreads, 0, stream>>>(dev(dqkv), dkv, B, T, H, hs,
                                                                                       group);
  CUDA_CHECK_LAUNCH();
}

// ---- dispatch ----------------------------------------------------------------------------

// The fused kernels take the call when the head fits their padding and their shared
// memory fits this GPU; otherwise the cuBLASLt path does. A tile grid beyond grid y's
// 65535 (T past 2 million steps) is refused.
template <class E>
bool use_fused(const Heads& a) {
  const int HD = padded_head_dim(a.hs);
  if (HD == 0) return false;
  if (Fused<E>::smem(HD) > context().properties.sharedMemPerBlockOptin) return false;
  // Every bf16 grid has a tile of at least 64 rows per y, every fp32 grid one of 32.
  const int64_t rows = std::is_same_v<E, float> ? kF32Rows : kBlockRows<128>;
  MPIPE_CHECK(ceil_div(a.T, rows) <= kMaxTiles && a.B * a.H <= INT32_MAX, "attention: ", a.B, " x ", a.H,
              " heads of ", a.T, " steps exceed one fused launch");
  return true;
}

Flash flash_sizes(const Heads& a) {
  Flash f;
  f.BH = static_cast<int>(a.B * a.H);
  f.T = static_cast<int>(a.T);
  f.H = static_cast<int>(a.H);
  f.hs = static_cast<int>(a.hs);
  f.KVH = static_cast<int>(a.KVH);
  f.BKV = static_cast<int>(a.B * a.KVH);
  f.scale = 1.0f / std::sqrt(static_cast<float>(a.hs));
  f.scale_log2 = f.scale * kLog2e;
  return f;
}

// The kernels' paths (fused where the head fits, else cuBLASLt).
template <class E>
void kernel_attention_forward(E* out, float* lse, const E* qkv, const Heads& a) {
  if (!use_fused<E>(a)) return gemm_attention_forward(out, lse, qkv, a.B, a.T, a.H, a.KVH, a.hs);
  Fused<E>::forward(out, lse, qkv, flash_sizes(a));
}
template <class E>
void kernel_attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, const Heads& a) {
  if (!use_fused<E>(a)) return gemm_attention_backward(dqkv, dout, qkv, out, lse, a.B, a.T, a.H, a.KVH, a.hs);
  // D = rowsum(dO * O) first: both fused kernels subtract it from dP.
  const int64_t rows = a.B * a.H * a.T;
  auto* dots = static_cast<float*>(scratch(static_cast<std::size_t>(rows) * sizeof(float)));
  attention_row_dots<<<row_blocks(rows), kThreads, 0, context().compute>>>(dots, dev(dout), dev(out), a.B, a.T, a.H,
                                                                          a.hs);
  CUDA_CHECK_LAUNCH();
  Fused<E>::backward(dqkv, dout, qkv, lse, dots, flash_sizes(a));
}

// ---- cuDNN or the kernel -------------------------------------------------------------
// A shape's first bf16 call in each direction runs cuDNN and then the kernel into
// temporaries, and compares them (max |cuDNN - kernel| against the kernel's largest
// magnitude): cuDNN keeps the shape only where they agree to within bf16's rounding of
// differently ordered sums. The graph was written from cuDNN's documentation and
// frontend, and a GPU that declines nothing but computes something else must not train
// on it. A disagreement is said on stderr, once per shape.

enum class Choice { unchecked, dnn, kernel };
using ChoiceKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, bool>;  // B, T, H, KVH, hs, backward
std::map<ChoiceKey, Choice>& choices() {
  static std::map<ChoiceKey, Choice> map;  // one compute thread per rank: no lock
  return map;
}
AttentionEngine& engine_setting() {
  static AttentionEngine engine = AttentionEngine::automatic;
  return engine;
}

// result[0] = max |a - b| and result[1] = max |b|, as the bits of non-negative floats
// (ordered as unsigned integers, so atomicMax orders them; a NaN's bits exceed infinity's).
template <class T>
__global__ void max_difference(unsigned* result, const T* a, const T* b, int64_t n) {
  unsigned diff = 0, mag = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float x = to_f32(a[i]), y = to_f32(b[i]);
    diff = max(diff, __float_as_uint(fabsf(x - y)));
    mag = max(mag, __float_as_uint(fabsf(y)));
  }
  atomicMax(result, diff);
  atomicMax(result + 1, mag);
}

// How far a (cuDNN's) is from b (the kernel's): {max |a - b|, max |b|}; synchronises.
template <class T>
std::pair<float, float> difference(const T* a, const T* b, int64_t n, unsigned* result) {
  CUDA_CHECK(cudaMemsetAsync(result, 0, 2 * sizeof(unsigned), context().compute));
  max_difference<<<blocks_for(n, kThreads), kThreads, 0, context().compute>>>(result, a, b, n);
  CUDA_CHECK_LAUNCH();
  unsigned host[2];
  CUDA_CHECK(cudaMemcpyAsync(host, result, sizeof(host), cudaMemcpyDeviceToHost, context().compute));
  CUDA_CHECK(cudaStreamSynchronize(context().compute));
  float diff, mag;
  std::memcpy(&diff, &host[0], sizeof(float));
  std::memcpy(&mag, &host[1], sizeof(float));
  return {diff, mag};
}

// Within bf16's rounding: outputs to 1/32 and gradients to 1/16 of the largest magnitude
// (differently ordered bf16 sums differ by a few units of 2^-8; a wrong mask, scale or
// head placement by the order of the values themselves); the lse, fp32, to 0.01.
constexpr float kOutputTolerance = 1.0f / 32, kGradientTolerance = 1.0f / 16, kLseTolerance = 0.01f;

bool agrees(std::pair<float, float> d, float tolerance) { return d.first <= tolerance * std::max(d.second, 1e-6f); }

void say_check(const char* direction, const Heads& a, bool ok, const std::string& detail) {
  if (ok && !dnn_attention_verbose()) return;
  std::fprintf(stderr, "mpipe attention %s %s: cuDNN %s the FlashAttention-2 kernel (%s)%s\n", a.text().c_str(),
               direction, ok ? "agrees with" : "DISAGREES with", detail.c_str(),
               ok ? "" : "; the kernel takes this shape");
}

// The shape's choice, or null where the kernel is asked for (set_attention_engine,
// MPIPE_ATTENTION=flash).
Choice* choice_of(const Heads& a, bool backward) {
  if (engine_setting() == AttentionEngine::kernel || !dnn_attention_wanted()) return nullptr;
  return &choices().try_emplace(ChoiceKey{a.B, a.T, a.H, a.KVH, a.hs, backward}, Choice::unchecked).first->second;
}

// bf16 forward: true when cuDNN ran it (checked at the shape's first call).
bool dnn_forward(bf16* out, float* lse, const bf16* qkv, const Heads& a) {
  const int64_t C = a.C(), KV = a.KV();
  if (!all_aligned({qkv, qkv + C, qkv + C + KV, out, lse}, 16)) return false;  // this call's pointers, not the shape
  Choice* chosen = choice_of(a, false);
  if (!chosen || *chosen == Choice::kernel) return false;
  // A shape's check waits for the GPU, which a CUDA graph being recorded cannot: its
  // first call is never recorded (steps 1 and 2 are not), and should one be, the kernel
  // takes that call.
  if (*chosen == Choice::unchecked && capturing()) return false;
  Choice& choice = *chosen;
  if (!dnn_attention_forward(out, lse, qkv, a)) {
    choice = Choice::kernel;
    return false;
  }
  if (choice == Choice::dnn) return true;
  const int64_t n = a.B * a.T * C, rows = a.B * a.H * a.T;
  ScratchPlan layout;  // the kernel's results and the comparison's, for a shape's first call only
  const std::size_t out_at = layout.reserve<bf16>(n), lse_at = layout.reserve<float>(rows),
                    result_at = layout.reserve<unsigned>(2);
  const DeviceBuffer memory(layout.bytes());
  bf16* out_kernel = place<bf16>(memory.data(), out_at);
  auto* lse_kernel = place<float>(memory.data(), lse_at);
  kernel_attention_forward(out_kernel, lse_kernel, qkv, a);
  const auto d_out = difference(dev(static_cast<const bf16*>(out)), dev(static_cast<const bf16*>(out_kernel)), n,
                                place<unsigned>(memory.data(), result_at));
  const auto d_lse = difference(static_cast<const float*>(lse), static_cast<const float*>(lse_kernel), rows,
                                place<unsigned>(memory.data(), result_at));
  const bool ok = agrees(d_out, kOutputTolerance) && d_lse.first <= kLseTolerance;
  say_check("forward", a, ok, cat("output ", d_out.first, " of ", d_out.second, ", lse ", d_lse.first));
  choice = ok ? Choice::dnn : Choice::kernel;
  if (!ok) {  // the kernel's results are the call's
    CUDA_CHECK(cudaMemcpyAsync(out, out_kernel, static_cast<std::size_t>(n) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                               context().compute));
    CUDA_CHECK(cudaMemcpyAsync(lse, lse_kernel, static_cast<std::size_t>(rows) * sizeof(float),
                               cudaMemcpyDeviceToDevice, context().compute));
  }
  return true;
}

bool dnn_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, const Heads& a) {
  const int64_t C = a.C(), KV = a.KV();
  if (!all_aligned({qkv, qkv + C, qkv + C + KV, out, dout, lse, dqkv, dqkv + C, dqkv + C + KV}, 16)) return false;
  Choice* chosen = choice_of(a, true);
  if (!chosen || *chosen == Choice::kernel) return false;
  // A shape's check waits for the GPU, which a CUDA graph being recorded cannot: its
  // first call is never recorded (steps 1 and 2 are not), and should one be, the kernel
  // takes that call.
  if (*chosen == Choice::unchecked && capturing()) return false;
  Choice& choice = *chosen;
  if (!dnn_attention_backward(dqkv, dout, qkv, out, lse, a)) {
    choice = Choice::kernel;
    return false;
  }
  if (choice == Choice::dnn) return true;
  const int64_t n = a.B * a.T * (C + 2 * KV);  // every q, k and v gradient
  ScratchPlan layout;  // as the forward's
  const std::size_t dqkv_at = layout.reserve<bf16>(n), result_at = layout.reserve<unsigned>(2);
  const DeviceBuffer memory(layout.bytes());
  bf16* dqkv_kernel = place<bf16>(memory.data(), dqkv_at);
  kernel_attention_backward(dqkv_kernel, dout, qkv, out, lse, a);
  const auto d = difference(dev(static_cast<const bf16*>(dqkv)), dev(static_cast<const bf16*>(dqkv_kernel)), n,
                            place<unsigned>(memory.data(), result_at));
  const bool ok = agrees(d, kGradientTolerance);
  say_check("backward", a, ok, cat("gradient ", d.first, " of ", d.second));
  choice = ok ? Choice::dnn : Choice::kernel;
  if (!ok)
    CUDA_CHECK(cudaMemcpyAsync(dqkv, dqkv_kernel, static_cast<std::size_t>(n) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                               context().compute));
  return true;
}

// The call's shape, checked: C channels in H heads, KVH key/value heads dividing them.
Heads heads_of(int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH) {
  MPIPE_CHECK(H > 0 && C > 0 && C % H == 0, "attention: ", C, " channels do not split into ", H, " heads");
  MPIPE_CHECK(KVH > 0 && H % KVH == 0, "attention: ", KVH, " key/value heads do not divide ", H, " heads");
  return Heads{B, T, H, KVH, C / H};
}

}  // namespace

std::string Heads::text() const {
  return cat("B ", B, " T ", T, " H ", H, KVH != H ? cat(" KVH ", KVH) : std::string(), " hs ", hs);
}

void set_attention_engine(AttentionEngine engine) { engine_setting() = engine; }

bool attention_on_cudnn(int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH, bool backward) {
  if (H <= 0 || C % H != 0 || KVH <= 0 || H % KVH != 0) return false;
  const auto found = choices().find(ChoiceKey{B, T, H, KVH, C / H, backward});
  return engine_setting() == AttentionEngine::automatic && found != choices().end() && found->second == Choice::dnn;
}

template <class E>
void attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t C, int64_t H, int64_t KVH) {
  if (B == 0 || T == 0) return;
  const Heads a = heads_of(B, T, C, H, KVH);
  if constexpr (std::is_same_v<E, bf16>)
    if (dnn_forward(out, lse, qkv, a)) return;
  kernel_attention_forward(out, lse, qkv, a);
}

template <class E>
void attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B, int64_t T,
                        int64_t C, int64_t H, int64_t KVH) {
  if (B == 0 || T == 0) return;
  const Heads a = heads_of(B, T, C, H, KVH);
  if constexpr (std::is_same_v<E, bf16>)
    if (dnn_backward(dqkv, dout, qkv, out, lse, a)) return;
  kernel_attention_backward(dqkv, dout, qkv, out, lse, a);
}

template void attention_forward<float>(float*, float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_forward<bf16>(bf16*, float*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_backward<float>(float*, const float*, const float*, const float*, const float*, int64_t,
                                        int64_t, int64_t, int64_t, int64_t);
template void attention_backward<bf16>(bf16*, const bf16*, const bf16*, const bf16*, const float*, int64_t, int64_t,
                                       int64_t, int64_t, int64_t);

}  // namespace mpipe::cuda
