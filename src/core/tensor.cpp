// Shape, dtype and device names.
#include "mpipe/core/tensor.hpp"

namespace mpipe {

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

}  // namespace mpipe

namespace mpipe {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::f32: return "fp32";
    case DType::i32: return "int32";
    case DType::bf16: return "bf16";
  }
  return "?";
}

const char* to_string(Device device) { return device == Device::cuda ? "cuda" : "cpu"; }

}  // namespace mpipe
