// Deadlines for collective waits: a rendezvous that names missing ranks, and a watchdog
// thread that ends the job when guarded work outlives its deadline.
#include "mpipe/pipeline/comm/watchdog.hpp"

#include "mpipe/core/run_clock.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

namespace mpipe {

std::atomic<int> stop_signals_received{0};

namespace {

constexpr int rendezvous_tag = 32001;  // on the world communicator, where stages send nothing
constexpr int roll_call_tag = 32002;
constexpr int heartbeat_tag = 32003;

// The time an abort waits, in a job on several hosts, for mpirun to find a lost node
// itself (end_job); mpirun's keepalives are to give up on a silent node within
// --p2p-timeout plus this (process.hpp: mpirun_lost_node_s).
constexpr double abort_delay_across_hosts_s = 3;

// Another rank names the failure and ends the job (or has): this one says nothing and
// waits long enough for that to happen (the grace of a roll call, and 5 s for mpirun),
// ending the job itself only if it has not.
[[noreturn]] void stay_quiet(MPI_Comm world, double grace_s) {
  std::this_thread::sleep_for(std::chrono::duration<double>(grace_s + 5));
  MPI_Abort(world, 1);
  std::abort();  // not reached
}

[[noreturn]] void end_job(MPI_Comm world, const std::string& line) {
  std::fflush(stdout);
  std::fprintf(stderr, "mpipe: error: %s\n", line.c_str());
  std::fflush(stderr);
  // Across hosts the silent rank may be a whole node gone. mpirun must give up on that
  // node's daemon (its TCP keepalives) before it is asked to kill the ranks there: a kill
  // sent towards it first waits on TCP's retransmissions, minutes. So the abort waits a
  // little for mpirun to find the node itself (it then ends the job, this rank with it).
  if (host_count() > 1) std::this_thread::sleep_for(std::chrono::duration<double>(abort_delay_across_hosts_s));
  MPI_Abort(world, 1);
  std::abort();  // not reached
}

using Clock = std::chrono::steady_clock;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// "rank 3" or "ranks 3, 5, …" (at most 8 named), each with its host in a job on several
// ("rank 3 on node7").
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() > 1 ? "ranks " : "rank ";
  for (std::size_t i = 0; i < ranks.size() && i < 8; ++i) s += cat(i ? ", " : "", ranks[i], on_host(ranks[i]));
  return ranks.size() > 8 ? s + ", …" : s;
}

// Tests `requests` until all are complete or the deadline passes; false on the latter.
bool wait_until(std::vector<MPI_Request>& requests, Clock::time_point deadline) {
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return true;
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// Tests `requests` until all are complete or `clock` has run `seconds`; false on the latter.
bool wait_run(std::vector<MPI_Request>& requests, const RunClock& clock, double seconds) {
  for (;;) {
    int done = 0;
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (done) return true;
    if (clock.seconds() > seconds) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

}  // namespace

void rendezvous(const Communicator& world, const std::string& what, double timeout_s, Watchdog* liveness) {
  const int size = world.size();
  if (size == 1) return;
  // Deadlines of time this rank ran: a stop of its own names nobody (RunClock).
  const RunClock run;
  int token = 1;
  if (world.rank() == 0) {
    std::vector<int> arrived(static_cast<std::size_t>(size - 1), 0);
    std::vector<MPI_Request> requests(static_cast<std::size_t>(size - 1));
    for (int r = 1; r < size; ++r)
      MPI_Irecv(&arrived[static_cast<std::size_t>(r - 1)], 1, MPI_INT, r, rendezvous_tag, world.get(),
                &requests[static_cast<std::size_t>(r - 1)]);
    if (!wait_run(requests, run, timeout_s)) {
      const auto not_arrived = [&] {
        std::vector<int> missing;
        for (int r = 1; r < size; ++r)
          if (!arrived[static_cast<std::size_t>(r - 1)]) missing.push_back(r);
        return missing;
      };
      std::vector<int> missing = not_arrived();
      std::string silence;
      // A stopped rank keeps the ranks that wait for it (the stages after it) from the
      // rendezvous too, their heartbeats going on. With heartbeats, name the silent ones
      // (as roll_call does), waiting up to the liveness time more for one to prove it.
      if (!missing.empty() && liveness && liveness->heartbeats()) {
        const RunClock more;
        for (;;) {
          std::vector<int> silent;
          double quiet = 0;
          for (const int r : missing) {
            if (liveness->answers(r)) continue;
            silent.push_back(r);
            quiet = std::max(quiet, liveness->silent_s(r));
          }
          if (!silent.empty()) {
            missing = silent;
            silence = cat(" and stopped answering (no heartbeat for ", std::round(quiet * 10) / 10, " s)");
            break;
          }
          if (more.seconds() > liveness->liveness_s() || wait_run(requests, more, more.seconds() + 0.05)) break;
        }
        missing = silence.empty() ? not_arrived() : missing;
      }
      // Every word is in (the last ones completed after the test): nobody is missing.
      if (!missing.empty())
        end_job(world.get(), cat(rank_list(missing), " did not reach ", what, " within ", timeout_s, " s (--p2p-timeout)",
                                 silence.empty() ? ": stopped or hung" : silence, "; ending the job"));
      if (!wait_run(requests, run, 2 * timeout_s))
        end_job(world.get(), cat("rank 0: the ranks' words at ", what, " arrived but did not complete; ending the job"));
    }
    for (int r = 1; r < size; ++r)
      MPI_Isend(&token, 1, MPI_INT, r, rendezvous_tag, world.get(), &requests[static_cast<std::size_t>(r - 1)]);
    if (!wait_run(requests, run, 2 * timeout_s))
      end_job(world.get(), cat("rank 0: a rank stopped answering right after reaching ", what, "; ending the job"));
  } else {
    int go = 0;
    std::vector<MPI_Request> requests(2);
    MPI_Isend(&token, 1, MPI_INT, 0, rendezvous_tag, world.get(), &requests[0]);
    MPI_Irecv(&go, 1, MPI_INT, 0, rendezvous_tag, world.get(), &requests[1]);
    // Rank 0 speaks first about missing ranks. Rank 0 itself missing: its heartbeats say
    // so within the timeout; without them, only waiting longer than it would take to speak.
    const bool heartbeats = liveness && liveness->heartbeats();
    const double limit = 2 * timeout_s + 5;
    for (;;) {
      if (wait_until(requests, after(0.05))) return;
      if (heartbeats && liveness->silent_s(0) >= timeout_s)
        roll_call(world.get(), cat(rank_on_host(world.rank()), ": waiting for ", rank_on_host(0), " at ", what, " (no heartbeat for ", timeout_s,
                                   " s, --p2p-timeout)"),
                  std::min(timeout_s, 3.0), liveness);
      if (run.seconds() > limit)
        end_job(world.get(), cat(rank_on_host(world.rank()), ": ", rank_on_host(0), " did not answer at ", what, " within ", limit,
                                 " s: stopped or hung; ending the job"));
    }
  }
}

Watchdog::Watchdog(const Communicator& world, std::string rank_name, double liveness_s)
    : world_(world.get()), rank_(world.rank()), rank_name_(std::move(rank_name)), liveness_s_(liveness_s) {
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  heartbeats_ = level == MPI_THREAD_MULTIPLE && world.size() > 1 && liveness_s > 0;
  if (heartbeats_) {
    const Clock::time_point now = Clock::now();  // a peer has the liveness time for its first word
    if (rank_ == 0)
      for (int r = 1; r < world.size(); ++r) peers_.push_back(Peer{r, 0, 0, MPI_REQUEST_NULL, MPI_REQUEST_NULL, now});
    else
      peers_.push_back(Peer{0, 0, 0, MPI_REQUEST_NULL, MPI_REQUEST_NULL, now});
  }
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
  if (heartbeats_) note_no_wakes();  // no gap of this thread's is time not run any more
  close_peers();
}

Watchdog::Guard Watchdog::arm(std::string what, double seconds) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    what_ = std::move(what);
    seconds_ = seconds;
    deadline_ = std::isfinite(seconds) ? after(seconds) : Clock::time_point::max();
    // The ranks arm together (after a collective): a peer has the liveness time from here
    // for its next word, whatever it did before (it may have built its watchdog later).
    const Clock::time_point now = Clock::now();
    for (Peer& p : peers_) p.heard = now;
    signals_at_arm_ = stop_signals_received.load();
    armed_ = true;
  }
  wake_.notify_all();
  return Guard(*this);
}

void Watchdog::doing(std::string what) {
  std::lock_guard<std::mutex> lock(mutex_);
  what_ = std::move(what);
}

void Watchdog::rename(std::string rank_name) {
  std::lock_guard<std::mutex> lock(mutex_);
  rank_name_ = std::move(rank_name);
}

double Watchdog::silent_s(int peer) {
  std::lock_guard<std::mutex> lock(mutex_);
  // The words that came since the thread last looked count first: a caller woken late
  // (this rank was the stopped one) sees its peers as they are, not as they were; and the
  // time this rank did not run that the thread has not woken to note counts against none.
  const Clock::time_point now = Clock::now();
  if (heartbeats_) beat(now, false);
  for (const Peer& p : peers_)
    if (p.rank == peer) return std::chrono::duration<double>(now - p.heard - unnoted_gap(now)).count();
  return -1;
}

void Watchdog::quiet_until_end(std::unique_lock<std::mutex>& lock) {
  // As stay_quiet, but a job that finishes its work here meanwhile (the destructor stops
  // this thread) was not failed by this rank: its exit code stays the run's.
  if (wake_.wait_for(lock, std::chrono::duration<double>(std::min(liveness_s_, 3.0) + 5), [this] { return stop_; })) return;
  lock.unlock();
  MPI_Abort(world_, 1);
}

void Watchdog::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  armed_ = false;
}

// A heartbeat that arrives after its receive was cancelled waits, unmatched, for the
// next Watchdog's receive on the same tag, where it counts as one word more of a rank
// that was alive: harmless.
void Watchdog::close_peers() {
  for (Peer& p : peers_) {
    if (p.receive != MPI_REQUEST_NULL) {
      MPI_Cancel(&p.receive);
      MPI_Wait(&p.receive, MPI_STATUS_IGNORE);
    }
    // A send not yet taken by its peer goes on by itself (a few bytes, sent eagerly).
    if (p.send != MPI_REQUEST_NULL) MPI_Request_free(&p.send);
  }
}

void Watchdog::beat(Clock::time_point now, bool send) {
  for (Peer& p : peers_) {
    int done = 0;
    if (p.receive == MPI_REQUEST_NULL)
      MPI_Irecv(&p.word_in, 1, MPI_INT, p.rank, heartbeat_tag, world_, &p.receive);
    for (;;) {  // every word that has come: the peer is alive
      MPI_Test(&p.receive, &done, MPI_STATUS_IGNORE);
      if (!done) break;
      p.heard = now;
      ++words_heard_;
      MPI_Irecv(&p.word_in, 1, MPI_INT, p.rank, heartbeat_tag, world_, &p.receive);
    }
    if (send) {
      if (p.send != MPI_REQUEST_NULL) MPI_Test(&p.send, &done, MPI_STATUS_IGNORE);
      if (p.send == MPI_REQUEST_NULL) MPI_Isend(&p.word_out, 1, MPI_INT, p.rank, heartbeat_tag, world_, &p.send);
    }
  }
}

void Watchdog::run() {
  // Words every quarter of the liveness time (at most 1 s apart), polled at least as often,
  // armed or not; judgements (a silent peer, the deadline) only while armed.
  const auto period = std::chrono::duration<double>(std::clamp(liveness_s_ / 4, 0.05, 1.0));
  const auto poll = std::chrono::duration_cast<Clock::duration>(period / 4);
  std::unique_lock<std::mutex> lock(mutex_);
  next_send_ = Clock::now();
  Clock::time_point last_wake = next_send_;
  while (!stop_) {
    // Without heartbeats only a deadline can fire: none (unarmed, or armed without one), sleep.
    if (!heartbeats_ && (!armed_ || deadline_ == Clock::time_point::max())) {
      wake_.wait(lock);
      continue;
    }
    const Clock::time_point until =
        !heartbeats_ ? deadline_ : armed_ ? std::min(deadline_, Clock::now() + poll) : Clock::now() + poll;
    wake_.wait_until(lock, until);
    if (stop_) break;
    const Clock::time_point now = Clock::now();
    // Woken late: with heartbeats this thread runs every `poll` (sooner when notified);
    // without, it sleeps to the deadline. Beyond that, the process did not run (stopped,
    // wherever in this loop the stop came, or starved): that time counts against no peer
    // and no deadline, here (the peers' silence, the guard's deadline) or in any wait
    // (RunClock). The words that came meanwhile are read below.
    const Clock::duration late = heartbeats_ ? now - last_wake - poll : now - until;
    const Clock::duration gap = late > not_run_threshold ? late : Clock::duration::zero();
    last_wake = now;
    if (gap > Clock::duration::zero()) {
      for (Peer& p : peers_) p.heard += gap;
      if (deadline_ != Clock::time_point::max()) deadline_ += gap;
    }
    if (!heartbeats_) note_not_run(now, gap);
    if (heartbeats_) {
      // The gap and the wake at once: a reader sees the gap in one or the other, never neither.
      note_wake(now, poll, gap);
      const bool send = now >= next_send_;
      if (send) next_send_ = now + std::chrono::duration_cast<Clock::duration>(period);
      beat(now, send);
    }
    if (!armed_) continue;
    for (const Peer& p : peers_) {
      const double silent = std::chrono::duration<double>(now - p.heard).count();
      if (silent < liveness_s_) continue;
      const std::string context = cat(rank_name_, ": ", what_);
      // The job is being torn down (another rank spoke): wait for its end, quietly.
      if (stop_signals_received.load() != signals_at_arm_) {
        quiet_until_end(lock);
        return;
      }
      if (rank_ == 0)  // it hears every rank: it names the silent one
        end_job(world_, cat(rank_list({p.rank}), " stopped answering (no heartbeat for ", liveness_s_, " s, --p2p-timeout). Seen by ",
                            context, "; ending the job"));
      lock.unlock();  // roll_call asks this watchdog who is alive
      roll_call(world_, context, std::min(liveness_s_, 3.0), this);  // rank 0 is silent: the others name it
    }
    if (now >= deadline_) {
      lock.unlock();
      roll_call(world_, cat(rank_name_, ": ", what_, " did not finish within ", std::round(seconds_ * 10) / 10, " s"),
                std::min(seconds_, 3.0), this);
    }
  }
}

void roll_call(MPI_Comm world, const std::string& context, double grace_s, Watchdog* liveness) {
  const int signals_at_entry = stop_signals_received.load();
  int size = 1, me = 0;
  MPI_Comm_size(world, &size);
  MPI_Comm_rank(world, &me);
  // Each word is the time its roll call began (ms of the wall clock): a rank that was
  // stopped and resumed (mpirun sends SIGCONT before it kills) finds words older than
  // its own roll call by more than the grace time, and knows the others have named it.
  const auto now_ms = [] {
    return static_cast<long long>(
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count());
  };
  std::vector<long long> heard(static_cast<std::size_t>(size), 0), token(1, now_ms());
  // Or: this rank did not run for the liveness time or longer (its heartbeats stopped for
  // as long, which proves it silent to the others), and a word began before it resumed:
  // that roll call found it silent and names it, however soon mpirun's SIGCONT came.
  long long resumed_ms = std::numeric_limits<long long>::min();
  if (liveness && liveness->heartbeats()) {
    const Clock::time_point now = Clock::now();
    const NotRun not_run = not_run_at(now);
    if (not_run.last_gap >= std::chrono::duration<double>(liveness->liveness_s()))
      resumed_ms = token[0] - std::chrono::duration_cast<std::chrono::milliseconds>(now - not_run.last_gap_end).count();
  }
  std::vector<MPI_Request> receives, sends;
  for (int r = 0; r < size; ++r) {
    if (r == me) continue;
    receives.emplace_back();
    sends.emplace_back();
    MPI_Irecv(&heard[static_cast<std::size_t>(r)], 1, MPI_LONG_LONG, r, roll_call_tag, world, &receives.back());
    MPI_Isend(token.data(), 1, MPI_LONG_LONG, r, roll_call_tag, world, &sends.back());
  }
  // The grace waits for ranks whose own waits have not timed out yet. With heartbeats it
  // ends sooner once it has all it needs: a rank silent for the whole liveness time (the
  // same proof that has rank 0 name one while armed), and no rank below this one that may
  // still speak (a rank below is heard, or silent as long). Ranks above stay quiet when
  // they hear this one; they are not named, whatever they are doing.
  const bool early = liveness && liveness->heartbeats();
  std::vector<int> stopped;  // proven silent, for the early end
  const auto settled = [&] {
    stopped.clear();
    for (int r = 0, i = 0; r < size; ++r) {
      if (r == me) continue;
      int done = 0;  // the word, if in, is read only from a completed receive
      MPI_Test(&receives[static_cast<std::size_t>(i++)], &done, MPI_STATUS_IGNORE);
      if (done) continue;
      const double quiet = liveness->silent_s(r);
      if (quiet >= liveness->liveness_s())
        stopped.push_back(r);
      else if (r < me)
        return false;  // may still speak, before this rank
    }
    return !stopped.empty();
  };
  const Clock::time_point grace_end = after(grace_s);
  bool ended_early = false;
  for (Clock::time_point next_look = Clock::now();;) {
    if (wait_until(receives, std::min(grace_end, after(0.02)))) break;
    if (Clock::now() > grace_end) break;
    if (early && Clock::now() >= next_look) {
      if ((ended_early = settled())) break;
      next_look = after(0.05);
    }
  }
  heard[static_cast<std::size_t>(me)] = token[0];
  std::vector<int> silent, running;  // not in the roll call: stopped, or their heartbeats go on
  int lowest_alive = size;             // of the ranks in the roll call: the one that speaks
  bool named = false;  // this rank was the silent one, and is heard only now
  // Not in the roll call but heard by the heartbeats just now: its threads run (its own
  // wait has not timed out yet, or its work is stuck).
  const bool heartbeats = liveness && liveness->heartbeats();
  for (int r = 0; r < size; ++r) {
    const long long word = heard[static_cast<std::size_t>(r)];
    if (word != 0) {
      lowest_alive = std::min(lowest_alive, r);
      if (token[0] - word > static_cast<long long>(grace_s * 1000) || (r != me && word < resumed_ms)) named = true;
      continue;
    }
    if (ended_early) continue;  // named: the proven ones alone
    (heartbeats && liveness->answers(r) ? running : silent).push_back(r);
  }
  if (ended_early) silent = stopped;
  // Across hosts, ranks proven silent on other hosts are a node gone: mpirun's keepalives
  // may have found it first and begun the teardown (its SIGTERM), but no rank has named
  // them; this one still does, within the second mpirun gives before its SIGKILL.
  const bool lost_node = ended_early && host_count() > 1 && !silent.empty() &&
                         std::all_of(silent.begin(), silent.end(), [&](int r) { return host_of(r) != host_of(me); });
  // Another rank speaks and ends the job; or it has (mpirun's SIGTERM of the teardown).
  if (lowest_alive != me || named || (stop_signals_received.load() != signals_at_entry && !lost_node))
    stay_quiet(world, grace_s);
  // Stopped ranks first; a rank whose heartbeats go on is named only when no rank stopped
  // (its work is stuck: a hang inside it), as a rank still in a wait of its own is not.
  if (silent.empty() && !running.empty())
    end_job(world, cat(rank_list(running), " stopped answering (its heartbeats go on: stuck in its own work). Seen by ",
                       context, "; ending the job"));
  if (silent.empty()) end_job(world, cat(context, "; every rank answers (a hung file system, or a deadlock); ending the job"));
  end_job(world, cat(rank_list(silent), " stopped answering (",
                     ended_early ? cat("no heartbeat for ", liveness->liveness_s(), " s, --p2p-timeout")
                                 : cat("silent for ", grace_s, " s after the deadline"),
                     "). Seen by ", context, "; ending the job"));
}

}  // namespace mpipe
