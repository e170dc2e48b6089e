// What BatchNorm's channels-first (batchnorm.cu) and channels-last (batchnorm_last.cu)
// kernels share. Included only by src/backend/cuda/*.cu.
#pragma once
#include <cstdint>

namespace mpipe::cuda {

// Channel c's statistics once its sum and sum of squared deviations over n elements are
// known: the running statistics moved (null: not) and the deferred rule's sums gathered
// (null: none; count, C sums, C sums of squares), one thread per channel.
__device__ __forceinline__ void record_statistics(float* running_mean, float* running_var, double* sums_out, int64_t c,
                                                  int64_t C, double n, double sum, double sq, float momentum) {
  const double m = sum / n, var = sq / n;
  if (running_mean) {
    const double unbiased = n > 1 ? sq / (n - 1) : var;
    running_mean[c] = (1 - momentum) * running_mean[c] + momentum * static_cast<float>(m);
    running_var[c] = (1 - momentum) * running_var[c] + momentum * static_cast<float>(unbiased);
  }
  if (sums_out) {
    if (c == 0) sums_out[0] += n;
    sums_out[1 + c] += sum;
    sums_out[1 + C + c] += sq + n * m * m;
  }
}

}  // namespace mpipe::cuda
