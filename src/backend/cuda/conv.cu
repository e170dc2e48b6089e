// CUDA convolution, pooling and BatchNorm over NCHW: the CPU ops of src/backend/cpu/conv.cpp
// on the GPU (contracts in include/mpipe/backend/cuda/ops.hpp).
//
// Convolution's forward and input gradient run on cuDNN where it offers a deterministic
// algorithm for the shape (conv_dnn.cu). The weight gradient, which cuDNN would round to
// the weights' type, and every shape cuDNN declines, run as one GEMM
// per group over the whole micro-batch: the input unfolded into columns (C/g x KH x KW,
// N x OH x OW) whose column index runs over samples and positions together, so the weight
// gradient sums all samples inside one fp32-accumulating GEMM. Columns and products live
// in scratch() for the call only: nothing is held between a forward and its backward.
//
// Determinism: no atomics. The input gradient of the GEMM path is gathered (each input
// element sums the columns that read it, in a fixed order), pooling backward likewise,
// and every channel sum of BatchNorm is split into per-segment partial sums, each in one
// block, added up in segment order: the split and every order depend on the sizes alone.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "conv_dnn.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// ---- shared helpers ----------------------------------------------------------------------

// q = a / b and r = a % b, in 32 bits when both fit (a fraction of a 64-bit division's
// cost). For the per-thread set-up of the loops below, never per element.
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

// Kernels that copy runs (rows of a plane, planes of a sample) give each run a group of
// 2^lg lanes, the fewest covering `width` units up to a warp: a short run (a 7 x 7 plane's
// row, a 1 x 1 plane) leaves no lanes idle beyond its group's.
int group_lg(int64_t width) {
  int lg = 0;
  while (lg < 5 && (int64_t{1} << lg) < width) ++lg;
  return lg;
}
// Runs per group so a thread moves about this many elements (amortising its set-up).
constexpr int64_t kElementsPerThread = 32;
// Loads a copying lane issues before their stores: independent loads in flight.
constexpr int kCopyDepth = 4;

// ---- row permutation -------------------------------------------------------------------

// dst row (a B + b) = src row (b A + a) for a < A, b < B, rows of L elements (L / W packs
// of W): the swap of the outer two axes of (B, A, L), e.g. (N, OC, plane) -> (OC, N,
// plane). A pure copy. Each group of lanes copies whole rows, lanes over consecutive packs
// (coalesced both ways); a group's rows advance by a fixed step, (a, b) carried from one
// to the next without dividing.
template <class T, int W>
__global__ void permute_rows_kernel(T* __restrict__ dst, const T* __restrict__ src, int64_t A, int64_t B, int64_t L,
                                    int lg) {
  const int64_t packs = L / W, rows = A * B;
  const int G = 1 << lg, lane = static_cast<int>(threadIdx.x) & (G - 1);
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> lg;
  const int64_t groups = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> lg;
  if (group >= rows) return;
  int64_t a, b, da, db;
  divmod(group, B, a, b);
  divmod(groups, B, da, db);
  for (int64_t r = group; r < rows; r += groups) {
    const T* from = src + (b * A + a) * L;
    T* to = dst + r * L;
    for (int64_t q = lane; q < packs; q += kCopyDepth * G) {  // kCopyDepth loads in flight, then the stores
      Pack<T, W> v[kCopyDepth];
#pragma unroll
      for (int u = 0; u < kCopyDepth; ++u)
        if (q + u * G < packs) v[u] = load_pack<W>(from + (q + u * G) * W);
#pragma unroll
      for (int u = 0; u < kCopyDepth; ++u)
        if (q + u * G < packs) store_pack<W>(to + (q + u * G) * W, v[u]);
    }
    a += da;
    b += db;
    if (b >= B) {
      b -= B;
      ++a;
    }
  }
}

// Launches permute_rows_kernel, 16-byte packs where L and the pointers allow.
template <class T>
void permute_rows(T* dst, const T* src, int64_t A, int64_t B, int64_t L, cudaStream_t stream) {
  const int64_t rows = A * B;
  if (rows == 0 || L == 0) return;
  int width = width_for<T>(L);
  if (!all_aligned({dst, src}, sizeof(T) * width)) width = 1;
  with_width<T>(width, [&](auto pack) {
    constexpr int W = decltype(pack)::value;
    const int lg = group_lg(L / W);
    const int64_t per_lane = ceil_div(L / W, int64_t{1} << lg) * W;  // elements a lane moves per row
    const int64_t rows_per_group = ceil_div(kElementsPerThread, per_lane);
    const unsigned blocks = blocks_for(rows, (kThreads >> lg) * rows_per_group);
    permute_rows_kernel<T, W><<<blocks, kThreads, 0, stream>>>(dst, src, A, B, L, lg);
    CUDA_CHECK_LAUNCH();
  });
}

// ---- unfolding -------------------------------------------------------------------------

// cols (C KH KW, N OH OW): row (c, kh, kw), column (n, oh, ow) = inp (n, c, oh s - p + kh,
// ow s - p + kw), zero outside the plane. A pure copy, in runs: one (row, n, oh) is OW
// consecutive columns from one input row (or zeros, above or below the plane). blockIdx.y
// picks the row (grid-stride), each group of 2^lg lanes runs g, g + groups, ... of it with
// lanes over ow; (n, oh) advances by a fixed step without dividing, so a thread divides
// only in its set-up. Coordinates within a plane in 32 bits (checked by the launcher),
// offsets in 64.
template <class T>
__global__ void im2col_kernel(T* __restrict__ cols, const T* __restrict__ inp, Window2d w, int lg) {
  const int64_t runs = w.N * w.OH, P = runs * w.OW, rows = w.C * w.KH * w.KW;
  const int G = 1 << lg, lane = static_cast<int>(threadIdx.x) & (G - 1);
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> lg;
  const int64_t groups = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> lg;
  if (group >= runs) return;
  int64_t n0, oh0, dn, doh;
  divmod(group, w.OH, n0, oh0);
  divmod(groups, w.OH, dn, doh);
  const int OW = static_cast<int>(w.OW), IW = static_cast<int>(w.W), stride = static_cast<int>(w.stride);
  const int64_t plane = w.H * w.W, jump = groups * w.OW;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    int64_t kw, kh, c, rest;
    divmod(row, w.KW, rest, kw);
    divmod(rest, w.KH, c, kh);
    const int x0 = static_cast<int>(kw - w.padding);  // x = ow s + x0
    const T* channel = inp + c * plane;
    T* out = cols + row * P + group * w.OW;
    int64_t n = n0, oh = oh0;
    for (int64_t j = group; j < runs; j += groups, out += jump) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h >= 0 && h < w.H) {
        const T* in = channel + n * w.C * plane + h * w.W;
        for (int ow = lane; ow < OW; ow += kCopyDepth * G) {  // kCopyDepth loads in flight, then the stores
          T v[kCopyDepth];
#pragma unroll
          for (int u = 0; u < kCopyDepth; ++u) {
            const int x = (ow + u * G) * stride + x0;
            v[u] = ow + u * G < OW && static_cast<unsigned>(x) < static_cast<unsigned>(IW) ? in[x] : from_f32<T>(0.0f);
          }
#pragma unroll
          for (int u = 0; u < kCopyDepth; ++u)
            if (ow + u * G < OW) out[ow + u * G] = v[u];
        }
      } else {
        for (int ow = lane; ow < OW; ow += G) out[ow] = from_f32<T>(0.0f);
      }
      oh += doh;
      n += dn;
      if (oh >= w.OH) {
        oh -= w.OH;
        ++n;
      }
    }
  }
}

// Launches the unfolding of inp into cols. A 1 x 1 window at stride 1 without padding
// unfolds to the row permutation cols (C, N plane) = inp (N, C, plane).
template <class T>
void im2col(T* cols, const T* inp, const Window2d& w, cudaStream_t stream) {
  if (w.KH == 1 && w.KW == 1 && w.stride == 1 && w.padding == 0) {
    permute_rows(cols, inp, w.C, w.N, w.H * w.W, stream);
    return;
  }
  const int64_t runs = w.N * w.OH, rows = w.C * w.KH * w.KW;
  if (runs == 0 || w.OW == 0 || rows == 0) return;
  MPIPE_CHECK(w.W <= INT32_MAX && w.padding + w.KW <= INT32_MAX && (w.OW - 1) * w.stride + w.KW <= INT32_MAX,
              "conv2d: a plane row of ", w.W, " exceeds the unfolding's 32-bit coordinates");
  const int lg = group_lg(w.OW);
  const int64_t per_lane = ceil_div(w.OW, int64_t{1} << lg);  // elements a lane writes per run
  const int64_t runs_per_group = ceil_div(kElementsPerThread, per_lane);
  const dim3 grid(blocks_for(runs, (kThreads >> lg) * runs_per_group),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  im2col_kernel<<<grid, kThreads, 0, stream>>>(cols, inp, w, lg);
  CUDA_CHECK_LAUNCH();
}

// The first and one-past-last output index along one axis whose window covers input
// position `at`: o s - p <= at <= o s - p + k - 1, within [0, outputs).
__device__ __forceinline__ void covering(int64_t at, int64_t kernel, int64_t stride, int64_t padding, int64_t outputs,
                                         int64_t& first, int64_t& end) {
  const int64_t low = at + padding - kernel + 1;  // o s >= low
  first = low <= 0 ? 0 : (low + stride - 1) / stride;
  const int64_t last = (at + padding) / stride + 1;
  end = last < outputs ? last : outputs;
}

// dinp (n, c, h, x) (+)= the sum, over the windows that read it (kh, kw in order), of the
// columns' gradient dcols (C KH KW, N OH OW), fp32.
template <class T>
__global__ void col2im_kernel(T* dinp, const float* dcols, Window2d w, bool accumulate) {
  const int64_t P = w.N * w.OH * w.OW, total = w.N * w.C * w.H * w.W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, c = (i / (w.W * w.H)) % w.C, n = i / (w.W * w.H * w.C);
    float sum = 0.0f;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t oh_scaled = h + w.padding - kh;
      if (oh_scaled < 0 || oh_scaled % w.stride != 0) continue;
      const int64_t oh = oh_scaled / w.stride;
      if (oh >= w.OH) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t ow_scaled = x + w.padding - kw;
        if (ow_scaled < 0 || ow_scaled % w.stride != 0) continue;
        const int64_t ow = ow_scaled / w.stride;
        if (ow >= w.OW) continue;
        sum += dcols[((c * w.KH + kh) * w.KW + kw) * P + (n * w.OH + oh) * w.OW + ow];
      }
    }
    dinp[i] = from_f32<T>(accumulate ? to_f32(dinp[i]) + sum : sum);
  }
}

// out (N, OC, OHW) = product (OC, N, OHW) + bias (OC; may be null).
template <class T>
__global__ void fold_output(T* out, const float* product, const T* bias, int64_t N, int64_t OC, int64_t plane) {
  const int64_t total = N * OC * plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t p = i % plane, oc = (i / plane) % OC, n = i / (plane * OC);
    const float v = product[(oc * N + n) * plane + p];
    out[i] = from_f32<T>(bias ? v + to_f32(bias[oc]) : v);
  }
}

// Threads per bias-gradient block.
constexpr int kChannelThreads = 512;

// dbias[oc] += the sum of row oc of dout_t (OC, P): one block per channel.
template <class T>
__global__ void bias_grad(float* dbias, const T* dout_t, int64_t P) {
  __shared__ float shared[32];
  const int64_t oc = blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) sum += to_f32(dout_t[oc * P + i]);
  sum = block_reduce(sum, Sum{}, 0.0f, shared);
  if (threadIdx.x == 0) dbias[oc] += sum;
}

// ---- pooling -----------------------------------------------------------------------------

template <class T>
__global__ void maxpool_forward_kernel(T* out, int32_t* argmax, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t ow = i % w.OW, oh = (i / w.OW) % w.OH, plane = i / (w.OW * w.OH);
    const T* in = inp + plane * w.H * w.W;
    float best = -INFINITY;
    int32_t at = -1;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h < 0 || h >= w.H) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t x = ow * w.stride - w.padding + kw;
        if (x < 0 || x >= w.W) continue;
        const float v = to_f32(in[h * w.W + x]);
        if (at < 0 || v > best) {  // the first of equal maxima, as the CPU and PyTorch
          best = v;
          at = static_cast<int32_t>(h * w.W + x);
        }
      }
    }
    out[i] = from_f32<T>(best);
    argmax[i] = at;
  }
}

// Each input element sums, in (oh, ow) order as the CPU, the gradients of the windows
// whose maximum it was.
template <class T>
__global__ void maxpool_backward_kernel(T* dinp, const T* dout, const int32_t* argmax, Window2d w, bool accumulate) {
  const int64_t total = w.N * w.C * w.H * w.W;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, plane = i / (w.W * w.H);
    const int32_t self = static_cast<int32_t>(h * w.W + x);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t o = (plane * w.OH + oh) * w.OW + ow;
        if (argmax[o] == self) sum += to_f32(dout[o]);
      }
    dinp[i] = from_f32<T>(sum);
  }
}

template <class T>
__global__ void avgpool_forward_kernel(T* out, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t ow = i % w.OW, oh = (i / w.OW) % w.OH, plane = i / (w.OW * w.OH);
    const T* in = inp + plane * w.H * w.W;
    float sum = 0.0f;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h < 0 || h >= w.H) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t x = ow * w.stride - w.padding + kw;
        if (x >= 0 && x < w.W) sum += to_f32(in[h * w.W + x]);
      }
    }
    out[i] = from_f32<T>(sum * inv);
  }
}

// A plane's mean (global average pooling, one window per plane): one warp per plane, so a
// 56 x 56 plane is not one thread's serial loop. Lanes sum fixed strides, then the warp.
template <class T>
__global__ void plane_mean_kernel(T* out, const T* inp, int64_t planes, int64_t plane_size) {
  const int64_t plane = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (plane >= planes) return;  // the whole warp
  float sum = 0.0f;
  for (int64_t i = lane; i < plane_size; i += 32) sum += to_f32(inp[plane * plane_size + i]);
  sum = warp_reduce(sum, Sum{});
  if (lane == 0) out[plane] = from_f32<T>(sum * (1.0f / static_cast<float>(plane_size)));
}

template <class T>
__global__ void avgpool_backward_kernel(T* dinp, const T* dout, Window2d w, bool accumulate) {
  const int64_t total = w.N * w.C * w.H * w.W;
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t x = i % w.W, h = (i / w.W) % w.H, plane = i / (w.W * w.H);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) sum += to_f32(dout[(plane * w.OH + oh) * w.OW + ow]) * inv;
    dinp[i] = from_f32<T>(sum);
  }
}

// ---- BatchNorm ---------------------------------------------------------------------------
// Channel c's N x plane elements come in S segments of whole samples, segment s = samples
// [s N / S, (s + 1) N / S), one block each (blockIdx.x = c S + s), so C S blocks keep
// the GPU busy however few channels. S follows from the sizes alone (norm_segments), and
// every sum is fixed by them: a thread's packs in order, in double, then the block's
// butterfly, then a channel's S partials in segment order (channel_total). The same bits
// on every run; no atomics.

constexpr int kNormThreads = 256;
// Segments: about this many blocks in all (several waves of kNormThreads-thread blocks on
// a 132-SM H100), but no segment under kNormMinElements elements (one pass of a few packs
// per thread) and no more segments than samples.
constexpr int64_t kNormBlocks = 4096;
constexpr int64_t kNormMinElements = 4096;

int64_t norm_segments(int64_t N, int64_t C, int64_t plane) {
  const int64_t wanted = std::min(ceil_div(kNormBlocks, C), N * plane / kNormMinElements);
  return std::clamp<int64_t>(wanted, 1, N);
}

struct NormShape {
  int64_t N, C, plane, S;  // S: segments per channel
};

// Channel c's segment s: samples [n0, n1).
struct Segment {
  int64_t c, n0, n1;
};
__device__ __forceinline__ Segment segment_of(const NormShape& sh, int64_t c, int64_t s) {
  return Segment{c, s * sh.N / sh.S, (s + 1) * sh.N / sh.S};
}

// This thread's packs of W elements in segment g, in order: pack (n, q) is the elements
// at (n C + c) plane + q W + [0, W). The block's threads take consecutive packs of the
// segment's (n, q) order (consecutive threads on consecutive q: coalesced; several samples
// at once when a plane is shorter than the block); a thread's next pack is blockDim packs
// on, (n, q, at) carried by additions, no division per pack.
template <int W>
struct SegmentWalk {
  int64_t n, q, at, n_end, Q, dn, dq, jump, wrap;

  __device__ __forceinline__ SegmentWalk(const NormShape& sh, const Segment& g) {
    const unsigned B = blockDim.x;
    Q = sh.plane / W;
    n = g.n0, q = threadIdx.x, dn = 0, dq = B;
    if (Q <= B) {
      const unsigned q32 = static_cast<unsigned>(Q);
      n += threadIdx.x / q32;
      q = threadIdx.x % q32;
      dn = B / q32;
      dq = B % q32;
    }
    n_end = g.n1;
    at = (n * sh.C + g.c) * sh.plane + q * W;
    const int64_t step = sh.C * sh.plane;
    jump = dn * step + dq * W;
    wrap = step - sh.plane;
  }
  __device__ __forceinline__ bool more() const { return n < n_end; }
  __device__ __forceinline__ void next() {
    n += dn;
    q += dq;
    at += jump;
    if (q >= Q) {  // past the plane's end: the next sample's row
      q -= Q;
      ++n;
      at += wrap;
    }
  }
};

// use(at, load(at)) for each of this thread's packs of segment g, in order. Two packs are
// loaded before either is used (two loads in flight per thread, for the memory system's
// sake); the uses, and so every sum, keep the packs' order.
template <int W, class Load, class Use>
__device__ __forceinline__ void for_each_pack(const NormShape& sh, const Segment& g, Load load, Use use) {
  SegmentWalk<W> it(sh, g);
  while (it.more()) {
    const int64_t first = it.at;
    it.next();
    if (!it.more()) {
      use(first, load(first));
      break;
    }
    const int64_t second = it.at;
    it.next();
    const auto a = load(first), b = load(second);
    use(first, a);
    use(second, b);
  }
}

// The sum of channel c's S segment partials, in an order fixed by S: lane l adds partials
// l, l + 32, ..., then the warp's butterfly. Every warp computes it alone, with the same
// bits, so no block-wide step is needed. The whole warp must call it.
__device__ __forceinline__ double channel_total(const double* partial, int64_t c, int64_t S) {
  double sum = 0.0;
  for (int64_t s = threadIdx.x % 32; s < S; s += 32) sum += partial[c * S + s];
  return warp_reduce(sum, Sum{});
}

// Pass 1 of the training forward: partial[c S + s] = the sum of x over segment s.
template <class T, int W>
__global__ void batchnorm_sum_kernel(double* partial, const T* inp, NormShape sh, bool packed) {
  __shared__ double shared[32];
  const Segment g = segment_of(sh, blockIdx.x / sh.S, blockIdx.x % sh.S);
  double sum = 0.0;
  for_each_pack<W>(
      sh, g, [&](int64_t at) { return load_run<W>(inp + at, packed); },
      [&](int64_t, const Pack<T, W>& x) {
#pragma unroll
        for (int j = 0; j < W; ++j) sum += to_f32(x.v[j]);
      });
  sum = block_reduce(sum, Sum{}, 0.0, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// Pass 2: the channel's mean m from pass 1's partials (each block alike), then
// squares[c S + s] = the sum of (x - m)^2 over segment s: the two-pass variance.
template <class T, int W>
__global__ void batchnorm_squares_kernel(double* squares, const double* sums, const T* inp, NormShape sh,
                                         bool packed) {
  __shared__ double shared[32];
  const Segment g = segment_of(sh, blockIdx.x / sh.S, blockIdx.x % sh.S);
  const double m = channel_total(sums, g.c, sh.S) / static_cast<double>(sh.N * sh.plane);
  double sum = 0.0;
  for_each_pack<W>(
      sh, g, [&](int64_t at) { return load_run<W>(inp + at, packed); },
      [&](int64_t, const Pack<T, W>& x) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const double d = to_f32(x.v[j]) - m;
          sum += d * d;
        }
      });
  sum = block_reduce(sum, Sum{}, 0.0, shared);
  if (threadIdx.x == 0) squares[blockIdx.x] = sum;
}

// Pass 3: the channel's statistics from both passes' partials, out = x scale + shift over
// the segment; segment 0's thread 0 writes the channel's statistics, running statistics
// and deferred sums, once.
template <class T, int W>
__global__ void batchnorm_normalize_kernel(T* out, float* mean, float* rstd, float* running_mean, float* running_var,
                                           double* sums_out, const double* sums, const double* squares, const T* inp,
                                           const T* weight, const T* bias, NormShape sh, float eps, float momentum,
                                           bool packed) {
  const int64_t c = blockIdx.x / sh.S, s = blockIdx.x % sh.S;
  const double n = static_cast<double>(sh.N * sh.plane);
  const double sum = channel_total(sums, c, sh.S), sq = channel_total(squares, c, sh.S);
  const double m = sum / n, var = sq / n;
  const float r = static_cast<float>(1.0 / sqrt(var + eps));
  const float scale = to_f32(weight[c]) * r, shift = to_f32(bias[c]) - static_cast<float>(m) * scale;
  for_each_pack<W>(
      sh, segment_of(sh, c, s), [&](int64_t at) { return load_run<W>(inp + at, packed); },
      [&](int64_t at, const Pack<T, W>& x) {
        Pack<T, W> y;
#pragma unroll
        for (int j = 0; j < W; ++j) y.v[j] = from_f32<T>(to_f32(x.v[j]) * scale + shift);
        store_run<W>(out + at, y, packed);
      });
  if (s != 0 || threadIdx.x != 0) return;
  mean[c] = static_cast<float>(m);
  rstd[c] = r;
  if (running_mean) {
    const double unbiased = n > 1 ? sq / (n - 1) : var;
    running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
    running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
  }
  if (sums_out) {
    if (c == 0) sums_out[0] += n;
    sums_out[1 + c] += sum;
    sums_out[1 + sh.C + c] += sq + n * m * m;
  }
}

__global__ void batchnorm_apply_sums_kernel(float* running_mean, float* running_var, const double* sums, int64_t C,
                                            float momentum) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const double count = sums[0];
  if (c >= C || count <= 0) return;  // nothing gathered
  const double m = sums[1 + c] / count;
  const double squares = fmax(0.0, sums[1 + C + c] - sums[1 + c] * m);
  const double unbiased = count > 1 ? squares / (count - 1) : squares / count;
  running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
  running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
}

template <class T>
__global__ void batchnorm_eval_kernel(T* out, const T* inp, const T* weight, const T* bias, const float* running_mean,
                                      const float* running_var, int64_t N, int64_t C, int64_t plane, float eps) {
  const int64_t total = N * C * plane;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t c = (i / plane) % C;
    const float scale = to_f32(weight[c]) / sqrtf(running_var[c] + eps);
    out[i] = from_f32<T>(to_f32(inp[i]) * scale + (to_f32(bias[c]) - running_mean[c] * scale));
  }
}

// dy and x at one pack.
template <class T, int W>
struct Packs2 {
  Pack<T, W> dy, x;
};

// Backward pass 1: per segment, the partial sums of dy and of dy xhat (xhat = (x - mean)
// rstd, in fp32 as the CPU), in double.
template <class T, int W>
__global__ void batchnorm_backward_sums_kernel(double* sum_dy, double* sum_dy_xhat, const T* dout, const T* inp,
                                               const float* mean, const float* rstd, NormShape sh, bool packed) {
  __shared__ double shared[32];
  const Segment g = segment_of(sh, blockIdx.x / sh.S, blockIdx.x % sh.S);
  const float mu = mean[g.c], r = rstd[g.c];
  double dy_sum = 0.0, dy_xhat_sum = 0.0;
  for_each_pack<W>(
      sh, g, [&](int64_t at) { return Packs2<T, W>{load_run<W>(dout + at, packed), load_run<W>(inp + at, packed)}; },
      [&](int64_t, const Packs2<T, W>& p) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const float d = to_f32(p.dy.v[j]);
          dy_sum += d;
          dy_xhat_sum += d * (to_f32(p.x.v[j]) - mu) * r;
        }
      });
  dy_sum = block_reduce(dy_sum, Sum{}, 0.0, shared);
  dy_xhat_sum = block_reduce(dy_xhat_sum, Sum{}, 0.0, shared);
  if (threadIdx.x != 0) return;
  sum_dy[blockIdx.x] = dy_sum;
  sum_dy_xhat[blockIdx.x] = dy_xhat_sum;
}

// Backward pass 2: the channel's two sums from pass 1's partials; the first block of a
// channel adds them to dweight and dbias (once), and with dinp every segment's block
// writes dx = w rstd (dy - mean(dy) - xhat mean(dy xhat)) over its segment. `per_channel`
// blocks per channel: S with dinp, else 1 (the parameter gradients alone).
template <class T, int W>
__global__ void batchnorm_backward_apply_kernel(T* dinp, float* dweight, float* dbias, const double* sum_dy,
                                                const double* sum_dy_xhat, const T* dout, const T* inp,
                                                const T* weight, const float* mean, const float* rstd, NormShape sh,
                                                int64_t per_channel, bool accumulate, bool packed) {
  const int64_t c = blockIdx.x / per_channel, s = blockIdx.x % per_channel;
  const double dy_sum = channel_total(sum_dy, c, sh.S), dy_xhat_sum = channel_total(sum_dy_xhat, c, sh.S);
  if (s == 0 && threadIdx.x == 0) {
    dweight[c] += static_cast<float>(dy_xhat_sum);
    dbias[c] += static_cast<float>(dy_sum);
  }
  if (!dinp) return;
  const double count = static_cast<double>(sh.N * sh.plane);
  const float mu = mean[c], r = rstd[c];
  const float k = to_f32(weight[c]) * r, a = static_cast<float>(dy_sum / count),
              b = static_cast<float>(dy_xhat_sum / count);
  for_each_pack<W>(
      sh, segment_of(sh, c, s),
      [&](int64_t at) { return Packs2<T, W>{load_run<W>(dout + at, packed), load_run<W>(inp + at, packed)}; },
      [&](int64_t at, const Packs2<T, W>& p) {
        Pack<T, W> dx;
        if (accumulate) dx = load_run<W>(dinp + at, packed);
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const float g = k * (to_f32(p.dy.v[j]) - a - (to_f32(p.x.v[j]) - mu) * r * b);
          dx.v[j] = from_f32<T>(accumulate ? to_f32(dx.v[j]) + g : g);
        }
        store_run<W>(dinp + at, dx, packed);
      });
}

unsigned grid_for(int64_t total) { return blocks_for(total, kThreads); }

// The batched per-group GEMM of a convolution: c = alpha op(a) op(b) (+ beta c) for each
// of `groups` matrices at the given strides (elements).
Gemm per_group(int64_t groups, int64_t M, int64_t N, int64_t K, const void* a, bool trans_a, int64_t lda,
               int64_t stride_a, const void* b, bool trans_b, int64_t ldb, int64_t stride_b, void* c, int64_t ldc,
               int64_t stride_c, cudaDataType_t ab_type, float beta) {
  MPIPE_CHECK(groups <= INT32_MAX, "conv2d: ", groups, " groups exceed one batched GEMM");
  Gemm g;
  g.M = M, g.N = N, g.K = K;
  g.a = a, g.lda = lda, g.trans_a = trans_a;
  g.b = b, g.ldb = ldb, g.trans_b = trans_b;
  g.c = c, g.ldc = ldc;
  g.ab_type = ab_type, g.c_type = CUDA_R_32F;
  g.beta = beta;
  g.batch = static_cast<int>(groups);
  g.stride_a = stride_a, g.stride_b = stride_b, g.stride_c = stride_c;
  return g;
}

}  // namespace

// ---- convolution -------------------------------------------------------------------------

template <class E>
void conv2d_forward(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w) {
  const int64_t P = w.N * w.OH * w.OW, plane = w.OH * w.OW;
  if (P == 0 || w.OC == 0) return;
  cudaStream_t stream = context().compute;
  if (dnn_conv_forward(out, inp, weight, bias, w)) return;
  const int64_t G = w.groups, Cg = w.C / G, OCg = w.OC / G, Kg = Cg * w.KH * w.KW;

  ScratchPlan plan;
  const std::size_t cols_at = plan.reserve<E>(w.C * w.KH * w.KW * P);  // (C KH KW, N OH OW)
  const std::size_t product_at = plan.reserve<float>(w.OC * P);         // (OC, N OH OW)
  void* base = scratch(plan.bytes());
  E* cols = place<E>(base, cols_at);
  auto* product = place<float>(base, product_at);

  im2col(dev(cols), dev(inp), w, stream);
  // product_g (OCg, P) = weight_g (OCg, Kg) · cols_g (Kg, P)
  gemm(per_group(G, OCg, P, Kg, weight, false, Kg, OCg * Kg, cols, false, P, Kg * P, product, P, OCg * P,
                 data_type<E>(), 0.0f));
  fold_output<<<grid_for(w.N * w.OC * plane), kThreads, 0, stream>>>(dev(out), product, bias ? dev(bias) : nullptr,
                                                                       w.N, w.OC, plane);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void conv2d_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                     const Window2d& w, GradMode mode) {
  const int64_t P = w.N * w.OH * w.OW, plane = w.OH * w.OW;
  if (P == 0 || w.OC == 0) return;
  // cuDNN's input gradient first: its workspace may grow scratch(), which the GEMM path
  // then carves.
  if (dinp && dnn_conv_input_gradient(dinp, dout, weight, w, mode)) dinp = nullptr;
  if (!dinp && !dweight && !dbias) return;
  const int64_t G = w.groups, Cg = w.C / G, OCg = w.OC / G, Kg = Cg * w.KH * w.KW;
  cudaStream_t stream = context().compute;

  ScratchPlan plan;
  const std::size_t dout_at = plan.reserve<E>(w.OC * P);                         // (OC, N OH OW)
  const std::size_t cols_at = plan.reserve<E>(dweight ? w.C * w.KH * w.KW * P : 0);       // (C KH KW, N OH OW)
  const std::size_t dcols_at = plan.reserve<float>(dinp ? w.C * w.KH * w.KW * P : 0);     // (C KH KW, N OH OW)
  void* base = scratch(plan.bytes());
  E* dout_t = place<E>(base, dout_at);
  E* cols = place<E>(base, cols_at);
  auto* dcols = place<float>(base, dcols_at);

  permute_rows(dev(dout_t), dev(dout), w.OC, w.N, plane, stream);  // (N, OC, plane) -> (OC, N, plane)
  if (dbias) {
    bias_grad<<<static_cast<unsigned>(w.OC), kChannelThreads, 0, stream>>>(dbias, dev(dout_t), P);
    CUDA_CHECK_LAUNCH();
  }
  if (dweight) {
    im2col(dev(cols), dev(inp), w, stream);
    // dweight_g (OCg, Kg) += dout_g (OCg, P) · cols_g (Kg, P)^T
    gemm(per_group(G, OCg, Kg, P, dout_t, false, P, OCg * P, cols, true, P, Kg * P, dweight, Kg, OCg * Kg,
                   data_type<E>(), 1.0f));
  }
  if (dinp) {
    // dcols_g (Kg, P) = weight_g (OCg, Kg)^T · dout_g (OCg, P)
    gemm(per_group(G, Kg, P, OCg, weight, true, Kg, OCg * Kg, dout_t, false, P, OCg * P, dcols, P, Kg * P,
                   data_type<E>(), 0.0f));
    col2im_kernel<<<grid_for(w.N * w.C * w.H * w.W), kThreads, 0, stream>>>(dev(dinp), dcols, w,
                                                                               mode == GradMode::accumulate);
    CUDA_CHECK_LAUNCH();
  }
}

// ---- pooling -----------------------------------------------------------------------------

template <class E>
void maxpool2d_forward(E* out, int32_t* argmax, const E* inp, const Window2d& w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  if (total == 0) return;
  maxpool_forward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(out), argmax, dev(inp), w);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void maxpool2d_backward(E* dinp, const E* dout, const int32_t* argmax, const Window2d& w, GradMode mode) {
  const int64_t total = w.N * w.C * w.H * w.W;
  if (total == 0) return;
  maxpool_backward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), argmax, w,
                                                                                mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void avgpool2d_forward(E* out, const E* inp, const Window2d& w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  if (total == 0) return;
  if (w.OH == 1 && w.OW == 1 && w.KH == w.H && w.KW == w.W && w.padding == 0) {  // global average pooling
    const int64_t planes = w.N * w.C;
    plane_mean_kernel<<<static_cast<unsigned>(ceil_div(planes, kRowsPerBlock)), kThreads, 0, context().compute>>>(
        dev(out), dev(inp), planes, w.H * w.W);
  } else {
    avgpool_forward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(out), dev(inp), w);
  }
  CUDA_CHECK_LAUNCH();
}

template <class E>
void avgpool2d_backward(E* dinp, const E* dout, const Window2d& w, GradMode mode) {
  const int64_t total = w.N * w.C * w.H * w.W;
  if (total == 0) return;
  avgpool_backward_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(dev(dinp), dev(dout), w,
                                                                                mode == GradMode::accumulate);
  CUDA_CHECK_LAUNCH();
}

// ---- BatchNorm ---------------------------------------------------------------------------

template <class E>
void batchnorm_forward_train(E* out, float* mean, float* rstd, float* running_mean, float* running_var, double* sums,
                             const E* inp, const E* weight, const E* bias, int64_t N, int64_t C, int64_t plane,
                             float eps, float momentum) {
  if (C == 0 || N * plane == 0) return;
  const NormShape sh{N, C, plane, norm_segments(N, C, plane)};
  const int64_t blocks = C * sh.S;
  MPIPE_CHECK(blocks <= INT32_MAX, "batchnorm: ", C, " channels exceed one launch");
  // The segment partials in scratch(), taken before any launch (it may grow, synchronising).
  ScratchPlan plan;
  const std::size_t sums_at = plan.reserve<double>(blocks), squares_at = plan.reserve<double>(blocks);
  void* base = scratch(plan.bytes());
  auto* partial_sums = place<double>(base, sums_at);
  auto* partial_squares = place<double>(base, squares_at);
  cudaStream_t stream = context().compute;
  using T = device_t<E>;
  const int width = width_for<T>(plane);  // from the sizes: it orders the sums
  const bool packed = all_aligned({inp, out}, sizeof(T) * width);
  with_width<T>(width, [&](auto pack) {
    constexpr int W = decltype(pack)::value;
    const unsigned grid = static_cast<unsigned>(blocks);
    batchnorm_sum_kernel<T, W><<<grid, kNormThreads, 0, stream>>>(partial_sums, dev(inp), sh, packed);
    CUDA_CHECK_LAUNCH();
    batchnorm_squares_kernel<T, W><<<grid, kNormThreads, 0, stream>>>(partial_squares, partial_sums, dev(inp), sh,
                                                                       packed);
    CUDA_CHECK_LAUNCH();
    batchnorm_normalize_kernel<T, W><<<grid, kNormThreads, 0, stream>>>(
        dev(out), mean, rstd, running_mean, running_var, sums, partial_sums, partial_squares, dev(inp), dev(weight),
        dev(bias), sh, eps, momentum, packed);
    CUDA_CHECK_LAUNCH();
  });
}

void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum) {
  if (C == 0) return;
  batchnorm_apply_sums_kernel<<<grid_for(C), kThreads, 0, context().compute>>>(running_mean, running_var, sums, C,
                                                                               momentum);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_forward_eval(E* out, const E* inp, const E* weight, const E* bias, const float* running_mean,
                            const float* running_var, int64_t N, int64_t C, int64_t plane, float eps) {
  const int64_t total = N * C * plane;
  if (total == 0) return;
  batchnorm_eval_kernel<<<grid_for(total), kThreads, 0, context().compute>>>(
      dev(out), dev(inp), dev(weight), dev(bias), running_mean, running_var, N, C, plane, eps);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane, GradMode mode) {
  if (C == 0 || N * plane == 0) return;
  const NormShape sh{N, C, plane, norm_segments(N, C, plane)};
  const int64_t blocks = C * sh.S;
  MPIPE_CHECK(blocks <= INT32_MAX, "batchnorm: ", C, " channels exceed one launch");
  ScratchPlan plan;
  const std::size_t dy_at = plan.reserve<double>(blocks), dy_xhat_at = plan.reserve<double>(blocks);
  void* base = scratch(plan.bytes());
  auto* sum_dy = place<double>(base, dy_at);
  auto* sum_dy_xhat = place<double>(base, dy_xhat_at);
  cudaStream_t stream = context().compute;
  using T = device_t<E>;
  const int width = width_for<T>(plane);
  const bool packed = all_aligned({dout, inp, dinp ? dinp : inp}, sizeof(T) * width);
  with_width<T>(width, [&](auto pack) {
    constexpr int W = decltype(pack)::value;
    batchnorm_backward_sums_kernel<T, W><<<static_cast<unsigned>(blocks), kNormThreads, 0, stream>>>(
        sum_dy, sum_dy_xhat, dev(dout), dev(inp), mean, rstd, sh, packed);
    CUDA_CHECK_LAUNCH();
    // Without dinp only the parameter gradients remain: one warp per channel.
    const int64_t per_channel = dinp ? sh.S : 1;
    const int threads = dinp ? kNormThreads : 32;
    batchnorm_backward_apply_kernel<T, W><<<static_cast<unsigned>(C * per_channel), threads, 0, stream>>>(
        dinp ? dev(dinp) : nullptr, dweight, dbias, sum_dy, sum_dy_xhat, dev(dout), dev(inp), dev(weight), mean, rstd,
        sh, per_channel, mode == GradMode::accumulate, packed);
    CUDA_CHECK_LAUNCH();
  });
}

#define MPIPE_CONV_OPS(E)                                                                                          \
  template void conv2d_forward<E>(E*, const E*, const E*, const E*, const Window2d&);                           \
  template void conv2d_backward<E>(E*, float*, float*, const E*, const E*, const E*, const Window2d&, GradMode);  \
  template void maxpool2d_forward<E>(E*, int32_t*, const E*, const Window2d&);                                   \
  template void maxpool2d_backward<E>(E*, const E*, const int32_t*, const Window2d&, GradMode);                  \
  template void avgpool2d_forward<E>(E*, const E*, const Window2d&);                                             \
  template void avgpool2d_backward<E>(E*, const E*, const Window2d&, GradMode);                                  \
  template void batchnorm_forward_train<E>(E*, float*, float*, float*, float*, double*, const E*, const E*,      \
                                           const E*, int64_t, int64_t, int64_t, float, float);                  \
  template void batchnorm_forward_eval<E>(E*, const E*, const E*, const E*, const float*, const float*, int64_t, \
                                          int64_t, int64_t, float);                                              \
  template void batchnorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,            \
                                      const float*, int64_t, int64_t, int64_t, GradMode);
MPIPE_CONV_OPS(float)
MPIPE_CONV_OPS(bf16)
#undef MPIPE_CONV_OPS

}  // namespace mpipe::cuda
