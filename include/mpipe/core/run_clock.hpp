// Time this process ran: deadlines that do not count time it was stopped.
//
// A rank that was stopped (SIGSTOP, a suspended job) or starved for a while saw nothing of
// its peers in that time. A deadline of wall time would have it give up a wait, or name a
// peer as silent, for a pause of its own (a job that did all its work then ended in an
// abort). The watchdog's heartbeat thread, which wakes every fraction of a second, adds
// each gap between its wakes beyond the expected one (note_not_run), and a gap it has not
// woken to add yet counts too (another thread of a resumed process may look first); a
// RunClock's time leaves out what was added since it started. The ranks that ran name a rank that was
// stopped long enough, as before.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>

namespace mpipe {

namespace detail {
inline std::atomic<long long> not_run_ns{0};
// The heartbeat thread's last wake (steady clock, ns; 0: none runs) and how long it may
// sleep between two: a gap that has gone on longer is time not run that it has yet to note
// (its process resumed and another thread looks first).
inline std::atomic<long long> last_wake_ns{0}, wake_period_ns{0};
inline long long steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
}  // namespace detail

// A gap between the heartbeat thread's wakes longer than it slept by this much is time the
// process did not run (a stop, or starvation); shorter ones are the scheduler's noise.
inline constexpr std::chrono::milliseconds not_run_threshold{250};

// The heartbeat thread: this process did not run for `gap` (beyond what it slept).
inline void note_not_run(std::chrono::steady_clock::duration gap) {
  detail::not_run_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(gap).count(),
                               std::memory_order_relaxed);
}
// The heartbeat thread, at each wake (after noting what it did not run): it woke at `now`
// and will sleep at most `period`.
inline void note_wake(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration period) {
  detail::wake_period_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(period).count(), std::memory_order_relaxed);
  detail::last_wake_ns.store(detail::steady_ns(now), std::memory_order_release);
}
// The heartbeat thread ends: no wake to come.
inline void note_no_wakes() { detail::last_wake_ns.store(0, std::memory_order_release); }
// The gap the heartbeat thread has not woken to note yet, where it is one (0 otherwise).
inline std::chrono::nanoseconds unnoted_gap(std::chrono::steady_clock::time_point now) {
  const long long wake = detail::last_wake_ns.load(std::memory_order_acquire);
  if (wake == 0) return std::chrono::nanoseconds(0);
  const auto gap = std::chrono::nanoseconds(detail::steady_ns(now) - wake - detail::wake_period_ns.load(std::memory_order_relaxed));
  return gap > not_run_threshold ? gap : std::chrono::nanoseconds(0);
}
// Time noted as not run since the process started, and the gap not noted yet.
inline std::chrono::nanoseconds time_not_run() {
  return std::chrono::nanoseconds(detail::not_run_ns.load(std::memory_order_relaxed)) +
         unnoted_gap(std::chrono::steady_clock::now());
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
