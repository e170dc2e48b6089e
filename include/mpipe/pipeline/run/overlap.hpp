// --overlap-steps (post-validation, Qi et al. 2023, section 4): what an update made ahead
// of the world's agreement replaces, kept to go back to when the bet is lost. The
// executor's side of it (advance, settle, the bet and its rollback) is in overlap.cpp.
#pragma once
#include <array>
#include <cstddef>
#include <span>
#include <utility>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/pipeline/run/step_device.hpp"

namespace mpipe {

class UpdateBackup {
 public:
  // For a rank's parameters and optimizer state, in one block where they live (host or
  // device memory).
  UpdateBackup(ParamStore& params, Optimizer& optimizer, StepDevice& device);
  // Before the update: the values, gradients and optimizer state; after it: the running
  // statistics as it left them.
  void save_state() { copy_state(/*back=*/false); }
  void save_statistics() { copy(statistics, /*back=*/false); }
  // Back to what the saves kept.
  void restore_state() { copy_state(/*back=*/true); }
  void restore_statistics() { copy(statistics, /*back=*/true); }

 private:
  enum Part { values, gradients, first, second, statistics, parts };
  std::span<float> live(Part part) const;  // the state a part keeps (statistics: all values)
  void copy(Part part, bool back);         // into the block, or `back` out of it
  void copy_state(bool back) {
    for (const Part part : {values, gradients, first, second}) copy(part, back);
  }

  ParamStore& params_;
  Optimizer& optimizer_;
  StepDevice& device_;
  std::vector<float> host_;
  cuda::DeviceBuffer on_device_;
  float* saved_ = nullptr;
  std::array<std::size_t, parts + 1> at_{};  // where each part begins, in floats
  std::vector<std::pair<std::size_t, std::size_t>> buffer_spans_;  // (offset, count) of running statistics
};

}  // namespace mpipe
