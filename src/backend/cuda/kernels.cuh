// Device building blocks shared by the op kernels: element conversions, packed
// (16-byte) loads and stores and runs of them, warp and block reductions in a fixed order, launch sizes,
// and the carving of one scratch() region into several buffers. Included only by
// src/backend/cuda/*.cu.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "context.cuh"
#include "mpipe/backend/op_types.hpp"
#include "mpipe/core/rng.hpp"

namespace mpipe::cuda {

// ---- element conversions -------------------------------------------------------------

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---- packed loads and stores ---------------------------------------------------------

// W consecutive elements loaded or stored with one instruction (up to 16 bytes); the
// address must be aligned to the pack's size.
template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <int W, class T>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, W>*>(p);
}
template <int W, class T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& pack) {
  *reinterpret_cast<Pack<T, W>*>(p) = pack;
}

// Elements of T in a 16-byte pack.
template <class T>
constexpr int pack_width = static_cast<int>(16 / sizeof(T));

// q = a / b and r = a % b, in 32 bits when both fit (a fraction of a 64-bit division's
// cost). For a thread's set-up of its loop, never per element.
__device__ __forceinline__ void divmod(int64_t a, int64_t b, int64_t& q, int64_t& r) {
  if (a <= UINT32_MAX && b <= UINT32_MAX) {
    const unsigned a32 = static_cast<unsigned>(a), b32 = static_cast<unsigned>(b), q32 = a32 / b32;
    q = q32;
    r = a32 - q32 * b32;
  } else {
    q = a / b;
    r = a - q * b;
  }
}

// W elements at p: one packed access when `packed` (p aligned to the pack), else W scalar
// ones. The same elements either way: W is what orders sums, never `packed`.
template <int W, class T>
__device__ __forceinline__ Pack<T, W> load_run(const T* p, bool packed) {
  if (W > 1 && packed) return load_pack<W>(p);
  Pack<T, W> r;
#pragma unroll
  for (int j = 0; j < W; ++j) r.v[j] = p[j];
  return r;
}
template <int W, class T>
__device__ __forceinline__ void store_run(T* p, const Pack<T, W>& r, bool packed) {
  if (W > 1 && packed) {
    store_pack<W>(p, r);
    return;
  }
#pragma unroll
  for (int j = 0; j < W; ++j) p[j] = r.v[j];
}

// The widest pack of T (16 bytes, 8 bytes, one element) that divides `length`.
template <class T>
int width_for(int64_t length) {
  constexpr int wide = pack_width<T>;
  return length % wide == 0 ? wide : length % (wide / 2) == 0 ? wide / 2 : 1;
}
// f(std::integral_constant<int, W>{}) for W = width, one of width_for's answers.
template <class T, class F>
void with_width(int width, F f) {
  constexpr int wide = pack_width<T>;
  if (width == wide) f(std::integral_constant<int, wide>{});
  else if (width == wide / 2) f(std::integral_constant<int, wide / 2>{});
  else f(std::integral_constant<int, 1>{});
}

inline bool aligned(const void* p, std::size_t bytes) { return reinterpret_cast<std::uintptr_t>(p) % bytes == 0; }
inline bool all_aligned(std::initializer_list<const void*> pointers, std::size_t bytes) {
  return std::all_of(pointers.begin(), pointers.end(), [bytes](const void* p) { return aligned(p, bytes); });
}

// ---- reductions ----------------------------------------------------------------------
// Butterfly (xor) shuffles: every lane ends with the same bits, since each step adds the
// same two values (a + b == b + a exactly), so the result is a pure function of the
// inputs and their lanes.

struct Sum {
  template <class U>
  __device__ __forceinline__ U operator()(U a, U b) const { return a + b; }
};
struct Max {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <class U, class Op>
__device__ __forceinline__ U warp_reduce(U value, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Every thread of the block gets the reduction of `value` over the block; `identity`
// fills the lanes beyond the block's warps. blockDim.x must be a multiple of 32 and at
// most 1024. Safe to call repeatedly with the same `shared` (32 slots).
template <class U, class Op>
__device__ U block_reduce(U value, Op op, U identity, U* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  value = warp_reduce(value, op);
  __syncthreads();  // a previous call may still be reading `shared`
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x / 32) ? shared[lane] : identity;
  return warp_reduce(value, op);
}

// ---- dropout masks --------------------------------------------------------------------

// The four words of group `group` (elements 4 group to 4 group + 3) of sample b:
// RandomStream::block(group) of make_stream(seed, Stream::dropout, sample_begin + b, site,
// step), rebuilt from `first`, sample 0's stream (only `a` differs between samples).
__device__ __forceinline__ Philox4 dropout_words(const RandomStream& first, int64_t b, int64_t group) {
  const auto i = static_cast<uint64_t>(group);
  return philox4x32({static_cast<uint32_t>(i), first.a + static_cast<uint32_t>(b),
                     first.b ^ static_cast<uint32_t>(i >> 32), first.c},
                    first.key);
}

// The stream of a dropout key's first sample, which dropout_words rebuilds the others from.
inline RandomStream first_dropout_stream(const DropoutKey& key) {
  return make_stream(key.seed, Stream::dropout, static_cast<uint32_t>(key.sample_begin), key.site,
                     static_cast<uint32_t>(key.step));
}

// x dropped by word `word`: kept and scaled, or zero, rounded to T (dropout_apply's value).
// The product is __fmul_rn's, never contracted with a sum after it into one fused
// multiply-add: a one-pass op keeps the bits of dropout_apply and add in turn.
template <class T>
__device__ __forceinline__ float dropped(float x, uint32_t word, uint32_t threshold, float keep_scale) {
  return to_f32(from_f32<T>(word >= threshold ? __fmul_rn(x, keep_scale) : 0.0f));
}

// ---- launches ------------------------------------------------------------------------

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;  // for kernels that give each row one warp
constexpr int64_t kMaxBlocks = 1 << 16;  // grid-stride loops take the rest

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// Blocks for `work` items at `per_block` each, capped for grid-stride loops.
// Reductions across rows sum fixed chunks of rows first, then the chunks in order: the
// chunking depends on the row count alone (determinism).
constexpr int64_t kMaxRowChunks = 128;
inline int64_t rows_per_chunk(int64_t N) { return std::max<int64_t>(16, ceil_div(N, kMaxRowChunks)); }

inline unsigned blocks_for(int64_t work, int64_t per_block) {
  return static_cast<unsigned>(std::min(ceil_div(work, per_block), kMaxBlocks));
}

// Several temporaries of one op carved out of one scratch() region, each 256-byte
// aligned: first reserve() them all, then place them at base().
class ScratchPlan {
 public:
  template <class T>
  std::size_t reserve(int64_t count) {
    const std::size_t at = (bytes_ + 255) & ~std::size_t{255};
    bytes_ = at + static_cast<std::size_t>(count) * sizeof(T);
    return at;
  }
  std::size_t bytes() const { return bytes_; }

 private:
  std::size_t bytes_ = 0;
};
template <class T>
T* place(void* base, std::size_t at) {
  return reinterpret_cast<T*>(static_cast<char*>(base) + at);
}

}  // namespace mpipe::cuda
