// Causal attention on cuDNN's fused engines, bf16 (see attention_dnn.cu), for
// attention.cu, and the shape of an attention call both files name. Included only by
// src/backend/cuda/*.cu.
#pragma once
#include <cstdint>
#include <string>

#include "context.cuh"

namespace mpipe::cuda {

// One attention call's shape: B sequences of T steps, H query heads and KVH key/value
// heads (KVH divides H; KVH = H: multi-head) of hs channels each. qkv rows are
// C + 2 KV wide: H query heads, then KVH key heads, then KVH value heads.
struct Heads {
  int64_t B, T, H, KVH, hs;
  int64_t C() const { return H * hs; }
  int64_t KV() const { return KVH * hs; }
  int64_t ld() const { return C() + 2 * KV(); }
  // "B 8 T 1024 H 16 hs 64", with "KVH 4" after H where it differs (the messages say it).
  std::string text() const;
};

// False under MPIPE_ATTENTION=flash (the FlashAttention-2 kernel everywhere).
bool dnn_attention_wanted();
// MPIPE_ATTENTION=verbose: each shape's choice said once on stderr.
bool dnn_attention_verbose();

// attention_forward's contract (out (B, T, C), lse (B, H, T) natural log, qkv (B, T,
// C + 2 KV)) on cuDNN; false (nothing written) where cuDNN declines the shape. Every
// tensor (q, k and v where they lie in qkv) 16-byte aligned, as the graph declares: the
// caller checks.
bool dnn_attention_forward(bf16* out, float* lse, const bf16* qkv, const Heads& a);
// attention_backward's contract (dqkv (B, T, C + 2 KV) overwritten) on cuDNN; false as
// above.
bool dnn_attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                            const Heads& a);

}  // namespace mpipe::cuda
