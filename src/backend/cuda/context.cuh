// Inside the CUDA backend: the rank's streams and library handles, and the checks that
// wrap every CUDA, cuBLAS and cuDNN call with file, line and the failing call. Included
// only by src/backend/cuda/*.cu.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <cstddef>
#include <string>

#include "libraries.cuh"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe::cuda {

[[noreturn]] void fail(const char* file, int line, const char* call, const std::string& what);
const char* cublas_status_name(cublasStatus_t status);

}  // namespace mpipe::cuda

// CUDA_CHECK(call): throws mpipe::Error "file:line: `call` failed: <CUDA's message>".
#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    const cudaError_t mpipe_status_ = (call);                                             \
    if (mpipe_status_ != cudaSuccess)                                                     \
      ::mpipe::cuda::fail(__FILE__, __LINE__, #call, cudaGetErrorString(mpipe_status_));  \
  } while (0)
#define CUBLAS_CHECK(call)                                                                       \
  do {                                                                                           \
    const cublasStatus_t mpipe_status_ = (call);                                                 \
    if (mpipe_status_ != CUBLAS_STATUS_SUCCESS)                                                  \
      ::mpipe::cuda::fail(__FILE__, __LINE__, #call, ::mpipe::cuda::cublas_status_name(mpipe_status_)); \
  } while (0)
#define CUDNN_CHECK(call)                                                                 \
  do {                                                                                    \
    const cudnnStatus_t mpipe_status_ = (call);                                           \
    if (mpipe_status_ != CUDNN_STATUS_SUCCESS)                                            \
      ::mpipe::cuda::fail(__FILE__, __LINE__, #call, ::mpipe::cuda::lib().cudnnGetErrorString(mpipe_status_)); \
  } while (0)
// After a kernel launch: a bad configuration shows up here, not at the next sync.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace mpipe::cuda {

// The process's GPU state, created by init().
struct Context {
  int device = -1;
  cudaDeviceProp properties{};
  cudaStream_t compute = nullptr;
  cudaStream_t to_device = nullptr;
  cudaStream_t to_host = nullptr;
  cublasHandle_t blas = nullptr;      // bound to `compute`
  cublasLtHandle_t blas_lt = nullptr;
  cudnnHandle_t dnn = nullptr;        // bound to `compute`
  void* lt_workspace = nullptr;       // cuBLASLt's, fixed size
  std::size_t lt_workspace_bytes = 0;
  void* scratch = nullptr;            // ops' temporary storage, see scratch()
  std::size_t scratch_bytes = 0;
};

// The context; throws when init() has not run.
Context& context();
inline cudaStream_t stream(StreamKind kind) {
  Context& c = context();
  return kind == StreamKind::compute ? c.compute : kind == StreamKind::to_device ? c.to_device : c.to_host;
}
// Temporary device storage for one op call on the compute stream (sort buffers, partial
// sums, attention scores). Grows, synchronising, only when a call needs more than any
// before it: in the first step, never in later ones of the same shape.
void* scratch(std::size_t bytes);

// Device views of our element types.
template <class E>
struct device_type;
template <>
struct device_type<float> {
  using type = float;
};
template <>
struct device_type<bf16> {
  using type = __nv_bfloat16;
};
template <class E>
using device_t = typename device_type<E>::type;
template <class E>
device_t<E>* dev(E* p) { return reinterpret_cast<device_t<E>*>(p); }
template <class E>
const device_t<E>* dev(const E* p) { return reinterpret_cast<const device_t<E>*>(p); }

}  // namespace mpipe::cuda
