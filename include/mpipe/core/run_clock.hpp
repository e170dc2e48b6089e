// Time this process ran: deadlines that do not count time it was stopped.
//
// A rank that was stopped (SIGSTOP, a suspended job) or starved for a while saw nothing of
// its peers in that time. A deadline of wall time would have it give up a wait, or name a
// peer as silent, for a pause of its own (a job that did all its work then ended in an
// abort). The watchdog's heartbeat thread, which wakes every fraction of a second, adds
// each gap between its wakes beyond the expected one, and a gap it has not woken to add
// yet counts too (another thread of a resumed process may look first); a RunClock's time
// leaves out what was added since it started. The ranks that ran name a rank that was
// stopped long enough, as before.
//
// The sum noted and the last wake change together, and a reader sees both as of one
// moment (a sequence lock): a reader that took the sum before a resumed heartbeat thread
// added the gap and the wake after it moved on (preempted between the two, or running a
// signal handler: mpirun's SIGTERM follows its SIGCONT) saw the gap in neither, and timed
// out a wait for its own stop.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>

namespace mpipe {

// A gap between the heartbeat thread's wakes longer than it slept by this much is time the
// process did not run (a stop, or starvation); shorter ones are the scheduler's noise.
inline constexpr std::chrono::milliseconds not_run_threshold{250};

// What a reader sees as of one moment: the time not run since the process started, the
// part of it the heartbeat thread has not noted yet, and the last gap (its length and when
// it ended; a gap not noted yet ends now).
struct NotRun {
  std::chrono::nanoseconds total{0}, unnoted{0}, last_gap{0};
  std::chrono::steady_clock::time_point last_gap_end{};
};

namespace detail {
inline long long steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}
// The state, under a sequence lock: odd while a writer changes it. The heartbeat thread's
// last wake (0: none runs) and how long it may sleep between two: a gap that has gone on
// longer is time not run that it has yet to note (its process resumed and another thread
// looks first).
struct NotRunState {
  std::atomic<unsigned> sequence{0};
  std::atomic<long long> noted_ns{0}, last_wake_ns{0}, wake_period_ns{0}, last_gap_ns{0}, last_gap_end_ns{0};
  std::mutex writers;  // one writer at a time (the heartbeat threads of two watchdogs)
};
inline NotRunState not_run_state;

// Changes the state under the sequence lock.
template <class Change>
void write_not_run(Change change) {
  NotRunState& s = not_run_state;
  std::lock_guard lock(s.writers);
  const unsigned at = s.sequence.load(std::memory_order_relaxed);
  s.sequence.store(at + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  change(s);
  s.sequence.store(at + 2, std::memory_order_release);
}
inline void add_gap(NotRunState& s, std::chrono::steady_clock::time_point end, std::chrono::nanoseconds gap) {
  if (gap <= std::chrono::nanoseconds(0)) return;
  s.noted_ns.store(s.noted_ns.load(std::memory_order_relaxed) + gap.count(), std::memory_order_relaxed);
  s.last_gap_ns.store(gap.count(), std::memory_order_relaxed);
  s.last_gap_end_ns.store(steady_ns(end), std::memory_order_relaxed);
}
}  // namespace detail

// The heartbeat thread, at each wake: it woke at `now` after a gap of `gap` beyond what it
// slept (zero: none, or one within the threshold) and will sleep at most `period`.
inline void note_wake(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration period,
                      std::chrono::steady_clock::duration gap) {
  detail::write_not_run([&](detail::NotRunState& s) {
    detail::add_gap(s, now, std::chrono::duration_cast<std::chrono::nanoseconds>(gap));
    s.wake_period_ns.store(std::chrono::duration_cast<std::chrono::nanoseconds>(period).count(), std::memory_order_relaxed);
    s.last_wake_ns.store(detail::steady_ns(now), std::memory_order_relaxed);
  });
}
// A thread that does not wake on a schedule (a watchdog without heartbeats) found at `now`
// that the process did not run for `gap`.
inline void note_not_run(std::chrono::steady_clock::time_point now, std::chrono::steady_clock::duration gap) {
  detail::write_not_run(
      [&](detail::NotRunState& s) { detail::add_gap(s, now, std::chrono::duration_cast<std::chrono::nanoseconds>(gap)); });
}
// The heartbeat thread ends: no wake to come.
inline void note_no_wakes() {
  detail::write_not_run([](detail::NotRunState& s) { s.last_wake_ns.store(0, std::memory_order_relaxed); });
}

// The state as of `now`, read whole: the gap the heartbeat thread has not woken to note
// yet, where it is one, counts (and is the last gap, ending now).
inline NotRun not_run_at(std::chrono::steady_clock::time_point now) {
  const detail::NotRunState& s = detail::not_run_state;
  long long noted = 0, wake = 0, period = 0, gap = 0, gap_end = 0;
  for (;;) {
    const unsigned before = s.sequence.load(std::memory_order_acquire);
    noted = s.noted_ns.load(std::memory_order_relaxed);
    wake = s.last_wake_ns.load(std::memory_order_relaxed);
    period = s.wake_period_ns.load(std::memory_order_relaxed);
    gap = s.last_gap_ns.load(std::memory_order_relaxed);
    gap_end = s.last_gap_end_ns.load(std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (before % 2 == 0 && s.sequence.load(std::memory_order_relaxed) == before) break;
  }
  NotRun r;
  r.total = std::chrono::nanoseconds(noted);
  r.last_gap = std::chrono::nanoseconds(gap);
  r.last_gap_end = std::chrono::steady_clock::time_point(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::nanoseconds(gap_end)));
  const auto unnoted = std::chrono::nanoseconds(detail::steady_ns(now) - wake - period);
  if (wake != 0 && unnoted > not_run_threshold) {
    r.total += unnoted;
    r.unnoted = r.last_gap = unnoted;
    r.last_gap_end = now;
  }
  return r;
}
// The gap the heartbeat thread has not woken to note yet, where it is one (0 otherwise).
inline std::chrono::nanoseconds unnoted_gap(std::chrono::steady_clock::time_point now) { return not_run_at(now).unnoted; }
// Time noted as not run since the process started, and the gap not noted yet.
inline std::chrono::nanoseconds time_not_run() { return not_run_at(std::chrono::steady_clock::now()).total; }

// Seconds run since construction (wall time less the time noted as not run).
class RunClock {
 public:
  RunClock() : start_(std::chrono::steady_clock::now()), not_run_(not_run_at(start_).total) {}
  double seconds() const {
    const auto now = std::chrono::steady_clock::now();
    return std::max(0.0, std::chrono::duration<double>((now - start_) - (not_run_at(now).total - not_run_)).count());
  }
  // Seconds noted as not run since construction.
  double not_run_seconds() const { return std::chrono::duration<double>(time_not_run() - not_run_).count(); }

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::nanoseconds not_run_;
};

}  // namespace mpipe
