// Optimizers over a ParamStore's flat buffers: AdamW (decoupled weight decay) and SGD
// with momentum; the learning-rate schedule (linear warm-up, cosine decay).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "mpipe/nn/params.hpp"

namespace mpipe {

struct OptimizerConfig {
  std::string kind = "adamw";  // adamw | sgd
  float lr = 1e-3f;
  float min_lr_ratio = 0.1f;   // cosine decays to lr * min_lr_ratio
  float weight_decay = 0.0f;
  float momentum = 0.9f;       // sgd
  float beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;  // adamw
  int warmup = 0;              // steps of linear warm-up
  float clip_grad = 1.0f;      // global gradient-norm clip; 0 disables
};

void validate(const OptimizerConfig& config);

// Learning rate at 0-based `step` of `total` steps.
float learning_rate(const OptimizerConfig& config, std::int64_t step, std::int64_t total);

class Optimizer {
 public:
  Optimizer(ParamStore& store, const OptimizerConfig& config);
  // One update with learning rate lr; `t` counts updates from 1 (Adam's bias correction).
  void update(float lr, std::int64_t t);
  // Optimizer state in the ParamStore's gradient layout: Adam's m and v, or SGD's
  // velocity; state_names() names them (as checkpoints do).
  std::span<float> state(int which) const { return (which == 0 ? first_ : second_).span(); }
  std::vector<std::string> state_names() const;

 private:
  ParamStore& store_;
  OptimizerConfig config_;
  FloatBuffer first_, second_;
};

}  // namespace mpipe
