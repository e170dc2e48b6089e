// Causal self-attention, the ops: attention_forward and attention_backward pick a path
// per call, and the backward first computes D = rowsum(dO * O).
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
// row kernels in between. q, k, v are first split into contiguous heads (B, H, T, hs);
// the scores S (B, H, T, T) are fp32, the probabilities P are E for the P·V GEMM. All
// temporaries live in one scratch() region, and the full T x T products are computed
// (the masked half is set to zero).

// src (B, T, mats, H, hs) -> dst (mats, B, H, T, hs); W elements at a time (hs % W == 0).
template <int W, class T>
__global__ void split_heads(T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats) {
  const int64_t total = mats * B * H * T_ * hs;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) * W;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W; i < total; i += stride) {
    const int64_t d = i % hs, t = (i / hs) % T_, h = (i / (hs * T_)) % H, b = (i / (hs * T_ * H)) % B,
                  m = i / (hs * T_ * H * B);
    store_pack<W>(dst + i, load_pack<W>(src + ((b * T_ + t) * mats + m) * H * hs + h * hs + d));
  }
}

// The inverse: src (mats, B, H, T, hs) -> dst (B, T, mats, H, hs).
template <int W, class T>
__global__ void merge_heads(T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats) {
  const int64_t total = mats * B * H * T_ * hs;
  const int64_t stride = (static_cast<int64_t>(gridDim.x) * blockDim.x) * W;
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * W; i < total; i += stride) {
    const int64_t d = i % hs, t = (i / hs) % T_, h = (i / (hs * T_)) % H, b = (i / (hs * T_ * H)) % B,
                  m = i / (hs * T_ * H * B);
    store_pack<W>(dst + ((b * T_ + t) * mats + m) * H * hs + h * hs + d, load_pack<W>(src + i));
  }
}

template <class T>
void rearrange_heads(bool split, T* dst, const T* src, int64_t B, int64_t T_, int64_t H, int64_t hs, int mats) {
  using D = device_t<T>;
  constexpr int W = pack_width<D>;
  cudaStream_t stream = context().compute;
  const int64_t total = mats * B * H * T_ * hs;
  if (hs % W == 0 && all_aligned({dst, src}, 16)) {
    const unsigned blocks = blocks_for(total / W, kThreads);
    if (split) split_heads<W><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats);
    else merge_heads<W><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats);
  } else {
    const unsigned blocks = blocks_for(total, kThreads);
    if (split) split_heads<1><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats);
    else merge_heads<1><<<blocks, kThreads, 0, stream>>>(dev(dst), dev(src), B, T_, H, hs, mats);
  }
  CUDA_CHECK_LAUNCH();
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
void gemm_attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t H, int64_t hs) {
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

  rearrange_heads(true, q, qkv, B, T, H, hs, 3);
  gemm(per_head(BH, T, T, hs, q, false, k, true, S, e_type, CUDA_R_32F, scale));  // S = q k^T / sqrt(hs)
  causal_softmax<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), lse, S, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, false, v, false, o, e_type, e_type, 1.0f));  // O = P v
  rearrange_heads(false, out, static_cast<const E*>(o), B, T, H, hs, 1);
}

template <class E>
void gemm_attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B,
                             int64_t T, int64_t H, int64_t hs) {
  const int64_t BH = B * H, per = BH * T * hs, rows = BH * T;
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

  rearrange_heads(true, q, qkv, B, T, H, hs, 3);
  rearrange_heads(true, dO, dout, B, T, H, hs, 1);
  attention_row_dots<<<row_blocks(rows), kThreads, 0, stream>>>(dots, dev(dout), dev(out), B, T, H, hs);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, T, hs, q, false, k, true, S, e_type, CUDA_R_32F, scale));  // S = q k^T / sqrt(hs)
  causal_probs<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), S, lse, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, true, dO, false, dv, e_type, e_type, 1.0f));     // dV = P^T dO
  gemm(per_head(BH, T, T, hs, dO, false, v, true, S, e_type, CUDA_R_32F, 1.0f));  // dP = dO V^T
  causal_softmax_backward<<<row_blocks(rows), kThreads, 0, stream>>>(dev(P), S, dots, rows, T);
  CUDA_CHECK_LAUNCH();
  gemm(per_head(BH, T, hs, T, P, false, k, false, dq, e_type, e_type, scale));  // dQ = dS K / sqrt(hs)
  gemm(per_head(BH, T, hs, T, P, true, q, false, dk, e_type, e_type, scale));   // dK = dS^T Q / sqrt(hs)
  rearrange_heads(false, dqkv, static_cast<const E*>(dq), B, T, H, hs, 3);
}

// ---- dispatch ----------------------------------------------------------------------------

// The fused kernels take the call when the head fits their padding and their shared
// memory fits this GPU; otherwise the cuBLASLt path does. A tile grid beyond grid y's
// 65535 (T past 2 million steps) is refused.
template <class E>
bool use_fused(int64_t B, int64_t T, int64_t H, int64_t hs) {
  const int HD = padded_head_dim(hs);
  if (HD == 0) return false;
  if (Fused<E>::smem(HD) > context().properties.sharedMemPerBlockOptin) return false;
  // Every bf16 grid has a tile of at least 64 rows per y, every fp32 grid one of 32.
  const int64_t rows = std::is_same_v<E, float> ? kF32Rows : kBlockRows<128>;
  MPIPE_CHECK(ceil_div(T, rows) <= kMaxTiles && B * H <= INT32_MAX, "attention: ", B, " x ", H, " heads of ", T,
              " steps exceed one fused launch");
  return true;
}

template <class E>
Flash flash_sizes(int64_t B, int64_t T, int64_t H, int64_t hs) {
  Flash f;
  f.BH = static_cast<int>(B * H);
  f.T = static_cast<int>(T);
  f.H = static_cast<int>(H);
  f.hs = static_cast<int>(hs);
  f.scale = 1.0f / std::sqrt(static_cast<float>(hs));
  f.scale_log2 = f.scale * kLog2e;
  return f;
}

// The kernels' paths (fused where the head fits, else cuBLASLt).
template <class E>
void kernel_attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t H, int64_t hs) {
  if (!use_fused<E>(B, T, H, hs)) return gemm_attention_forward(out, lse, qkv, B, T, H, hs);
  Fused<E>::forward(out, lse, qkv, flash_sizes<E>(B, T, H, hs));
}
template <class E>
void kernel_attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B,
                               int64_t T, int64_t H, int64_t hs) {
  if (!use_fused<E>(B, T, H, hs)) return gemm_attention_backward(dqkv, dout, qkv, out, lse, B, T, H, hs);
  // D = rowsum(dO * O) first: both fused kernels subtract it from dP.
  const int64_t rows = B * H * T;
  auto* dots = static_cast<float*>(scratch(static_cast<std::size_t>(rows) * sizeof(float)));
  attention_row_dots<<<row_blocks(rows), kThreads, 0, context().compute>>>(dots, dev(dout), dev(out), B, T, H, hs);
  CUDA_CHECK_LAUNCH();
  Fused<E>::backward(dqkv, dout, qkv, lse, dots, flash_sizes<E>(B, T, H, hs));
}

// ---- cuDNN or the kernel -------------------------------------------------------------
// A shape's first bf16 call in each direction runs cuDNN and then the kernel into
// temporaries, and compares them (max |cuDNN - kernel| against the kernel's largest
// magnitude): cuDNN keeps the shape only where they agree to within bf16's rounding of
// differently ordered sums. The graph was written from cuDNN's documentation and
// frontend, and a GPU that declines nothing but computes something else must not train
// on it. A disagreement is said on stderr, once per shape.

enum class Choice { unchecked, dnn, kernel };
using ChoiceKey = std::tuple<int64_t, int64_t, int64_t, int64_t, bool>;  // B, T, H, hs, backward
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

void say_check(const char* direction, int64_t B, int64_t T, int64_t H, int64_t hs, bool ok, const std::string& detail) {
  if (ok && !dnn_attention_verbose()) return;
  std::fprintf(stderr, "mpipe attention B %lld T %lld H %lld hs %lld %s: cuDNN %s the FlashAttention-2 kernel (%s)%s\n",
               static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(H),
               static_cast<long long>(hs), direction, ok ? "agrees with" : "DISAGREES with", detail.c_str(),
               ok ? "" : "; the kernel takes this shape");
}

// The shape's choice, or null where the kernel is asked for (set_attention_engine,
// MPIPE_ATTENTION=flash).
Choice* choice_of(int64_t B, int64_t T, int64_t H, int64_t hs, bool backward) {
  if (engine_setting() == AttentionEngine::kernel || !dnn_attention_wanted()) return nullptr;
  return &choices().try_emplace(ChoiceKey{B, T, H, hs, backward}, Choice::unchecked).first->second;
}

// bf16 forward: true when cuDNN ran it (checked at the shape's first call).
bool dnn_forward(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t H, int64_t hs) {
  const int64_t C = H * hs;
  if (!all_aligned({qkv, qkv + C, qkv + 2 * C, out, lse}, 16)) return false;  // this call's pointers, not the shape
  Choice* chosen = choice_of(B, T, H, hs, false);
  if (!chosen || *chosen == Choice::kernel) return false;
  // A shape's check waits for the GPU, which a CUDA graph being recorded cannot: its
  // first call is never recorded (steps 1 and 2 are not), and should one be, the kernel
  // takes that call.
  if (*chosen == Choice::unchecked && capturing()) return false;
  Choice& choice = *chosen;
  if (!dnn_attention_forward(out, lse, qkv, B, T, H, hs)) {
    choice = Choice::kernel;
    return false;
  }
  if (choice == Choice::dnn) return true;
  const int64_t n = B * T * C, rows = B * H * T;
  ScratchPlan layout;  // the kernel's results and the comparison's, for a shape's first call only
  const std::size_t out_at = layout.reserve<bf16>(n), lse_at = layout.reserve<float>(rows),
                    result_at = layout.reserve<unsigned>(2);
  const DeviceBuffer memory(layout.bytes());
  bf16* out_kernel = place<bf16>(memory.data(), out_at);
  auto* lse_kernel = place<float>(memory.data(), lse_at);
  kernel_attention_forward(out_kernel, lse_kernel, qkv, B, T, H, hs);
  const auto d_out = difference(dev(static_cast<const bf16*>(out)), dev(static_cast<const bf16*>(out_kernel)), n,
                                place<unsigned>(memory.data(), result_at));
  const auto d_lse = difference(static_cast<const float*>(lse), static_cast<const float*>(lse_kernel), rows,
                                place<unsigned>(memory.data(), result_at));
  const bool ok = agrees(d_out, kOutputTolerance) && d_lse.first <= kLseTolerance;
  say_check("forward", B, T, H, hs, ok,
            cat("output ", d_out.first, " of ", d_out.second, ", lse ", d_lse.first));
  choice = ok ? Choice::dnn : Choice::kernel;
  if (!ok) {  // the kernel's results are the call's
    CUDA_CHECK(cudaMemcpyAsync(out, out_kernel, static_cast<std::size_t>(n) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                               context().compute));
    CUDA_CHECK(cudaMemcpyAsync(lse, lse_kernel, static_cast<std::size_t>(rows) * sizeof(float),
                               cudaMemcpyDeviceToDevice, context().compute));
  }
  return true;
}

bool dnn_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int64_t B,
                  int64_t T, int64_t H, int64_t hs) {
  const int64_t C = H * hs;
  if (!all_aligned({qkv, qkv + C, qkv + 2 * C, out, dout, lse, dqkv, dqkv + C, dqkv + 2 * C}, 16)) return false;
  Choice* chosen = choice_of(B, T, H, hs, true);
  if (!chosen || *chosen == Choice::kernel) return false;
  // A shape's check waits for the GPU, which a CUDA graph being recorded cannot: its
  // first call is never recorded (steps 1 and 2 are not), and should one be, the kernel
  // takes that call.
  if (*chosen == Choice::unchecked && capturing()) return false;
  Choice& choice = *chosen;
  if (!dnn_attention_backward(dqkv, dout, qkv, out, lse, B, T, H, hs)) {
    choice = Choice::kernel;
    return false;
  }
  if (choice == Choice::dnn) return true;
  const int64_t n = B * T * 3 * C;
  ScratchPlan layout;  // as the forward's
  const std::size_t dqkv_at = layout.reserve<bf16>(n), result_at = layout.reserve<unsigned>(2);
  const DeviceBuffer memory(layout.bytes());
  bf16* dqkv_kernel = place<bf16>(memory.data(), dqkv_at);
  kernel_attention_backward(dqkv_kernel, dout, qkv, out, lse, B, T, H, hs);
  const auto d = difference(dev(static_cast<const bf16*>(dqkv)), dev(static_cast<const bf16*>(dqkv_kernel)), n,
                            place<unsigned>(memory.data(), result_at));
  const bool ok = agrees(d, kGradientTolerance);
  say_check("backward", B, T, H, hs, ok, cat("gradient ", d.first, " of ", d.second));
  choice = ok ? Choice::dnn : Choice::kernel;
  if (!ok)
    CUDA_CHECK(cudaMemcpyAsync(dqkv, dqkv_kernel, static_cast<std::size_t>(n) * sizeof(bf16), cudaMemcpyDeviceToDevice,
                               context().compute));
  return true;
}

}  // namespace

void set_attention_engine(AttentionEngine engine) { engine_setting() = engine; }

bool attention_on_cudnn(int64_t B, int64_t T, int64_t C, int64_t H, bool backward) {
  if (H <= 0 || C % H != 0) return false;
  const auto found = choices().find(ChoiceKey{B, T, H, C / H, backward});
  return engine_setting() == AttentionEngine::automatic && found != choices().end() && found->second == Choice::dnn;
}

template <class E>
void attention_forward(E* out, float* lse, const E* qkv, int64_t B, int64_t T, int64_t C, int64_t H) {
  if (B == 0 || T == 0) return;
  MPIPE_CHECK(H > 0 && C > 0 && C % H == 0, "attention: ", C, " channels do not split into ", H, " heads");
  const int64_t hs = C / H;
  if constexpr (std::is_same_v<E, bf16>)
    if (dnn_forward(out, lse, qkv, B, T, H, hs)) return;
  kernel_attention_forward(out, lse, qkv, B, T, H, hs);
}

template <class E>
void attention_backward(E* dqkv, const E* dout, const E* qkv, const E* out, const float* lse, int64_t B, int64_t T,
                        int64_t C, int64_t H) {
  if (B == 0 || T == 0) return;
  MPIPE_CHECK(H > 0 && C > 0 && C % H == 0, "attention: ", C, " channels do not split into ", H, " heads");
  const int64_t hs = C / H;
  if constexpr (std::is_same_v<E, bf16>)
    if (dnn_backward(dqkv, dout, qkv, out, lse, B, T, H, hs)) return;
  kernel_attention_backward(dqkv, dout, qkv, out, lse, B, T, H, hs);
}

// ---- generation: queries against a key/value cache ------------------------------------
// One block per (sequence, head, query row): its threads take the keys in turn for the
// scores (kept in shared memory), then the channels for the weighted sum of values. The
// reductions are block_reduce's fixed trees: the same bits on every run.
template <class T>
__global__ void attention_decode_kernel(T* out, const T* cache, int64_t rows, int64_t position, int64_t capacity,
                                        int64_t C, int64_t H) {
  extern __shared__ float scores[];  // (keys)
  __shared__ float reduce[32];
  const int64_t i = blockIdx.x % rows, bh = blockIdx.x / rows, b = bh / H, h = bh % H;
  const int64_t hs = C / H, ld = 3 * C, row = position + i, keys = row + 1;
  const T* base = cache + b * capacity * ld + h * hs;
  const T* q = base + row * ld;
  const float scale = rsqrtf(static_cast<float>(hs));
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < keys; j += blockDim.x) {
    const T* k = base + j * ld + C;
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
    for (int64_t j = 0; j < keys; ++j) acc += scores[j] * to_f32(base[j * ld + 2 * C + c]);
    o[c] = from_f32<T>(acc * inv);
  }
}

template <class E>
void attention_decode(E* out, const E* cache, int64_t B, int64_t rows, int64_t position, int64_t capacity, int64_t C,
                      int64_t H) {
  if (B == 0 || rows == 0) return;
  MPIPE_CHECK(H > 0 && C % H == 0, "attention: ", C, " channels do not split into ", H, " heads");
  MPIPE_CHECK(position + rows <= kMaxDecodeKeys, "attention decode: ", position + rows, " positions; the GPU takes up to ",
              kMaxDecodeKeys);
  const std::size_t shared = static_cast<std::size_t>(position + rows) * sizeof(float);
  attention_decode_kernel<<<static_cast<unsigned>(B * H * rows), 128, shared, context().compute>>>(
      dev(out), dev(cache), rows, position, capacity, C, H);
  CUDA_CHECK_LAUNCH();
}

template void attention_decode<float>(float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_decode<bf16>(bf16*, const bf16*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

template void attention_forward<float>(float*, float*, const float*, int64_t, int64_t, int64_t, int64_t);
template void attention_forward<bf16>(bf16*, float*, const bf16*, int64_t, int64_t, int64_t, int64_t);
template void attention_backward<float>(float*, const float*, const float*, const float*, const float*, int64_t,
                                        int64_t, int64_t, int64_t);
template void attention_backward<bf16>(bf16*, const bf16*, const bf16*, const bf16*, const float*, int64_t, int64_t,
                                       int64_t, int64_t);

}  // namespace mpipe::cuda
