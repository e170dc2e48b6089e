// AdamW / SGD over the flat buffers, one pass per parameter view (decay differs per view).
#include "mpipe/nn/optimizer.hpp"

#include <cmath>

namespace mpipe {

void validate(const OptimizerConfig& c) {
  MPIPE_REQUIRE(c.kind == "adamw" || c.kind == "sgd", "use --optimizer adamw or sgd",
                "unknown optimizer '", c.kind, "'");
  MPIPE_REQUIRE(c.lr > 0.0f && std::isfinite(c.lr), "e.g. --lr 3e-4", "--lr must be positive, got ", c.lr);
  MPIPE_REQUIRE(c.weight_decay >= 0.0f, "e.g. --weight-decay 0.1", "--weight-decay must be >= 0, got ", c.weight_decay);
  MPIPE_REQUIRE(c.momentum >= 0.0f && c.momentum < 1.0f, "e.g. --momentum 0.9",
                "--momentum must be in [0, 1), got ", c.momentum);
  MPIPE_REQUIRE(c.warmup >= 0, "e.g. --warmup 100", "--warmup must be >= 0, got ", c.warmup);
  MPIPE_REQUIRE(c.clip_grad >= 0.0f, "use 0 to disable clipping", "--clip-grad must be >= 0, got ", c.clip_grad);
}

float learning_rate(const OptimizerConfig& c, std::int64_t step, std::int64_t total) {
  if (step < c.warmup) return c.lr * static_cast<float>(step + 1) / static_cast<float>(c.warmup);
  const double span = std::max<std::int64_t>(1, total - c.warmup);
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup) / span);
  const double min_lr = static_cast<double>(c.lr) * c.min_lr_ratio;
  return static_cast<float>(min_lr + 0.5 * (c.lr - min_lr) * (1.0 + std::cos(M_PI * progress)));
}

Optimizer::Optimizer(ParamStore& store, const OptimizerConfig& config)
    : store_(store), config_(config), first_(store.params().size()),
      second_(config.kind == "adamw" ? store.params().size() : 0) {
  validate(config);
}

std::vector<std::string> Optimizer::state_names() const {
  if (config_.kind == "adamw") return {"exp_avg", "exp_avg_sq"};
  return {"momentum_buffer"};
}

void Optimizer::update(float lr, std::int64_t t) {
  float* params = store_.params().data();
  const float* grads = store_.grads().data();
  for (const ParamEntry& e : store_.entries()) {
    if (e.alias) continue;  // the owner's entry updates these values
    const float wd = e.decay ? config_.weight_decay : 0.0f;
    const std::size_t o = e.offset;  // gradients and optimizer state
    float* p = params + e.param_offset;
    if (config_.kind == "adamw")
      cpu::adamw_update(p, grads + o, first_.data() + o, second_.data() + o, e.numel(), lr, config_.beta1,
                        config_.beta2, config_.eps, wd, t);
    else
      cpu::sgd_update(p, grads + o, first_.data() + o, e.numel(), lr, config_.momentum, wd);
  }
}

}  // namespace mpipe
