// The sum of a gradient span that two ranks hold (a tied weight's owner and its copy, or
// the owner's rows that one vocabulary chunk of a head is),
// by exchanging it: each rank posts its receive when the step starts, into a buffer of
// its own, sends its span as soon as it is final, and adds what arrived. One transfer
// each way, kept moving by Progress while the ranks still compute, with no collective
// rounds and no temporary buffers inside MPI, where Open MPI's MPI_Iallreduce of a large
// span is slower than its blocking MPI_Allreduce, itself slower than this exchange
// (docs/communication.md has the figures). a + b == b + a in IEEE arithmetic, so both ranks end with
// the same bits, and they are those of the one-rank sum (owner += copy).
// A large span moves in up to `max_pieces` messages, added one by one as each arrives:
// the add of one piece runs while the next ones move (the add of a 154 MB span alone
// takes about as long as its transfer).
#pragma once
#include <span>
#include <vector>

#include "mpipe/backend/message.hpp"
#include "mpipe/core/tensor.hpp"
#include "mpipe/pipeline/comm/comm.hpp"
#include "mpipe/pipeline/comm/progress.hpp"

namespace mpipe {

class PairSum {
 public:
  // Pieces of a span: at most this many, none below min_piece_floats unless the span is.
  static constexpr int max_pieces = 8;
  static constexpr std::size_t min_piece_floats = std::size_t{1} << 20;  // 4 MiB
  static int pieces(std::size_t floats);
  // `group`: the ranks of tied weights, `partner` the other rank of this sum in it.
  // `span`: this rank's part, in device
  // memory on a GPU; messages go from and into it directly when MPI is CUDA-aware,
  // otherwise through pinned host buffers. `tag` tells this span's messages apart (its
  // pieces go in order under the same tag: MPI keeps their order).
  PairSum(const Communicator& group, int partner, Progress& progress, MessagePath path, std::span<float> span, int tag);
  // Requests in flight at once, at most, for a span of `floats`.
  static int requests(std::size_t floats) { return 2 * pieces(floats); }
  // At the step's start, before any compute: the partner's part may arrive early.
  void post_receive();
  // This rank's part is final (on a GPU: once the compute stream has run so far).
  void start();
  bool started() const { return !pieces_.empty() && pieces_.front().send != Progress::none; }
  // Waits for both transfers and adds the partner's part (on a GPU: in the compute
  // stream), piece by piece as each arrives. Returns the start and the later completion;
  // Error after timeout_s.
  Progress::Completion finish(double timeout_s, const char* what, int index);

 private:
  struct Piece {
    std::size_t offset, count;  // of the span
    Inbox incoming;             // the partner's part of it
    Progress::Ticket receive = Progress::none, send = Progress::none;
  };
  const Communicator& group_;
  int partner_;
  Progress& progress_;
  Device device_;
  std::span<float> span_;
  int tag_;
  Outbox outgoing_;      // this rank's
  std::vector<Piece> pieces_;
};

}  // namespace mpipe
