// The sum of a span over the ranks of a group (a layer's gradients over its replicas),
// every rank ending with the same bits: a reduce-scatter then an all-gather, each a
// direct exchange of point-to-point messages kept moving by Progress.
//   1. The span is cut into one chunk per rank. Each rank sends every other rank that
//      rank's chunk, and receives every other rank's copy of its own chunk.
//   2. Each rank adds up its chunk in the group's rank order, x0 + x1 + ... + x(D-1),
//      whichever rank it is, and sends the sum to every other rank, which receives it
//      in place.
// Each rank sends and receives (D-1)/D of the span per phase, as a ring does, in two
// rounds instead of 2(D-1). The summation order depends on D and the span's length
// only, so it is the same for every stage count K (promise 1), and every rank copies
// the one sum of each chunk (promise 2). Open MPI's MPI_Iallreduce (libNBC), which this
// replaces, measured 1.3x-2.6x its blocking MPI_Allreduce on large spans; this exchange
// is measured by bench_comm ("bucket sum") against the blocking call of the same bytes.
// The second phase begins once the first has arrived: advance() starts it without
// waiting (the reducer calls it between layers), finish() waits for what is left. Its
// messages do not wake the progress thread: the compute loop's sweeps between layers and
// the thread's own poll move them, and the final wait drives them (a woken thread only
// costs context switches on the rank's core: 1.7x a blocking call on a 0.5 MB sum).
#pragma once
#include <span>
#include <string>
#include <vector>

#include "mpipe/backend/message.hpp"
#include "mpipe/core/tensor.hpp"
#include "mpipe/pipeline/comm/comm.hpp"
#include "mpipe/pipeline/comm/progress.hpp"

namespace mpipe {

class GroupSum {
 public:
  // `span`: this rank's values, in device memory on a GPU with CUDA-aware MPI (host
  // memory otherwise: `path`). `tag` and tag + 1 tell this sum's messages apart.
  GroupSum(const Communicator& group, Progress& progress, MessagePath path, std::span<float> span, int tag);
  // Requests in flight at once, at most.
  static int requests(int ranks) { return 2 * (ranks - 1); }
  // The span is final: the first phase is posted.
  void start();
  bool started() const { return phase_ != Phase::idle; }
  // Starts the second phase if the first has arrived; never blocks (but on a GPU, for
  // the adds before the sends).
  void advance();
  // Waits for both phases; returns the first phase's post and the last completion.
  // Error after timeout_s (per wait), naming `what` and `index`.
  Progress::Completion finish(double timeout_s, const char* what, int index);

 private:
  enum class Phase { idle, scatter, gather };
  std::span<float> chunk(int rank) const;  // of the span
  Tensor tensor(std::span<float> values) const;
  void begin_gather();  // the first phase has arrived: add, send the sum, receive the others'

  const Communicator& group_;
  Progress& progress_;
  Device device_;
  std::span<float> span_;
  int tag_;
  int rank_, ranks_;
  std::vector<Inbox> incoming_;            // [rank]: its copy of this rank's chunk (none for this rank)
  Outbox outgoing_;                        // this rank's summed chunk, final for MPI
  std::vector<Progress::Ticket> tickets_;  // this phase's receives, then its sends
  std::vector<long> expected_;             // bytes of each receive of this phase
  Phase phase_ = Phase::idle;
  Progress::Clock::time_point posted_;
  Progress::Completion done_;              // the first phase's, carried into finish()
};

}  // namespace mpipe
