// Owned host memory: a float buffer aligned for vector loads.
#pragma once
#include <cstddef>
#include <memory>
#include <span>

namespace mpipe {

// A 64-byte-aligned float buffer, zero-initialised, owned.
class FloatBuffer {
 public:
  FloatBuffer() = default;
  explicit FloatBuffer(std::size_t n);
  float* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  std::span<float> span() const { return {data_.get(), size_}; }

 private:
  struct Free {
    void operator()(float* p) const;
  };
  std::unique_ptr<float[], Free> data_;
  std::size_t size_ = 0;
};

}  // namespace mpipe
