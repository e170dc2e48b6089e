// A two-rank sum by exchange: the tied weights' gradients.
#include "mpipe/pipeline/pair_sum.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"

namespace mpipe {

PairSum::PairSum(const Communicator& group, int partner, Progress& progress, Device device, bool cuda_aware,
                 std::span<float> span, int tag)
    : group_(group), partner_(partner), progress_(progress), device_(device), cuda_aware_(cuda_aware), span_(span),
      tag_(tag) {
  MPIPE_CHECK(partner >= 0 && partner < group.size() && partner != group.rank(), "a pair sum with rank ", partner,
              " of ", group.size());
  incoming_ = Inbox::make(Shape{static_cast<std::int64_t>(span.size())}, DType::f32, device, cuda_aware);
  send_wire_ = std::as_bytes(span);
  if (device == Device::cuda && !cuda_aware) {
    outgoing_host_ = cuda::PinnedBuffer(span.size_bytes());
    send_wire_ = {outgoing_host_.as<std::byte>(), span.size_bytes()};
  }
}

void PairSum::post_receive() {
  MPIPE_CHECK(receive_ == Progress::none && send_ == Progress::none, "a pair sum posted twice");
  receive_ = progress_.track(group_.irecv(incoming_.wire, partner_, tag_), true);
}

void PairSum::start() {
  if (device_ == Device::cuda) {
    if (!cuda_aware_) cuda::copy_to_host(outgoing_host_.data(), span_.data(), span_.size_bytes());
    cuda::synchronize(cuda::StreamKind::compute);  // MPI reads the data now
  }
  send_ = progress_.track(group_.isend(send_wire_, partner_, tag_), true);
}

Progress::Completion PairSum::finish(double timeout_s, const char* what, int index) {
  MPIPE_CHECK(started(), "a pair sum finished before it started");
  const Progress::Completion sent = progress_.wait(send_, timeout_s, what, index);
  const Progress::Completion received =
      progress_.wait(receive_, timeout_s, what, index, static_cast<long>(incoming_.wire.size()));
  if (device_ == Device::cuda && !cuda_aware_)
    cuda::copy_to_device(incoming_.tensor.data, incoming_.staging.data(), incoming_.tensor.bytes());
  ops::add(Tensor{span_.data(), incoming_.tensor.shape, DType::f32, device_}, incoming_.tensor);
  Progress::Completion c;
  c.posted = sent.posted;
  c.completed = std::max(sent.completed, received.completed);
  c.waited = sent.waited + received.waited;
  return c;
}

}  // namespace mpipe
