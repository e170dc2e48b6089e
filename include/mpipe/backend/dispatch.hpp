// Inside backend/: what the Tensor ops (ops.cpp, conv_ops.cpp) share: pointers of a
// tensor's element type, the device and element-type checks, and MPIPE_ON_GPU, which
// runs a CUDA op with E bound to the tensor's element type. Not for code above backend/.
#pragma once
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe::ops::detail {

template <class E>
inline E* ptr(const Tensor& t) {
  return static_cast<E*>(t.data);
}
template <class E>
inline E* ptr_or_null(const Tensor& t) {
  return t.empty() ? nullptr : static_cast<E*>(t.data);
}

// Tensors of one op live on one device, and the activation-like ones share an element
// type. A mismatch is a bug in the layer or the executor, not a user error.
inline void same_place(const char* op, const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return;
  MPIPE_CHECK(a.device == b.device, op, ": tensors on ", to_string(a.device), " and ", to_string(b.device));
  MPIPE_CHECK(a.dtype == b.dtype, op, ": tensors of ", to_string(a.dtype), " and ", to_string(b.dtype));
}
inline void same_device(const char* op, const Tensor& a, const Tensor& b) {
  if (a.empty() || b.empty()) return;
  MPIPE_CHECK(a.device == b.device, op, ": tensors on ", to_string(a.device), " and ", to_string(b.device));
}
inline void is_f32(const char* op, const Tensor& t) {
  MPIPE_CHECK(t.empty() || t.dtype == DType::f32, op, ": expected fp32, got ", to_string(t.dtype));
}

#if MPIPE_HAVE_CUDA
// Runs `body` with E bound to the element type of `t` (fp32 or bf16).
#define MPIPE_ON_GPU(t, body)                \
  do {                                       \
    if ((t).dtype == DType::bf16) {          \
      using E = ::mpipe::bf16;               \
      body;                                  \
    } else {                                 \
      MPIPE_CHECK((t).dtype == DType::f32, "GPU op on ", to_string((t).dtype)); \
      using E = float;                       \
      body;                                  \
    }                                        \
  } while (0)
#else
#define MPIPE_ON_GPU(t, body) throw Error("a tensor on the GPU in a build without CUDA")
#endif

}  // namespace mpipe::ops::detail
