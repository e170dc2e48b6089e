// Owned host memory.
#include "mpipe/core/buffer.hpp"

#include <cstdlib>
#include <cstring>

#include "mpipe/core/error.hpp"

namespace mpipe {

FloatBuffer::FloatBuffer(std::size_t n) : size_(n) {
  const std::size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes > 0 ? bytes : 64)));
  MPIPE_CHECK(data_, "out of memory allocating ", bytes, " bytes");
  std::memset(data_.get(), 0, bytes > 0 ? bytes : 64);
}

void FloatBuffer::Free::operator()(float* p) const { std::free(p); }

}  // namespace mpipe
