// Arena: the bump allocator that holds activations, per-call contexts and scratch.
//
// Everything a step allocates comes from here and is released at once by reset(). The
// first step may outgrow the arena (it then chains extra blocks); reset() folds them
// into one block of the high-water size, so every later step of the same shape runs
// without touching the heap. growths() counts the times the heap was used.
//
// An arena for a GPU takes a DeviceMemory: its tensors then live in device memory while
// the per-call contexts (objects()) stay in host memory, in a second pool.
#pragma once
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "mpipe/core/tensor.hpp"

namespace mpipe {

// Where an arena's tensors live when not in host memory: the backend's allocator. Plain
// function pointers, so that core stays below the backend.
struct DeviceMemory {
  Device device = Device::cpu;
  void* (*allocate)(std::size_t bytes) = nullptr;
  void (*release)(void* p) noexcept = nullptr;
  void (*zero)(void* p, std::size_t bytes) = nullptr;
};

// Bytes live in a set of arenas at once (Arena::count_in), and the most so far: a rank's
// true activation peak, where the sum of its arenas' high-water marks adds moments apart
// (a slot's forward peak and the scratch arena's backward one).
struct Gauge {
  std::size_t used = 0, peak = 0;
  void add(std::size_t bytes) {
    used += bytes;
    peak = used > peak ? used : peak;
  }
};

class Arena {
 public:
  static constexpr std::size_t alignment = 64;

  explicit Arena(std::size_t initial_bytes = 0);
  explicit Arena(const DeviceMemory& memory);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // 64-byte-aligned uninitialised memory, valid until reset().
  void* allocate(std::size_t bytes);
  Tensor tensor(Shape shape, DType dtype = DType::f32);
  Tensor zeros(Shape shape, DType dtype = DType::f32);
  Device device() const { return memory_.device; }
  // n value-initialised objects of a trivially destructible type (contexts), always in
  // host memory.
  template <class T>
  T* objects(std::size_t n) {
    static_assert(std::is_trivially_destructible_v<T>);
    T* p = static_cast<T*>(host_objects_ ? host_objects_->allocate(n * sizeof(T)) : allocate(n * sizeof(T)));
    for (std::size_t i = 0; i < n; ++i) new (p + i) T{};
    return p;
  }

  void reset();
  // A point to come back to: rewind(mark()) makes what was allocated since free for the
  // next allocations (the memory stays the arena's; on a GPU later kernels of the same
  // stream reuse it in stream order). A host arena's contexts are rewound with its
  // tensors; a device arena's (in their own host pool) are not.
  struct Mark {
    std::size_t block = 0, offset = 0, used = 0;
  };
  Mark mark() const { return {current_, offset_, used_total_}; }
  void rewind(const Mark& m) {
    if (gauge_) gauge_->used -= used_total_ - m.used;
    current_ = m.block, offset_ = m.offset, used_total_ = m.used;
  }
  // What this arena holds counts in `gauge` from now on (its tensors, and in a host arena
  // contexts, as high_water() counts them).
  void count_in(Gauge* gauge) { gauge_ = gauge; }
  std::size_t used() const { return used_total_; }
  // The address the next allocation from mark m would have taken had it fit its block.
  const void* at(const Mark& m) const { return m.block < blocks_.size() ? blocks_[m.block].memory + m.offset : nullptr; }
  // Where `t` is the last allocation, rewinds past it (the next allocations reuse its
  // memory) and says so; else changes nothing.
  bool give_back(const Tensor& t) {
    const std::size_t bytes = rounded(t.bytes());
    if (!t.data || current_ >= blocks_.size() || offset_ < bytes || blocks_[current_].memory + offset_ - bytes != t.data)
      return false;
    rewind({current_, offset_ - bytes, used_total_ - bytes});
    return true;
  }
  static std::size_t rounded(std::size_t bytes) { return (bytes + alignment - 1) / alignment * alignment; }
  // Spent memory: the first run of `bytes` (64-byte aligned) of what was allocated between
  // marks `from` and `to` (the caller knows nothing reads it again) that overlaps none of
  // `live`; null where none is that long. Runs do not cross the blocks of a first step.
  void* spent(const Mark& from, const Mark& to, std::size_t bytes, std::span<const Tensor> live) const;
  // Peak bytes of tensors (and, in a host arena, contexts) between resets.
  std::size_t high_water() const { return high_water_; }
  std::size_t capacity() const;
  std::size_t growths() const { return growths_; }

 private:
  struct Block {
    std::byte* memory = nullptr;
    std::size_t size = 0;
  };
  void add_block(std::size_t bytes);
  void release_blocks();

  DeviceMemory memory_;
  std::unique_ptr<Arena> host_objects_;  // contexts of a device arena
  std::vector<Block> blocks_;
  std::size_t current_ = 0;  // index of the block being filled
  std::size_t offset_ = 0;   // bytes used in blocks_[current_]
  std::size_t used_total_ = 0;
  std::size_t high_water_ = 0;
  std::size_t growths_ = 0;
  Gauge* gauge_ = nullptr;
};

}  // namespace mpipe
