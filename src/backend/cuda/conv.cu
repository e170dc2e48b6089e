// CUDA convolution and pooling over NCHW: the CPU ops of src/backend/cpu/conv.cpp on the
// GPU (contracts in include/mpipe/backend/cuda/ops.hpp; BatchNorm: batchnorm.cu). Pooling
// also over NHWC (Window2d::channels_last); channels-last convolutions are cuDNN's alone
// (conv_dnn.cu); their bias gradient is bias_grad's, by columns.
//
// Convolution's forward, input gradient and weight gradient run on cuDNN where it offers
// a deterministic algorithm for the shape (conv_dnn.cu; in bf16 cuDNN rounds the weight
// gradient to bf16 before it is added to the fp32 one). Every direction cuDNN declines
// runs as one GEMM per group over the whole micro-batch: the input unfolded into columns
// (C/g x KH x KW, N x OH x OW) whose column index runs over samples and positions
// together, so the weight gradient sums all samples inside one fp32-accumulating GEMM.
// The GEMMs read dout permuted to (OC, N OH OW), and the bias gradient sums that copy's
// rows; when cuDNN took both gradients it sums dout in place instead, in the same order
// (the same bits). Columns and products live in scratch() for the call only: nothing is
// held between a forward and its backward.
//
// Determinism: no atomics. The input gradient of the GEMM path is gathered (each input
// element sums the columns that read it, in a fixed order), pooling backward likewise.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "conv_dnn.cuh"
#include "gemm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// ---- copying runs ------------------------------------------------------------------------

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

// dbias[oc] += the sum of channel oc's P elements, element i at oc channel_step + i
// element_step: a row of dout_t (OC, P) (steps P, 1), or a column of channels-last dout
// (P, OC) (steps 1, OC; strided reads, a bias beside a channels-last convolution being
// rare, BatchNorm taking its place). One block per channel, thread t elements t, t +
// blockDim.x, ..., then the block's sum.
template <class T>
__global__ void bias_grad(float* dbias, const T* dout, int64_t P, int64_t channel_step, int64_t element_step) {
  __shared__ float shared[32];
  const int64_t oc = blockIdx.x;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < P; i += blockDim.x) sum += to_f32(dout[oc * channel_step + i * element_step]);
  sum = block_reduce(sum, Sum{}, 0.0f, shared);
  if (threadIdx.x == 0) dbias[oc] += sum;
}

// bias_grad read from dout (N, OC, plane) itself, for a backward that needs no permuted
// copy: thread t sums the same (n, p) as there (the channel's index i = n plane + p at t,
// t + blockDim.x, ...) in the same order, so the bits are the same; (n, p) advances by a
// fixed step without dividing.
template <class T>
__global__ void bias_grad_nchw(float* dbias, const T* dout, int64_t N, int64_t OC, int64_t plane) {
  __shared__ float shared[32];
  const int64_t oc = blockIdx.x;
  int64_t n, p, dn, dp;
  divmod(threadIdx.x, plane, n, p);
  divmod(blockDim.x, plane, dn, dp);
  float sum = 0.0f;
  while (n < N) {
    sum += to_f32(dout[(n * OC + oc) * plane + p]);
    n += dn;
    p += dp;
    if (p >= plane) {
      p -= plane;
      ++n;
    }
  }
  sum = block_reduce(sum, Sum{}, 0.0f, shared);
  if (threadIdx.x == 0) dbias[oc] += sum;
}

// ---- pooling -----------------------------------------------------------------------------

// Element (n, c, h, x) of an image of C channels and H x W planes, in either layout, and
// the element at a memory index.
struct ImageAt {
  int64_t C, H, W;
  bool last;  // channels last (NHWC)
  __device__ int64_t operator()(int64_t n, int64_t c, int64_t h, int64_t x) const {
    return last ? ((n * H + h) * W + x) * C + c : ((n * C + c) * H + h) * W + x;
  }
  __device__ void split(int64_t i, int64_t& n, int64_t& c, int64_t& h, int64_t& x) const {
    if (last) {
      c = i % C, x = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
    } else {
      x = i % W, h = (i / W) % H, c = (i / (W * H)) % C, n = i / (W * H * C);
    }
  }
};
__device__ __forceinline__ ImageAt input_at(const Window2d& w) { return {w.C, w.H, w.W, w.channels_last}; }
__device__ __forceinline__ ImageAt output_at(const Window2d& w) { return {w.C, w.OH, w.OW, w.channels_last}; }

// One plane of either layout indexed by h W + x (max_window's view).
template <class T>
struct PlaneView {
  const T* base;
  int64_t step;
  __device__ T operator[](int64_t i) const { return base[i * step]; }
};

// Threads over the outputs in memory order (channels last: consecutive threads on
// consecutive channels, coalesced).
template <class T>
__global__ void maxpool_forward_kernel(T* out, int32_t* argmax, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const ImageAt in_at = input_at(w), out_at = output_at(w);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, oh, ow;
    out_at.split(i, n, c, oh, ow);
    const PlaneView<T> in{inp + in_at(n, c, 0, 0), w.channels_last ? w.C : 1};
    int32_t at;  // the first of equal maxima, as the CPU and PyTorch (backend/op_types.hpp)
    const float best = max_window(in, oh, ow, w, [](T v) { return to_f32(v); }, &at);
    out[i] = from_f32<T>(best);
    argmax[i] = at;
  }
}

// Each input element sums, in (oh, ow) order as the CPU, the gradients of the windows
// whose maximum it was.
template <class T>
__global__ void maxpool_backward_kernel(T* dinp, const T* dout, const int32_t* argmax, Window2d w, bool accumulate) {
  const int64_t total = w.N * w.C * w.H * w.W;
  const ImageAt in_at = input_at(w), out_at = output_at(w);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, h, x;
    in_at.split(i, n, c, h, x);
    const int32_t self = static_cast<int32_t>(h * w.W + x);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) {
        const int64_t o = out_at(n, c, oh, ow);
        if (argmax[o] == self) sum += to_f32(dout[o]);
      }
    dinp[i] = from_f32<T>(sum);
  }
}

template <class T>
__global__ void avgpool_forward_kernel(T* out, const T* inp, Window2d w) {
  const int64_t total = w.N * w.C * w.OH * w.OW;
  const float inv = 1.0f / static_cast<float>(w.KH * w.KW);
  const ImageAt in_at = input_at(w), out_at = output_at(w);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, oh, ow;
    out_at.split(i, n, c, oh, ow);
    float sum = 0.0f;
    for (int64_t kh = 0; kh < w.KH; ++kh) {
      const int64_t h = oh * w.stride - w.padding + kh;
      if (h < 0 || h >= w.H) continue;
      for (int64_t kw = 0; kw < w.KW; ++kw) {
        const int64_t x = ow * w.stride - w.padding + kw;
        if (x >= 0 && x < w.W) sum += to_f32(inp[in_at(n, c, h, x)]);
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
  const ImageAt in_at = input_at(w), out_at = output_at(w);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t n, c, h, x;
    in_at.split(i, n, c, h, x);
    int64_t oh0, oh1, ow0, ow1;
    covering(h, w.KH, w.stride, w.padding, w.OH, oh0, oh1);
    covering(x, w.KW, w.stride, w.padding, w.OW, ow0, ow1);
    float sum = accumulate ? to_f32(dinp[i]) : 0.0f;
    for (int64_t oh = oh0; oh < oh1; ++oh)
      for (int64_t ow = ow0; ow < ow1; ++ow) sum += to_f32(dout[out_at(n, c, oh, ow)]) * inv;
    dinp[i] = from_f32<T>(sum);
  }
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
  MPIPE_CHECK(!w.channels_last, "conv2d_forward: a channels-last window on the channels-first op");
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
  MPIPE_CHECK(!w.channels_last, "conv2d_backward: a channels-last window on the channels-first op");
  const int64_t P = w.N * w.OH * w.OW, plane = w.OH * w.OW;
  if (P == 0 || w.OC == 0) return;
  // cuDNN's gradients first: their workspace may grow scratch(), which the GEMM path
  // then carves.
  if (dinp && dnn_conv_input_gradient(dinp, dout, weight, w, mode)) dinp = nullptr;
  if (dweight && dnn_conv_weight_gradient(dweight, dout, inp, w)) dweight = nullptr;
  if (!dinp && !dweight && !dbias) return;
  cudaStream_t stream = context().compute;
  if (!dinp && !dweight) {  // no GEMM left to read a permuted copy of dout
    bias_grad_nchw<<<static_cast<unsigned>(w.OC), kChannelThreads, 0, stream>>>(dbias, dev(dout), w.N, w.OC, plane);
    CUDA_CHECK_LAUNCH();
    return;
  }
  const int64_t G = w.groups, Cg = w.C / G, OCg = w.OC / G, Kg = Cg * w.KH * w.KW;

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
    bias_grad<<<static_cast<unsigned>(w.OC), kChannelThreads, 0, stream>>>(dbias, dev(dout_t), P, P, 1);
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

template <class E>
void conv2d_bias_gradient_last(float* dbias, const E* dout, int64_t rows, int64_t OC) {
  if (rows == 0 || OC == 0) return;
  MPIPE_CHECK(OC <= INT32_MAX, "conv2d: ", OC, " channels exceed one launch");
  bias_grad<<<static_cast<unsigned>(OC), kChannelThreads, 0, context().compute>>>(dbias, dev(dout), rows, 1, OC);
  CUDA_CHECK_LAUNCH();
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
  if (!w.channels_last && w.OH == 1 && w.OW == 1 && w.KH == w.H && w.KW == w.W && w.padding == 0) {  // global
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

#define MPIPE_CONV_OPS(E)                                                                                          \
  template void conv2d_forward<E>(E*, const E*, const E*, const E*, const Window2d&);                           \
  template void conv2d_backward<E>(E*, float*, float*, const E*, const E*, const E*, const Window2d&, GradMode);  \
  template void conv2d_bias_gradient_last<E>(float*, const E*, int64_t, int64_t);                                \
  template void maxpool2d_forward<E>(E*, int32_t*, const E*, const Window2d&);                                   \
  template void maxpool2d_backward<E>(E*, const E*, const int32_t*, const Window2d&, GradMode);                  \
  template void avgpool2d_forward<E>(E*, const E*, const Window2d&);                                             \
  template void avgpool2d_backward<E>(E*, const E*, const Window2d&, GradMode);
MPIPE_CONV_OPS(float)
MPIPE_CONV_OPS(bf16)
#undef MPIPE_CONV_OPS

}  // namespace mpipe::cuda
