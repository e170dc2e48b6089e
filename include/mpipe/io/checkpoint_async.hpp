// --checkpoint-async: a checkpoint written while training goes on. At its step each rank
// copies what it writes (parameter values, optimizer state, the updates made) to host
// memory and returns; a thread of its own writes the file from the copy, with the
// synchronous save's every check, agreement, verification and rename
// (commit_checkpoint), its collectives on duplicates of the grid's communicators. The
// file is the synchronous one's, bit for bit. A new checkpoint, the run's end, a stop
// and an evaluation-free exit wait for the write in flight (wait()), which reports a
// failure there, on every rank alike (the write agreed on it); the previous checkpoint
// stays in place.
#pragma once
#include <cstdint>
#include <exception>
#include <optional>
#include <thread>
#include <vector>

#include "mpipe/io/checkpoint.hpp"

namespace mpipe {

class AsyncCheckpoint {
 public:
  // Collective over the world: the communicators the writes use. UserError when MPI
  // cannot run calls from two threads (MPI_THREAD_MULTIPLE).
  explicit AsyncCheckpoint(Executor& exec);
  ~AsyncCheckpoint();  // waits for a write in flight (its failure, if any, is dropped)
  AsyncCheckpoint(const AsyncCheckpoint&) = delete;
  AsyncCheckpoint& operator=(const AsyncCheckpoint&) = delete;

  // Collective: the write in flight waited for (its result returned, or its failure
  // thrown), the rendezvous, this rank's copy; then the write of step `step` starts.
  std::optional<SaveResult> start(CheckpointDir& dir, std::int64_t step, Watchdog* liveness);
  // Collective: waits for the write in flight; its result (nothing when none was in
  // flight), or throws its failure on every rank.
  // `liveness`: the run's watchdog, armed while this rank waits.
  std::optional<SaveResult> wait(Watchdog* liveness = nullptr);
  bool in_flight() const { return thread_.joinable(); }
  // Seconds the last start() kept training waiting (the wait, the rendezvous, the copy).
  double stall_seconds() const { return stall_; }

 private:
  Executor& exec_;
  Communicator world_, pipeline_;
  bool writes_;  // this rank writes (replica 0, or every replica with --shard-optimizer)
  std::vector<float> params_;  // the copy: the store's values, each optimizer state
  std::vector<std::vector<float>> states_;
  std::thread thread_;
  std::optional<SaveResult> result_;
  std::exception_ptr error_;
  double stall_ = 0;
};

}  // namespace mpipe
