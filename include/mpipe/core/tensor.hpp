// Tensor: a non-owning view (pointer, shape, dtype, device) over memory owned by an
// Arena or a flat parameter buffer. Trivially copyable, so contexts can hold them.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "mpipe/core/error.hpp"

namespace mpipe {

enum class DType : std::uint8_t { f32, i32, bf16 };
enum class Device : std::uint8_t { cpu, cuda };

inline std::size_t dtype_size(DType dtype) { return dtype == DType::bf16 ? 2 : 4; }
// Bytes of one fp32 or int32 element: master parameters, optimizer state, a batch's
// tokens, features and targets, and activations as costs count them.
inline constexpr std::size_t word_bytes = 4;
inline double f32_bytes(double elements) { return static_cast<double>(word_bytes) * elements; }
const char* to_string(DType dtype);
const char* to_string(Device device);

struct Shape {
  static constexpr int max_rank = 4;
  std::array<std::int64_t, max_rank> dims{};
  int rank = 0;

  Shape() = default;
  Shape(std::initializer_list<std::int64_t> list) {
    MPIPE_CHECK(list.size() <= max_rank, "rank ", list.size());
    for (auto d : list) dims[rank++] = d;
  }
  std::int64_t operator[](int i) const { return dims[i < 0 ? rank + i : i]; }
  std::int64_t& operator[](int i) { return dims[i < 0 ? rank + i : i]; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= dims[i];
    return n;
  }
  // Product of all dimensions but the last: the number of rows of a (.., C) tensor.
  std::int64_t rows() const { return rank == 0 ? 1 : numel() / dims[rank - 1]; }
  bool operator==(const Shape& other) const {
    if (rank != other.rank) return false;
    for (int i = 0; i < rank; ++i)
      if (dims[i] != other.dims[i]) return false;
    return true;
  }
  std::string str() const;
};

struct Tensor {
  void* data = nullptr;
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu;

  std::int64_t numel() const { return shape.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
  bool empty() const { return data == nullptr; }

  float* f32() const {
    MPIPE_CHECK(dtype == DType::f32, "tensor is not f32");
    return static_cast<float*>(data);
  }
  std::int32_t* i32() const {
    MPIPE_CHECK(dtype == DType::i32, "tensor is not i32");
    return static_cast<std::int32_t*>(data);
  }
  std::span<float> span() const { return {f32(), static_cast<std::size_t>(numel())}; }
  // The raw bytes, for messages between stages in whatever precision the tensor has.
  std::span<std::byte> byte_span() const { return {static_cast<std::byte*>(data), bytes()}; }
  // The same memory seen with another shape of equal element count.
  Tensor view(Shape new_shape) const {
    MPIPE_CHECK(new_shape.numel() == numel(), "view ", new_shape.str(), " of ", shape.str());
    Tensor t = *this;
    t.shape = new_shape;
    return t;
  }
  // Rows [begin, end) of the first dimension (samples of a batch); empty stays empty.
  Tensor samples(std::int64_t begin, std::int64_t end) const {
    if (empty()) return *this;
    MPIPE_CHECK(shape.rank >= 1 && 0 <= begin && begin <= end && end <= shape[0], "samples ", begin, "-", end, " of ",
                shape.str());
    const std::int64_t per = shape[0] == 0 ? 0 : numel() / shape[0];
    Tensor t = *this;
    t.data = static_cast<std::byte*>(data) + static_cast<std::size_t>(begin * per) * dtype_size(dtype);
    t.shape[0] = end - begin;
    return t;
  }
  // Its first new_shape.numel() elements seen with that shape.
  Tensor head(Shape new_shape) const {
    MPIPE_CHECK(new_shape.numel() <= numel(), "head ", new_shape.str(), " of ", shape.str());
    Tensor t = *this;
    t.shape = new_shape;
    return t;
  }
};

inline Tensor make_tensor(float* data, Shape shape) { return {data, shape, DType::f32, Device::cpu}; }
inline Tensor make_tensor(std::int32_t* data, Shape shape) {
  return {data, shape, DType::i32, Device::cpu};
}

}  // namespace mpipe
