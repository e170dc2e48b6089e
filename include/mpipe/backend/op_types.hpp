// Types shared by the CPU and CUDA op interfaces. Plain C++17: CUDA sources include it.
#pragma once
#include <cstdint>

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

// The geometry of a 2-D convolution or pooling window over NCHW tensors: input
// (N, C, H, W), output (N, OC, OH, OW), kernel KH x KW, the same stride and zero
// padding along both axes, C and OC split into `groups` (convolution only).
struct Window2d {
  std::int64_t N = 0, C = 0, H = 0, W = 0, OC = 0, OH = 0, OW = 0;
  std::int64_t KH = 1, KW = 1, stride = 1, padding = 0, groups = 1;
};

}  // namespace mpipe
