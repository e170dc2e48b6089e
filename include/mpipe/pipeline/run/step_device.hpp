// The device a rank's training steps compute on, chosen once (--device) and asked by the
// executor instead of branching on it: where the step's batch lives, how a compute action
// is timed, where the step's loss is summed, how device memory is copied, and whether MPI
// reads device memory itself or through pinned host copies. The CPU and the GPU are its
// two implementations (step_device.cpp).
#pragma once
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>

#include "mpipe/backend/message.hpp"
#include "mpipe/core/tensor.hpp"

namespace mpipe {

class StepDevice {
 public:
  using Clock = std::chrono::steady_clock;
  // A compute action timed on the device: seconds from the step's start (begin_step()).
  struct Timed {
    int kind, micro_batch, stage;
    double start, end;
  };
  // `cuda_aware`: MPI takes device pointers (GPU only). `actions`: compute actions per
  // step at most (the GPU's events are made once, here).
  static std::unique_ptr<StepDevice> make(Device device, bool cuda_aware, int actions);
  virtual ~StepDevice() = default;

  Device kind() const { return kind_; }
  bool cuda_aware() const { return cuda_aware_; }
  // How messages reach MPI (backend/message.hpp).
  MessagePath path() const { return {.device = kind_, .cuda_aware = cuda_aware_}; }
  // MPI moves device memory through pinned host copies (a GPU without CUDA-aware MPI).
  bool staged() const { return path().staged(); }
  // Compute actions are timed by the host as they run (the CPU); otherwise on the device,
  // read by finish_step() into timed().
  bool host_timed() const { return kind_ == Device::cpu; }

  // The batch of a rank that reads one: the dataset fills host_inputs() and
  // host_targets() (4-byte elements), compute reads inputs() and targets(). With
  // `spare`, a second host batch as large: spare_inputs() and spare_targets(), which
  // the next step's batch is read into while this step computes (Prefetch), and which
  // swap_batch() makes the batch.
  virtual void allocate_batch(const Shape& inputs, DType input_dtype, const Shape& targets, bool spare) = 0;
  const Tensor& host_inputs() const { return host_inputs_; }
  const Tensor& host_targets() const { return host_targets_; }
  const Tensor& inputs() const { return inputs_; }
  const Tensor& targets() const { return targets_; }
  const Tensor& spare_inputs() const { return spare_inputs_; }
  const Tensor& spare_targets() const { return spare_targets_; }
  virtual void swap_batch() = 0;
  virtual void upload_batch() {}

  // Where the loss layer adds the step's loss on the device, or null: the host adds it up.
  virtual double* loss_sum() { return nullptr; }
  // Around the step's actions: the device's loss sum zeroed (with `loss`) and the origin
  // of its times marked; then its work waited for, its compute times read, and the loss
  // sum returned (0 where the host adds it up, or without `loss`).
  virtual void begin_step(bool /*loss*/) { origin_ = Clock::now(); }
  virtual double finish_step(bool /*loss*/) { return 0.0; }
  // When begin_step() ran, on the host's clock.
  Clock::time_point origin() const { return origin_; }
  // Around one compute action: nothing on the CPU (the host times it), events on a GPU.
  virtual void begin_compute(int /*kind*/, int /*micro_batch*/, int /*stage*/) {}
  virtual void end_compute() {}
  // The step's compute actions as the device timed them, after finish_step().
  virtual std::span<const Timed> timed() const { return {}; }

  // CUDA Graphs (--cuda-graphs on; Stage::graphed): whether this pass's compute actions
  // are recorded as graphs (the executor says so per pass; never while a step's ops are
  // profiled: their timing events cannot be in a graph), and one action's recording:
  // begin_graph(), its host code queueing its kernels, launch_graph(key) with the action's
  // key (below actions(): the same key each step). Nothing on the CPU.
  virtual void graph_pass(bool /*on*/) {}
  virtual bool graphing() const { return false; }
  virtual void begin_graph() {}
  virtual void launch_graph(int /*key*/) {}
  virtual void abandon_graph() noexcept {}

  // A copy between device buffers, in compute order.
  virtual void copy(void* dst, const void* src, std::size_t bytes) const = 0;
  // The host waits until the device has run everything queued (MPI may read the data).
  virtual void synchronize() const {}

 protected:
  StepDevice(Device kind, bool cuda_aware) : kind_(kind), cuda_aware_(cuda_aware) {}
  Device kind_;
  bool cuda_aware_;
  Tensor host_inputs_, host_targets_, inputs_, targets_, spare_inputs_, spare_targets_;
  Clock::time_point origin_;
};

}  // namespace mpipe
