// Arenas: bump allocation in a chain of blocks, rewound per step and folded into one block
// that holds the high-water mark.
#include "mpipe/core/arena.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstring>

namespace mpipe {

Arena::Arena(std::size_t initial_bytes) {
  if (initial_bytes > 0) add_block(initial_bytes);
}

Arena::Arena(const DeviceMemory& memory) : memory_(memory) {
  if (memory_.device != Device::cpu) {
    MPIPE_CHECK(memory_.allocate && memory_.release && memory_.zero, "device arena without an allocator");
    host_objects_ = std::make_unique<Arena>();
  }
}

Arena::~Arena() {
  if (gauge_) gauge_->used -= used_total_;
  release_blocks();
}

void Arena::release_blocks() {
  for (Block& b : blocks_) {
    if (memory_.device == Device::cpu) std::free(b.memory);
    else memory_.release(b.memory);  // cudaFree waits for the device, so queued kernels finish first
  }
  blocks_.clear();
}

void Arena::add_block(std::size_t bytes) {
  bytes = rounded(std::max<std::size_t>(bytes, 1 << 20));
  Block block;
  if (memory_.device == Device::cpu) {
    block.memory = static_cast<std::byte*>(std::aligned_alloc(alignment, bytes));
    MPIPE_CHECK(block.memory, "out of memory allocating ", bytes, " bytes of activations");
  } else {
    block.memory = static_cast<std::byte*>(memory_.allocate(bytes));  // throws with a hint
  }
  block.size = bytes;
  blocks_.push_back(block);
  ++growths_;
}

void* Arena::allocate(std::size_t bytes) {
  bytes = rounded(std::max<std::size_t>(bytes, 1));
  while (current_ < blocks_.size() && offset_ + bytes > blocks_[current_].size) {
    ++current_;
    offset_ = 0;
  }
  if (current_ == blocks_.size()) {
    add_block(std::max(bytes, capacity()));  // geometric growth during the first step
    offset_ = 0;
  }
  std::byte* p = blocks_[current_].memory + offset_;
  offset_ += bytes;
  used_total_ += bytes;
  high_water_ = std::max(high_water_, used_total_);
  if (gauge_) gauge_->add(bytes);
  return p;
}

void* Arena::spent(const Mark& from, const Mark& to, std::size_t bytes, std::span<const Tensor> live) const {
  bytes = rounded(std::max<std::size_t>(bytes, 1));
  for (std::size_t b = from.block; b <= to.block && b < blocks_.size(); ++b) {
    const Block& block = blocks_[b];
    const auto base = reinterpret_cast<std::uintptr_t>(block.memory);
    std::uintptr_t lo = base + (b == from.block ? from.offset : 0);
    const std::uintptr_t hi = base + (b == to.block ? to.offset : block.size);
    // First fit: past every live tensor the run would overlap, until none does.
    for (bool moved = true; moved && lo + bytes <= hi;) {
      moved = false;
      for (const Tensor& t : live) {
        const auto at = reinterpret_cast<std::uintptr_t>(t.data);
        if (!t.data || at >= lo + bytes || at + t.bytes() <= lo) continue;
        lo = base + rounded(at + t.bytes() - base);
        moved = true;
      }
    }
    if (lo + bytes <= hi) return block.memory + (lo - base);
  }
  return nullptr;
}

Tensor Arena::tensor(Shape shape, DType dtype) {
  Tensor t;
  t.shape = shape;
  t.dtype = dtype;
  t.device = memory_.device;
  t.data = allocate(static_cast<std::size_t>(shape.numel()) * dtype_size(dtype));
  return t;
}

Tensor Arena::zeros(Shape shape, DType dtype) {
  Tensor t = tensor(shape, dtype);
  if (memory_.device == Device::cpu) std::memset(t.data, 0, t.bytes());
  else memory_.zero(t.data, t.bytes());
  return t;
}

std::size_t Arena::capacity() const {
  std::size_t total = 0;
  for (const auto& b : blocks_) total += b.size;
  return total;
}

void Arena::reset() {
  if (blocks_.size() > 1) {
    // Fold the chain into one block that holds the whole high-water mark.
    std::size_t need = high_water_ + high_water_ / 16;
    release_blocks();
    add_block(need);
    // Touch the new block now: its pages are faulted in here, not in the next step's
    // forward, whose timings (the phase table, the bubble simulated from them) would
    // otherwise carry them. No transparent huge pages: they made every later step slower
    // where tried (docs/architecture.md, "Memory", has the figures of both).
    if (memory_.device == Device::cpu) std::memset(blocks_.front().memory, 0, blocks_.front().size);
  }
  if (host_objects_) host_objects_->reset();
  if (gauge_) gauge_->used -= used_total_;
  current_ = 0;
  offset_ = 0;
  used_total_ = 0;
}

}  // namespace mpipe
