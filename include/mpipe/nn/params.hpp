// ParamStore: the parameters of a range of layers (a stage) in one flat buffer, their
// gradients in another of the same layout, with named views bound into the layers.
// Zeroing, norms, the optimizer and checkpoints are each one pass over one span.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mpipe/nn/model.hpp"

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

struct ParamEntry {
  int layer = 0;             // global layer index
  int index = 0;             // position in the layer's param_specs()
  std::string name;          // e.g. "attn.c_attn.weight"
  Shape shape;
  std::size_t offset = 0;        // of its gradient (and, unless alias, its values)
  std::size_t param_offset = 0;  // of its values: the owner's when alias
  bool decay = false;
  // A tied copy (the GPT head's view of wte) keeps its own gradient, which is summed
  // with the owner's after backward. When the owner lives in the same store the copy
  // shares the owner's values (alias) and the optimizer skips it; otherwise it holds
  // values of its own that the same updates keep identical to the owner's.
  bool tied_copy = false;
  bool alias = false;
  int owner_layer = -1;          // who initialises it (itself, or the tied owner)
  int owner_index = -1;
  std::int64_t numel() const { return shape.numel(); }
};

class ParamStore {
 public:
  // Parameters of layers [begin, end) of model, initialised from seed as GPT-2 does.
  ParamStore(Model& model, int begin, int end, std::uint64_t seed);

  std::span<const ParamEntry> entries() const { return entries_; }
  std::span<float> params() const { return params_.span(); }
  std::span<float> grads() const { return grads_.span(); }
  std::size_t count() const;  // parameters of this range, tied copies not counted
  Tensor param(const ParamEntry& e) const;
  Tensor grad(const ParamEntry& e) const;
  void zero_grads();
  // Sum of squared gradients per layer of the range, in layer order; tied copies are
  // left out (their gradient equals the owner's once summed).
  void grad_sum_squares(std::span<double> per_layer) const;
  // Where owner and tied copy both live here: the owner's gradient becomes their sum and
  // the copy's is zeroed (its values are the owner's).
  void sum_local_tied_grads();
  int begin() const { return begin_; }
  int end() const { return end_; }

 private:
  int begin_, end_;
  std::vector<ParamEntry> entries_;
  FloatBuffer params_, grads_;
};

}  // namespace mpipe
