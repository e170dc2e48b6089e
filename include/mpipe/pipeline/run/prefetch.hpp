// The next step's batch read on a thread of its own while the current step computes
// (--prefetch): the host's share of a step, which on a GPU is otherwise all of the time
// the device waits between steps (synthetic 224x224 images: ~130 ms a step on one core,
// against ~55 ms of ResNet-50 compute on an H100). Every batch is a pure function of
// (seed, step, sample), so reading it early changes no bit of a run.
//
// One reader thread, made once and reused: a step's read is handed to it through a mutex
// and condition variable, with nothing allocated per step. A read that fails keeps its
// error until that batch is asked for, and is said then as a synchronous read would have
// said it; a batch read ahead but not asked for next (an evaluation between steps, a
// step run again after a roll-back) is waited for and dropped.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "mpipe/core/tensor.hpp"

namespace mpipe {

class Prefetch {
 public:
  // What a read does: fills (inputs, targets) with batch `step` of the training data, or
  // of the held-out data when `training` is false.
  using Fill = std::function<void(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets)>;

  // `threads`: OpenMP threads the reader's fills may use (the datasets' loops).
  // `background`: the reader is of the idle class on any core (core/background.hpp):
  // on the CPU, where it shares cores with compute, it takes only the time the ranks
  // leave idle (waits, the bubble), and take() gives it the rank's core where none came.
  Prefetch(Fill fill, int threads, bool background);
  ~Prefetch();  // waits for a read in flight, then ends the thread
  Prefetch(const Prefetch&) = delete;
  Prefetch& operator=(const Prefetch&) = delete;

  // Starts reading batch (step, training) into (inputs, targets), which nothing else may
  // touch until take() or the next start(). A read still in flight is waited for first.
  void start(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets);
  // Whether batch (step, training) is the one read ahead: waits for it and returns true,
  // or rethrows the read's error. Any other read ahead is waited for and dropped (false),
  // and so is none at all.
  bool take(std::int64_t step, bool training);

  // Reads started, and of them taken (for tests and the log).
  std::int64_t started() const { return started_; }
  std::int64_t taken() const { return taken_; }

 private:
  void run();
  // Waits (lock held) until no read is in flight.
  void wait_idle(std::unique_lock<std::mutex>& lock);

  Fill fill_;
  int threads_;
  bool background_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool queued_ = false, busy_ = false, stop_ = false, held_ = false;
  std::int64_t step_ = 0;
  bool training_ = true;
  Tensor inputs_, targets_;
  std::exception_ptr error_;
  std::int64_t started_ = 0, taken_ = 0;
  std::thread thread_;  // last: started once everything it reads is set
};

}  // namespace mpipe
