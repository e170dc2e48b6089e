// Flat parameter storage, tied-weight aliasing and deterministic initialisation.
#include "mpipe/nn/params.hpp"

#include <cstdlib>
#include <cstring>

#include "mpipe/core/rng.hpp"

namespace mpipe {

FloatBuffer::FloatBuffer(std::size_t n) : size_(n) {
  const std::size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  data_.reset(static_cast<float*>(std::aligned_alloc(64, bytes > 0 ? bytes : 64)));
  MPIPE_CHECK(data_, "out of memory allocating ", bytes, " bytes");
  std::memset(data_.get(), 0, bytes > 0 ? bytes : 64);
}

void FloatBuffer::Free::operator()(float* p) const { std::free(p); }

namespace {

// Every view starts on a 64-byte boundary.
std::size_t padded(std::int64_t n) { return static_cast<std::size_t>((n + 15) / 16 * 16); }

void initialise(float* data, std::int64_t n, const ParamSpec& spec, std::uint64_t seed, int layer,
                int index) {
  switch (spec.init) {
    case Init::zeros:
      std::fill(data, data + n, 0.0f);
      break;
    case Init::ones:
      std::fill(data, data + n, 1.0f);
      break;
    case Init::normal: {
      // Keyed by the owning (layer, parameter): any stage holding it draws the same values.
      const RandomStream stream = make_stream(seed, Stream::init, static_cast<std::uint32_t>(layer),
                                              static_cast<std::uint32_t>(index), 0);
      constexpr std::int64_t chunk = 1 << 16;  // a multiple of 4: chunks start on block boundaries
#pragma omp parallel for schedule(static)
      for (std::int64_t begin = 0; begin < n; begin += chunk) {
        const std::int64_t count = std::min(chunk, n - begin);
        for (std::int64_t b = 0; b * 4 < count; ++b) {  // element i is normals4(i / 4)[i % 4]
          const auto v = stream.normals4(static_cast<std::uint64_t>((begin / 4) + b));
          for (std::int64_t j = 0; j < 4 && b * 4 + j < count; ++j) data[begin + b * 4 + j] = spec.std * v[j];
        }
      }
      break;
    }
  }
}

}  // namespace

ParamStore::ParamStore(Model& model, int begin, int end, std::uint64_t seed)
    : begin_(begin), end_(end) {
  MPIPE_CHECK(0 <= begin && begin < end && end <= model.size(), "layer range ", begin, "..", end);
  std::vector<std::vector<ParamSpec>> specs(end - begin);
  std::size_t total = 0;
  for (int layer = begin; layer < end; ++layer) {
    specs[layer - begin] = model.layer(layer).param_specs();
    const auto& layer_specs = specs[layer - begin];
    for (int i = 0; i < static_cast<int>(layer_specs.size()); ++i) {
      const ParamSpec& spec = layer_specs[i];
      ParamEntry e;
      e.layer = layer;
      e.index = i;
      e.name = spec.name;
      e.shape = spec.shape;
      e.decay = spec.decay;
      e.owner_layer = layer;
      e.owner_index = i;
      if (spec.tied_layer >= 0) {
        // Find the owner; share its storage when it lives in this range.
        const auto owner_specs = model.layer(spec.tied_layer).param_specs();
        int owner_index = -1;
        for (int j = 0; j < static_cast<int>(owner_specs.size()); ++j)
          if (owner_specs[j].name == spec.tied_name) owner_index = j;
        MPIPE_CHECK(owner_index >= 0, "tied parameter ", spec.tied_name, " not found");
        MPIPE_CHECK(owner_specs[owner_index].shape == spec.shape, "tied shapes differ");
        e.owner_layer = spec.tied_layer;
        e.owner_index = owner_index;
        e.tied_copy = true;
        for (const ParamEntry& other : entries_)
          if (other.layer == e.owner_layer && other.index == owner_index) {
            e.alias = true;
            e.param_offset = other.offset;
          }
      }
      e.offset = total;
      if (!e.alias) e.param_offset = e.offset;
      total += padded(e.numel());
      entries_.push_back(e);
    }
  }
  params_ = FloatBuffer(total);
  grads_ = FloatBuffer(total);
  for (const ParamEntry& e : entries_) {
    if (e.alias) continue;
    const auto owner_specs = e.owner_layer == e.layer ? specs[e.layer - begin]
                                                      : model.layer(e.owner_layer).param_specs();
    initialise(params_.data() + e.offset, e.numel(), owner_specs[e.owner_index], seed, e.owner_layer,
               e.owner_index);
  }
  // Bind views, layer by layer.
  std::size_t at = 0;
  for (int layer = begin; layer < end; ++layer) {
    std::vector<Tensor> p, g;
    for (; at < entries_.size() && entries_[at].layer == layer; ++at) {
      p.push_back(param(entries_[at]));
      g.push_back(grad(entries_[at]));
    }
    model.layer(layer).bind(p, g);
  }
}

std::size_t ParamStore::count() const {
  std::size_t n = 0;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) n += static_cast<std::size_t>(e.numel());
  return n;
}

Tensor ParamStore::param(const ParamEntry& e) const { return make_tensor(params_.data() + e.param_offset, e.shape); }
Tensor ParamStore::grad(const ParamEntry& e) const { return make_tensor(grads_.data() + e.offset, e.shape); }

void ParamStore::zero_grads() { std::memset(grads_.data(), 0, grads_.size() * sizeof(float)); }

void ParamStore::grad_sum_squares(std::span<double> per_layer) const {
  MPIPE_CHECK(per_layer.size() == static_cast<std::size_t>(end_ - begin_), "per-layer span");
  std::fill(per_layer.begin(), per_layer.end(), 0.0);
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) per_layer[e.layer - begin_] += cpu::sum_squares(grads_.data() + e.offset, e.numel());
}

void ParamStore::sum_local_tied_grads() {
  for (const ParamEntry& copy : entries_) {
    if (!copy.alias) continue;
    for (const ParamEntry& owner : entries_)
      if (owner.layer == copy.owner_layer && owner.index == copy.owner_index) {
        float* a = grads_.data() + owner.offset;
        float* b = grads_.data() + copy.offset;
        // The copy's values are the owner's, so only the owner's gradient may count.
        for (std::int64_t i = 0; i < owner.numel(); ++i) {
          a[i] += b[i];
          b[i] = 0.0f;
        }
      }
  }
}

}  // namespace mpipe
