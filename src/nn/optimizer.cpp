// AdamW / SGD over the flat buffers, one pass per parameter view (decay differs per view).
#include "mpipe/nn/optimizer.hpp"

#include <cmath>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/backend/op_profile.hpp"

#if MPIPE_HAVE_CUDA
#include "mpipe/backend/cuda/ops.hpp"
#endif

namespace mpipe {

void validate(const OptimizerConfig& c) {
  MPIPE_REQUIRE(c.kind == "adamw" || c.kind == "sgd", "use --optimizer adamw or sgd",
                "unknown optimizer '", c.kind, "'");
  MPIPE_REQUIRE(c.lr > 0.0f && std::isfinite(c.lr), "e.g. --lr 3e-4", "--lr must be positive, got ", c.lr);
  MPIPE_REQUIRE(c.weight_decay >= 0.0f && std::isfinite(c.weight_decay), "e.g. --weight-decay 0.1",
                "--weight-decay must be finite and >= 0, got ", c.weight_decay);
  MPIPE_REQUIRE(c.momentum >= 0.0f && c.momentum < 1.0f, "e.g. --momentum 0.9",
                "--momentum must be in [0, 1), got ", c.momentum);
  MPIPE_REQUIRE(c.warmup >= 0, "e.g. --warmup 100", "--warmup must be >= 0, got ", c.warmup);
  MPIPE_REQUIRE(c.lr_schedule == "cosine" || c.lr_schedule == "linear" || c.lr_schedule == "constant" ||
                    c.lr_schedule == "wsd",
                "use --lr-schedule cosine, linear, constant or wsd", "unknown --lr-schedule '", c.lr_schedule, "'");
  MPIPE_REQUIRE(c.lr_decay_steps >= 0, "e.g. --lr-decay-steps 10000 (0: --steps)", "--lr-decay-steps must be >= 0, got ",
                c.lr_decay_steps);
  MPIPE_REQUIRE(c.min_lr_ratio >= 0.0f && c.min_lr_ratio <= 1.0f, "e.g. --min-lr-ratio 0.1",
                "--min-lr-ratio must be in [0, 1], got ", c.min_lr_ratio);
  MPIPE_REQUIRE(c.wsd_decay > 0.0f && c.wsd_decay <= 1.0f, "e.g. --wsd-decay 0.2",
                "--wsd-decay must be in (0, 1], got ", c.wsd_decay);
  MPIPE_REQUIRE(c.clip_grad >= 0.0f && std::isfinite(c.clip_grad), "use 0 to disable clipping", "--clip-grad must be finite and >= 0, got ", c.clip_grad);
}

float learning_rate(const OptimizerConfig& c, std::int64_t step, std::int64_t total) {
  if (step < c.warmup) return c.lr * static_cast<float>(step + 1) / static_cast<float>(c.warmup);
  if (c.lr_schedule == "constant") return c.lr;
  const std::int64_t end = c.lr_decay_steps > 0 ? c.lr_decay_steps : total;
  const double span = static_cast<double>(std::max<std::int64_t>(1, end - c.warmup));
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup) / span);
  const double min_lr = static_cast<double>(c.lr) * c.min_lr_ratio;
  double keep;  // the fraction of (lr - min_lr) left
  if (c.lr_schedule == "linear") keep = 1.0 - progress;
  else if (c.lr_schedule == "wsd") keep = std::min(1.0, (1.0 - progress) / static_cast<double>(c.wsd_decay));
  else keep = 0.5 * (1.0 + std::cos(M_PI * progress));
  return static_cast<float>(min_lr + (c.lr - min_lr) * keep);
}

std::pair<std::size_t, std::size_t> shard_elements(const Shape& shape, int part, int parts) {
  const std::int64_t rows = shape.rank > 0 ? shape[0] : 1;
  const std::int64_t row = rows > 0 ? shape.numel() / rows : 0;
  const auto at = [&](int p) { return static_cast<std::size_t>(rows * p / parts * row); };
  return {at(part), at(part + 1)};
}

namespace {

// Unsharded: every view but aliases, whole, its state in the gradients' layout. Sharded:
// the trained views' pieces, their state packed.
std::vector<ShardPiece> make_pieces(const ParamStore& store, int part, int parts, std::size_t* state_size) {
  std::vector<ShardPiece> pieces;
  std::size_t packed = 0;
  const auto entries = store.entries();
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const ParamEntry& e = entries[i];
    if (e.alias) continue;  // the owner's entry updates these values
    ShardPiece p;
    p.entry = static_cast<int>(i);
    p.decay = e.decay;
    if (parts == 1) {
      p.count = static_cast<std::size_t>(e.numel());
      p.state_offset = e.offset;
    } else {
      if (e.buffer) continue;
      const auto [first, last] = shard_elements(e.shape, part, parts);
      if (first == last) continue;
      p.element = first;
      p.count = last - first;
      p.state_offset = packed;
      packed += (p.count + 15) / 16 * 16;  // 64-byte aligned, as the store's views
    }
    p.param_offset = e.param_offset + p.element;
    p.grad_offset = e.offset + p.element;
    pieces.push_back(p);
  }
  *state_size = parts == 1 ? store.params().size() : packed;
  return pieces;
}

}  // namespace

Optimizer::Optimizer(ParamStore& store, const OptimizerConfig& config, int part, int parts)
    : store_(store), config_(config), adamw_(config.kind == "adamw"), part_(part), parts_(parts) {
  validate(config);
  MPIPE_CHECK(parts >= 1 && part >= 0 && part < parts, "optimizer shard ", part, " of ", parts);
  std::size_t state_size = 0;
  pieces_ = make_pieces(store, part, parts, &state_size);
  piece_index_.assign(store.entries().size(), -1);
  for (std::size_t i = 0; i < pieces_.size(); ++i) piece_index_[static_cast<std::size_t>(pieces_[i].entry)] = static_cast<int>(i);
  first_ = FloatBuffer(state_size);
  if (adamw_) second_ = FloatBuffer(state_size);
}

const ShardPiece* Optimizer::piece_of(int entry) const {
  const int i = piece_index_[static_cast<std::size_t>(entry)];
  return i < 0 ? nullptr : &pieces_[static_cast<std::size_t>(i)];
}

std::vector<std::string> Optimizer::state_names(const OptimizerConfig& config) {
  if (config.kind == "adamw") return {"exp_avg", "exp_avg_sq"};
  return {"momentum_buffer"};
}

void Optimizer::to_device() {
  MPIPE_CHECK(store_.device() == Device::cuda && !on_device_, "Optimizer::to_device before the store's");
  const std::size_t bytes = first_.size() * sizeof(float);
  device_first_ = cuda::DeviceBuffer(bytes);
  if (second_.size() > 0) device_second_ = cuda::DeviceBuffer(bytes);
  // The view table of one update launch: this rank's pieces.
  std::vector<std::int64_t> param_offsets, offsets, state_offsets, sizes;
  std::vector<float> decay;
  for (const ShardPiece& p : pieces_) {
    param_offsets.push_back(static_cast<std::int64_t>(p.param_offset));
    offsets.push_back(static_cast<std::int64_t>(p.grad_offset));
    state_offsets.push_back(static_cast<std::int64_t>(p.state_offset));
    sizes.push_back(static_cast<std::int64_t>(p.count));
    decay.push_back(p.decay ? config_.weight_decay : 0.0f);
    largest_view_ = std::max(largest_view_, static_cast<std::int64_t>(p.count));
  }
  view_count_ = static_cast<int>(sizes.size());
  const std::size_t n = std::max<std::size_t>(1, sizes.size());
  view_param_offsets_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_offsets_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_state_offsets_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_sizes_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_decay_ = cuda::DeviceBuffer(n * sizeof(float));
  cuda::copy_to_device(view_param_offsets_.data(), param_offsets.data(), param_offsets.size() * sizeof(std::int64_t));
  cuda::copy_to_device(view_offsets_.data(), offsets.data(), offsets.size() * sizeof(std::int64_t));
  cuda::copy_to_device(view_state_offsets_.data(), state_offsets.data(), state_offsets.size() * sizeof(std::int64_t));
  cuda::copy_to_device(view_sizes_.data(), sizes.data(), sizes.size() * sizeof(std::int64_t));
  cuda::copy_to_device(view_decay_.data(), decay.data(), decay.size() * sizeof(float));
  on_device_ = true;
  upload();  // synchronises, so the vectors above may go
}

void Optimizer::download() {
  if (!on_device_) return;
  cuda::copy_to_host(first_.data(), device_first_.data(), first_.size() * sizeof(float));
  if (second_.size() > 0) cuda::copy_to_host(second_.data(), device_second_.data(), second_.size() * sizeof(float));
  cuda::synchronize(cuda::StreamKind::compute);
}

void Optimizer::upload() {
  if (!on_device_) return;
  cuda::copy_to_device(device_first_.data(), first_.data(), first_.size() * sizeof(float));
  if (second_.size() > 0) cuda::copy_to_device(device_second_.data(), second_.data(), second_.size() * sizeof(float));
  cuda::synchronize(cuda::StreamKind::compute);
}

std::span<float> Optimizer::live_state(int which) const {
  if (!on_device_) return state(which);
  const cuda::DeviceBuffer& b = which == 0 ? device_first_ : device_second_;
  return {b.as<float>(), b.bytes() / sizeof(float)};
}

void Optimizer::update(float lr, std::int64_t t) {
  const ops::OpTimer timer(ops::OpKind::optimizer, "optimizer_update");  // with the GPU's bf16 copy of the result
  if (on_device_) {
#if MPIPE_HAVE_CUDA
    cuda::ViewTable views;
    views.param_offsets = view_param_offsets_.as<std::int64_t>();
    views.offsets = view_offsets_.as<std::int64_t>();
    views.state_offsets = view_state_offsets_.as<std::int64_t>();
    views.sizes = view_sizes_.as<std::int64_t>();
    views.weight_decay = view_decay_.as<float>();
    views.count = view_count_;
    views.largest = largest_view_;
    float* params = store_.master().data();
    const float* grads = store_.grads().data();
    // Unsharded, the views are every value but aliases (their owners' memory) and the
    // padding between views (never read): the update writes the bf16 copy as it goes.
    // Sharded, this rank updates its pieces only, and the copy is made from the gathered
    // master after the update (Reducer::finish_gather), once.
    bf16* copy = parts_ == 1 ? store_.compute_copy() : nullptr;
    if (adamw_)
      cuda::adamw_update(params, grads, device_first_.as<float>(), device_second_.as<float>(), views, lr,
                         config_.beta1, config_.beta2, config_.eps, t, copy);
    else
      cuda::sgd_update(params, grads, device_first_.as<float>(), views, lr, config_.momentum, copy);
#endif
    return;
  }
  float* params = store_.params().data();
  const float* grads = store_.grads().data();
  for (const ShardPiece& piece : pieces_) {
    const float wd = piece.decay ? config_.weight_decay : 0.0f;
    const std::size_t s = piece.state_offset;
    const auto n = static_cast<std::int64_t>(piece.count);
    float* p = params + piece.param_offset;
    const float* g = grads + piece.grad_offset;
    if (adamw_)
      cpu::adamw_update(p, g, first_.data() + s, second_.data() + s, n, lr, config_.beta1, config_.beta2, config_.eps, wd, t);
    else
      cpu::sgd_update(p, g, first_.data() + s, n, lr, config_.momentum, wd);
  }
}

}  // namespace mpipe
