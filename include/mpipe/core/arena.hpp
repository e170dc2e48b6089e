// Arena: the bump allocator that holds activations, per-call contexts and scratch.
//
// Everything a step allocates comes from here and is released at once by reset(). The
// first step may outgrow the arena (it then chains extra blocks); reset() folds them
// into one block of the high-water size, so every later step of the same shape runs
// without touching the heap. growths() counts the times the heap was used.
#pragma once
#include <cstddef>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "mpipe/core/tensor.hpp"

namespace mpipe {

class Arena {
 public:
  static constexpr std::size_t alignment = 64;

  explicit Arena(std::size_t initial_bytes = 0);
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // 64-byte-aligned uninitialised memory, valid until reset().
  void* allocate(std::size_t bytes);
  Tensor tensor(Shape shape, DType dtype = DType::f32);
  Tensor zeros(Shape shape, DType dtype = DType::f32) {
    Tensor t = tensor(shape, dtype);
    std::memset(t.data, 0, t.bytes());
    return t;
  }
  // n value-initialised objects of a trivially destructible type (contexts).
  template <class T>
  T* objects(std::size_t n) {
    static_assert(std::is_trivially_destructible_v<T>);
    T* p = static_cast<T*>(allocate(n * sizeof(T)));
    for (std::size_t i = 0; i < n; ++i) new (p + i) T{};
    return p;
  }

  void reset();
  std::size_t used() const { return used_total_; }
  std::size_t high_water() const { return high_water_; }
  std::size_t capacity() const;
  std::size_t growths() const { return growths_; }

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  struct Block {
    std::unique_ptr<std::byte[], Free> memory;
    std::size_t size = 0;
  };
  void add_block(std::size_t bytes);

  std::vector<Block> blocks_;
  std::size_t current_ = 0;  // index of the block being filled
  std::size_t offset_ = 0;   // bytes used in blocks_[current_]
  std::size_t used_total_ = 0;
  std::size_t high_water_ = 0;
  std::size_t growths_ = 0;
};

}  // namespace mpipe
