// ParamStore: the parameters of a range of layers (a stage) in one flat buffer, their
// gradients in another of the same layout, with named views bound into the layers.
// Zeroing, norms, the optimizer and checkpoints are each one pass over one span.
//
// On a GPU (to_device()) the fp32 master values and gradients live in device memory,
// plus, in bf16 training, a bf16 compute copy of the values that the layers read. The
// host buffer params() is then a mirror that download() and upload() keep for
// checkpoints; the host gradient buffer is given up.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/ops.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/buffer.hpp"
#include "mpipe/nn/model.hpp"

namespace mpipe {

struct ParamEntry {
  int layer = 0;             // global layer index
  int index = 0;             // position in the layer's param_specs()
  std::string name;          // e.g. "attn.c_attn.weight"
  Shape shape;
  std::size_t offset = 0;        // of its gradient (and, unless alias, its values)
  std::size_t param_offset = 0;  // of its values: the owner's when alias
  bool decay = false;
  bool buffer = false;  // not trained (ParamSpec::buffer)
  // A tied copy (the GPT head's view of wte) keeps its own gradient, which is summed
  // with the owner's after backward. When the owner lives in the same store the copy
  // shares the owner's values (alias) and the optimizer skips it; otherwise it holds
  // values of its own that the same updates keep identical to the owner's.
  bool tied_copy = false;
  bool alias = false;
  int owner_layer = -1;          // who initialises it (itself, or the tied owner)
  int owner_index = -1;
  // A copy of some of the owner's rows (a vocabulary chunk of the head): where in the
  // owner's elements it begins (0 for a copy of all of it).
  std::size_t owner_element = 0;
  std::int64_t numel() const { return shape.numel(); }
};

// The parameter an entry holds values of, as its owner declares it: its own spec, or a
// tied copy's owner's (name and whole shape: a checkpoint's dataset, an export's tensor).
inline ParamSpec owner_spec(const Model& model, const ParamEntry& e) {
  return model.layer(e.owner_layer).param_specs()[static_cast<std::size_t>(e.owner_index)];
}

class ParamStore {
 public:
  // Parameters of `layers` (ascending) of model, initialised from seed as GPT-2 does,
  // stored in layer order.
  ParamStore(Model& model, std::vector<int> layers, std::uint64_t seed);
  // Of layers [begin, end).
  ParamStore(Model& model, int begin, int end, std::uint64_t seed);

  std::span<const ParamEntry> entries() const { return entries_; }
  // The values in host memory: the truth on the CPU, a mirror on a GPU.
  std::span<float> params() const { return params_.span(); }
  // The gradients where training keeps them (device memory on a GPU).
  std::span<float> grads() const { return {grads_.f32(), static_cast<std::size_t>(grads_.numel())}; }
  // The fp32 master values where training keeps them.
  std::span<float> master() const { return {master_.f32(), static_cast<std::size_t>(master_.numel())}; }
  std::size_t count() const;  // parameters of this range, tied copies not counted
  // What the layers read: the compute copy on a GPU, but the fp32 master for buffers
  // (the layers move those).
  Tensor param(const ParamEntry& e) const;
  Tensor grad(const ParamEntry& e) const;
  void zero_grads();
  void scale_grads(float factor);

  // Moves training onto this process's GPU (cuda::init() first): master values and
  // gradients into device memory, a compute copy in `compute` (f32 or bf16), and the
  // layers rebound to the device views.
  void to_device(DType compute);
  Device device() const { return master_.device; }
  DType compute_dtype() const { return compute_.dtype; }
  // GPU only: master values to the host mirror (before a checkpoint), and back with the
  // compute copy refreshed (after loading one).
  void download();
  void upload();
  // After an update on a GPU: the bf16 compute copy from the fp32 master values.
  void refresh_compute_copy();
  // The bf16 compute copy in device memory, element for element the master's (an update
  // may write it as it goes: Optimizer::update); null where there is none (the CPU, fp32).
  bf16* compute_copy() const;
  // Sum of squared gradients per layer, at [layer] of a span of the model's size (the
  // layers not held here: 0); tied copies are left out (their gradient equals the
  // owner's once summed).
  void grad_sum_squares(std::span<double> per_layer) const;
  // Where owner and tied copy both live here: the owner's gradient becomes their sum and
  // the copy's is zeroed (its values are the owner's).
  void sum_local_tied_grads();
  const std::vector<int>& layers() const { return layers_; }

 private:
  void bind_layers();
  void make_norms();

  Model& model_;
  std::vector<int> layers_;
  std::vector<ParamEntry> entries_;
  FloatBuffer params_, host_grads_;  // host memory: the values always, the gradients on the CPU
  cuda::DeviceBuffer device_master_, device_grads_, device_compute_;  // GPU (compute: bf16 only)
  // Where training keeps the whole flat store, wherever that is: the fp32 master values,
  // their gradients, and the copy the layers compute with (the master values in fp32).
  Tensor master_, grads_, compute_;
  mutable ops::SpanSums norms_;  // of the gradient spans that count (entries not tied copies)
};

}  // namespace mpipe
