// FlashAttention-2 for causal self-attention: no (T, T) matrix ever reaches global
// memory. The forward walks each query tile over its key tiles up to the diagonal with an
// online softmax and keeps only O and each row's log-sum-exp; the backward recomputes
// P = exp(S - lse) tile by tile. q, k and v are read in place from the (B, T, C + 2 KV)
// layout: per row H query heads, then KVH key heads, then KVH value heads, each hs wide
// (KV = KVH hs); query head h reads key/value head h / (H / KVH) (grouped-query
// attention; KVH = H: multi-head, rows of 3C).
//
// Determinism: no atomics. The backward splits into a kernel per key tile that sums dK
// and dV over the query tiles in order, and a kernel per query tile that sums dQ over
// the key tiles in order; every reduction (row max, row sum) has a fixed shape. Under
// grouped-query attention the key tile's block walks its group's H / KVH query heads in
// ascending order, each over its query tiles in order, into the same accumulators: dK
// and dV of a key/value head are whole when the block ends, written once (no partials,
// no second pass). With KVH = H the group is one head and every kernel does what it did
// before groups existed, in the same order: the same bits.
//
// This header: the constants and the launch shared by the fused kernels, the tensor-core
// building blocks of the bf16 kernels (PTX wrappers, shared-memory tiles, warp tiles),
// and the per-type entry points Fused<E> that attention.cu dispatches to, defined in
// flash_bf16.cu (tensor cores) and flash_f32.cu (CUDA cores). Included only by
// src/backend/cuda/*.cu.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels.cuh"

namespace mpipe::cuda::flash {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// Every fused kernel runs 4 warps: in the bf16 kernels each warp owns 16 or 32 rows of
// the block's tile (one or two m16 MMA slabs), in the fp32 kernels 4 threads share each
// of 32 rows.
constexpr int kFlashThreads = 128;
// Grid y counts tiles along T.
constexpr int64_t kMaxTiles = 65535;
// Rows of the fp32 kernels' tiles (queries and keys alike).
constexpr int kF32Rows = 32;

using bf16_t = __nv_bfloat16;

// ---- PTX wrappers (sm_80+) -------------------------------------------------------------

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without a register round trip; with valid == false nothing is
// read and the 16 bytes are zero-filled (rows beyond T, columns beyond hs).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register
// i receives matrix i in the mma fragment layout (lane l: row l/4, columns 2(l%4), +1).
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
// The same, each matrix transposed (lane l: rows 2(l%4), +1, column l/4).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

// d (16x8, fp32) += a (16x16, bf16, row) · b (16x8, bf16, col). Fragments per lane
// (g = lane / 4, c = 2 (lane % 4)): a {(g, c..c+1), (g+8, c..), (g, c+8..), (g+8, c+8..)},
// b {(k c..c+1, n g), (k c+8.., n g)}, d {(g, c), (g, c+1), (g+8, c), (g+8, c+1)}.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, `lo` in the low half (the lower column of a fragment).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return static_cast<unsigned>(__bfloat16_as_ushort(v.x)) | (static_cast<unsigned>(__bfloat16_as_ushort(v.y)) << 16);
}

// 2^x on the SFU, flushing results below 2^-126 to zero: for the bf16 kernels, whose P
// is rounded to bf16 (and whose row sums start at 1) before such a value could matter.
// exp2(-inf) = +0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The A fragments (16 x 16 keys) of a product whose left operand is held as two adjacent
// 16x8 accumulator tiles: FlashAttention-2's register reuse of P (and dS) for P·V.
__device__ __forceinline__ void accumulators_as_a(unsigned (&a)[4], const float (&left)[4], const float (&right)[4]) {
  a[0] = pack_bf16(left[0], left[1]);
  a[1] = pack_bf16(left[2], left[3]);
  a[2] = pack_bf16(right[0], right[1]);
  a[3] = pack_bf16(right[2], right[3]);
}

// ---- bf16 tiles in shared memory -------------------------------------------------------
// A tile is ROWS x HD bf16 at a row stride of HD + 8: the 16-byte skew puts the 8 rows
// of each ldmatrix on distinct banks (row strides of 80, 144 and 272 bytes).

template <int HD>
constexpr int tile_stride = HD + 8;

// Rows [row0, row0 + ROWS) of one head's matrix, whose row t starts at src + t * ld,
// into s; rows at or beyond T and columns at or beyond hs become zeros, so a padded head
// dimension adds nothing to a dot product. VEC: 16-byte cp.async (hs % 8 == 0 and src
// 16-byte aligned), in flight until cp_async_wait; otherwise element loads.
template <int ROWS, int HD, bool VEC>
__device__ __forceinline__ void load_tile(bf16_t* s, const bf16_t* src, int64_t ld, int row0, int T, int hs) {
  constexpr int LD = tile_stride<HD>;
  if constexpr (VEC) {
    constexpr int kChunks = HD / 8;
    static_assert(ROWS * kChunks % kFlashThreads == 0);
    // Not unrolled: unrolled, the compiler keeps one 64-bit address per chunk live
    // across the whole key loop (60+ registers at HD 128).
#pragma unroll 1
    for (int i = 0; i < ROWS * kChunks / kFlashThreads; ++i) {
      const int c = i * kFlashThreads + static_cast<int>(threadIdx.x);
      const int r = c / kChunks, d = c % kChunks * 8, t = row0 + r;
      const bool valid = t < T && d < hs;
      cp_async16(s + r * LD + d, valid ? src + static_cast<int64_t>(t) * ld + d : src, valid);
    }
  } else {
    for (int e = static_cast<int>(threadIdx.x); e < ROWS * HD; e += kFlashThreads) {
      const int r = e / HD, d = e % HD, t = row0 + r;
      s[r * LD + d] = t < T && d < hs ? src[static_cast<int64_t>(t) * ld + d] : __ushort_as_bfloat16(0);
    }
  }
}

// The inverse for results: tile rows < T and columns < hs to dst (row t at dst + t * ld).
template <int ROWS, int HD, bool VEC>
__device__ __forceinline__ void store_tile(bf16_t* dst, int64_t ld, const bf16_t* s, int row0, int T, int hs) {
  constexpr int LD = tile_stride<HD>;
  if constexpr (VEC) {
    constexpr int kChunks = HD / 8;
    static_assert(ROWS * kChunks % kFlashThreads == 0);
#pragma unroll 1
    for (int i = 0; i < ROWS * kChunks / kFlashThreads; ++i) {
      const int c = i * kFlashThreads + static_cast<int>(threadIdx.x);
      const int r = c / kChunks, d = c % kChunks * 8, t = row0 + r;
      if (t < T && d < hs)
        *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(t) * ld + d) =
            *reinterpret_cast<const uint4*>(s + r * LD + d);
    }
  } else {
    for (int e = static_cast<int>(threadIdx.x); e < ROWS * HD; e += kFlashThreads) {
      const int r = e / HD, d = e % HD, t = row0 + r;
      if (t < T && d < hs) dst[static_cast<int64_t>(t) * ld + d] = s[r * LD + d];
    }
  }
}

// ---- warp tiles ------------------------------------------------------------------------
// Each warp owns MS slabs of 16 rows (an m16 MMA each) of its block's row tile, and
// multiplies them by operands in shared memory that all warps read whole. Two slabs let
// each B fragment feed two MMAs, halving the shared-memory reads per MMA (what bounds
// mma.sync kernels); the accumulators allow that up to HD 64.
template <int HD>
constexpr int kSlabs = HD <= 64 ? 2 : 1;
// Rows of a block's tile: 4 warps x 16 MS.
template <int HD>
constexpr int kWarpRows = 16 * kSlabs<HD>;
template <int HD>
constexpr int kBlockRows = kFlashThreads / 32 * kWarpRows<HD>;

// acc[ms] (16 x 8 NB) += A_ms · B^T, A_ms = rows 16 ms.. of `a` (row-major, HD wide), B
// the first 8 NB rows of `b` (row-major, HD wide): the S = Q K^T and dP = dO V^T shapes.
template <int HD, int MS, int NB>
__device__ __forceinline__ void mma_a_bt(float (&acc)[MS][NB][4], const bf16_t* a, const bf16_t* b) {
  constexpr int LD = tile_stride<HD>;
  static_assert(NB % 2 == 0);
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int ks = 0; ks < HD / 16; ++ks) {
    // Matrices: rows 0..7, 8..15 at column k, then both at k + 8: a0..a3 of the fragment.
    unsigned af[MS][4];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) ldmatrix_x4(af[ms], a + (ms * 16 + lane % 16) * LD + ks * 16 + lane / 16 * 8);
#pragma unroll
    for (int j = 0; j < NB / 2; ++j) {
      // Matrices: rows 16j..+7 at k, k+8, then rows 16j+8..+15 at k, k+8: (b0, b1) of
      // two 8-column blocks.
      unsigned bf[4];
      ldmatrix_x4(bf, b + (j * 16 + lane % 8 + lane / 16 * 8) * LD + ks * 16 + lane / 8 % 2 * 8);
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        mma_bf16(acc[ms][2 * j], af[ms], bf[0], bf[1]);
        mma_bf16(acc[ms][2 * j + 1], af[ms], bf[2], bf[3]);
      }
    }
  }
}

// acc[ms] (16 x HD) += P_ms · B, P_ms (16 x 16 KB) held in accumulator tiles p[ms][2 KB]
// and B the first 16 KB rows of `b` (row-major, HD wide): the O = P V, dV = P^T dO and
// dQ = dS K shapes.
template <int HD, int MS, int KB>
__device__ __forceinline__ void mma_p_b(float (&acc)[MS][HD / 8][4], const float (&p)[MS][2 * KB][4],
                                        const bf16_t* b) {
  constexpr int LD = tile_stride<HD>;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < KB; ++kk) {
    unsigned af[MS][4];
#pragma unroll
    for (int ms = 0; ms < MS; ++ms) accumulators_as_a(af[ms], p[ms][2 * kk], p[ms][2 * kk + 1]);
#pragma unroll
    for (int db = 0; db < HD / 16; ++db) {
      // Transposed matrices: rows 16kk..+7 then 16kk+8..+15 at columns 16db, then both at
      // 16db + 8: (b0, b1) of two 8-column blocks.
      unsigned bf[4];
      ldmatrix_x4_trans(bf, b + (kk * 16 + lane % 8 + lane / 8 % 2 * 8) * LD + db * 16 + lane / 16 * 8);
#pragma unroll
      for (int ms = 0; ms < MS; ++ms) {
        mma_bf16(acc[ms][2 * db], af[ms], bf[0], bf[1]);
        mma_bf16(acc[ms][2 * db + 1], af[ms], bf[2], bf[3]);
      }
    }
  }
}

// A warp's accumulators (MS slabs of 16 x 8 NB) times `mul`, as bf16 into its rows of a
// tile (s = the warp's first row): the way out through shared memory, for 16-byte stores.
template <int MS, int NB>
__device__ __forceinline__ void stage_accumulators(bf16_t* s, int ld, const float (&acc)[MS][NB][4],
                                                   const float (&mul)[MS][2]) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = 2 * (lane % 4);
#pragma unroll
  for (int ms = 0; ms < MS; ++ms)
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
      bf16_t* at = s + (ms * 16 + g) * ld + nb * 8 + c;
      *reinterpret_cast<unsigned*>(at) = pack_bf16(acc[ms][nb][0] * mul[ms][0], acc[ms][nb][1] * mul[ms][0]);
      *reinterpret_cast<unsigned*>(at + 8 * ld) =
          pack_bf16(acc[ms][nb][2] * mul[ms][1], acc[ms][nb][3] * mul[ms][1]);
    }
}

// The same factor for every row.
template <int MS>
__device__ __forceinline__ void fill_factor(float (&mul)[MS][2], float value) {
#pragma unroll
  for (int ms = 0; ms < MS; ++ms) mul[ms][0] = mul[ms][1] = value;
}

// ---- launches ----------------------------------------------------------------------------

// The fused kernels' sizes: T and the tile counts in int; (b, h) pairs on grid x, or
// (b, key/value head) pairs for the dK, dV kernels.
struct Flash {
  int BH, T, H, hs;
  int KVH, BKV;  // key/value heads, B KVH
  float scale, scale_log2;
};

// Where a row's heads lie in qkv (B, T, C + 2 KV): row stride ld, query head h at h hs,
// key head j at C + j hs, value head j at C + KV + j hs.
struct HeadLayout {
  int64_t C, KV, ld;
  int group;  // query heads per key/value head, H / KVH
  __host__ __device__ HeadLayout(int H, int KVH, int hs)
      : C(static_cast<int64_t>(H) * hs), KV(static_cast<int64_t>(KVH) * hs), ld(C + 2 * KV), group(H / KVH) {}
  // Offsets within a row of the key and the value head query head h reads.
  __host__ __device__ int64_t k_at(int h, int hs) const { return C + static_cast<int64_t>(h / group) * hs; }
  __host__ __device__ int64_t v_at(int h, int hs) const { return C + KV + static_cast<int64_t>(h / group) * hs; }
};

// The head dimension a fused kernel pads hs to; 0 where none does.
inline int padded_head_dim(int64_t hs) { return hs <= 32 ? 32 : hs <= 64 ? 64 : hs <= 128 ? 128 : 0; }

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), int64_t tiles, int BH, std::size_t smem, Args... args) {
  // Beyond 48 KB a kernel must opt in, once per kernel (its size is fixed by its head
  // dimension). Kernels of one signature share this instantiation, so the ones done are
  // kept by address; launches come from the rank's one compute thread.
  if (smem > 48 * 1024) {
    static std::vector<const void*> opted_in;
    const void* key = reinterpret_cast<const void*>(kernel);
    if (std::find(opted_in.begin(), opted_in.end(), key) == opted_in.end()) {
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      opted_in.push_back(key);
    }
  }
  const dim3 grid(static_cast<unsigned>(BH), static_cast<unsigned>(tiles));
  kernel<<<grid, kFlashThreads, smem, context().compute>>>(args...);
  CUDA_CHECK_LAUNCH();
}

// Per element type: the shared memory the fused kernels need at head dimension HD, and
// their launches.
template <class E>
struct Fused;

// Defined in flash_bf16.cu.
template <>
struct Fused<bf16> {
  static std::size_t smem(int HD);
  static void forward(bf16* out, float* lse, const bf16* qkv, const Flash& f);
  static void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* dots,
                       const Flash& f);
};

// Defined in flash_f32.cu.
template <>
struct Fused<float> {
  static std::size_t smem(int HD);
  static void forward(float* out, float* lse, const float* qkv, const Flash& f);
  static void backward(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* dots,
                       const Flash& f);
};

}  // namespace mpipe::cuda::flash
