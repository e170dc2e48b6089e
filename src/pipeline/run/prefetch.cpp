// The reader thread of --prefetch (pipeline/run/prefetch.hpp).
#include "mpipe/pipeline/run/prefetch.hpp"

#include <utility>

#include "mpipe/core/background.hpp"

#ifdef _OPENMP
#include <omp.h>
#endif

namespace mpipe {

Prefetch::Prefetch(Fill fill, int threads, bool background)
    : fill_(std::move(fill)), threads_(threads), background_(background), thread_([this] { run(); }) {}

Prefetch::~Prefetch() {
  {
    std::unique_lock lock(mutex_);
    wait_idle(lock);
    stop_ = true;
  }
  wake_.notify_one();
  thread_.join();
}

void Prefetch::wait_idle(std::unique_lock<std::mutex>& lock) {
  done_.wait(lock, [this] { return !queued_ && !busy_; });
}

void Prefetch::start(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets) {
  {
    std::unique_lock lock(mutex_);
    wait_idle(lock);
    step_ = step;
    training_ = training;
    inputs_ = inputs;
    targets_ = targets;
    error_ = nullptr;
    queued_ = held_ = true;
    ++started_;
  }
  wake_.notify_one();
}

bool Prefetch::take(std::int64_t step, bool training) {
  std::unique_lock lock(mutex_);
  wait_idle(lock);
  const bool hit = held_ && step_ == step && training_ == training;
  held_ = false;
  if (!hit) return false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  ++taken_;
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
    lock.unlock();
    std::exception_ptr error;
    try {
      fill_(step, training, inputs, targets);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    error_ = error;
    busy_ = false;
    done_.notify_all();
  }
}

}  // namespace mpipe
