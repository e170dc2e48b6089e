// Trainer: one process, all layers. Splits each mini-batch into micro-batches, runs
// forward and backward of each in ascending order (gradients accumulate in that fixed
// order), then clips and steps the optimizer. The pipeline executor generalises this
// to stages on many ranks and must give the same numbers.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "mpipe/core/arena.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/nn/params.hpp"

namespace mpipe {

struct TrainConfig {
  ModelConfig model;
  OptimizerConfig optimizer;
  std::string data = "synthetic";
  int batch_size = 32;      // global mini-batch, in samples
  int micro_batches = 1;
  int steps = 100;          // the step training runs up to
  std::uint64_t seed = 1;
  int threads = 0;          // 0: every core the process may use
  int log_every = 10;
  std::string metrics;      // JSON-lines file, or empty
};

// Checks everything that can be checked before building; UserError on a problem.
void validate(const TrainConfig& config);

struct StepResult {
  std::int64_t step = 0;
  double loss = 0.0;        // mean over the mini-batch's loss rows
  double grad_norm = 0.0;   // before clipping
  float lr = 0.0f;
  bool skipped = false;     // non-finite gradients: no update made
  double seconds = 0.0;
};

class Trainer {
 public:
  explicit Trainer(const TrainConfig& config);

  StepResult step(std::int64_t step);
  Model& model() { return model_; }
  ParamStore& params() { return *params_; }
  const Dataset& dataset() const { return *dataset_; }
  const Arena& arena() const { return arena_; }
  // Runs forward and backward over the mini-batch of `step` without updating: the
  // gradients (of the mean loss) are left in params().grads(); returns the mean loss.
  double compute_gradients(std::int64_t step);

 private:
  TrainConfig config_;
  Model model_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Dataset> dataset_;
  Arena arena_;
  std::vector<Shape> shapes_;       // per layer, for one micro-batch
  Tensor inputs_, targets_;         // the whole mini-batch, (B, ...)
  std::unique_ptr<std::byte[]> batch_memory_;
  std::int64_t updates_ = 0;        // optimizer updates made (Adam's t)
};

}  // namespace mpipe
