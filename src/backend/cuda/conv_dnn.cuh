// Convolution on cuDNN for conv.cu (see conv_dnn.cu). Included only by
// src/backend/cuda/*.cu.
#pragma once
#include "context.cuh"
#include "mpipe/backend/op_types.hpp"

namespace mpipe::cuda {

// out (N, OC, OH, OW) = conv(inp, weight) + bias (may be null), on cuDNN; false (nothing
// written) where cuDNN has no deterministic algorithm for the shape or declines it.
template <class E>
bool dnn_conv_forward(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w);
// dinp (N, C, H, W) per mode = the input gradient, on cuDNN; false (nothing written) as above.
template <class E>
bool dnn_conv_input_gradient(E* dinp, const E* dout, const E* weight, const Window2d& w, GradMode mode);
// dweight (OC, C/groups, KH, KW) fp32 += the weight gradient, on cuDNN; in bf16 the
// gradient is rounded to bf16 before it is added (cuDNN writes it in the inputs' type).
// false (nothing written) as above.
template <class E>
bool dnn_conv_weight_gradient(float* dweight, const E* dout, const E* inp, const Window2d& w);

}  // namespace mpipe::cuda
