// Flat parameter storage, tied-weight aliasing and deterministic initialisation.
#include "mpipe/nn/params.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "mpipe/backend/ops.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/bf16.hpp"
#include "mpipe/core/rng.hpp"
#if MPIPE_HAVE_CUDA
#include "mpipe/backend/cuda/ops.hpp"
#endif

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
  grads_ = FloatBuffer(total);
  for (const ParamEntry& e : entries_) {
    if (e.alias) continue;
    const auto owner_specs = e.owner_layer == e.layer ? specs[static_cast<std::size_t>(e.layer)]
                                                      : model.layer(e.owner_layer).param_specs();
    initialise(params_.data() + e.offset, e.numel(), owner_specs[e.owner_index], seed, e.owner_layer,
               e.owner_index, static_cast<std::int64_t>(e.owner_element));
  }
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

std::span<float> ParamStore::grads() const {
  if (device_ == Device::cpu) return grads_.span();
  return {device_grads_.as<float>(), params_.size()};
}

std::span<float> ParamStore::master() const {
  if (device_ == Device::cpu) return params_.span();
  return {device_master_.as<float>(), params_.size()};
}

Tensor ParamStore::param(const ParamEntry& e) const {
  if (device_ == Device::cpu) return make_tensor(params_.data() + e.param_offset, e.shape);
  if (compute_dtype_ == DType::f32) return {device_master_.as<float>() + e.param_offset, e.shape, DType::f32, Device::cuda};
  return {device_compute_.as<bf16>() + e.param_offset, e.shape, DType::bf16, Device::cuda};
}

Tensor ParamStore::grad(const ParamEntry& e) const {
  return {grads().data() + e.offset, e.shape, DType::f32, device_};
}

void ParamStore::zero_grads() {
  if (device_ == Device::cpu) std::memset(grads_.data(), 0, grads_.size() * sizeof(float));
  else cuda::zero(device_grads_.data(), params_.size() * sizeof(float));
}

void ParamStore::scale_grads(float factor) {
  if (device_ == Device::cpu) {
    cpu::scale(grads_.data(), factor, static_cast<int64_t>(params_.size()));
    return;
  }
#if MPIPE_HAVE_CUDA
  cuda::scale(device_grads_.as<float>(), factor, static_cast<int64_t>(params_.size()));
#endif
}

void ParamStore::to_device(DType compute) {
  MPIPE_CHECK(device_ == Device::cpu, "parameters are on the GPU already");
  MPIPE_CHECK(compute == DType::f32 || compute == DType::bf16, "compute type ", to_string(compute));
  const std::size_t bytes = params_.size() * sizeof(float);
  device_master_ = cuda::DeviceBuffer(bytes);
  device_grads_ = cuda::DeviceBuffer(bytes);
  if (compute == DType::bf16) device_compute_ = cuda::DeviceBuffer(params_.size() * sizeof(bf16));
  device_ = Device::cuda;
  compute_dtype_ = compute;
  grads_ = FloatBuffer();  // gradients live on the GPU from now on
  // The norm's spans, once, so that a step never allocates.
  std::vector<std::int64_t> offsets, sizes;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) {
      offsets.push_back(static_cast<std::int64_t>(e.offset));
      sizes.push_back(e.numel());
    }
  norm_count_ = static_cast<int>(offsets.size());
  norm_offsets_ = cuda::DeviceBuffer(std::max<std::size_t>(1, offsets.size()) * sizeof(std::int64_t));
  norm_sizes_ = cuda::DeviceBuffer(std::max<std::size_t>(1, sizes.size()) * sizeof(std::int64_t));
  norm_sums_ = cuda::DeviceBuffer(std::max<std::size_t>(1, sizes.size()) * sizeof(double));
  norm_sums_host_ = cuda::PinnedBuffer(std::max<std::size_t>(1, sizes.size()) * sizeof(double));
  cuda::copy_to_device(norm_offsets_.data(), offsets.data(), offsets.size() * sizeof(std::int64_t));
  cuda::copy_to_device(norm_sizes_.data(), sizes.data(), sizes.size() * sizeof(std::int64_t));
  upload();  // synchronises, so the vectors above may go
  bind_layers();
}

void ParamStore::download() {
  if (device_ == Device::cpu) return;
  cuda::copy_to_host(params_.data(), device_master_.data(), params_.size() * sizeof(float));
  cuda::synchronize(cuda::StreamKind::compute);
}

void ParamStore::upload() {
  if (device_ == Device::cpu) return;
  cuda::copy_to_device(device_master_.data(), params_.data(), params_.size() * sizeof(float));
  refresh_compute_copy();
  cuda::synchronize(cuda::StreamKind::compute);
}

void ParamStore::refresh_compute_copy() {
  if (device_ == Device::cpu || compute_dtype_ == DType::f32) return;
#if MPIPE_HAVE_CUDA
  cuda::convert(device_compute_.as<bf16>(), device_master_.as<float>(), static_cast<int64_t>(params_.size()));
#endif
}

void ParamStore::grad_sum_squares(std::span<double> per_layer) const {
  MPIPE_CHECK(per_layer.size() == static_cast<std::size_t>(model_.size()), "per-layer span");
  std::fill(per_layer.begin(), per_layer.end(), 0.0);
  if (device_ == Device::cpu) {
    for (const ParamEntry& e : entries_)
      if (!e.tied_copy) per_layer[static_cast<std::size_t>(e.layer)] += cpu::sum_squares(grads_.data() + e.offset, e.numel());
    return;
  }
#if MPIPE_HAVE_CUDA
  // One launch for every span, one copy back; then the same per-layer sums in entry order.
  cuda::sum_squares(norm_sums_.as<double>(), device_grads_.as<float>(), norm_offsets_.as<std::int64_t>(),
                    norm_sizes_.as<std::int64_t>(), norm_count_);
  cuda::copy_to_host(norm_sums_host_.data(), norm_sums_.data(), static_cast<std::size_t>(norm_count_) * sizeof(double));
  cuda::synchronize(cuda::StreamKind::compute);
  const double* sums = norm_sums_host_.as<double>();
  int i = 0;
  for (const ParamEntry& e : entries_)
    if (!e.tied_copy) per_layer[static_cast<std::size_t>(e.layer)] += sums[i++];
#endif
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
