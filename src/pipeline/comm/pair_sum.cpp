// A two-rank sum by exchange: the tied weights' gradients.
#include "mpipe/pipeline/comm/pair_sum.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"
#include "mpipe/nn/optimizer.hpp"

namespace mpipe {

int PairSum::pieces(std::size_t floats) {
  return static_cast<int>(std::clamp<std::size_t>(floats / min_piece_floats, 1, max_pieces));
}

PairSum::PairSum(const Communicator& group, int partner, Progress& progress, MessagePath path, std::span<float> span,
                 int tag)
    : group_(group), partner_(partner), progress_(progress), device_(path.device), span_(span), tag_(tag),
      outgoing_(span.size_bytes(), path) {
  MPIPE_CHECK(partner >= 0 && partner < group.size() && partner != group.rank(), "a pair sum with rank ", partner,
              " of ", group.size());
  const int n = pieces(span.size());
  pieces_.reserve(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    const auto [first, last] = shard_elements(Shape{static_cast<std::int64_t>(span.size())}, p, n);
    pieces_.push_back({first, last - first, Inbox(Shape{static_cast<std::int64_t>(last - first)}, DType::f32, path)});
  }
}

void PairSum::post_receive() {
  for (Piece& p : pieces_) {
    MPIPE_CHECK(p.receive == Progress::none && p.send == Progress::none, "a pair sum posted twice");
    p.receive = progress_.track(group_.irecv(p.incoming.wire(), partner_, tag_), true, false);
  }
  progress_.wake();  // once for all the pieces
}

void PairSum::start() {
  // MPI reads the data now: it must be final (on a GPU, and copied out where staged).
  const std::span<const std::byte> wire =
      outgoing_.leave(Tensor{span_.data(), Shape{static_cast<std::int64_t>(span_.size())}, DType::f32, device_});
  outgoing_.wait();
  for (Piece& p : pieces_)
    p.send = progress_.track(group_.isend(wire.subspan(p.offset * sizeof(float), p.count * sizeof(float)), partner_, tag_), true,
                             false);
  progress_.wake();
}

Progress::Completion PairSum::finish(double timeout_s, const char* what, int index) {
  MPIPE_CHECK(started(), "a pair sum finished before it started");
  Progress::Completion c;
  for (Piece& p : pieces_) {
    // The add writes over the piece this rank sends: its send must have left.
    const Progress::Completion sent = progress_.wait(p.send, timeout_s, what, index);
    const Progress::Completion received =
        progress_.wait(p.receive, timeout_s, what, index, static_cast<long>(p.incoming.wire().size()));
    p.incoming.arrived();  // the add below runs after it in compute order
    ops::add(Tensor{span_.data() + p.offset, p.incoming.tensor().shape, DType::f32, device_}, p.incoming.tensor());
    if (&p == &pieces_.front()) c.posted = sent.posted;
    c.completed = std::max({c.completed, sent.completed, received.completed});
    c.waited += sent.waited + received.waited;
  }
  return c;
}

}  // namespace mpipe
