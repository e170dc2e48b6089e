// The next step's batch read on a thread of its own while the current step computes
// (--prefetch): the host's share of a step, which on a GPU is otherwise all of the time
// the device waits between steps (synthetic 224x224 images: ~130 ms a step on one core,
// against ~55 ms of ResNet-50 compute on an H100). Every batch is a pure function of
// (seed, step, sample), so reading it early changes no bit of a run.
//
// One reader thread, made once and reused: a step's read is handed to it through a mutex
// and condition variable, with nothing allocated per step. The reader fills the batch in
// pieces of samples, in order; take() lets it take no further piece and fills the rest on
// the calling thread with the rank's threads, while the reader ends its piece in flight.
// On the CPU, where the reader is of the idle class and the ranks' threads may keep every
// core busy, a read that found no idle time is then the synchronous read's work, not one
// idle thread's (the small CNN's step at 2 threads on 2 cores had lost 4% to a whole read
// left to it). Each sample is a
// pure function of (seed, step, sample), so the split changes no bit. A read that fails
// keeps its error until that batch is asked for, and is said then as a synchronous read
// would have said it; a batch read ahead but not asked for next (an evaluation between
// steps, a step run again after a roll-back) is stopped and dropped.
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
  // What a read does: fills samples [begin, end) of (inputs, targets) with those of batch
  // `step` of the training data, or of the held-out data when `training` is false.
  using Fill = std::function<void(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets,
                                  std::int64_t begin, std::int64_t end)>;

  // `threads`: OpenMP threads the reader's fills may use (the datasets' loops).
  // `background`: the reader is of the idle class on any core (core/background.hpp):
  // on the CPU, where it shares cores with compute, it takes only the time the ranks
  // leave idle (waits, the bubble). `piece`: samples the reader fills between looks at
  // whether take() came (0: the whole batch in one piece).
  Prefetch(Fill fill, int threads, bool background, std::int64_t piece = 0);
  ~Prefetch();  // waits for a read in flight, then ends the thread
  Prefetch(const Prefetch&) = delete;
  Prefetch& operator=(const Prefetch&) = delete;

  // Starts reading batch (step, training), `samples` of them, into (inputs, targets),
  // which nothing else may touch until take() or the next start(). A read still in flight
  // is stopped first.
  void start(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets, std::int64_t samples);
  // Whether batch (step, training) is the one read ahead: stops the reader after its piece
  // in flight, fills the samples it had not reached on the calling thread (while that
  // piece is still being filled), waits for the piece and returns true, or rethrows the
  // read's error (the reader's, or this thread's for the rest).
  // Any other read ahead is stopped and dropped (false), and so is none at all.
  bool take(std::int64_t step, bool training);

  // Reads started, and of them taken; samples the reader filled and take() filled (for
  // tests and the log).
  std::int64_t started() const { return started_; }
  std::int64_t taken() const { return taken_; }
  std::int64_t read_ahead() const { return read_ahead_; }
  std::int64_t read_late() const { return read_late_; }

 private:
  void run();
  // Stops the read in flight (lock held): the reader takes no further piece; returns once
  // its piece in flight is filled. next_ is then the first sample it did not fill.
  void stop_read(std::unique_lock<std::mutex>& lock);

  Fill fill_;
  int threads_;
  bool background_;
  std::int64_t piece_;
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  bool queued_ = false, busy_ = false, stop_ = false, held_ = false, claimed_ = false;
  std::int64_t step_ = 0;
  bool training_ = true;
  Tensor inputs_, targets_;
  std::int64_t samples_ = 0, next_ = 0;  // the batch's samples; the first not yet claimed by the reader
  std::exception_ptr error_;
  std::int64_t started_ = 0, taken_ = 0, read_ahead_ = 0, read_late_ = 0;
  std::thread thread_;  // last: started once everything it reads is set
};

}  // namespace mpipe
