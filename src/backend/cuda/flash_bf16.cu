// FlashAttention-2 in bf16 on tensor cores (see flash.cuh), for hs <= 128: mma.sync
// m16n8k16, ldmatrix, cp.async double buffering, fp32 accumulation, P and dS rounded to
// bf16 for their products; hs padded with zeros to 32, 64 or 128 in shared memory.
// 16-byte copies when hs % 8 == 0 and the tensors are aligned, element copies otherwise
// (hs = 20, 60, ...). Blocks of 128 rows (64 at HD 128) against key tiles of 64 (32 in
// dQ at HD <= 64). The forward, the dK/dV and the dQ kernel, and their launches
// (Fused<bf16>).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "flash.cuh"

namespace mpipe::cuda::flash {

namespace {

// ---- bf16 forward ------------------------------------------------------------------------
// Block: one tile of query rows (128 for HD <= 64, 64 for HD 128) of one (b, h); key
// tiles of 64 up to the diagonal, double buffered (cp.async for tile n + 1 runs while
// tile n is used). Q lives in registers after the first tile. Shared memory: Q + 2 K +
// 2 V tiles = (rows + 256) x (HD + 8) bf16: 30, 54 or 85 KB for HD 32, 64, 128.

constexpr int kFwdKeys = 64;
template <int HD>
constexpr std::size_t forward_smem_bf16 =
    std::size_t{kBlockRows<HD> + 4 * kFwdKeys} * tile_stride<HD> * sizeof(bf16_t);

template <int HD, bool VEC>
__global__ void __launch_bounds__(kFlashThreads)
    flash_forward_bf16(bf16_t* out, float* lse, const bf16_t* qkv, int T, int H, int KVH, int hs, float scale_log2) {
  constexpr int LD = tile_stride<HD>, MS = kSlabs<HD>, BR = kBlockRows<HD>, BC = kFwdKeys, NB = HD / 8,
                KS = HD / 16;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  bf16_t* Qs = reinterpret_cast<bf16_t*>(flash_smem);
  bf16_t* Ks = Qs + BR * LD;  // two buffers
  bf16_t* Vs = Ks + 2 * BC * LD;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
  const int m = static_cast<int>(gridDim.y - 1 - blockIdx.y);  // the longest rows start first
  const int bh = static_cast<int>(blockIdx.x), b = bh / H, h = bh % H;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  const bf16_t* sample = qkv + static_cast<int64_t>(b) * T * ld;
  const bf16_t* q = sample + static_cast<int64_t>(h) * hs;
  const bf16_t* k = sample + heads.k_at(h, hs);
  const bf16_t* v = sample + heads.v_at(h, hs);
  const int q0 = m * BR, wrow = warp * kWarpRows<HD>;
  // This lane's rows: q0 + wrow + 16 ms + g + 8 r, r = 0, 1 (accumulator halves).
  const int row_base = q0 + wrow + g;
  // Key tiles up to the block's last row (the causal limit), and not beyond T.
  const int tiles = static_cast<int>(std::min(ceil_div(q0 + BR, BC), ceil_div(T, BC)));

  load_tile<BR, HD, VEC>(Qs, q, ld, q0, T, hs);
  load_tile<BC, HD, VEC>(Ks, k, ld, 0, T, hs);
  load_tile<BC, HD, VEC>(Vs, v, ld, 0, T, hs);
  cp_async_commit();

  unsigned qf[MS][KS][4];
  float o[MS][NB][4] = {};
  // Running max of the scaled scores in log2 units, and this lane's share of the row sum
  // (the quad's four shares are added once, at the end: each is rescaled alike).
  float row_max[MS][2], row_sum[MS][2];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int r = 0; r < 2; ++r) row_max[ms][r] = -INFINITY, row_sum[ms][r] = 0.0f;

  for (int n = 0; n < tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < tiles) {
      load_tile<BC, HD, VEC>(Ks + (buf ^ 1) * BC * LD, k, ld, (n + 1) * BC, T, hs);
      load_tile<BC, HD, VEC>(Vs + (buf ^ 1) * BC * LD, v, ld, (n + 1) * BC, T, hs);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
          ldmatrix_x4(qf[ms][ks], Qs + (wrow + ms * 16 + lane % 16) * LD + ks * 16 + lane / 16 * 8);
    }
    const bf16_t* Kt = Ks + buf * BC * LD;
    const bf16_t* Vt = Vs + buf * BC * LD;

    // S = Q K^T for the warp's rows x 64 keys (mma_a_bt with Q from registers).
    float s[MS][BC / 8][4] = {};
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
      for (int j = 0; j < BC / 16; ++j) {
        unsigned bf[4];
        ldmatrix_x4(bf, Kt + (j * 16 + lane % 8 + lane / 16 * 8) * LD + ks * 16 + lane / 8 % 2 * 8);
#pragma unroll
        for (int ms = 0; ms < MS; ++ms) {
          mma_bf16(s[ms][2 * j], qf[ms][ks], bf[0], bf[1]);
          mma_bf16(s[ms][2 * j + 1], qf[ms][ks], bf[2], bf[3]);
        }
      }
    }
    if (n * BC + BC - 1 > q0) {  // some key here comes after some row: key j > row i is masked
#pragma unroll
      for (int ms = 0; ms < MS; ++ms)
#pragma unroll
        for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (n * BC + nb * 8 + c + (e & 1) > row_base + ms * 16 + e / 2 * 8) s[ms][nb][e] = -INFINITY;
    }

    // Online softmax per row, in log2 units: exp(x) = exp2(x log2 e).
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[ms][r];
#pragma unroll
        for (int nb = 0; nb < BC / 8; ++nb)
          mx = fmaxf(mx, fmaxf(s[ms][nb][2 * r], s[ms][nb][2 * r + 1]) * scale_log2);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Tile 0 holds key 0, which no row masks, so every row's max is finite from the
        // first tile on; the guard only keeps exp2 free of NaN should that ever change.
        const float base = mx == -INFINITY ? 0.0f : mx;
        const float alpha = fast_exp2(row_max[ms][r] - base);
        row_max[ms][r] = mx;
        row_sum[ms][r] *= alpha;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          o[ms][nb][2 * r] *= alpha;
          o[ms][nb][2 * r + 1] *= alpha;
        }
#pragma unroll
        for (int nb = 0; nb < BC / 8; ++nb)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float p = fast_exp2(fmaf(s[ms][nb][e], scale_log2, -base));
            s[ms][nb][e] = p;
            row_sum[ms][r] += p;
          }
      }

    // O += P V, P rounded to bf16 as the MMA takes it; the row sums stay in fp32.
    mma_p_b<HD, MS, BC / 16>(o, s, Vt);
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  float inv[MS][2];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[ms][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[ms][r] = 1.0f / sum;
      const int row = row_base + ms * 16 + 8 * r;
      if (c == 0 && row < T) lse[static_cast<int64_t>(bh) * T + row] = (row_max[ms][r] + log2f(sum)) * kLn2;
    }
  // O through the warp's own rows of the Q tile (Q now lives in registers).
  stage_accumulators(Qs + wrow * LD, LD, o, inv);
  __syncthreads();
  store_tile<BR, HD, VEC>(out + static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs, C, Qs, q0, T, hs);
}

// ---- bf16 backward: dK, dV ---------------------------------------------------------------
// Block: one tile of keys (128 for HD <= 64, 64 for HD 128) of one (b, key/value head),
// looping over the query tiles of 32 that see them (from the diagonal to T) in order, of
// each query head of its group in ascending order (one step sequence, so the double
// buffering runs on across a change of head). Each warp
// computes S^T = K Q^T directly, so P^T and dS^T are already the left operands of
// dV += P^T dO and dK += dS^T Q. Query tiles (Q, dO, their lse and D) are double
// buffered. Shared memory: K + V + 2 Q + 2 dO tiles, (2 keys + 128) x (HD + 8) bf16, and
// 4 x 32 floats: 31, 55 or 69 KB.

constexpr int kKvQueries = 32;
template <int HD>
constexpr std::size_t kv_smem_bf16 =
    std::size_t{2 * kBlockRows<HD> + 4 * kKvQueries} * tile_stride<HD> * sizeof(bf16_t) +
    std::size_t{4} * kKvQueries * sizeof(float);

template <int HD, bool VEC>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_kv_bf16(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse, const float* dots,
                           int T, int H, int KVH, int hs, float scale_log2, float scale) {
  constexpr int LD = tile_stride<HD>, MS = kSlabs<HD>, BC = kBlockRows<HD>, BR = kKvQueries, NQ = BR / 8;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  bf16_t* Ks = reinterpret_cast<bf16_t*>(flash_smem);
  bf16_t* Vs = Ks + BC * LD;
  bf16_t* Qs = Vs + BC * LD;       // two buffers
  bf16_t* dOs = Qs + 2 * BR * LD;  // two buffers
  float* lse_s = reinterpret_cast<float*>(dOs + 2 * BR * LD);  // two buffers, times log2 e
  float* dot_s = lse_s + 2 * BR;                                // two buffers

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
  const int n = static_cast<int>(blockIdx.y);  // the first key tiles see the most queries: first
  const int bkv = static_cast<int>(blockIdx.x), b = bkv / KVH, kv_head = bkv % KVH;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  // The group's first query head h0: its q and dO rows, lse and D; head h0 + j lies j hs
  // (j T) on.
  const int h0 = kv_head * heads.group;
  const bf16_t* q = qkv + static_cast<int64_t>(b) * T * ld + static_cast<int64_t>(h0) * hs;
  const bf16_t* dO = dout + static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h0) * hs;
  const float* lse_row = lse + (static_cast<int64_t>(b) * H + h0) * T;
  const float* dot_row = dots + (static_cast<int64_t>(b) * H + h0) * T;
  const int64_t kv_at = static_cast<int64_t>(b) * T * ld + heads.k_at(h0, hs);  // the key head; its values KV on
  const int k0 = n * BC, wrow = warp * kWarpRows<HD>;
  const int key_base = k0 + wrow + g;  // this lane's keys: key_base + 16 ms + 8 r
  // Query tiles before k0 / BR end before the first key: all masked.
  const int m_first = k0 / BR, m_count = static_cast<int>(ceil_div(T, BR));
  // Step i: query head h0 + i / per_head (the group's in ascending order), its query tile
  // m_first + i % per_head. KVH = H: one head, step i is tile m_first + i.
  const int per_head = m_count - m_first, steps = heads.group * per_head;

  // Queries beyond T get lse = +inf: P = exp2(-inf) = 0 there, and dO, D are zero.
  const auto load_queries = [&](int step, int buf) {
    const int j = step / per_head, m = m_first + (step - j * per_head);
    load_tile<BR, HD, VEC>(Qs + buf * BR * LD, q + static_cast<int64_t>(j) * hs, ld, m * BR, T, hs);
    load_tile<BR, HD, VEC>(dOs + buf * BR * LD, dO + static_cast<int64_t>(j) * hs, C, m * BR, T, hs);
    if (threadIdx.x < BR) {
      const int t = m * BR + static_cast<int>(threadIdx.x);
      const int64_t at = static_cast<int64_t>(j) * T + t;
      lse_s[buf * BR + threadIdx.x] = t < T ? lse_row[at] * kLog2e : INFINITY;
      dot_s[buf * BR + threadIdx.x] = t < T ? dot_row[at] : 0.0f;
    }
  };
  load_tile<BC, HD, VEC>(Ks, qkv + kv_at, ld, k0, T, hs);
  load_tile<BC, HD, VEC>(Vs, qkv + kv_at + heads.KV, ld, k0, T, hs);
  load_queries(0, 0);
  cp_async_commit();

  float dk[MS][HD / 8][4] = {}, dv[MS][HD / 8][4] = {};
  for (int step = 0; step < steps; ++step) {
    const int buf = step & 1;
    if (step + 1 < steps) {
      load_queries(step + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* Qt = Qs + buf * BR * LD;
    const bf16_t* dOt = dOs + buf * BR * LD;
    const float* lt = lse_s + buf * BR;
    const float* dt = dot_s + buf * BR;
    const int q0 = (m_first + step % per_head) * BR;

    // P^T = exp(S^T scale - lse): keys (rows) x queries (columns). Masked entries are
    // selected away (never multiplied: exp2 of a masked score may overflow).
    float p[MS][NQ][4] = {};
    mma_a_bt<HD, MS, NQ>(p, Ks + wrow * LD, Qt);
    const bool diagonal = k0 + BC - 1 > q0;  // some key here comes after some query
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nb = 0; nb < NQ; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nb * 8 + c + (e & 1);
          const float x = fast_exp2(fmaf(p[ms][nb][e], scale_log2, -lt[col]));
          p[ms][nb][e] = diagonal && key_base + ms * 16 + e / 2 * 8 > q0 + col ? 0.0f : x;
        }
    // dP^T = V dO^T.
    float ds[MS][NQ][4] = {};
    mma_a_bt<HD, MS, NQ>(ds, Vs + wrow * LD, dOt);
    // dV += P^T dO.
    mma_p_b<HD, MS, NQ / 2>(dv, p, dOt);
    // dS^T = P^T (dP^T - D), D per query (column).
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nb = 0; nb < NQ; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[ms][nb][e] = p[ms][nb][e] * (ds[ms][nb][e] - dt[nb * 8 + c + (e & 1)]);
    // dK += dS^T Q (times scale at the end).
    mma_p_b<HD, MS, NQ / 2>(dk, ds, Qt);
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  // Through the warp's own rows of the (now unused) K and V tiles, for 16-byte stores.
  float k_factor[MS][2], v_factor[MS][2];
  fill_factor(k_factor, scale);
  fill_factor(v_factor, 1.0f);
  stage_accumulators(Ks + wrow * LD, LD, dk, k_factor);
  stage_accumulators(Vs + wrow * LD, LD, dv, v_factor);
  __syncthreads();
  store_tile<BC, HD, VEC>(dqkv + kv_at, ld, Ks, k0, T, hs);
  store_tile<BC, HD, VEC>(dqkv + kv_at + heads.KV, ld, Vs, k0, T, hs);
}

// ---- bf16 backward: dQ -------------------------------------------------------------------
// Block: one tile of query rows (as the forward's) of one (b, h), looping over the key
// tiles up to the diagonal in order, K and V double buffered; 32-key tiles at HD <= 64
// keep P, dS and dQ of two slabs within the registers. Shared memory: Q + dO + 2 K +
// 2 V tiles: 30, 54 or 102 KB.

template <int HD>
constexpr int kDqKeys = HD <= 64 ? 32 : 64;
template <int HD>
constexpr std::size_t q_smem_bf16 =
    std::size_t{2 * kBlockRows<HD> + 4 * kDqKeys<HD>} * tile_stride<HD> * sizeof(bf16_t);

template <int HD, bool VEC>
__global__ void __launch_bounds__(kFlashThreads)
    flash_backward_q_bf16(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse, const float* dots,
                          int T, int H, int KVH, int hs, float scale_log2, float scale) {
  constexpr int LD = tile_stride<HD>, MS = kSlabs<HD>, BR = kBlockRows<HD>, BC = kDqKeys<HD>, NK = BC / 8;
  extern __shared__ __align__(128) unsigned char flash_smem[];
  bf16_t* Qs = reinterpret_cast<bf16_t*>(flash_smem);
  bf16_t* dOs = Qs + BR * LD;
  bf16_t* Ks = dOs + BR * LD;  // two buffers
  bf16_t* Vs = Ks + 2 * BC * LD;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
  const int m = static_cast<int>(gridDim.y - 1 - blockIdx.y);  // the longest rows start first
  const int bh = static_cast<int>(blockIdx.x), b = bh / H, h = bh % H;
  const HeadLayout heads(H, KVH, hs);
  const int64_t C = heads.C, ld = heads.ld;
  const int64_t sample = static_cast<int64_t>(b) * T * ld, q_at = sample + static_cast<int64_t>(h) * hs;
  const bf16_t* q = qkv + q_at;
  const bf16_t* k = qkv + sample + heads.k_at(h, hs);
  const bf16_t* v = qkv + sample + heads.v_at(h, hs);
  const int q0 = m * BR, wrow = warp * kWarpRows<HD>;
  const int row_base = q0 + wrow + g;  // this lane's rows: row_base + 16 ms + 8 r
  const int tiles = static_cast<int>(std::min(ceil_div(q0 + BR, BC), ceil_div(T, BC)));

  load_tile<BR, HD, VEC>(Qs, q, ld, q0, T, hs);
  load_tile<BR, HD, VEC>(dOs, dout + static_cast<int64_t>(b) * T * C + static_cast<int64_t>(h) * hs, C, q0, T, hs);
  load_tile<BC, HD, VEC>(Ks, k, ld, 0, T, hs);
  load_tile<BC, HD, VEC>(Vs, v, ld, 0, T, hs);
  cp_async_commit();

  // This lane's rows: lse (times log2 e; +inf beyond T, so P = 0 there) and D.
  float row_lse[MS][2], row_dot[MS][2];
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row_base + ms * 16 + 8 * r;
      row_lse[ms][r] = row < T ? lse[static_cast<int64_t>(bh) * T + row] * kLog2e : INFINITY;
      row_dot[ms][r] = row < T ? dots[static_cast<int64_t>(bh) * T + row] : 0.0f;
    }
  float dq[MS][HD / 8][4] = {};

  for (int n = 0; n < tiles; ++n) {
    const int buf = n & 1;
    if (n + 1 < tiles) {
      load_tile<BC, HD, VEC>(Ks + (buf ^ 1) * BC * LD, k, ld, (n + 1) * BC, T, hs);
      load_tile<BC, HD, VEC>(Vs + (buf ^ 1) * BC * LD, v, ld, (n + 1) * BC, T, hs);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* Kt = Ks + buf * BC * LD;
    const bf16_t* Vt = Vs + buf * BC * LD;

    // P = exp(S scale - lse), masked entries selected away.
    float p[MS][NK][4] = {};
    mma_a_bt<HD, MS, NK>(p, Qs + wrow * LD, Kt);
    const bool diagonal = n * BC + BC - 1 > q0;  // some key here comes after some row
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nb = 0; nb < NK; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = fast_exp2(fmaf(p[ms][nb][e], scale_log2, -row_lse[ms][e / 2]));
          p[ms][nb][e] = diagonal && n * BC + nb * 8 + c + (e & 1) > row_base + ms * 16 + e / 2 * 8 ? 0.0f : x;
        }
    // dP = dO V^T, then dS = P (dP - D) in place.
    float ds[MS][NK][4] = {};
    mma_a_bt<HD, MS, NK>(ds, dOs + wrow * LD, Vt);
#pragma unroll
    for (int ms = 0; ms < MS; ++ms)
#pragma unroll
      for (int nb = 0; nb < NK; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[ms][nb][e] = p[ms][nb][e] * (ds[ms][nb][e] - row_dot[ms][e / 2]);
    // dQ += dS K (times scale at the end).
    mma_p_b<HD, MS, NK / 2>(dq, ds, Kt);
    __syncthreads();  // every warp is done with buffer `buf` before it is refilled
  }

  // Through this warp's own rows of the Q tile (no other warp reads them).
  float factor[MS][2];
  fill_factor(factor, scale);
  stage_accumulators(Qs + wrow * LD, LD, dq, factor);
  __syncthreads();
  store_tile<BR, HD, VEC>(dqkv + q_at, ld, Qs, q0, T, hs);
}

// ---- launches ----------------------------------------------------------------------------

template <int HD, bool VEC>
void forward_at(bf16_t* out, float* lse, const bf16_t* qkv, const Flash& f) {
  launch(flash_forward_bf16<HD, VEC>, ceil_div(f.T, kBlockRows<HD>), f.BH, forward_smem_bf16<HD>, out, lse, qkv, f.T,
         f.H, f.KVH, f.hs, f.scale_log2);
}
template <int HD, bool VEC>
void backward_at(bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse, const float* dots,
                 const Flash& f) {
  launch(flash_backward_kv_bf16<HD, VEC>, ceil_div(f.T, kBlockRows<HD>), f.BKV, kv_smem_bf16<HD>, dqkv, dout, qkv,
         lse, dots, f.T, f.H, f.KVH, f.hs, f.scale_log2, f.scale);
  launch(flash_backward_q_bf16<HD, VEC>, ceil_div(f.T, kBlockRows<HD>), f.BH, q_smem_bf16<HD>, dqkv, dout, qkv, lse,
         dots, f.T, f.H, f.KVH, f.hs, f.scale_log2, f.scale);
}
template <int HD>
void forward_vec(bool vec, bf16_t* out, float* lse, const bf16_t* qkv, const Flash& f) {
  if (vec) forward_at<HD, true>(out, lse, qkv, f);
  else forward_at<HD, false>(out, lse, qkv, f);
}
template <int HD>
void backward_vec(bool vec, bf16_t* dqkv, const bf16_t* dout, const bf16_t* qkv, const float* lse, const float* dots,
                  const Flash& f) {
  if (vec) backward_at<HD, true>(dqkv, dout, qkv, lse, dots, f);
  else backward_at<HD, false>(dqkv, dout, qkv, lse, dots, f);
}

}  // namespace

std::size_t Fused<bf16>::smem(int HD) {
  return HD == 32   ? std::max({forward_smem_bf16<32>, kv_smem_bf16<32>, q_smem_bf16<32>})
         : HD == 64 ? std::max({forward_smem_bf16<64>, kv_smem_bf16<64>, q_smem_bf16<64>})
                    : std::max({forward_smem_bf16<128>, kv_smem_bf16<128>, q_smem_bf16<128>});
}

void Fused<bf16>::forward(bf16* out, float* lse, const bf16* qkv, const Flash& f) {
  // 16-byte copies: whole 8-element chunks per head, at 16-byte aligned addresses
  // (the row strides C and C + 2 KV are then multiples of 8 elements as well).
  const bool vec = f.hs % 8 == 0 && all_aligned({out, qkv}, 16);
  const int HD = padded_head_dim(f.hs);
  if (HD == 32) forward_vec<32>(vec, dev(out), lse, dev(qkv), f);
  else if (HD == 64) forward_vec<64>(vec, dev(out), lse, dev(qkv), f);
  else forward_vec<128>(vec, dev(out), lse, dev(qkv), f);
}

void Fused<bf16>::backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dots,
                           const Flash& f) {
  const bool vec = f.hs % 8 == 0 && all_aligned({dqkv, dout, qkv}, 16);
  const int HD = padded_head_dim(f.hs);
  if (HD == 32) backward_vec<32>(vec, dev(dqkv), dev(dout), dev(qkv), lse, dots, f);
  else if (HD == 64) backward_vec<64>(vec, dev(dqkv), dev(dout), dev(qkv), lse, dots, f);
  else backward_vec<128>(vec, dev(dqkv), dev(dout), dev(qkv), lse, dots, f);
}

}  // namespace mpipe::cuda::flash
