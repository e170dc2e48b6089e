// Convolution on cuDNN (its legacy convolution API, opened through libraries.cuh): the
// forward, the input gradient and the weight gradient, each where cuDNN's heuristics
// offer a deterministic algorithm for the shape (fp32 restricted to FMA kernels, so no
// TF32; bf16 on tensor cores). The algorithm is chosen once per shape and direction from
// the heuristics' ranking, not by timing, which could choose differently in another
// process and break partition transparency, and kept with its descriptors; the workspace
// (at most 256 MiB) comes from scratch(). The legacy API writes a bf16 convolution's
// weight gradient in bf16 (its inputs' type): that gradient is rounded to bf16 once,
// then added to the fp32 one. MPIPE_CONV=gemm turns cuDNN off (for comparisons): conv.cu's
// GEMM path then does all; MPIPE_CONV=verbose prints each shape's choice.
//
// Channels last (Window2d::channels_last): the activations are described as NHWC and
// the filter as NHWC too ((OC, KH, KW, C/groups), cuDNN's layout for its tensor-core
// kernels, which then need no transposes of their own). The weights stay (OC, C/groups,
// KH, KW) everywhere else (optimizer, checkpoints): each call swaps them into scratch
// (swap_inner), and the weight gradient comes back in the filter's layout and is added
// to the fp32 one swapped back. A channels-last shape cuDNN declines is the caller's to
// run through channels first (conv_ops.cpp).
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

#include "conv_dnn.cuh"
#include "kernels.cuh"
#include "mpipe/backend/cuda/ops.hpp"

namespace mpipe::cuda {

namespace {

// MPIPE_CONV: unset, cuDNN takes what it can; "gemm", none; "verbose", as unset, and each
// shape's choice (algorithm, math, workspace, or the GEMM path) printed once to stderr.
const char* conv_mode() {
  static const char* mode = [] {
    const char* v = std::getenv("MPIPE_CONV");
    return v ? v : "";
  }();
  return mode;
}
bool dnn_wanted() { return std::strcmp(conv_mode(), "gemm") != 0; }
bool verbose() { return std::strcmp(conv_mode(), "verbose") == 0; }

// The most workspace a cuDNN algorithm may ask for (PyTorch's order of size); larger
// ones are passed over: scratch() never shrinks, so one would stay held all run.
constexpr std::size_t kMaxWorkspace = std::size_t{256} << 20;

// One shape's descriptors and algorithms. A direction without a deterministic algorithm
// (or refused at run time) falls back to the GEMM path, for this shape from then on.
// `backward` is the input gradient; `w`, in the inputs' type, describes the weight
// gradient too (the legacy API writes it in that type).
struct DnnConv {
  cudnnTensorDescriptor_t x = nullptr, y = nullptr;
  cudnnFilterDescriptor_t w = nullptr;
  cudnnConvolutionDescriptor_t forward_conv = nullptr, backward_conv = nullptr, weight_grad_conv = nullptr;
  bool has_forward = false, has_backward = false, has_weight_grad = false;
  cudnnConvolutionFwdAlgo_t forward{};
  cudnnConvolutionBwdDataAlgo_t backward{};
  cudnnConvolutionBwdFilterAlgo_t weight_grad{};
  std::size_t forward_bytes = 0, backward_bytes = 0, weight_grad_bytes = 0;

  DnnConv() = default;
  DnnConv(const DnnConv&) = delete;
  DnnConv& operator=(const DnnConv&) = delete;
  ~DnnConv() {
    const Libraries& l = lib();
    if (weight_grad_conv) l.cudnnDestroyConvolutionDescriptor(weight_grad_conv);
    if (backward_conv) l.cudnnDestroyConvolutionDescriptor(backward_conv);
    if (forward_conv) l.cudnnDestroyConvolutionDescriptor(forward_conv);
    if (w) l.cudnnDestroyFilterDescriptor(w);
    if (y) l.cudnnDestroyTensorDescriptor(y);
    if (x) l.cudnnDestroyTensorDescriptor(x);
  }
};

using DnnKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          bool, bool>;
DnnKey key_of(const Window2d& w, bool bf16) {
  return {w.N, w.C, w.H, w.W, w.OC, w.KH, w.KW, w.stride, w.padding, w.groups, bf16, w.channels_last};
}

bool ok(cudnnStatus_t status) { return status == CUDNN_STATUS_SUCCESS; }

// A convolution descriptor of the shape with `math`.
bool make_conv(cudnnConvolutionDescriptor_t& conv, const Window2d& w, cudnnMathType_t math) {
  const Libraries& l = lib();
  const int pad = static_cast<int>(w.padding), stride = static_cast<int>(w.stride);
  return ok(l.cudnnCreateConvolutionDescriptor(&conv)) &&
         ok(l.cudnnSetConvolution2dDescriptor(conv, pad, pad, stride, stride, 1, 1, CUDNN_CROSS_CORRELATION,
                                              CUDNN_DATA_FLOAT)) &&
         ok(l.cudnnSetConvolutionGroupCount(conv, static_cast<int>(w.groups))) &&
         ok(l.cudnnSetConvolutionMathType(conv, math));
}

// Algorithms that transform the problem (FFT, Winograd): deterministic but less exact,
// kept out of fp32, the precision that is compared with the CPU at 1e-5.
bool transforms(cudnnConvolutionFwdAlgo_t a) {
  return a == CUDNN_CONVOLUTION_FWD_ALGO_FFT || a == CUDNN_CONVOLUTION_FWD_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_FWD_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdDataAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_DATA_ALGO_WINOGRAD_NONFUSED;
}
bool transforms(cudnnConvolutionBwdFilterAlgo_t a) {
  return a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_FFT_TILING ||
         a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD || a == CUDNN_CONVOLUTION_BWD_FILTER_ALGO_WINOGRAD_NONFUSED;
}

// The algorithm cuDNN's heuristics rank first among the deterministic ones whose math is
// allowed (fp32: FMA only, so no TF32, and no transform) and whose workspace fits; false
// when there is none.
template <class Perf>
bool choose(const std::vector<Perf>& ranked, int returned, bool bf16, Perf& chosen) {
  for (int i = 0; i < returned; ++i) {
    const Perf& p = ranked[static_cast<std::size_t>(i)];
    const bool math = bf16 ? p.mathType != CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION
                           : p.mathType == CUDNN_FMA_MATH && !transforms(p.algo);
    if (ok(p.status) && p.determinism == CUDNN_DETERMINISTIC && math && p.memory <= kMaxWorkspace) {
      chosen = p;
      return true;
    }
  }
  return false;
}

std::unique_ptr<DnnConv> build_dnn(const Window2d& w, bool bf16) {
  auto plan = std::make_unique<DnnConv>();
  // 4-d descriptors take int, and the legacy API indexes a tensor's elements in 32 bits.
  for (const int64_t v : {w.N, w.C, w.H, w.W, w.OC, w.OH, w.OW, w.KH, w.KW, w.N * w.C * w.H * w.W,
                          w.N * w.OC * w.OH * w.OW, w.OC * (w.C / w.groups) * w.KH * w.KW})
    if (v > INT_MAX) return plan;
  const Libraries& l = lib();
  cudnnHandle_t handle = context().dnn;
  const cudnnDataType_t type = bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_FLOAT;
  const cudnnMathType_t math = bf16 ? CUDNN_TENSOR_OP_MATH : CUDNN_FMA_MATH;
  const cudnnTensorFormat_t format = w.channels_last ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  const auto i = [](int64_t v) { return static_cast<int>(v); };
  // The 4-d setters take the sizes in N, C, H, W order whatever the format.
  if (!ok(l.cudnnCreateTensorDescriptor(&plan->x)) ||
      !ok(l.cudnnSetTensor4dDescriptor(plan->x, format, type, i(w.N), i(w.C), i(w.H), i(w.W))) ||
      !ok(l.cudnnCreateTensorDescriptor(&plan->y)) ||
      !ok(l.cudnnSetTensor4dDescriptor(plan->y, format, type, i(w.N), i(w.OC), i(w.OH), i(w.OW))) ||
      !ok(l.cudnnCreateFilterDescriptor(&plan->w)) ||
      !ok(l.cudnnSetFilter4dDescriptor(plan->w, type, format, i(w.OC), i(w.C / w.groups), i(w.KH), i(w.KW))))
    return plan;

  // Forward.
  int most = 0, returned = 0;
  if (make_conv(plan->forward_conv, w, math) &&
      ok(l.cudnnGetConvolutionForwardAlgorithmMaxCount(handle, &most)) && most > 0) {
    std::vector<cudnnConvolutionFwdAlgoPerf_t> ranked(static_cast<std::size_t>(most));
    cudnnConvolutionFwdAlgoPerf_t chosen{};
    if (ok(l.cudnnGetConvolutionForwardAlgorithm_v7(handle, plan->x, plan->w, plan->forward_conv, plan->y, most,
                                                     &returned, ranked.data())) &&
        choose(ranked, returned, bf16, chosen) && ok(l.cudnnSetConvolutionMathType(plan->forward_conv, chosen.mathType)) &&
        ok(l.cudnnGetConvolutionForwardWorkspaceSize(handle, plan->x, plan->w, plan->forward_conv, plan->y, chosen.algo,
                                                     &plan->forward_bytes))) {
      plan->forward = chosen.algo;
      plan->has_forward = plan->forward_bytes <= kMaxWorkspace;  // the size asked, not the ranking's estimate
    }
  }
  // The input gradient.
  most = returned = 0;
  if (make_conv(plan->backward_conv, w, math) &&
      ok(l.cudnnGetConvolutionBackwardDataAlgorithmMaxCount(handle, &most)) && most > 0) {
    std::vector<cudnnConvolutionBwdDataAlgoPerf_t> ranked(static_cast<std::size_t>(most));
    cudnnConvolutionBwdDataAlgoPerf_t chosen{};
    if (ok(l.cudnnGetConvolutionBackwardDataAlgorithm_v7(handle, plan->w, plan->y, plan->backward_conv, plan->x, most,
                                                          &returned, ranked.data())) &&
        choose(ranked, returned, bf16, chosen) &&
        ok(l.cudnnSetConvolutionMathType(plan->backward_conv, chosen.mathType)) &&
        ok(l.cudnnGetConvolutionBackwardDataWorkspaceSize(handle, plan->w, plan->y, plan->backward_conv, plan->x,
                                                          chosen.algo, &plan->backward_bytes))) {
      plan->backward = chosen.algo;
      plan->has_backward = plan->backward_bytes <= kMaxWorkspace;  // the size asked, not the ranking's estimate
    }
  }
  // The weight gradient.
  most = returned = 0;
  if (make_conv(plan->weight_grad_conv, w, math) &&
      ok(l.cudnnGetConvolutionBackwardFilterAlgorithmMaxCount(handle, &most)) && most > 0) {
    std::vector<cudnnConvolutionBwdFilterAlgoPerf_t> ranked(static_cast<std::size_t>(most));
    cudnnConvolutionBwdFilterAlgoPerf_t chosen{};
    if (ok(l.cudnnGetConvolutionBackwardFilterAlgorithm_v7(handle, plan->x, plan->y, plan->weight_grad_conv, plan->w,
                                                            most, &returned, ranked.data())) &&
        choose(ranked, returned, bf16, chosen) &&
        ok(l.cudnnSetConvolutionMathType(plan->weight_grad_conv, chosen.mathType)) &&
        ok(l.cudnnGetConvolutionBackwardFilterWorkspaceSize(handle, plan->x, plan->y, plan->weight_grad_conv, plan->w,
                                                            chosen.algo, &plan->weight_grad_bytes))) {
      plan->weight_grad = chosen.algo;
      plan->has_weight_grad = plan->weight_grad_bytes <= kMaxWorkspace;  // the size asked, not the ranking's estimate
    }
  }
  return plan;
}

// The shape's cuDNN plan, built at its first use (ops are queued by the rank's one
// compute thread, so the cache needs no lock); null when cuDNN is off.
DnnConv* dnn_conv(const Window2d& w, bool bf16) {
  if (!dnn_wanted()) return nullptr;
  static std::map<DnnKey, std::unique_ptr<DnnConv>> plans;
  std::unique_ptr<DnnConv>& plan = plans[key_of(w, bf16)];
  if (!plan) {
    plan = build_dnn(w, bf16);
    if (verbose())
      std::fprintf(stderr,
                   "mpipe conv %s%s N %lld C %lld %lldx%lld -> OC %lld %lldx%lld, kernel %lldx%lld stride %lld pad %lld "
                   "groups %lld: forward %s (algorithm %d, %zu B), input gradient %s (algorithm %d, %zu B), "
                   "weight gradient %s (algorithm %d, %zu B)\n",
                   bf16 ? "bf16" : "fp32", w.channels_last ? " channels-last" : "", static_cast<long long>(w.N), static_cast<long long>(w.C),
                   static_cast<long long>(w.H), static_cast<long long>(w.W), static_cast<long long>(w.OC),
                   static_cast<long long>(w.OH), static_cast<long long>(w.OW), static_cast<long long>(w.KH),
                   static_cast<long long>(w.KW), static_cast<long long>(w.stride), static_cast<long long>(w.padding),
                   static_cast<long long>(w.groups), plan->has_forward ? "cuDNN" : "GEMM", static_cast<int>(plan->forward),
                   plan->forward_bytes, plan->has_backward ? "cuDNN" : "GEMM", static_cast<int>(plan->backward),
                   plan->backward_bytes, plan->has_weight_grad ? "cuDNN" : "GEMM", static_cast<int>(plan->weight_grad),
                   plan->weight_grad_bytes);
  }
  return plan.get();
}

// A run's status: true when done; false when cuDNN declines the shape now (not
// supported: the GEMM path from then on, said once under MPIPE_CONV=verbose); any other
// failure is an error, never papered over by the other path (which could leave ranks on
// different paths for one shape).
bool ran(cudnnStatus_t status, bool& has, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return true;
  if (status != CUDNN_STATUS_NOT_SUPPORTED)
    throw Error(cat("cuDNN's convolution ", what, " failed: ", lib().cudnnGetErrorString(status)));
  has = false;
  if (verbose()) std::fprintf(stderr, "mpipe conv: cuDNN declined the %s at run time; the GEMM path takes it\n", what);
  return false;
}

// out (N, OC, plane) += bias (OC).
template <class T>
__global__ void add_bias(T* out, const T* bias, int64_t OC, int64_t plane, int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    out[i] = from_f32<T>(to_f32(out[i]) + to_f32(bias[(i / plane) % OC]));
}

// sum (OC, Cg, KK) += part: a weight gradient from cuDNN into the fp32 one, part in the
// same layout, or (swapped, channels last) in (OC, KK, Cg).
template <class T>
__global__ void add_into_f32(float* sum, const T* part, int64_t total, int64_t Cg, int64_t KK, bool swapped) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    int64_t from = i;
    if (swapped) {
      const int64_t k = i % KK, c = (i / KK) % Cg, o = i / (KK * Cg);
      from = (o * KK + k) * Cg + c;
    }
    sum[i] += to_f32(part[from]);
  }
}

// The filter cuDNN reads: the weights themselves (channels first), or swapped into
// `swapped` (channels last: (OC, Cg, KK) -> (OC, KK, Cg)).
template <class E>
const E* filter_of(const E* weight, E* swapped, const Window2d& w) {
  if (!w.channels_last) return weight;
  swap_inner(swapped, weight, w.OC, w.C / w.groups, w.KH * w.KW, false);
  return swapped;
}
int64_t filter_count(const Window2d& w) { return w.OC * (w.C / w.groups) * w.KH * w.KW; }

}  // namespace

template <class E>
bool dnn_conv_input_gradient(E* dinp, const E* dout, const E* weight, const Window2d& w, GradMode mode) {
  DnnConv* dnn = dnn_conv(w, std::is_same_v<E, bf16>);
  if (!dnn || !dnn->has_backward) return false;
  const float alpha = 1.0f, beta = mode == GradMode::accumulate ? 1.0f : 0.0f;
  // The workspace and a swapped filter from one scratch() call (a second may move the first).
  ScratchPlan plan;
  const std::size_t workspace_at = plan.reserve<char>(static_cast<int64_t>(dnn->backward_bytes));
  const std::size_t filter_at = plan.reserve<E>(w.channels_last ? filter_count(w) : 0);
  void* base = scratch(plan.bytes());
  void* workspace = dnn->backward_bytes ? place<char>(base, workspace_at) : nullptr;
  const E* filter = filter_of(weight, place<E>(base, filter_at), w);
  return ran(lib().cudnnConvolutionBackwardData(context().dnn, &alpha, dnn->w, filter, dnn->y, dout,
                                               dnn->backward_conv, dnn->backward, workspace, dnn->backward_bytes, &beta,
                                               dnn->x, dinp),
             dnn->has_backward, "input gradient");
}

template <class E>
bool dnn_conv_weight_gradient(float* dweight, const E* dout, const E* inp, const Window2d& w) {
  DnnConv* dnn = dnn_conv(w, std::is_same_v<E, bf16>);
  if (!dnn || !dnn->has_weight_grad) return false;
  const float alpha = 1.0f;
  if (std::is_same_v<E, float> && !w.channels_last) {
    const float beta = 1.0f;  // accumulates, as the GEMM path does
    void* workspace = dnn->weight_grad_bytes ? scratch(dnn->weight_grad_bytes) : nullptr;
    return ran(lib().cudnnConvolutionBackwardFilter(context().dnn, &alpha, dnn->x, inp, dnn->y, dout,
                                                    dnn->weight_grad_conv, dnn->weight_grad, workspace,
                                                    dnn->weight_grad_bytes, &beta, dnn->w, dweight),
               dnn->has_weight_grad, "weight gradient");
  } else {
    // The gradient in the inputs' type (the filter descriptor's) and layout, overwritten,
    // beside the workspace: both from one scratch() call, since a second call may
    // reallocate the region under the first's pointer.
    using T = device_t<E>;
    const int64_t count = filter_count(w);
    ScratchPlan plan;
    const std::size_t workspace_at = plan.reserve<char>(static_cast<int64_t>(dnn->weight_grad_bytes));
    const std::size_t part_at = plan.reserve<T>(count);
    void* base = scratch(plan.bytes());
    void* workspace = dnn->weight_grad_bytes ? place<char>(base, workspace_at) : nullptr;
    auto* part = place<T>(base, part_at);
    const float beta = 0.0f;
    if (!ran(lib().cudnnConvolutionBackwardFilter(context().dnn, &alpha, dnn->x, inp, dnn->y, dout,
                                                  dnn->weight_grad_conv, dnn->weight_grad, workspace,
                                                  dnn->weight_grad_bytes, &beta, dnn->w, part),
             dnn->has_weight_grad, "weight gradient"))
      return false;
    add_into_f32<<<blocks_for(count, kThreads), kThreads, 0, context().compute>>>(
        dweight, part, count, w.C / w.groups, w.KH * w.KW, w.channels_last);
    CUDA_CHECK_LAUNCH();
    return true;
  }
}

template <class E>
bool dnn_conv_forward(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w) {
  DnnConv* dnn = dnn_conv(w, std::is_same_v<E, bf16>);
  if (!dnn || !dnn->has_forward) return false;
  const float alpha = 1.0f, beta = 0.0f;
  ScratchPlan plan;  // as the input gradient's
  const std::size_t workspace_at = plan.reserve<char>(static_cast<int64_t>(dnn->forward_bytes));
  const std::size_t filter_at = plan.reserve<E>(w.channels_last ? filter_count(w) : 0);
  void* base = scratch(plan.bytes());
  void* workspace = dnn->forward_bytes ? place<char>(base, workspace_at) : nullptr;
  const E* filter = filter_of(weight, place<E>(base, filter_at), w);
  if (!ran(lib().cudnnConvolutionForward(context().dnn, &alpha, dnn->x, inp, dnn->w, filter, dnn->forward_conv,
                                         dnn->forward, workspace, dnn->forward_bytes, &beta, dnn->y, out),
           dnn->has_forward, "forward"))
    return false;
  if (bias) {
    // A channel's outputs are a plane apart (channels first) or side by side (last).
    const int64_t plane = w.OH * w.OW, total = w.N * w.OC * plane;
    add_bias<<<blocks_for(total, kThreads), kThreads, 0, context().compute>>>(dev(out), dev(bias), w.OC,
                                                                              w.channels_last ? 1 : plane, total);
    CUDA_CHECK_LAUNCH();
  }
  return true;
}

template <class E>
bool conv2d_forward_last(E* out, const E* inp, const E* weight, const E* bias, const Window2d& w) {
  MPIPE_CHECK(w.channels_last, "conv2d_forward_last: a channels-first window");
  return w.N * w.OH * w.OW == 0 || w.OC == 0 || dnn_conv_forward(out, inp, weight, bias, w);
}

template <class E>
bool conv2d_input_gradient_last(E* dinp, const E* dout, const E* weight, const Window2d& w, GradMode mode) {
  MPIPE_CHECK(w.channels_last, "conv2d_input_gradient_last: a channels-first window");
  return w.N * w.OH * w.OW == 0 || w.OC == 0 || dnn_conv_input_gradient(dinp, dout, weight, w, mode);
}

template <class E>
bool conv2d_weight_gradient_last(float* dweight, const E* dout, const E* inp, const Window2d& w) {
  MPIPE_CHECK(w.channels_last, "conv2d_weight_gradient_last: a channels-first window");
  return w.N * w.OH * w.OW == 0 || w.OC == 0 || dnn_conv_weight_gradient(dweight, dout, inp, w);
}

#define MPIPE_DNN_CONV_OPS(E)                                                                  \
  template bool dnn_conv_forward<E>(E*, const E*, const E*, const E*, const Window2d&);         \
  template bool dnn_conv_input_gradient<E>(E*, const E*, const E*, const Window2d&, GradMode); \
  template bool dnn_conv_weight_gradient<E>(float*, const E*, const E*, const Window2d&);                 \
  template bool conv2d_forward_last<E>(E*, const E*, const E*, const E*, const Window2d&);                \
  template bool conv2d_input_gradient_last<E>(E*, const E*, const E*, const Window2d&, GradMode);        \
  template bool conv2d_weight_gradient_last<E>(float*, const E*, const E*, const Window2d&);
MPIPE_DNN_CONV_OPS(float)
MPIPE_DNN_CONV_OPS(bf16)
#undef MPIPE_DNN_CONV_OPS

}  // namespace mpipe::cuda
