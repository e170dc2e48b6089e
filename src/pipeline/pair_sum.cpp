// A two-rank sum by exchange: the tied weights' gradients.
#include "mpipe/pipeline/pair_sum.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"

namespace mpipe {

PairSum::PairSum(const Communicator& pair, Progress& progress, Device device, bool cuda_aware, std::span<float> span,
                 int tag)
    : pair_(pair), progress_(progress), device_(device), cuda_aware_(cuda_aware), span_(span), tag_(tag) {
  MPIPE_CHECK(pair.size() == 2, "a pair sum over ", pair.size(), " ranks");
  const std::size_t bytes = span.size_bytes();
  send_wire_ = std::as_bytes(span);
  if (device == Device::cpu) {
    incoming_ = FloatBuffer(span.size());
    receive_wire_ = std::as_writable_bytes(std::span<float>(incoming_.data(), span.size()));
    return;
  }
  incoming_device_ = cuda::DeviceBuffer(bytes);
  if (cuda_aware) {
    receive_wire_ = {incoming_device_.as<std::byte>(), bytes};
  } else {
    incoming_host_ = cuda::PinnedBuffer(bytes);
    outgoing_host_ = cuda::PinnedBuffer(bytes);
    receive_wire_ = {incoming_host_.as<std::byte>(), bytes};
    send_wire_ = {outgoing_host_.as<std::byte>(), bytes};
  }
}

void PairSum::post_receive() {
  MPIPE_CHECK(receive_ == Progress::none && send_ == Progress::none, "a pair sum posted twice");
  receive_ = progress_.track(pair_.irecv(receive_wire_, 1 - pair_.rank(), tag_), true);
}

void PairSum::start() {
  if (device_ == Device::cuda) {
    if (!cuda_aware_) cuda::copy_to_host(outgoing_host_.data(), span_.data(), span_.size_bytes());
    cuda::synchronize(cuda::StreamKind::compute);  // MPI reads the data now
  }
  send_ = progress_.track(pair_.isend(send_wire_, 1 - pair_.rank(), tag_), true);
}

Progress::Completion PairSum::finish(double timeout_s, const char* what, int index) {
  MPIPE_CHECK(started(), "a pair sum finished before it started");
  const Progress::Completion sent = progress_.wait(send_, timeout_s, what, index);
  const Progress::Completion received =
      progress_.wait(receive_, timeout_s, what, index, static_cast<long>(receive_wire_.size()));
  if (device_ == Device::cpu) {
    ops::add(tensor(span_.data()), tensor(incoming_.data()));
  } else {
    if (!cuda_aware_) cuda::copy_to_device(incoming_device_.data(), incoming_host_.data(), span_.size_bytes());
    ops::add(tensor(span_.data()), tensor(incoming_device_.data()));
  }
  Progress::Completion c;
  c.posted = sent.posted;
  c.completed = std::max(sent.completed, received.completed);
  c.waited = sent.waited + received.waited;
  return c;
}

}  // namespace mpipe
