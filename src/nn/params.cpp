// Flat parameter storage, tied-weight aliasing and deterministic initialisation.
#include "mpipe/nn/params.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "mpipe/backend/ops.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"

namespace mpipe {


namespace {

// Every view starts on a 64-byte boundary.
std::size_t padded(std::int64_t n) { return static_cast<std::size_t>((n + 15) / 16 * 16); }

// Elements [first, first + n) of the parameter `spec` of (layer, index): a tied copy of
// some of the owner's rows draws exactly those of the owner's values.
void initialise(float* data, std::int64_t n, const ParamSpec& spec, std::uint64_t seed, int layer,
                int index, std::int64_t first = 0) {
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
      const std::int64_t lead = first % 4;      // elements of the first block before `first`
#pragma omp parallel for schedule(static)
      for (std::int64_t begin = 0; begin < n + lead; begin += chunk) {
        const std::int64_t count = std::min(chunk, n + lead - begin);
        for (std::int64_t b = 0; b * 4 < count; ++b) {  // element i is normals4(i / 4)[i % 4]
          const auto v = stream.normals4(static_cast<std::uint64_t>((first - lead + begin) / 4 + b));
          for (std::int64_t j = 0; j < 4 && b * 4 + j < count; ++j) {
            const std::int64_t at = begin + b * 4 + j - lead;
            if (at >= 0) data[at] = spec.std * v[j];
          }
        }
      }
      break;
    }
  }
}

}  // namespace

namespace {
std::vector<int> range(int begin, int end) {
  MPIPE_CHECK(0 <= begin && begin < end, "layer range ", begin, "..", end);
  std::vector<int> layers(static_cast<std::size_t>(end - begin));
  for (int i = begin; i < end; ++i) layers[static_cast<std::size_t>(i - begin)] = i;
  return layers;
}
}  // namespace

ParamStore::ParamStore(Model& model, int begin, int end, std::uint64_t seed)
    : ParamStore(model, range(begin, end), seed) {}

ParamStore::ParamStore(Model& model, std::vector<int> layers, std::uint64_t seed)
    : model_(model), layers_(std::move(layers)) {
  MPIPE_CHECK(!layers_.empty() && std::is_sorted(layers_.begin(), layers_.end()) && layers_.front() >= 0 &&
                  layers_.back() < model.size() && std::adjacent_find(layers_.begin(), layers_.end()) == layers_.end(),
              "parameter store of layers ", layers_.empty() ? -1 : layers_.front(), "..", layers_.empty() ? -1 : layers_.back());
  std::vector<std::vector<ParamSpec>> specs(static_cast<std::size_t>(model.size()));
  std::size_t total = 0;
  for (const int layer : layers_) {
    specs[static_cast<std::size_t>(layer)] = model.layer(layer).param_specs();
    const auto& layer_specs = specs[static_cast<std::size_t>(layer)];
    for (int i = 0; i < static_cast<int>(layer_specs.size()); ++i) {
      const ParamSpec& spec = layer_specs[i];
      ParamEntry e;
      e.layer = layer;
      e.index = i;
      e.name = spec.name;
      e.shape = spec.shape;
      e.decay = spec.decay;
      e.buffer = spec.buffer;
      e.owner_layer = layer;
      e.owner_index = i;
      if (spec.tied_layer >= 0) {
        // Find the owner; share its storage when it lives in this range.
        const auto owner_specs = model.layer(spec.tied_layer).param_specs();
        int owner_index = -1;
        for (int j = 0; j < static_cast<int>(owner_specs.size()); ++j)
          if (owner_specs[j].name == spec.tied_name) owner_index = j;
        MPIPE_CHECK(owner_index >= 0, "tied parameter ", spec.tied_name, " not found");
        const Shape& owner = owner_specs[owner_index].shape;
        if (spec.tied_rows_end < 0) {
          MPIPE_CHECK(owner == spec.shape, "tied shapes differ");
        } else {
          const std::int64_t row = owner.numel() / owner[0];
          MPIPE_CHECK(0 <= spec.tied_rows_begin && spec.tied_rows_begin < spec.tied_rows_end &&
                          spec.tied_rows_end <= owner[0] && spec.shape[0] == spec.tied_rows_end - spec.tied_rows_begin &&
                          spec.shape.numel() / spec.shape[0] == row,
                      "tied rows ", spec.tied_rows_begin, "..", spec.tied_rows_end, " of ", owner.str(), " as ", spec.shape.str());
          e.owner_element = static_cast<std::size_t>(spec.tied_rows_begin * row);
        }
        e.owner_layer = spec.tied_layer;
        e.owner_index = owner_index;
        e.tied_copy = true;
        for (const ParamEntry& other : entries_)
          if (other.layer == e.owner_layer && other.index == owner_index) {
            e.alias = true;
            e.param_offset = other.offset + e.owner_element;
          }
      }
      e.offset = total;
      if (!e.alias) e.param_offset = e.offset;
      total += padded(e.numel());
      entries_.push_back(e);
    }
  }
  params_ = FloatBuffer(total);
  host_grads_ = FloatBuffer(total);
  master_ = compute_ = make_tensor(params_.data(), Shape{static_cast<std::int64_t>(total)});
  grads_ = make_tensor(host_grads_.data(), Shape{static_cast<std::int64_t>(total)});
  for (const ParamEntry& e : entries_) {
    if (e.alias) continue;
    const auto owner_specs = e.owner_layer == e.layer ? specs[static_cast<std::size_t>(e.layer)]
                                                      : model.layer(e.owner_layer).param_specs();
    initialise(params_.data() + e.offset, e.numel(), owner_specs[e.owner_index], seed, e.owner_layer,
               e.owner_index, static_cast<std::int64_t>(e.owner_element));
  }
  make_norms();
  bind_layers();
}

void ParamStore::bind_layers() {
  std::size_t at = 0;
  for (const int layer : layers_) {
    std::vector<Tensor> p, g;
    for (; at < entries_.size() && entries_[at].layer == layer; ++at) {
      p.push_back(param(entries_[at]));
      g.push_back(grad(entries_[at]));
    }
    model_.layer(layer).bind(p, g);
  }
}

std::size_t ParamStore::count() const {
  std::size_t n = 0;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) n += static_cast<std::size_t>(e.numel());
  return n;
}

Tensor ParamStore::param(const ParamEntry& e) const {
  // Buffers (BatchNorm's running statistics) are moved by the layers, not the optimizer:
  // they are the fp32 master itself, or a bf16 compute copy would lose their updates.
  const Tensor& from = e.buffer ? master_ : compute_;
  return {static_cast<std::byte*>(from.data) + e.param_offset * dtype_size(from.dtype), e.shape, from.dtype, from.device};
}

Tensor ParamStore::grad(const ParamEntry& e) const {
  return {grads().data() + e.offset, e.shape, DType::f32, grads_.device};
}

void ParamStore::zero_grads() { ops::zero(grads_); }

void ParamStore::scale_grads(float factor) { ops::scale(grads_, factor); }

void ParamStore::make_norms() {
  std::vector<std::int64_t> offsets, sizes;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) {
      offsets.push_back(static_cast<std::int64_t>(e.offset));
      sizes.push_back(e.numel());
    }
  norms_ = ops::SpanSums(grads_.device, offsets, sizes);
}

void ParamStore::to_device(DType compute) {
  MPIPE_CHECK(device() == Device::cpu, "parameters are on the GPU already");
  MPIPE_CHECK(compute == DType::f32 || compute == DType::bf16, "compute type ", to_string(compute));
  const std::size_t bytes = params_.size() * sizeof(float);
  const Shape all{static_cast<std::int64_t>(params_.size())};
  device_master_ = cuda::DeviceBuffer(bytes);
  device_grads_ = cuda::DeviceBuffer(bytes);
  master_ = compute_ = {device_master_.data(), all, DType::f32, Device::cuda};
  grads_ = {device_grads_.data(), all, DType::f32, Device::cuda};
  if (compute == DType::bf16) {
    device_compute_ = cuda::DeviceBuffer(params_.size() * sizeof(bf16));
    compute_ = {device_compute_.data(), all, DType::bf16, Device::cuda};
  }
  host_grads_ = FloatBuffer();  // gradients live on the GPU from now on
  make_norms();  // the norm's spans, once, so that a step never allocates
  upload();
  bind_layers();
}

void ParamStore::download() { ops::transfer(make_tensor(params_.data(), master_.shape), master_); }

void ParamStore::upload() {
  ops::transfer(master_, make_tensor(params_.data(), master_.shape));
  refresh_compute_copy();
}

void ParamStore::refresh_compute_copy() {
  if (compute_.data != master_.data) ops::convert(compute_, master_);
}

bf16* ParamStore::compute_copy() const {
  return compute_.data != master_.data && compute_.dtype == DType::bf16 ? static_cast<bf16*>(compute_.data) : nullptr;
}

void ParamStore::grad_sum_squares(std::span<double> per_layer) const {
  MPIPE_CHECK(per_layer.size() == static_cast<std::size_t>(model_.size()), "per-layer span");
  std::fill(per_layer.begin(), per_layer.end(), 0.0);
  // The per-span sums, then the per-layer sums in entry order.
  const std::span<const double> sums = norms_.sums(grads_);
  std::size_t i = 0;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) per_layer[static_cast<std::size_t>(e.layer)] += sums[i++];
}

void ParamStore::sum_local_tied_grads() {
  for (const ParamEntry& copy : entries_) {
    if (!copy.alias) continue;
    for (const ParamEntry& owner : entries_)
      if (owner.layer == copy.owner_layer && owner.index == copy.owner_index) {
        // The copy's values are the owner's, so only the owner's gradient may count.
        Tensor rows = grad(copy);
        rows.data = static_cast<float*>(grad(owner).data) + copy.owner_element;
        ops::add(rows, grad(copy));
        ops::zero(grad(copy));
      }
  }
}

}  // namespace mpipe
