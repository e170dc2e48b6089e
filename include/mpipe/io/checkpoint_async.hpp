// --checkpoint-async: a checkpoint written while training goes on. At its step each rank
// copies only what the next step's forwards change (BatchNorm's running statistics) and
// returns; a thread of its own copies the rest of what it writes (parameter values,
// optimizer state) to host memory while the next step computes, and then writes the
// file from the copy, with the synchronous save's every check, agreement, verification
// and rename (commit_checkpoint), its collectives on duplicates of the grid's
// communicators. The next update, which would change what is not copied yet, first
// copies what is left itself (StateReader::finish). The file is the synchronous one's,
// bit for bit. A write that fails is seen at the next step (failed()); a new
// checkpoint, the run's end, a stop and an evaluation-free exit wait for the write in
// flight (wait()), which reports a failure there, on every rank alike (the write agreed
// on it); the previous checkpoint stays in place.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

#include "mpipe/io/checkpoint.hpp"

namespace mpipe {

class AsyncCheckpoint : StateReader {
 public:
  // Collective over the world: the communicators the writes use. UserError when MPI
  // cannot run calls from two threads (MPI_THREAD_MULTIPLE). The copy's memory is taken
  // and touched here; the executor's updates wait for a copy in progress.
  explicit AsyncCheckpoint(Executor& exec);
  // Whether this MPI takes calls from two threads (--checkpoint-async auto's test).
  static bool possible();
  ~AsyncCheckpoint();  // waits for a write in flight (its failure, if any, is dropped)
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  // Collective: the write in flight waited for (its result returned, or its failure
  // thrown), the rendezvous, the copy of what the next forwards change; then the copy of
  // the rest and the write of step `step` start on the thread.
  std::optional<SaveResult> start(CheckpointDir& dir, std::int64_t step, Watchdog* liveness);
  // Collective: waits for the write in flight; its result (nothing when none was in
  // flight), or throws its failure on every rank.
  // `liveness`: the run's watchdog, armed while this rank waits.
  std::optional<SaveResult> wait(Watchdog* liveness = nullptr);
  bool in_flight() const { return thread_.joinable(); }
  // The write in flight has ended in a failure (wait() throws it). Every rank's write
  // agrees on failing, each seeing it at its own moment.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Seconds the last start() kept training waiting (the wait, the rendezvous, the copy of
  // the running statistics).
  double stall_seconds() const { return stall_; }

 private:
  // A piece of the copy: `count` values from the live state to the copy's memory.
  struct Piece {
    const float* from;
    float* to;
    std::size_t count;
  };
  void finish() override;  // StateReader: the update's wait
  void copy_pieces();      // claims and copies pieces until none is left

  Executor& exec_;
  Communicator world_, pipeline_;
  bool writes_;  // this rank writes (replica 0, or every replica with --shard-optimizer)
  // Tests (MPIPE_CHECKPOINT_COPY_AT_UPDATE set): the thread leaves the whole copy to the
  // next update, so that a file differs from the synchronous one if anything changed the
  // state before that update's wait.
  bool copy_at_update_;
  std::vector<float> params_;  // the copy: the store's values, each optimizer state
  std::vector<std::vector<float>> states_;
  std::vector<Piece> now_;     // copied at the step: the buffers (running statistics)
  std::vector<Piece> later_;   // the rest, in pieces of at most 4 MiB
  std::atomic<int> next_{0}, copied_{0};  // of later_: claimed, copied
  double copy_wait_ = 0;       // seconds the training thread spent in finish() for this write
  std::thread thread_;
  std::optional<SaveResult> result_;
  std::exception_ptr error_;
  std::atomic<bool> failed_{false};
  double stall_ = 0;
};

}  // namespace mpipe
