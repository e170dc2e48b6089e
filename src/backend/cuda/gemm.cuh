// Row-major GEMMs on cuBLASLt, for the matmul and attention ops. Included only by
// src/backend/cuda/*.cu.
#pragma once
#include <cstdint>

#include "context.cuh"

namespace mpipe::cuda {

// c (M, N) = alpha * op(a) (M, K) · op(b) (K, N) + beta * c, all row-major, `batch`
// times at the given strides (elements). op(x) is x^T when trans_x. fp32 accumulation
// (CUBLAS_COMPUTE_32F, never TF32).
struct Gemm {
  int64_t M = 0, N = 0, K = 0;
  const void* a = nullptr;
  int64_t lda = 0;
  bool trans_a = false;
  const void* b = nullptr;
  int64_t ldb = 0;
  bool trans_b = false;
  void* c = nullptr;
  int64_t ldc = 0;
  cudaDataType_t ab_type = CUDA_R_32F;  // of a and b
  cudaDataType_t c_type = CUDA_R_32F;
  float alpha = 1.0f, beta = 0.0f;
  int batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  const void* bias = nullptr;  // (N) of c_type, added to every row of c (epilogue)
  void* gelu_pre = nullptr;    // (M, N) at ldc: when set, c = GELU(pre) and pre receives the pre-activation
};

// Queues the GEMM on the compute stream; throws when cuBLASLt has no algorithm for it.
void gemm(const Gemm& g);
// As gemm(), but returns false instead of throwing when cuBLASLt has no algorithm (an
// epilogue not offered for these types, say), so the caller can do the work otherwise.
bool try_gemm(const Gemm& g);

template <class E>
constexpr cudaDataType_t data_type();
template <>
constexpr cudaDataType_t data_type<float>() {
  return CUDA_R_32F;
}
template <>
constexpr cudaDataType_t data_type<bf16>() {
  return CUDA_R_16BF;
}

}  // namespace mpipe::cuda
