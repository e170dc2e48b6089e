// A rank stopped (SIGSTOP) just before a rendezvous, the wait that opens every checkpoint
// and the end of training: the ranks still answering must name it within the timeout,
// rank 0 included, which only its heartbeats can tell apart from a slow rank 0.
// With WAITER, that rank first waits for a word from VICTIM (as the stage after a stopped
// one waits for its activation), its heartbeats going on: it misses the rendezvous too,
// and must not be named.
// Usage: mpiexec -n N stopped_rank VICTIM TIMEOUT_S [WAITER]. Never exits 0: the job ends
// by MPI_Abort with one line naming VICTIM (stopped_rank.sh checks the line and the time).
#include <mpi.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>

#include "mpipe/pipeline/comm/watchdog.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr, "usage: stopped_rank VICTIM TIMEOUT_S [WAITER]\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const int victim = std::atoi(argv[1]);
  const double timeout = std::atof(argv[2]);
  const int waiter = argc == 4 ? std::atoi(argv[3]) : -1;
  {
    const mpipe::Communicator world = mpipe::Communicator::borrow(MPI_COMM_WORLD);
    mpipe::Watchdog watchdog(world, mpipe::cat("rank ", world.rank()), timeout);
    world.barrier();  // the watchdogs start together, as in a run
    int word = 0;
    if (world.rank() == victim) {
      std::raise(SIGSTOP);
      if (waiter >= 0) MPI_Send(&word, 1, MPI_INT, waiter, 7, MPI_COMM_WORLD);
    }
    if (world.rank() == waiter) MPI_Recv(&word, 1, MPI_INT, victim, 7, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    mpipe::rendezvous(world, "the test's rendezvous", timeout, &watchdog);
  }
  std::fprintf(stderr, "the rendezvous passed with rank %d stopped\n", victim);
  MPI_Finalize();
  return 0;
}
