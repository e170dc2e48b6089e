// Deadlines for the waits that cannot time out by themselves: MPI collectives and HDF5's
// collective file operations (a checkpoint). A rank that stops answering there (SIGSTOP,
// a hung node) would otherwise leave every other rank waiting for ever.
#pragma once
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#include "mpipe/pipeline/comm.hpp"

namespace mpipe {

// Every rank of `world` tells rank 0 it reached `what`, then waits for rank 0's word to
// go on. Rank 0 names the ranks that did not come within `timeout_s`; a rank not released
// in twice that names rank 0. Either way: one line on stderr and MPI_Abort (exit 1).
void rendezvous(const Communicator& world, const std::string& what, double timeout_s);

// A wait timed out (`context`: what this rank saw). Every rank that gets here tells all
// others; after `grace_s`, the lowest rank heard names the ranks not heard from (the
// stopped ones) in one line and ends the job (MPI_Abort, exit 1); the others stay quiet.
[[noreturn]] void roll_call(MPI_Comm world, const std::string& context, double grace_s);

// A thread that ends the job (one line naming this rank and what it was doing, then
// MPI_Abort) when a guarded stretch of work outlives its deadline.
class Watchdog {
 public:
  explicit Watchdog(const Communicator& world, std::string rank_name);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Arms the deadline until the returned guard is destroyed (or the next arm).
  class Guard {
   public:
    explicit Guard(Watchdog& dog) : dog_(&dog) {}
    Guard(Guard&& other) noexcept : dog_(other.dog_) { other.dog_ = nullptr; }
    Guard(const Guard&) = delete;
    ~Guard() {
      if (dog_) dog_->disarm();
    }

   private:
    Watchdog* dog_;
  };
  [[nodiscard]] Guard arm(std::string what, double seconds);

 private:
  void disarm();
  void run();

  MPI_Comm world_;
  std::string rank_name_, what_;
  double seconds_ = 0;
  bool armed_ = false, stop_ = false;
  std::chrono::steady_clock::time_point deadline_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace mpipe
