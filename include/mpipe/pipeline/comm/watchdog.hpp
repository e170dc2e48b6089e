// Deadlines for the waits that cannot time out by themselves: MPI collectives and HDF5's
// collective file operations (a checkpoint). A rank that stops answering there (SIGSTOP,
// a hung node) would otherwise leave every other rank waiting for ever.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

// Every rank of `world` tells rank 0 it reached `what`, then waits for rank 0's word to
// go on. Rank 0 names the ranks that did not come within `timeout_s`. The others name
// rank 0 (a roll call among them) once `liveness`'s heartbeats say it has been silent for
// `timeout_s`; without heartbeats, once it has not released them in twice that and 5 s.
// Either way: one line on stderr and MPI_Abort (exit 1).
class Watchdog;
void rendezvous(const Communicator& world, const std::string& what, double timeout_s,
                Watchdog* liveness = nullptr);

// Stop signals (SIGTERM, SIGUSR1) this process has received; the application's handler
// counts them. A rank that gets one while it is about to name a stopped rank stays quiet:
// mpirun sends SIGTERM when another rank's MPI_Abort tears the job down, and that rank
// has spoken already (one line per failure).
extern std::atomic<int> stop_signals_received;

// A wait timed out (`context`: what this rank saw). Every rank that gets here tells all
// others; after `grace_s`, the lowest rank heard names the ranks not heard from (the
// stopped ones) in one line and ends the job (MPI_Abort, exit 1); the others stay quiet.
// With `liveness` (the run's watchdog, on rank 0: heartbeats from every rank), a rank not
// in the roll call but heard from within half the liveness time is alive (its own wait
// has not timed out yet) and is not named; and the grace ends as soon as a rank not in the
// roll call has been silent for the whole liveness time while every rank below this one
// is heard or as silent: it names the silent ones, and a rank above that is still in its
// own wait hears this one and stays quiet (a stop is named within --p2p-timeout plus the
// time the heartbeats take to prove it, not plus the grace).
[[noreturn]] void roll_call(MPI_Comm world, const std::string& context, double grace_s, Watchdog* liveness = nullptr);

// A thread that ends the job (one line, then MPI_Abort) when a guarded stretch of work
// outlives its deadline, or, sooner, when a rank stops answering within it.
//
// Liveness: from its construction on, the watchdog threads exchange heartbeats (rank 0
// with every rank) whatever their main threads are doing, so a long write is told apart
// from a stopped rank. While armed, rank 0 names a rank silent for `liveness_s` seconds;
// when rank 0 is the silent one, the others hold a roll call that names it; unarmed,
// `silent_s` tells a wait how long a peer has been silent (a rendezvous asks about rank 0).
// A peer is silent from the construction on, and again from each arm on (a rank stopped
// before its first word is found too), so the ranks construct it together, after a
// collective (one for a whole run), and arm it together.
// The deadline then only bounds work that every rank is still doing (a hung file system).
// Heartbeats need MPI_THREAD_MULTIPLE; without it the deadline alone stands.
// Time this rank did not run (a stop of its own: SIGSTOP and the SIGCONT that resumes it, a
// suspended job, starvation), seen as a gap between the thread's wakes, counts against no
// peer's silence, no deadline here and no wait's (core/run_clock.hpp): a rank that was
// stopped names nobody for it, and is named by those that ran, if it was stopped long
// enough. (It used to judge itself stopped by a late wake and go quiet, then abort: under
// load a job that had done all its work ended with exit 1 and no line.)
class Watchdog {
 public:
  Watchdog(const Communicator& world, std::string rank_name, double liveness_s);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  // Arms the deadline until the returned guard is destroyed (or the next arm).
  class Guard {
   public:
    explicit Guard(Watchdog& dog) : dog_(&dog) {}
    Guard(Guard&& other) noexcept : dog_(other.dog_) { other.dog_ = nullptr; }
    Guard(const Guard&) = delete;
    ~Guard() { reset(); }
    // Disarms now (the destructor then does nothing).
    void reset() {
      if (dog_) dog_->disarm();
      dog_ = nullptr;
    }

   private:
    Watchdog* dog_;
  };
  // `seconds`: infinity for no deadline (liveness alone: start-up, whose reads and
  // measurements have no size to bound them by).
  [[nodiscard]] Guard arm(std::string what, double seconds);
  // What the armed stretch is doing now, for the line that ends the job (start-up's phases).
  void doing(std::string what);
  // The name the line gives this rank ("rank 3" until the grid names its stage).
  void rename(std::string rank_name);

  // Whether heartbeats run (MPI_THREAD_MULTIPLE, more than one rank, liveness_s > 0).
  bool heartbeats() const { return heartbeats_; }
  // Seconds since `peer` was last heard (from the construction on), counting the words
  // that arrived since the thread last looked; -1 for a rank this
  // one does not exchange heartbeats with (rank 0's peers are all ranks, the others' rank 0).
  double silent_s(int peer);
  // Whether `peer` was heard within half the liveness time: its threads run (a rank that
  // missed a rendezvous or a roll call for waiting on another, or for its own work), where
  // a silent one stopped. False for a rank this one does not exchange heartbeats with.
  bool answers(int peer) {
    const double quiet = silent_s(peer);
    return quiet >= 0 && quiet < liveness_s_ / 2;
  }
  double liveness_s() const { return liveness_s_; }
  // Heartbeats received so far, from every peer.
  long words_heard() {
    std::lock_guard<std::mutex> lock(mutex_);
    return words_heard_;
  }

 private:
  struct Peer {  // a rank this one exchanges heartbeats with
    int rank = 0;
    int word_in = 0, word_out = 0;
    MPI_Request receive = MPI_REQUEST_NULL, send = MPI_REQUEST_NULL;
    std::chrono::steady_clock::time_point heard;
  };
  void disarm();
  void run();
  void beat(std::chrono::steady_clock::time_point now, bool send);  // under mutex_
  void close_peers();
  // The thread's end when another rank speaks: quiet until the job ends, or until this
  // rank's work ends first (then nothing failed here).
  void quiet_until_end(std::unique_lock<std::mutex>& lock);

  MPI_Comm world_;
  int rank_ = 0;
  std::string rank_name_, what_;
  double seconds_ = 0, liveness_s_ = 0;
  bool heartbeats_ = false, armed_ = false, stop_ = false;
  int signals_at_arm_ = 0;
  long words_heard_ = 0;
  std::vector<Peer> peers_;
  std::chrono::steady_clock::time_point deadline_, next_send_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

}  // namespace mpipe
