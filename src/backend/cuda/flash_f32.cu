// FlashAttention-2 in fp32 on CUDA-core FMAs (see flash.cuh), for hs <= 128: the same
// algorithm as the bf16 kernels in 32 x 32 tiles, the reference-precision path. The
// forward, the dK/dV and the dQ kernel, and their launches (Fused<float>).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "flash.cuh"

namespace mpipe::cuda::flash {

namespace {

// ---- fp32 (CUDA cores) ---------------------------------------------------------------------
// The same three kernels in fp32 FMAs, tiles of 32 rows: thread t owns row t / 4 of the
// block's tile, score columns t % 4 + 4j and output columns t % 4 + 4k, so a row's four
// threads are one quad of a warp (reduced with two shuffles). Tiles are padded to a row
// stride of HD + 1 floats, which puts the rows that a warp reads on distinct banks.

template <int HD>
constexpr int f32_stride = HD + 1;
constexpr int kF32ScoreStride = kF32Rows + 1;

template <int ROWS, int HD>
__device__ __forceinline__ void load_tile_f32(float* s, const float* src, int64_t ld, int row0, int T, int hs) {
  constexpr int LD = f32_stride<HD>;
  for (int e = static_cast<int>(threadIdx.x); e < ROWS * HD; e += kFlashThreads) {
    const int r = e / HD, d = e % HD, t = row0 + r;
    s[r * LD + d] = t < T && d < hs ? src[static_cast<int64_t>(t) * ld + d] : 0.0f;
  }
}

template <int HD>
constexpr std::size_t forward_smem_f32 =
    (std::size_t{3} * kF32Rows * f32_stride<HD> + std::size_t{kF32Rows} * kF32ScoreStride) * sizeof(float);

template <int HD>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_f32(float* out, float* lse, const float* qkv, int T, int H, int KVH, int hs, float scale_log2) {
  constexpr int LD = f32_stride<HD>, BR = kF32Rows, BC = kF32Rows, SL = kF32ScoreStride, DK = HD / 4;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  float* Qs = reinterpret_cast<float*>(flash_smem);
  float* Ks = Qs + BR * LD;
  float* Vs = Ks + BC * LD;
  float* Ps = Vs + BC * LD;

  const int r = threadIdx.x / 4, c4 = threadIdx.x % 4;
  const int m = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int bh = static_cast<int>(blockIdx.x), b = bh / H, h = bh % H;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  const float* sample = qkv + static_cast<int64_t>(b) * T * ld;
  const float* q = sample + static_cast<int64_t>(h) * hs;
  const float* k = sample + heads.k_at(h, hs);
  const float* v = sample + heads.v_at(h, hs);
  const int q0 = m * BR, row = q0 + r;
  load_tile_f32<BR, HD>(Qs, q, ld, q0, T, hs);

  float o[DK] = {};
  float row_max = -INFINITY, row_sum = 0.0f;
  for (int n = 0; n <= m; ++n) {
    __syncthreads();  // the previous tile's readers are done
    load_tile_f32<BC, HD>(Ks, k, ld, n * BC, T, hs);
    load_tile_f32<BC, HD>(Vs, v, ld, n * BC, T, hs);
    __syncthreads();
    float s[BC / 4] = {};
    for (int d = 0; d < HD; ++d) {
      const float qd = Qs[r * LD + d];
#pragma unroll
      for (int j = 0; j < BC / 4; ++j) s[j] = fmaf(qd, Ks[(c4 + 4 * j) * LD + d], s[j]);
    }
    float mx = row_max;
#pragma unroll
    for (int j = 0; j < BC / 4; ++j) {
      if (n == m && n * BC + c4 + 4 * j > row) s[j] = -INFINITY;  // the diagonal tile
      mx = fmaxf(mx, s[j] * scale_log2);
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float base = mx == -INFINITY ? 0.0f : mx;
    const float alpha = exp2f(row_max - base);
    row_max = mx;
    row_sum *= alpha;
#pragma unroll
    for (int k = 0; k < DK; ++k) o[k] *= alpha;
#pragma unroll
    for (int j = 0; j < BC / 4; ++j) {
      const float p = exp2f(fmaf(s[j], scale_log2, -base));
      row_sum += p;
      Ps[r * SL + c4 + 4 * j] = p;
    }
    __syncwarp();  // a row's P comes from its own quad
    for (int j = 0; j < BC; ++j) {
      const float p = Ps[r * SL + j];
#pragma unroll
      for (int k = 0; k < DK; ++k) o[k] = fmaf(p, Vs[j * LD + c4 + 4 * k], o[k]);
    }
  }
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
  row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);
  if (row >= T) return;
  if (c4 == 0) lse[static_cast<int64_t>(bh) * T + row] = (row_max + log2f(row_sum)) * kLn2;
  const float inv = 1.0f / row_sum;
  float* dst = out + (static_cast<int64_t>(b) * T + row) * C + static_cast<int64_t>(h) * hs;
#pragma unroll
  for (int k = 0; k < DK; ++k)
    if (c4 + 4 * k < hs) dst[c4 + 4 * k] = o[k] * inv;
}

template <int HD>
constexpr std::size_t kv_smem_f32 = (std::size_t{4} * kF32Rows * f32_stride<HD> +
                                     std::size_t{2} * kF32Rows * kF32ScoreStride + std::size_t{2} * kF32Rows) *
                                    sizeof(float);

// Block: 32 keys of one key/value head; thread rows are keys, score columns are queries,
// of each query head of the group in turn.
template <int HD>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_kv_f32(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* dots, int T,
                          int H, int KVH, int hs, float scale_log2, float scale) {
  constexpr int LD = f32_stride<HD>, BR = kF32Rows, BC = kF32Rows, SL = kF32ScoreStride, DK = HD / 4;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  float* Ks = reinterpret_cast<float*>(flash_smem);
  float* Vs = Ks + BC * LD;
  float* Qs = Vs + BC * LD;
  float* dOs = Qs + BR * LD;
  float* Pt = dOs + BR * LD;
  float* dSt = Pt + BC * SL;
  float* lse_s = dSt + BC * SL;  // times log2 e
  float* dot_s = lse_s + BR;

  const int r = threadIdx.x / 4, c4 = threadIdx.x % 4;
  const int n = static_cast<int>(blockIdx.y);
  const int bkv = static_cast<int>(blockIdx.x), b = bkv / KVH, kv_head = bkv % KVH;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  const int64_t sample = static_cast<int64_t>(b) * T * ld, kv_at = sample + heads.k_at(kv_head * heads.group, hs);
  const int k0 = n * BC, key = k0 + r;
  const int m_count = static_cast<int>(ceil_div(T, BR));
  load_tile_f32<BC, HD>(Ks, qkv + kv_at, ld, k0, T, hs);
  load_tile_f32<BC, HD>(Vs, qkv + kv_at + heads.KV, ld, k0, T, hs);

  float dk[DK] = {}, dv[DK] = {};
  // The group's query heads in ascending order (one, the block's own, when KVH = H),
  // each over its query tiles from the diagonal (BR == BC: query tile n holds it) on.
  const int per_head = m_count - n;
  for (int step = 0; step < heads.group * per_head; ++step) {
    const int m = n + step % per_head, h = kv_head * heads.group + step / per_head, bh = b * H + h;
    const float* q = qkv + sample + static_cast<int64_t>(h) * hs;
    const float* dO = dout + static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs;
    const int q0 = m * BR;
    __syncthreads();  // the previous tile's readers are done
    load_tile_f32<BR, HD>(Qs, q, ld, q0, T, hs);
    load_tile_f32<BR, HD>(dOs, dO, C, q0, T, hs);
    if (threadIdx.x < BR) {
      const int t = q0 + static_cast<int>(threadIdx.x);
      lse_s[threadIdx.x] = t < T ? lse[static_cast<int64_t>(bh) * T + t] * kLog2e : INFINITY;
      dot_s[threadIdx.x] = t < T ? dots[static_cast<int64_t>(bh) * T + t] : 0.0f;
    }
    __syncthreads();
    float s[BR / 4] = {}, dp[BR / 4] = {};
    for (int d = 0; d < HD; ++d) {
      const float kd = Ks[r * LD + d], vd = Vs[r * LD + d];
#pragma unroll
      for (int j = 0; j < BR / 4; ++j) {
        s[j] = fmaf(kd, Qs[(c4 + 4 * j) * LD + d], s[j]);
        dp[j] = fmaf(vd, dOs[(c4 + 4 * j) * LD + d], dp[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < BR / 4; ++j) {
      const int col = c4 + 4 * j;
      float p = exp2f(fmaf(s[j], scale_log2, -lse_s[col]));
      if (m == n && key > q0 + col) p = 0.0f;
      Pt[r * SL + col] = p;
      dSt[r * SL + col] = p * (dp[j] - dot_s[col]);
    }
    __syncwarp();  // a key row's P^T and dS^T come from its own quad
    for (int j = 0; j < BR; ++j) {
      const float p = Pt[r * SL + j], ds = dSt[r * SL + j];
#pragma unroll
      for (int k = 0; k < DK; ++k) {
        dv[k] = fmaf(p, dOs[j * LD + c4 + 4 * k], dv[k]);
        dk[k] = fmaf(ds, Qs[j * LD + c4 + 4 * k], dk[k]);
      }
    }
  }
  if (key >= T) return;
  float* dst = dqkv + kv_at + static_cast<int64_t>(key) * ld;
#pragma unroll
  for (int k = 0; k < DK; ++k)
    if (c4 + 4 * k < hs) {
      dst[c4 + 4 * k] = dk[k] * scale;
      dst[heads.KV + c4 + 4 * k] = dv[k];
    }
}

template <int HD>
constexpr std::size_t q_smem_f32 =
    (std::size_t{4} * kF32Rows * f32_stride<HD> + std::size_t{kF32Rows} * kF32ScoreStride) * sizeof(float);

// Block: 32 query rows.
template <int HD>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_q_f32(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* dots, int T,
                         int H, int KVH, int hs, float scale_log2, float scale) {
  constexpr int LD = f32_stride<HD>, BR = kF32Rows, BC = kF32Rows, SL = kF32ScoreStride, DK = HD / 4;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  float* Qs = reinterpret_cast<float*>(flash_smem);
  float* dOs = Qs + BR * LD;
  float* Ks = dOs + BR * LD;
  float* Vs = Ks + BC * LD;
  float* dSs = Vs + BC * LD;

  const int r = threadIdx.x / 4, c4 = threadIdx.x % 4;
  const int m = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int bh = static_cast<int>(blockIdx.x), b = bh / H, h = bh % H;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  const int64_t sample = static_cast<int64_t>(b) * T * ld, q_at = sample + static_cast<int64_t>(h) * hs;
  const float* q = qkv + q_at;
  const float* k = qkv + sample + heads.k_at(h, hs);
  const float* v = qkv + sample + heads.v_at(h, hs);
  const int q0 = m * BR, row = q0 + r;
  load_tile_f32<BR, HD>(Qs, q, ld, q0, T, hs);
  load_tile_f32<BR, HD>(dOs, dout + static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs, C, q0, T, hs);
  const float row_lse = row < T ? lse[static_cast<int64_t>(bh) * T + row] * kLog2e : INFINITY;
  const float row_dot = row < T ? dots[static_cast<int64_t>(bh) * T + row] : 0.0f;

  float dq[DK] = {};
  for (int n = 0; n <= m; ++n) {
    __syncthreads();  // the previous tile's readers are done
    load_tile_f32<BC, HD>(Ks, k, ld, n * BC, T, hs);
    load_tile_f32<BC, HD>(Vs, v, ld, n * BC, T, hs);
    __syncthreads();
    float s[BC / 4] = {}, dp[BC / 4] = {};
    for (int d = 0; d < HD; ++d) {
      const float qd = Qs[r * LD + d], od = dOs[r * LD + d];
#pragma unroll
      for (int j = 0; j < BC / 4; ++j) {
        s[j] = fmaf(qd, Ks[(c4 + 4 * j) * LD + d], s[j]);
        dp[j] = fmaf(od, Vs[(c4 + 4 * j) * LD + d], dp[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < BC / 4; ++j) {
      const int col = c4 + 4 * j;
      float p = exp2f(fmaf(s[j], scale_log2, -row_lse));
      if (n == m && n * BC + col > row) p = 0.0f;
      dSs[r * SL + col] = p * (dp[j] - row_dot);
    }
    __syncwarp();  // a row's dS comes from its own quad
    for (int j = 0; j < BC; ++j) {
      const float ds = dSs[r * SL + j];
#pragma unroll
      for (int k = 0; k < DK; ++k) dq[k] = fmaf(ds, Ks[j * LD + c4 + 4 * k], dq[k]);
    }
  }
  if (row >= T) return;
  float* dst = dqkv + q_at + static_cast<int64_t>(row) * ld;
#pragma unroll
  for (int k = 0; k < DK; ++k)
    if (c4 + 4 * k < hs) dst[c4 + 4 * k] = dq[k] * scale;
}

// ---- launches ----------------------------------------------------------------------------

template <int HD>
void forward_at(float* out, float* lse, const float* qkv, const Flash& f) {
  launch(flash_forward_f32<HD>, ceil_div(f.T, kF32Rows), f.BH, forward_smem_f32<HD>, out, lse, qkv, f.T, f.H, f.KVH,
         f.hs, f.scale_log2);
}
template <int HD>
void backward_at(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* dots,
                 const Flash& f) {
  launch(flash_backward_kv_f32<HD>, ceil_div(f.T, kF32Rows), f.BKV, kv_smem_f32<HD>, dqkv, dout, qkv, lse, dots, f.T,
         f.H, f.KVH, f.hs, f.scale_log2, f.scale);
  launch(flash_backward_q_f32<HD>, ceil_div(f.T, kF32Rows), f.BH, q_smem_f32<HD>, dqkv, dout, qkv, lse, dots, f.T,
         f.H, f.KVH, f.hs, f.scale_log2, f.scale);
}

}  // namespace

std::size_t Fused<float>::smem(int HD) {
  return HD == 32   ? std::max({forward_smem_f32<32>, kv_smem_f32<32>, q_smem_f32<32>})
         : HD == 64 ? std::max({forward_smem_f32<64>, kv_smem_f32<64>, q_smem_f32<64>})
                    : std::max({forward_smem_f32<128>, kv_smem_f32<128>, q_smem_f32<128>});
}

void Fused<float>::forward(float* out, float* lse, const float* qkv, const Flash& f) {
  const int HD = padded_head_dim(f.hs);
  if (HD == 32) forward_at<32>(out, lse, qkv, f);
  else if (HD == 64) forward_at<64>(out, lse, qkv, f);
  else forward_at<128>(out, lse, qkv, f);
}

void Fused<float>::backward(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* dots,
                            const Flash& f) {
  const int HD = padded_head_dim(f.hs);
  if (HD == 32) backward_at<32>(dqkv, dout, qkv, lse, dots, f);
  else if (HD == 64) backward_at<64>(dqkv, dout, qkv, lse, dots, f);
  else backward_at<128>(dqkv, dout, qkv, lse, dots, f);
}

}  // namespace mpipe::cuda::flash
