// The sum of a gradient span that two ranks hold (a tied weight's owner and its copy, or
// the owner's rows that one vocabulary chunk of a head is),
// by exchanging it: each rank posts its receive when the step starts, into a buffer of
// its own, sends its span as soon as it is final, and adds what arrived. One transfer
// each way, kept moving by Progress while the ranks still compute, with no collective
// rounds and no temporary buffers inside MPI, where Open MPI's MPI_Iallreduce of a large
// span is slower than its blocking MPI_Allreduce, itself slower than this exchange
// (docs/communication.md has the figures). a + b == b + a in IEEE arithmetic, so both ranks end with
// the same bits, and they are those of the one-rank sum (owner += copy).
#pragma once
#include <span>

#include "mpipe/backend/message.hpp"
#include "mpipe/core/tensor.hpp"
#include "mpipe/pipeline/comm.hpp"
#include "mpipe/pipeline/progress.hpp"

namespace mpipe {

class PairSum {
 public:
  // `group`: the ranks of tied weights, `partner` the other rank of this sum in it.
  // `span`: this rank's part, in device
  // memory on a GPU; messages go from and into it directly when MPI is CUDA-aware,
  // otherwise through pinned host buffers. `tag` tells this span's messages apart.
  PairSum(const Communicator& group, int partner, Progress& progress, MessagePath path, std::span<float> span, int tag);
  // At the step's start, before any compute: the partner's part may arrive early.
  void post_receive();
  // This rank's part is final (on a GPU: once the compute stream has run so far).
  void start();
  bool started() const { return send_ != Progress::none; }
  // Waits for both transfers and adds the partner's part (on a GPU: in the compute
  // stream). Returns the start and the later completion; Error after timeout_s.
  Progress::Completion finish(double timeout_s, const char* what, int index);

 private:
  const Communicator& group_;
  int partner_;
  Progress& progress_;
  Device device_;
  std::span<float> span_;
  int tag_;
  Inbox incoming_;       // the partner's part
  Outbox outgoing_;      // this rank's
  Progress::Ticket receive_ = Progress::none, send_ = Progress::none;
};

}  // namespace mpipe
