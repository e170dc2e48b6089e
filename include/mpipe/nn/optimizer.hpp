// Optimizers over a ParamStore's flat buffers: AdamW (decoupled weight decay) and SGD
// with momentum; the learning-rate schedule (linear warm-up, cosine decay).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
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

// One piece of a parameter view that a rank's optimizer updates: with the optimizer
// sharded over D replicas (--shard-optimizer, ZeRO-1), replica r updates rows
// [r R / D, (r + 1) R / D) of each trained view of R rows (its first dimension), and
// keeps optimizer state for those rows only, packed one piece after another.
// Unsharded, a piece is a whole view and the state keeps the gradients' layout.
struct ShardPiece {
  int entry = 0;                 // in the store's entries()
  std::size_t element = 0;       // first element of the piece within its view
  std::size_t count = 0;         // elements
  std::size_t param_offset = 0;  // of its values in the store
  std::size_t grad_offset = 0;   // of its gradient
  std::size_t state_offset = 0;  // of its optimizer state
  bool decay = false;
};

// Elements [first, second) of a view of `shape` that piece `part` of `parts` holds:
// whole rows, the first dimension split as evenly as it goes (pieces differ by a row
// at most; with fewer rows than parts some are empty).
std::pair<std::size_t, std::size_t> shard_elements(const Shape& shape, int part, int parts);

class Optimizer {
 public:
  // `part` of `parts`: this rank's shard of the optimizer (replica `part` of `parts`);
  // 0 of 1 holds it all. Sharded, views that are not trained (buffers) and aliases have
  // no piece: their values are never updated.
  Optimizer(ParamStore& store, const OptimizerConfig& config, int part = 0, int parts = 1);
  // One update with learning rate lr; `t` counts updates from 1 (Adam's bias correction).
  void update(float lr, std::int64_t t);
  // Optimizer state in the ParamStore's gradient layout: Adam's m and v, or SGD's
  // velocity; state_names() names them (as checkpoints do).
  // In host memory: the truth on the CPU, a mirror on a GPU (see download()).
  std::span<float> state(int which) const { return (which == 0 ? first_ : second_).span(); }
  // The state where updates read and write it: device memory on a GPU, else state().
  std::span<float> live_state(int which) const;
  std::vector<std::string> state_names() const { return state_names(config_); }
  // The pieces this rank updates, in entry order, and for entry `entry` its piece (null
  // where it has none).
  std::span<const ShardPiece> pieces() const { return pieces_; }
  const ShardPiece* piece_of(int entry) const;
  bool sharded() const { return parts_ > 1; }
  int part() const { return part_; }
  int parts() const { return parts_; }
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
  int part_, parts_;
  std::vector<ShardPiece> pieces_;
  std::vector<int> piece_index_;  // [entry] -> into pieces_, or -1
  FloatBuffer first_, second_;
  bool on_device_ = false;
  cuda::DeviceBuffer device_first_, device_second_;
  cuda::DeviceBuffer view_param_offsets_, view_offsets_, view_state_offsets_, view_sizes_, view_decay_;
  int view_count_ = 0;
  std::int64_t largest_view_ = 0;
};

}  // namespace mpipe
