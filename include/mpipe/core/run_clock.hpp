// Time this process ran: deadlines that do not count time it was stopped.
//
// A rank that was stopped (SIGSTOP, a suspended job) or starved for a while saw nothing of
// its peers in that time. A deadline of wall time would have it give up a wait, or name a
// peer as silent, for a pause of its own (a job that did all its work then ended in an
// abort). The watchdog's heartbeat thread, which wakes every fraction of a second, adds
// each gap between its wakes beyond the expected one (note_not_run); a RunClock's time
// leaves out what was added since it started. The ranks that ran name a rank that was
// stopped long enough, as before.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>

namespace mpipe {

namespace detail {
inline std::atomic<long long> not_run_ns{0};
}  // namespace detail

// The heartbeat thread: this process did not run for `gap` (beyond what it slept).
inline void note_not_run(std::chrono::steady_clock::duration gap) {
  detail::not_run_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(gap).count(),
                               std::memory_order_relaxed);
}
// Time noted as not run since the process started.
inline std::chrono::nanoseconds time_not_run() {
  return std::chrono::nanoseconds(detail::not_run_ns.load(std::memory_order_relaxed));
}

// Seconds run since construction (wall time less the time noted as not run).
class RunClock {
 public:
  RunClock() : start_(std::chrono::steady_clock::now()), not_run_(time_not_run()) {}
  double seconds() const {
    const auto wall = std::chrono::steady_clock::now() - start_;
    return std::max(0.0, std::chrono::duration<double>(wall - (time_not_run() - not_run_)).count());
  }
  // Seconds noted as not run since construction.
  double not_run_seconds() const { return std::chrono::duration<double>(time_not_run() - not_run_).count(); }

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::nanoseconds not_run_;
};

}  // namespace mpipe
