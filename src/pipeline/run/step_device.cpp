// The CPU and the GPU as the executor's step device.
#include "mpipe/pipeline/run/step_device.hpp"

#include <cstring>
#include <utility>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/backend/op_profile.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

// The CPU: the batch is read where the dataset wrote it, compute actions are timed by
// the host, the loss is added up on the host.
class CpuStepDevice final : public StepDevice {
 public:
  CpuStepDevice() : StepDevice(Device::cpu, false) {}

  void allocate_batch(const Shape& inputs, DType input_dtype, const Shape& targets, bool spare) override {
    const std::size_t bytes = static_cast<std::size_t>(inputs.numel() + targets.numel()) * word_bytes;
    memory_ = std::make_unique<std::byte[]>(spare ? 2 * bytes : bytes);
    host_inputs_ = inputs_ = {memory_.get(), inputs, input_dtype, Device::cpu};
    host_targets_ = targets_ = {memory_.get() + inputs.numel() * word_bytes, targets, DType::i32, Device::cpu};
    if (spare) {
      spare_inputs_ = {memory_.get() + bytes, inputs, input_dtype, Device::cpu};
      spare_targets_ = {memory_.get() + bytes + inputs.numel() * word_bytes, targets, DType::i32, Device::cpu};
    }
  }
  void swap_batch() override {
    std::swap(host_inputs_, spare_inputs_);
    std::swap(host_targets_, spare_targets_);
    inputs_ = host_inputs_;
    targets_ = host_targets_;
  }
  void copy(void* dst, const void* src, std::size_t bytes) const override { std::memcpy(dst, src, bytes); }

 private:
  std::unique_ptr<std::byte[]> memory_;
};

// A GPU: the batch is copied over once per step from pinned memory; the step's work is
// queued on the compute stream, each compute action between two timing events read once
// the step is done; the loss layer adds the loss up on the device.
class CudaStepDevice final : public StepDevice {
 public:
  CudaStepDevice(bool cuda_aware, int actions)
      : StepDevice(Device::cuda, cuda_aware), loss_(sizeof(double)), host_loss_(sizeof(double)), graphs_(actions) {
    // The origin, then two marks per compute action.
    for (int i = 0; i < 1 + 2 * actions; ++i) marks_.emplace_back(true);
    pending_.reserve(static_cast<std::size_t>(actions));
    timed_.reserve(static_cast<std::size_t>(actions));
  }

  void allocate_batch(const Shape& inputs, DType input_dtype, const Shape& targets, bool spare) override {
    const std::size_t bytes = static_cast<std::size_t>(inputs.numel() + targets.numel()) * word_bytes;
    // Pinned: the copy to the GPU is one DMA. The spare's half is read into while the
    // other is copied from (queued on the compute stream, done by the step's end).
    host_ = cuda::PinnedBuffer(spare ? 2 * bytes : bytes);
    device_ = cuda::DeviceBuffer(bytes);
    const auto at = [&](std::size_t half) { return host_.as<std::byte>() + half * bytes; };
    host_inputs_ = {at(0), inputs, input_dtype, Device::cpu};
    host_targets_ = {at(0) + inputs.numel() * word_bytes, targets, DType::i32, Device::cpu};
    if (spare) {
      spare_inputs_ = {at(1), inputs, input_dtype, Device::cpu};
      spare_targets_ = {at(1) + inputs.numel() * word_bytes, targets, DType::i32, Device::cpu};
    }
    inputs_ = {device_.data(), inputs, input_dtype, Device::cuda};
    targets_ = {device_.as<std::byte>() + inputs.numel() * word_bytes, targets, DType::i32, Device::cuda};
  }
  void swap_batch() override {
    std::swap(host_inputs_, spare_inputs_);
    std::swap(host_targets_, spare_targets_);
  }
  // The host batch is one block, inputs then targets, in either half: the device's size.
  void upload_batch() override { cuda::copy_to_device(device_.data(), host_inputs_.data, device_.bytes()); }

  double* loss_sum() override { return loss_.as<double>(); }

  void begin_step(bool loss) override {
    if (loss) cuda::zero(loss_.data(), sizeof(double));
    pending_.clear();
    timed_.clear();
    marks_[0].record(cuda::StreamKind::compute);
    origin_ = Clock::now();  // the stream was idle: its mark is now
  }

  double finish_step(bool loss) override {
    cuda::synchronize(cuda::StreamKind::compute);
    double sum = 0.0;
    if (loss) {
      cuda::copy_to_host(host_loss_.data(), loss_.data(), sizeof(double));
      cuda::synchronize(cuda::StreamKind::compute);
      sum = *host_loss_.as<double>();
    }
    for (std::size_t i = 0; i < pending_.size(); ++i)
      timed_.push_back({pending_[i].kind, pending_[i].micro_batch, pending_[i].stage,
                        cuda::seconds_between(marks_[0], marks_[1 + 2 * i]),
                        cuda::seconds_between(marks_[0], marks_[2 + 2 * i])});
    return sum;
  }

  void begin_compute(int kind, int micro_batch, int stage) override {
    const std::size_t i = pending_.size();
    MPIPE_CHECK(2 * i + 2 < marks_.size(), "more compute actions than the step has marks for");
    pending_.push_back({kind, micro_batch, stage, 0.0, 0.0});
    marks_[1 + 2 * i].record(cuda::StreamKind::compute);
  }
  void end_compute() override { marks_[2 * pending_.size()].record(cuda::StreamKind::compute); }
  std::span<const Timed> timed() const override { return timed_; }

  void copy(void* dst, const void* src, std::size_t bytes) const override { cuda::copy_on_device(dst, src, bytes); }
  void synchronize() const override { cuda::synchronize(cuda::StreamKind::compute); }

  void graph_pass(bool on) override { graph_pass_ = on; }
  bool graphing() const override { return graph_pass_ && !ops::OpProfile::active(); }
  void begin_graph() override { graphs_.begin_capture(); }
  void launch_graph(int key) override { graphs_.launch_captured(key); }
  void abandon_graph() noexcept override { graphs_.abandon(); }

 private:
  cuda::PinnedBuffer host_;
  cuda::DeviceBuffer device_;
  cuda::DeviceBuffer loss_;  // one double: the step's summed loss
  cuda::PinnedBuffer host_loss_;
  cuda::GraphSet graphs_;  // one per compute action of a step
  bool graph_pass_ = false;
  std::vector<cuda::Event> marks_;
  std::vector<Timed> pending_, timed_;  // sized once: nothing in the step allocates
};

}  // namespace

std::unique_ptr<StepDevice> StepDevice::make(Device device, bool cuda_aware, int actions) {
  if (device == Device::cpu) return std::make_unique<CpuStepDevice>();
  return std::make_unique<CudaStepDevice>(cuda_aware, actions);
}

}  // namespace mpipe
