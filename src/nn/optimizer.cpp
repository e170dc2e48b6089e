// AdamW / SGD over the flat buffers, one pass per parameter view (decay differs per view).
#include "mpipe/nn/optimizer.hpp"

#include <cmath>

#include "mpipe/backend/cpu/ops.hpp"

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

Optimizer::Optimizer(ParamStore& store, const OptimizerConfig& config)
    : store_(store), config_(config), adamw_(config.kind == "adamw"), first_(store.params().size()),
      second_(config.kind == "adamw" ? store.params().size() : 0) {
  validate(config);
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
  // The view table of one update launch: every entry but the aliases, whose values the
  // owner's entry updates.
  std::vector<std::int64_t> param_offsets, offsets, sizes;
  std::vector<float> decay;
  for (const ParamEntry& e : store_.entries()) {
    if (e.alias) continue;
    param_offsets.push_back(static_cast<std::int64_t>(e.param_offset));
    offsets.push_back(static_cast<std::int64_t>(e.offset));
    sizes.push_back(e.numel());
    decay.push_back(e.decay ? config_.weight_decay : 0.0f);
    largest_view_ = std::max(largest_view_, e.numel());
  }
  view_count_ = static_cast<int>(sizes.size());
  const std::size_t n = std::max<std::size_t>(1, sizes.size());
  view_param_offsets_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_offsets_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_sizes_ = cuda::DeviceBuffer(n * sizeof(std::int64_t));
  view_decay_ = cuda::DeviceBuffer(n * sizeof(float));
  cuda::copy_to_device(view_param_offsets_.data(), param_offsets.data(), param_offsets.size() * sizeof(std::int64_t));
  cuda::copy_to_device(view_offsets_.data(), offsets.data(), offsets.size() * sizeof(std::int64_t));
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
  if (on_device_) {
#if MPIPE_HAVE_CUDA
    cuda::ViewTable views;
    views.param_offsets = view_param_offsets_.as<std::int64_t>();
    views.offsets = view_offsets_.as<std::int64_t>();
    views.sizes = view_sizes_.as<std::int64_t>();
    views.weight_decay = view_decay_.as<float>();
    views.count = view_count_;
    views.largest = largest_view_;
    float* params = store_.master().data();
    const float* grads = store_.grads().data();
    if (adamw_)
      cuda::adamw_update(params, grads, device_first_.as<float>(), device_second_.as<float>(), views, lr,
                         config_.beta1, config_.beta2, config_.eps, t);
    else
      cuda::sgd_update(params, grads, device_first_.as<float>(), views, lr, config_.momentum);
    store_.refresh_compute_copy();
#endif
    return;
  }
  float* params = store_.params().data();
  const float* grads = store_.grads().data();
  for (const ParamEntry& e : store_.entries()) {
    if (e.alias) continue;  // the owner's entry updates these values
    const float wd = e.decay ? config_.weight_decay : 0.0f;
    const std::size_t o = e.offset;  // gradients and optimizer state
    float* p = params + e.param_offset;
    if (adamw_)
      cpu::adamw_update(p, grads + o, first_.data() + o, second_.data() + o, e.numel(), lr, config_.beta1,
                        config_.beta2, config_.eps, wd, t);
    else
      cpu::sgd_update(p, grads + o, first_.data() + o, e.numel(), lr, config_.momentum, wd);
  }
}

}  // namespace mpipe
