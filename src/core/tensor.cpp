// Shape printing.
#include "mpipe/core/tensor.hpp"

namespace mpipe {

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < rank; ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

}  // namespace mpipe
