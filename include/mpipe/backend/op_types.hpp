// Types shared by the CPU and CUDA op interfaces, and the rules both backends' kernels
// apply alike. Plain C++17: CUDA sources include it.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MPIPE_HOST_DEVICE __host__ __device__
#else
#define MPIPE_HOST_DEVICE
#endif

namespace mpipe {

// Whether an op overwrites its input-gradient output or adds to it. Parameter
// gradients are always accumulated, so micro-batches sum into them.
enum class GradMode { overwrite, accumulate };

// Dropout mask key: the mask of element e of sample s is a pure function of
// (seed, step, sample_begin + s, site, e), so recomputation, any batch split and either
// backend agree.
struct DropoutKey {
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  std::uint64_t sample_begin = 0;  // index within the step of this call's first sample
  std::uint32_t site = 0;          // global layer index * 16 + site within the layer
};

// Dropout's rule on both backends: an element is kept when its 32-bit word is at least
// p 2^32, and what is kept is scaled by 1 / (1 - p).
struct DropoutRule {
  std::uint32_t threshold = 0;
  float keep_scale = 1.0f;
  explicit DropoutRule(float p)
      : threshold(static_cast<std::uint32_t>(std::min(4294967295.0, std::ldexp(static_cast<double>(p), 32)))),
        keep_scale(1.0f / (1.0f - p)) {}
};

// Runs of `length` elements copied between two layouts: run i from src[i · src_stride +
// src_offset] to dst[i · dst_stride + dst_offset] (a channel concatenation's halves, each
// sample's channels a run).
struct Runs {
  std::int64_t count = 0, length = 0;
  std::int64_t dst_stride = 0, dst_offset = 0, src_stride = 0, src_offset = 0;
};

// The geometry of a 2-D convolution or pooling window: input (N, C, H, W), output
// (N, OC, OH, OW), kernel KH x KW, the same stride and zero padding along both axes, C
// and OC split into `groups` (convolution only). The shapes are logical; the tensors lie
// in memory as NCHW, or as NHWC (channels last: each position's channels side by side)
// where `channels_last` is set (train --channels-last on). Weights are (OC, C/groups, KH,
// KW) in either layout.
struct Window2d {
  std::int64_t N = 0, C = 0, H = 0, W = 0, OC = 0, OH = 0, OW = 0;
  std::int64_t KH = 1, KW = 1, stride = 1, padding = 0, groups = 1;
  bool channels_last = false;
};

// Output (oh, ow) of a max pool over one plane `in` (a pointer, or anything indexed by
// h W + x: a channels-last plane's strided view), its elements read as floats by
// `load`: the first of equal maxima in (kh, kw) order, as PyTorch (a NaN first stays; a
// later one is passed over), and in *at where it is (-1: no element in the window). The
// CPU's and the GPU's kernels both choose by it, so their argmax agree.
template <class In, class Load>
MPIPE_HOST_DEVICE inline float max_window(In in, std::int64_t oh, std::int64_t ow, const Window2d& w, Load load,
                                          std::int32_t* at) {
  float best = -INFINITY;
  *at = -1;
  for (std::int64_t kh = 0; kh < w.KH; ++kh) {
    const std::int64_t h = oh * w.stride - w.padding + kh;
    if (h < 0 || h >= w.H) continue;
    for (std::int64_t kw = 0; kw < w.KW; ++kw) {
      const std::int64_t x = ow * w.stride - w.padding + kw;
      if (x < 0 || x >= w.W) continue;
      const float v = load(in[h * w.W + x]);
      if (*at < 0 || v > best) {
        best = v;
        *at = static_cast<std::int32_t>(h * w.W + x);
      }
    }
  }
  return best;
}

}  // namespace mpipe
