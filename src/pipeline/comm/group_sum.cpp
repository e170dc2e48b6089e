// A sum over a group by a direct reduce-scatter and all-gather: the replicas' gradients.
#include "mpipe/pipeline/comm/group_sum.hpp"

#include <algorithm>

#include "mpipe/backend/ops.hpp"
#include "mpipe/nn/optimizer.hpp"

namespace mpipe {

GroupSum::GroupSum(const Communicator& group, Progress& progress, MessagePath path, std::span<float> span, int tag)
    : group_(group), progress_(progress), device_(path.device), span_(span), tag_(tag), rank_(group.rank()),
      ranks_(group.size()) {
  MPIPE_CHECK(ranks_ >= 2 && !path.staged(), "a group sum over ", ranks_, " ranks, staged ", path.staged());
  incoming_.resize(static_cast<std::size_t>(ranks_));
  const std::size_t mine = chunk(rank_).size();
  for (int r = 0; r < ranks_; ++r)
    if (r != rank_ && mine > 0) incoming_[static_cast<std::size_t>(r)] = Inbox(Shape{static_cast<std::int64_t>(mine)}, DType::f32, path);
  outgoing_ = Outbox(mine * sizeof(float), path);
  tickets_.assign(static_cast<std::size_t>(requests(ranks_)), Progress::none);
  expected_.assign(tickets_.size(), -1);
}

std::span<float> GroupSum::chunk(int rank) const {
  const auto [first, last] = shard_elements(Shape{static_cast<std::int64_t>(span_.size())}, rank, ranks_);
  return span_.subspan(first, last - first);
}

Tensor GroupSum::tensor(std::span<float> values) const {
  return Tensor{values.data(), Shape{static_cast<std::int64_t>(values.size())}, DType::f32, device_};
}

void GroupSum::start() {
  MPIPE_CHECK(phase_ == Phase::idle, "a group sum started twice");
  posted_ = Progress::Clock::now();
  std::size_t t = 0;
  const std::size_t mine = chunk(rank_).size();
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    expected_[t] = static_cast<long>(mine * sizeof(float));
    tickets_[t++] = mine == 0 ? Progress::none
                              : progress_.track(group_.irecv(incoming_[static_cast<std::size_t>(r)].wire(), r, tag_), true, false);
  }
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    const std::span<float> theirs = chunk(r);
    tickets_[t++] = theirs.empty() ? Progress::none
                                   : progress_.track(group_.isend(std::as_bytes(theirs), r, tag_), true, false);
  }
  phase_ = Phase::scatter;
}

void GroupSum::begin_gather() {
  // Every ticket of the first phase is complete (or released by a wait): the adds, in
  // rank order x0 + x1 + ... whichever rank r this is, into r's own chunk without a
  // copy: a + b == b + a, so x0 + ... + x(r-1) gathers in rank 0's copy, this rank's
  // chunk adds that to itself, then each later rank's copy.
  for (std::size_t t = 0; t < tickets_.size(); ++t) {
    const Progress::Completion c = progress_.wait(tickets_[t], 0, "the gradient sum's first phase", 0, expected_[t]);
    done_.completed = std::max(done_.completed, c.completed);
  }
  const std::span<float> mine = chunk(rank_);
  if (!mine.empty()) {
    auto theirs = [&](int r) {
      incoming_[static_cast<std::size_t>(r)].arrived();
      return incoming_[static_cast<std::size_t>(r)].tensor();
    };
    const Tensor own = tensor(mine);
    if (rank_ > 0) {
      const Tensor before = theirs(0);
      for (int r = 1; r < rank_; ++r) ops::add(before, theirs(r));
      ops::add(own, before);
    }
    for (int r = rank_ + 1; r < ranks_; ++r) ops::add(own, theirs(r));
  }
  // The sum goes to every other rank; theirs come into their chunks' places, whose first
  // phase sends are complete.
  const std::span<const std::byte> wire = outgoing_.leave(tensor(mine));
  outgoing_.wait();
  std::size_t t = 0;
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    const std::span<float> theirs = chunk(r);
    expected_[t] = static_cast<long>(theirs.size_bytes());
    tickets_[t++] = theirs.empty() ? Progress::none
                                   : progress_.track(group_.irecv(std::as_writable_bytes(theirs), r, tag_ + 1), true, false);
  }
  for (int r = 0; r < ranks_; ++r) {
    if (r == rank_) continue;
    tickets_[t++] = mine.empty() ? Progress::none : progress_.track(group_.isend(wire, r, tag_ + 1), true, false);
  }
  phase_ = Phase::gather;
}

void GroupSum::advance() {
  if (phase_ != Phase::scatter) return;
  for (const Progress::Ticket t : tickets_)
    if (!progress_.complete(t)) return;
  begin_gather();
}

Progress::Completion GroupSum::finish(double timeout_s, const char* what, int index) {
  MPIPE_CHECK(started(), "a group sum finished before it started");
  const Progress::Attending attending(progress_);  // through both phases' waits
  if (phase_ == Phase::scatter) {
    for (std::size_t t = 0; t < tickets_.size(); ++t) {
      const Progress::Completion c = progress_.wait(tickets_[t], timeout_s, what, index, expected_[t]);
      done_.waited += c.waited;
    }
    begin_gather();
  }
  Progress::Completion c = done_;
  c.posted = posted_;
  for (std::size_t t = 0; t < tickets_.size(); ++t) {
    const Progress::Completion g = progress_.wait(tickets_[t], timeout_s, what, index, expected_[t]);
    c.completed = std::max({c.completed, g.completed, posted_});
    c.waited += g.waited;
  }
  phase_ = Phase::idle;
  done_ = {};
  return c;
}

}  // namespace mpipe
