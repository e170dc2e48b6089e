// Start-up before the watchdog: the deadline from before MPI_Init to the watchdog's first
// heartbeat, and the tests' fault points; after it, the phases every rank agrees on.
#include "mpipe/app/startup.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <iterator>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mpipe/app/process.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

namespace {

using Clock = std::chrono::steady_clock;

// The variables a launcher gives each rank its world rank in, in the order looked at.
constexpr const char* rank_variables[] = {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"};

// A rank's number from its environment (NUL-separated NAME=VALUE entries), or -1.
int rank_in(const std::string& environment) {
  for (const char* name : rank_variables) {
    const std::string key = cat(name, "=");
    for (std::size_t at = 0; at < environment.size();) {
      const std::size_t end = std::min(environment.find('\0', at), environment.size());
      if (environment.compare(at, key.size(), key) == 0) return std::atoi(environment.c_str() + at + key.size());
      at = end + 1;
    }
  }
  return -1;
}

int own_rank() {
  for (const char* name : rank_variables)
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return -1;
}

// How many ranks the launcher started on this host (0: it does not say).
int local_ranks() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* value = std::getenv(name)) return std::atoi(value);
  return 0;
}

// A process of this host that the launcher started beside this one: its pid, world rank
// and whether it is stopped.
struct Sibling {
  int pid = 0, rank = -1;
  bool stopped = false;
};

// The state letter and parent of process `pid` from /proc/PID/stat ("pid (comm) S ppid ...";
// comm may hold spaces and parentheses: the fields follow its last ')').
bool read_stat(int pid, char* state, int* parent) {
  std::ifstream file(cat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const std::size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  return std::sscanf(text.c_str() + close + 1, " %c %d", state, parent) == 2;
}

// The launcher's other children on this host that are ranks (their environment names one).
std::vector<Sibling> siblings() {
  std::vector<Sibling> out;
  const int parent = static_cast<int>(::getppid()), me = static_cast<int>(::getpid());
  DIR* proc = ::opendir("/proc");
  if (!proc) return out;
  while (const dirent* entry = ::readdir(proc)) {
    const int pid = std::atoi(entry->d_name);
    char state = 0;
    int their_parent = 0;
    if (pid <= 0 || pid == me || !read_stat(pid, &state, &their_parent) || their_parent != parent) continue;
    if (state == 'Z' || state == 'X') continue;  // gone
    std::ifstream file(cat("/proc/", pid, "/environ"));
    const std::string environment((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    const int rank = rank_in(environment);
    if (rank >= 0) out.push_back({pid, rank, state == 'T' || state == 't'});
  }
  ::closedir(proc);
  return out;
}

struct Deadline {
  std::mutex mutex;
  std::condition_variable wake;
  bool done = false;
  double seconds = 0;
  std::string phase;
  std::thread thread;
};
Deadline* g_deadline = nullptr;  // armed in run_main, before MPI_Init, and ended by run_train

// Ends this process and, through the launcher, the job: MPI_Abort once MPI is up,
// otherwise an exit (the launcher ends a job whose rank exits before MPI_Init completes).
[[noreturn]] void end_job() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// Start-up without a stopped rank on this host ends this much run time after the
// deadline, and not before this much in all: the host that has the stopped rank speaks
// first, and a slow start of a healthy job (a loaded machine, many ranks) is let be.
constexpr double unexplained_after_s = 3, unexplained_at_least_s = 10;

// The deadline passed (`seconds` run in `phase`): a stopped rank of this host is named;
// without one, `explained` false, this host's lowest rank says none of it is stopped.
// Either way one line from one rank here, and the job ends.
[[noreturn]] void give_up(const std::string& phase, double seconds, const std::vector<Sibling>& others) {
  const int me = own_rank();
  std::vector<Sibling> stopped;
  int speaker = me;  // the lowest rank of this host still running
  for (const Sibling& s : others)
    if (s.stopped) stopped.push_back(s);
    else if (s.rank >= 0 && (speaker < 0 || s.rank < speaker)) speaker = s.rank;
  std::sort(stopped.begin(), stopped.end(), [](const Sibling& a, const Sibling& b) { return a.rank < b.rank; });
  // A rank of this host has ended already (no rank ends in start-up but to end the job:
  // the lowest, whose deadline passed a moment before this one's, spoke and aborted), or
  // another rank here speaks: it ends the job; end anyway if it does not.
  const bool one_ended = local_ranks() > 0 && static_cast<int>(others.size()) + 1 < local_ranks();
  if (speaker != me || one_ended) {
    std::this_thread::sleep_for(std::chrono::seconds(5));
    end_job();
  }
  std::string line;
  if (!stopped.empty()) {
    std::string ranks, pids;
    for (std::size_t i = 0; i < stopped.size(); ++i) {
      ranks += cat(i ? ", " : "", stopped[i].rank);
      pids += cat(i ? ", " : "", stopped[i].pid);
    }
    const bool many = stopped.size() > 1;
    line = cat(many ? "ranks " : "rank ", ranks, " stopped answering (", many ? "pids " : "pid ", pids, " on ", this_host(),
               many ? " are" : " is", " stopped: SIGSTOP?). Seen by rank ", me, ": start-up (", phase,
               ") did not finish within ", seconds, " s (--p2p-timeout); ending the job");
  } else {
    line = cat("rank ", me, " on ", this_host(), ": start-up (", phase, ") did not finish within ", seconds,
               " s (--p2p-timeout) and no rank of this host is stopped: a rank on another host stopped, was lost or "
               "could not start; ending the job");
  }
  std::fflush(stdout);
  std::fprintf(stderr, "mpipe: error: %s\n", line.c_str());
  std::fflush(stderr);
  end_job();
}

void run_deadline(Deadline& d) {
  // Run time, in slices: a gap between two wakes much longer than the slice is time this
  // process did not run (stopped itself, then resumed), which counts against no one.
  constexpr auto slice = std::chrono::milliseconds(100), not_run = std::chrono::milliseconds(250);
  double ran = 0, looked = -1;
  Clock::time_point last = Clock::now();
  std::unique_lock<std::mutex> lock(d.mutex);
  while (!d.done) {
    d.wake.wait_for(lock, slice);
    if (d.done) return;
    const Clock::time_point now = Clock::now();
    if (now - last < slice + not_run) ran += std::chrono::duration<double>(now - last).count();
    last = now;
    // Past the deadline: the host's ranks, looked at every half second.
    if (ran < d.seconds || ran - looked < 0.5) continue;
    looked = ran;
    const std::string phase = d.phase;
    const double seconds = d.seconds;
    lock.unlock();
    const std::vector<Sibling> others = siblings();
    const bool stopped = std::any_of(others.begin(), others.end(), [](const Sibling& s) { return s.stopped; });
    if (stopped || ran >= std::max(seconds + unexplained_after_s, unexplained_at_least_s)) give_up(phase, seconds, others);
    lock.lock();
  }
}

}  // namespace

void arm_startup_deadline(double seconds, const char* phase) {
  if (g_deadline) return;
  g_deadline = new Deadline;  // lives until disarmed
  g_deadline->seconds = seconds;
  g_deadline->phase = phase;
  g_deadline->thread = std::thread([d = g_deadline] { run_deadline(*d); });
}

void startup_phase(const char* phase, double seconds) {
  if (!g_deadline) return;
  std::lock_guard<std::mutex> lock(g_deadline->mutex);
  g_deadline->phase = phase;
  if (seconds > 0) g_deadline->seconds = seconds;
}

void disarm_startup_deadline() {
  if (!g_deadline) return;
  {
    std::lock_guard<std::mutex> lock(g_deadline->mutex);
    g_deadline->done = true;
  }
  g_deadline->wake.notify_all();
  g_deadline->thread.join();
  delete g_deadline;
  g_deadline = nullptr;
}

double p2p_timeout_of(int argc, char** argv, double fallback) {
  static constexpr const char* option = "--p2p-timeout";
  double given = fallback;  // the last one, as the options' parser takes it
  for (int i = 1; i < argc; ++i) {
    const char* value = nullptr;
    if (std::strcmp(argv[i], option) == 0 && i + 1 < argc) value = argv[i + 1];
    else if (std::strncmp(argv[i], option, std::strlen(option)) == 0 && argv[i][std::strlen(option)] == '=')
      value = argv[i] + std::strlen(option) + 1;
    if (!value) continue;
    char* end = nullptr;
    const double seconds = std::strtod(value, &end);
    if (end != value && *end == '\0' && seconds > 0 && seconds < 1e9) given = seconds;
  }
  return given;
}

void fault_point(const char* phase, int rank) {
  static const std::string fault = [] {
    const char* value = std::getenv("MPIPE_FAULT_STOP");
    return std::string(value ? value : "");
  }();
  if (!fault.empty() && fault == cat(phase, "@", rank < 0 ? own_rank() : rank)) std::raise(SIGSTOP);
}

int agree(const Communicator& world, const std::function<void()>& phase) {
  int code = 0;
  std::string message;
  try {
    phase();
  } catch (const UserError& e) {
    code = exit_user_error;
    message = cat("mpipe: error: ", e.what(), "; hint: ", e.hint());
  } catch (const std::exception& e) {
    code = exit_internal_error;
    message = cat("mpipe: internal error on ", rank_on_host(world.rank()), ": ", e.what());
  }
  // The worst code wins (internal over user error); the lowest rank with it speaks.
  int worst = code;
  world.allreduce(std::span<int>(&worst, 1), Reduce::max);
  if (worst == 0) return 0;
  int speaker = code == worst ? world.rank() : world.size();
  world.allreduce(std::span<int>(&speaker, 1), Reduce::min);
  if (speaker == world.rank()) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", message.c_str());
  }
  return worst;
}

StartUp::StartUp(const Communicator& world, Watchdog& watchdog)
    : world_(world), watchdog_(watchdog), guard_(watchdog.arm("start-up", std::numeric_limits<double>::infinity())) {}

int StartUp::phase(const char* name, const std::function<void()>& body) {
  watchdog_.doing(cat("start-up (", name, ")"));
  fault_point(name, world_.rank());
  return agree(world_, body);
}

}  // namespace mpipe
