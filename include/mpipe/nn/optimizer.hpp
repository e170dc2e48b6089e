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
  std::string lr_schedule = "cosine";  // cosine | linear | constant | wsd, after the warm-up
  long long lr_decay_steps = 0;        // the step the decay ends at (0: --steps); min lr after
  float wsd_decay = 0.2f;              // wsd: the last fraction of the decay steps that decays
  float clip_grad = 1.0f;      // global gradient-norm clip; 0 disables
};

void validate(const OptimizerConfig& config);

// Learning rate at 0-based `step`: linear warm-up, then the schedule over the decay
// steps (`lr_decay_steps`, or `total` when 0), then lr * min_lr_ratio.
float learning_rate(const OptimizerConfig& config, std::int64_t step, std::int64_t total);

class Optimizer {
 public:
  Optimizer(ParamStore& store, const OptimizerConfig& config);
  // One update with learning rate lr; `t` counts updates from 1 (Adam's bias correction).
  void update(float lr, std::int64_t t);
  // Optimizer state in the ParamStore's gradient layout: Adam's m and v, or SGD's
  // velocity; state_names() names them (as checkpoints do).
  // In host memory: the truth on the CPU, a mirror on a GPU (see download()).
  std::span<float> state(int which) const { return (which == 0 ? first_ : second_).span(); }
  // The state where updates read and write it: device memory on a GPU, else state().
  std::span<float> live_state(int which) const;
  std::vector<std::string> state_names() const { return state_names(config_); }
  static std::vector<std::string> state_names(const OptimizerConfig& config);

  // Follows the store onto the GPU (after ParamStore::to_device()): the state moves to
  // device memory and updates run there, one launch for all views.
  void to_device();
  // GPU only: state to the host mirror (before a checkpoint) and back (after loading).
  void download();
  void upload();

 private:
  ParamStore& store_;
  OptimizerConfig config_;
  bool adamw_;  // else SGD: the kind, decided once
  FloatBuffer first_, second_;
  bool on_device_ = false;
  cuda::DeviceBuffer device_first_, device_second_;
  cuda::DeviceBuffer view_param_offsets_, view_offsets_, view_sizes_, view_decay_;
  int view_count_ = 0;
  std::int64_t largest_view_ = 0;
};

}  // namespace mpipe
