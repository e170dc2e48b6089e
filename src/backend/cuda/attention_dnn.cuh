// Causal attention on cuDNN's fused engines, bf16 (see attention_dnn.cu), for
// attention.cu. Included only by src/backend/cuda/*.cu.
#pragma once
#include <cstdint>

#include "context.cuh"

namespace mpipe::cuda {

// False under MPIPE_ATTENTION=flash (the FlashAttention-2 kernel everywhere).
bool dnn_attention_wanted();
// MPIPE_ATTENTION=verbose: each shape's choice said once on stderr.
bool dnn_attention_verbose();

// attention_forward's contract (out (B, T, C), lse (B, H, T) natural log, qkv (B, T, 3C))
// on cuDNN; false (nothing written) where cuDNN declines the shape. Every tensor (q, k
// and v where they lie in qkv) 16-byte aligned, as the graph declares: the caller checks.
bool dnn_attention_forward(bf16* out, float* lse, const bf16* qkv, int64_t B, int64_t T, int64_t H, int64_t hs);
// attention_backward's contract (dqkv (B, T, 3C) overwritten) on cuDNN; false as above.
bool dnn_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                            int64_t B, int64_t T, int64_t H, int64_t hs);

}  // namespace mpipe::cuda
