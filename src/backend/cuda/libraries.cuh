// cuBLAS, cuBLASLt and cuDNN, opened with dlopen when the GPU is first used (cuda::init)
// instead of by the dynamic loader at start: cuBLASLt alone costs every process ~0.35 s
// of relocation and constructors (353k relocations), in which a stop signal would kill
// a rank before its handler is installed, and which a CPU run never needs. Only
// libcudart is linked. Included only by src/backend/cuda/*.cu.
//
// A function of these libraries is called through the table: lib().cublasLtMatmul(...).
// Using another one = adding its name to the list below.
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cudnn.h>

// The functions used, by library. Names as the headers' macros make them
// (cublasCreate is cublasCreate_v2): each is looked up under its expanded name.
#define MPIPE_CUBLAS_FUNCTIONS(X) \
  X(cublasCreate)                 \
  X(cublasSetStream)              \
  X(cublasSetAtomicsMode)         \
  X(cublasSetWorkspace)
#define MPIPE_CUBLASLT_FUNCTIONS(X)      \
  X(cublasLtCreate)                      \
  X(cublasLtMatmul)                      \
  X(cublasLtMatmulAlgoGetHeuristic)      \
  X(cublasLtMatmulDescCreate)            \
  X(cublasLtMatmulDescDestroy)           \
  X(cublasLtMatmulDescSetAttribute)      \
  X(cublasLtMatmulPreferenceCreate)      \
  X(cublasLtMatmulPreferenceDestroy)     \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatrixLayoutCreate)          \
  X(cublasLtMatrixLayoutDestroy)         \
  X(cublasLtMatrixLayoutSetAttribute)
#define MPIPE_CUDNN_FUNCTIONS(X)                      \
  X(cudnnCreate)                                      \
  X(cudnnGetErrorString)                              \
  X(cudnnSetStream)                                   \
  X(cudnnCreateTensorDescriptor)                      \
  X(cudnnSetTensor4dDescriptor)                       \
  X(cudnnDestroyTensorDescriptor)                     \
  X(cudnnCreateFilterDescriptor)                      \
  X(cudnnSetFilter4dDescriptor)                       \
  X(cudnnDestroyFilterDescriptor)                     \
  X(cudnnCreateConvolutionDescriptor)                 \
  X(cudnnSetConvolution2dDescriptor)                  \
  X(cudnnSetConvolutionGroupCount)                    \
  X(cudnnSetConvolutionMathType)                      \
  X(cudnnDestroyConvolutionDescriptor)                \
  X(cudnnGetConvolutionForwardAlgorithmMaxCount)      \
  X(cudnnGetConvolutionForwardAlgorithm_v7)           \
  X(cudnnGetConvolutionForwardWorkspaceSize)          \
  X(cudnnConvolutionForward)                          \
  X(cudnnGetConvolutionBackwardDataAlgorithmMaxCount) \
  X(cudnnGetConvolutionBackwardDataAlgorithm_v7)      \
  X(cudnnGetConvolutionBackwardDataWorkspaceSize)     \
  X(cudnnConvolutionBackwardData)                    \
  X(cudnnGetConvolutionBackwardFilterAlgorithmMaxCount) \
  X(cudnnGetConvolutionBackwardFilterAlgorithm_v7)  \
  X(cudnnGetConvolutionBackwardFilterWorkspaceSize) \
  X(cudnnConvolutionBackwardFilter)                 \
  X(cudnnGetVersion)                                \
  X(cudnnBackendCreateDescriptor)                   \
  X(cudnnBackendDestroyDescriptor)                  \
  X(cudnnBackendSetAttribute)                       \
  X(cudnnBackendGetAttribute)                       \
  X(cudnnBackendFinalize)                           \
  X(cudnnBackendExecute)

namespace mpipe::cuda {

struct Libraries {
#define MPIPE_LIBRARY_MEMBER(name) decltype(&::name) name = nullptr;
  MPIPE_CUBLAS_FUNCTIONS(MPIPE_LIBRARY_MEMBER)
  MPIPE_CUBLASLT_FUNCTIONS(MPIPE_LIBRARY_MEMBER)
  MPIPE_CUDNN_FUNCTIONS(MPIPE_LIBRARY_MEMBER)
#undef MPIPE_LIBRARY_MEMBER
};

// The table, loaded at the first call (thread-safe). Throws mpipe::Error naming the
// library or function that could not be found, with dlerror's words and a hint.
const Libraries& lib();

}  // namespace mpipe::cuda
