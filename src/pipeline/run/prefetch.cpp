// The reader thread of --prefetch (pipeline/run/prefetch.hpp).
#include "mpipe/pipeline/run/prefetch.hpp"

#include <algorithm>
#include <utility>

#include "mpipe/core/background.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace mpipe {

Prefetch::Prefetch(Fill fill, int threads, bool background, std::int64_t piece)
    : fill_(std::move(fill)), threads_(threads), background_(background), piece_(piece), thread_([this] { run(); }) {}

Prefetch::~Prefetch() {
  {
    std::unique_lock lock(mutex_);
    stop_read(lock);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Prefetch::stop_read(std::unique_lock<std::mutex>& lock) {
  claimed_ = true;
  queued_ = false;  // a read the reader never woke for: none of it is the reader's
  done_.wait(lock, [this] { return !busy_; });
}

void Prefetch::start(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets,
                     std::int64_t samples) {
  {
    std::unique_lock lock(mutex_);
    stop_read(lock);
    step_ = step;
    training_ = training;
    inputs_ = inputs;
    targets_ = targets;
    samples_ = samples;
    next_ = 0;
    error_ = nullptr;
    claimed_ = false;
    queued_ = held_ = true;
    ++started_;
  }
  wake_.notify_one();
}

bool Prefetch::take(std::int64_t step, bool training) {
  std::unique_lock lock(mutex_);
  const bool hit = held_ && step_ == step && training_ == training;
  if (!hit || error_) {  // dropped, or a piece failed already (the samples after it are never read)
    stop_read(lock);
    held_ = false;
    if (!hit) return false;
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
  // The reader takes no further piece (nor starts, if it never woke); the samples from
  // next_ on are this thread's, filled with its OpenMP team (the counts are this thread's
  // alone) while the reader ends its piece in flight: waiting for that piece first would
  // leave the team idle for it (a reader of the idle class, starved by compute, may be
  // anywhere in it).
  claimed_ = true;
  queued_ = false;
  const std::int64_t begin = next_, end = samples_;
  const Tensor inputs = inputs_, targets = targets_;
  lock.unlock();
  std::exception_ptr mine;
  if (begin < end) {
    try {
      fill_(step, training, inputs, targets, begin, end);
    } catch (...) {
      mine = std::current_exception();
    }
  }
  lock.lock();
  done_.wait(lock, [this] { return !busy_; });
  held_ = false;
  // The reader's error first: its samples come before this thread's.
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  if (mine) std::rethrow_exception(mine);
  ++taken_;
  read_ahead_ += begin;
  read_late_ += end - begin;
  return true;
}

void Prefetch::run() {
  if (background_) become_background_thread();
#ifdef _OPENMP
  omp_set_num_threads(threads_ > 0 ? threads_ : 1);  // this thread's own teams
#endif
  std::unique_lock lock(mutex_);
  for (;;) {
    wake_.wait(lock, [this] { return queued_ || stop_; });
    if (!queued_) return;  // stop_
    queued_ = false;
    busy_ = true;
    const std::int64_t step = step_;
    const bool training = training_;
    const Tensor inputs = inputs_, targets = targets_;
    const std::int64_t piece = piece_ > 0 ? piece_ : std::max<std::int64_t>(samples_, 1);
    // Pieces in sample order until take() claims the rest or one fails (the samples after
    // a failed one are never read: the error is the first in sample order, as a
    // synchronous read's).
    while (!claimed_ && !error_ && next_ < samples_) {
      const std::int64_t begin = next_, end = std::min(samples_, begin + piece);
      next_ = end;
      lock.unlock();
      std::exception_ptr error;
      try {
        fill_(step, training, inputs, targets, begin, end);
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      error_ = error;
    }
    busy_ = false;
    done_.notify_all();
  }
}

}  // namespace mpipe
