// A two-rank sum by exchange: the tied weights' gradients.
#include "mpipe/pipeline/pair_sum.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"

namespace mpipe {

PairSum::PairSum(const Communicator& group, int partner, Progress& progress, MessagePath path, std::span<float> span,
                 int tag)
    : group_(group), partner_(partner), progress_(progress), device_(path.device), span_(span), tag_(tag),
      incoming_(Shape{static_cast<std::int64_t>(span.size())}, DType::f32, path), outgoing_(span.size_bytes(), path) {
  MPIPE_CHECK(partner >= 0 && partner < group.size() && partner != group.rank(), "a pair sum with rank ", partner,
              " of ", group.size());
}

void PairSum::post_receive() {
  MPIPE_CHECK(receive_ == Progress::none && send_ == Progress::none, "a pair sum posted twice");
  receive_ = progress_.track(group_.irecv(incoming_.wire(), partner_, tag_), true);
}

void PairSum::start() {
  // MPI reads the data now: it must be final (on a GPU, and copied out where staged).
  const std::span<const std::byte> wire =
      outgoing_.leave(Tensor{span_.data(), Shape{static_cast<std::int64_t>(span_.size())}, DType::f32, device_});
  outgoing_.wait();
  send_ = progress_.track(group_.isend(wire, partner_, tag_), true);
}

Progress::Completion PairSum::finish(double timeout_s, const char* what, int index) {
  MPIPE_CHECK(started(), "a pair sum finished before it started");
  const Progress::Completion sent = progress_.wait(send_, timeout_s, what, index);
  const Progress::Completion received =
      progress_.wait(receive_, timeout_s, what, index, static_cast<long>(incoming_.wire().size()));
  incoming_.arrived();  // the add below runs after it in compute order
  ops::add(Tensor{span_.data(), incoming_.tensor().shape, DType::f32, device_}, incoming_.tensor());
  Progress::Completion c;
  c.posted = sent.posted;
  c.completed = std::max(sent.completed, received.completed);
  c.waited = sent.waited + received.waited;
  return c;
}

}  // namespace mpipe
