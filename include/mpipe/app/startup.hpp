// Start-up: before the watchdog, a deadline from before MPI_Init until the watchdog's
// heartbeats run, and the fault points tests stop ranks at; after it, the phases every
// rank runs and agrees on (StartUp).
//
// From its construction on, the watchdog (pipeline/comm/watchdog.hpp) names a rank that stops
// answering. Before it, a rank stopped inside MPI_Init (or before it, or in the first
// collective) leaves the others waiting in Open MPI's start-up, which has no timeout. So a
// thread armed before MPI_Init gives start-up `--p2p-timeout` of run time (a stop of this
// rank's own does not count); when it passes, the ranks of this host look at their
// siblings (the launcher's other children here): a stopped one (process state T) is named
// by the lowest rank still running, in one line, and the job ends (exit 1). Where no rank
// of this host is stopped (the stopped one is on another host, which names it), the lowest
// rank here says so after a few seconds more, and ends the job.
#pragma once
#include <functional>

#include "mpipe/pipeline/comm/comm.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

// Arms the deadline: `seconds` of run time for `phase` ("MPI_Init"). Only system calls
// and a thread: MPI is not up yet.
void arm_startup_deadline(double seconds, const char* phase);
// Start-up reached `phase`; `seconds` (when > 0) replaces the deadline's time (the
// options, once parsed, may give another --p2p-timeout than the command line's words).
void startup_phase(const char* phase, double seconds = 0);
// The watchdog runs: the deadline's thread ends. Safe when never armed.
void disarm_startup_deadline();

// --p2p-timeout as the command line gives it ("--p2p-timeout S" or "--p2p-timeout=S"; the
// last one), read before MPI_Init; `fallback` when it does not (or not as a positive number).
double p2p_timeout_of(int argc, char** argv, double fallback);

// A test's fault: MPIPE_FAULT_STOP=PHASE@RANK stops (SIGSTOP) that world rank as it
// reaches that start-up phase, so a test can put a stopped rank in any of them
// (tests/mpi/startup_stopped.sh). `rank` < 0: this process's rank as the launcher gave it
// (before MPI_Init). Unset in every real run.
void fault_point(const char* phase, int rank = -1);

// Runs `phase` on every rank and agrees on the outcome, so that a rank that fails
// during set-up never leaves the others waiting in a collective. On failure the first
// failing rank prints its message and every rank returns the same exit code.
int agree(const Communicator& world, const std::function<void()>& phase);

// Start-up: phases every rank runs and agrees on (agree above), under one watchdog armed
// from the first to the last. A rank stopped anywhere in them (or before the first) leaves
// the others in a collective; the watchdog's heartbeats name it within --p2p-timeout.
// Without a deadline: a checkpoint's read or --partition time's measurement has no size
// known in advance to bound it by.
class StartUp {
 public:
  StartUp(const Communicator& world, Watchdog& watchdog);
  // Runs `body` as the phase `name`; its agreed exit code (0: go on).
  int phase(const char* name, const std::function<void()>& body);

 private:
  const Communicator& world_;
  Watchdog& watchdog_;
  Watchdog::Guard guard_;
};

}  // namespace mpipe
