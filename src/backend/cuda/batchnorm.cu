// CUDA BatchNorm over NCHW (both rules' statistics, evaluation, backward): the CPU ops of
// src/backend/cpu/conv.cpp on the GPU (contracts in include/mpipe/backend/cuda/ops.hpp).
//
// Determinism: no atomics. Every channel sum is split into per-segment partial sums, each
// in one block, added up in segment order: the split and every order depend on the sizes
// alone.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "batchnorm.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

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
                                           bool packed, bool relu) {
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
        for (int j = 0; j < W; ++j) {
          y.v[j] = from_f32<T>(to_f32(x.v[j]) * scale + shift);
          // Rectified as relu_forward would, from the stored value: the same bits.
          if (relu && to_f32(y.v[j]) < 0.0f) y.v[j] = from_f32<T>(0.0f);
        }
        store_run<W>(out + at, y, packed);
      });
  if (s != 0 || threadIdx.x != 0) return;
  mean[c] = static_cast<float>(m);
  rstd[c] = r;
  record_statistics(running_mean, running_var, sums_out, c, sh.C, n, sum, sq, momentum);
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

// One launch's segments (blocks = C S) and two arrays of C S segment partials in scratch(),
// taken before any launch (scratch() may grow, synchronising). The pack width follows from
// the plane alone: it orders the sums.
template <class T>
struct NormLaunch {
  NormShape sh;
  unsigned blocks;
  double *first, *second;
  int width;
  NormLaunch(int64_t N, int64_t C, int64_t plane)
      : sh{N, C, plane, norm_segments(N, C, plane)}, width(width_for<T>(plane)) {
    const int64_t count = C * sh.S;
    MPIPE_CHECK(count <= INT32_MAX, "batchnorm: ", C, " channels exceed one launch");
    blocks = static_cast<unsigned>(count);
    ScratchPlan plan;
    const std::size_t first_at = plan.reserve<double>(count), second_at = plan.reserve<double>(count);
    void* base = scratch(plan.bytes());
    first = place<double>(base, first_at);
    second = place<double>(base, second_at);
  }
};

}  // namespace

template <class E>
void batchnorm_forward_train(E* out, float* mean, float* rstd, float* running_mean, float* running_var, double* sums,
                             const E* inp, const E* weight, const E* bias, int64_t N, int64_t C, int64_t plane,
                             float eps, float momentum, bool relu) {
  if (C == 0 || N * plane == 0) return;
  using T = device_t<E>;
  const NormLaunch<T> at(N, C, plane);
  double* partial_sums = at.first;
  double* partial_squares = at.second;
  const bool packed = all_aligned({inp, out}, sizeof(T) * at.width);
  cudaStream_t stream = context().compute;
  with_width<T>(at.width, [&](auto pack) {
    constexpr int W = decltype(pack)::value;
    batchnorm_sum_kernel<T, W><<<at.blocks, kNormThreads, 0, stream>>>(partial_sums, dev(inp), at.sh, packed);
    CUDA_CHECK_LAUNCH();
    batchnorm_squares_kernel<T, W><<<at.blocks, kNormThreads, 0, stream>>>(partial_squares, partial_sums, dev(inp),
                                                                            at.sh, packed);
    CUDA_CHECK_LAUNCH();
    batchnorm_normalize_kernel<T, W><<<at.blocks, kNormThreads, 0, stream>>>(
        dev(out), mean, rstd, running_mean, running_var, sums, partial_sums, partial_squares, dev(inp), dev(weight),
        dev(bias), at.sh, eps, momentum, packed, relu);
    CUDA_CHECK_LAUNCH();
  });
}

void batchnorm_apply_sums(float* running_mean, float* running_var, const double* sums, int64_t C, float momentum) {
  if (C == 0) return;
  batchnorm_apply_sums_kernel<<<blocks_for(C, kThreads), kThreads, 0, context().compute>>>(running_mean, running_var, sums, C,
                                                                               momentum);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_forward_eval(E* out, const E* inp, const E* weight, const E* bias, const float* running_mean,
                            const float* running_var, int64_t N, int64_t C, int64_t plane, float eps) {
  const int64_t total = N * C * plane;
  if (total == 0) return;
  batchnorm_eval_kernel<<<blocks_for(total, kThreads), kThreads, 0, context().compute>>>(
      dev(out), dev(inp), dev(weight), dev(bias), running_mean, running_var, N, C, plane, eps);
  CUDA_CHECK_LAUNCH();
}

template <class E>
void batchnorm_backward(E* dinp, float* dweight, float* dbias, const E* dout, const E* inp, const E* weight,
                        const float* mean, const float* rstd, int64_t N, int64_t C, int64_t plane, GradMode mode) {
  if (C == 0 || N * plane == 0) return;
  using T = device_t<E>;
  const NormLaunch<T> at(N, C, plane);
  double* sum_dy = at.first;
  double* sum_dy_xhat = at.second;
  const NormShape& sh = at.sh;
  const bool packed = all_aligned({dout, inp, dinp ? dinp : inp}, sizeof(T) * at.width);
  cudaStream_t stream = context().compute;
  with_width<T>(at.width, [&](auto pack) {
    constexpr int W = decltype(pack)::value;
    batchnorm_backward_sums_kernel<T, W><<<at.blocks, kNormThreads, 0, stream>>>(
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

#define MPIPE_BATCHNORM_OPS(E)                                                                                    \
  template void batchnorm_forward_train<E>(E*, float*, float*, float*, float*, double*, const E*, const E*,      \
                                           const E*, int64_t, int64_t, int64_t, float, float, bool);            \
  template void batchnorm_forward_eval<E>(E*, const E*, const E*, const E*, const float*, const float*, int64_t, \
                                          int64_t, int64_t, float);                                              \
  template void batchnorm_backward<E>(E*, float*, float*, const E*, const E*, const E*, const float*,            \
                                      const float*, int64_t, int64_t, int64_t, GradMode);
MPIPE_BATCHNORM_OPS(float)
MPIPE_BATCHNORM_OPS(bf16)
#undef MPIPE_BATCHNORM_OPS

}  // namespace mpipe::cuda
