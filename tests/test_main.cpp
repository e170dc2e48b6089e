// doctest's main for every test binary: MPI around the run (the executor needs it, as
// a singleton or under mpiexec), and a failed check makes the process exit non-zero on
// every rank.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include "mpipe/backend/cpu/blas_core.hpp"
#include "mpipe/core/sanitizer.hpp"

int main(int argc, char** argv) {
  mpipe::cpu::choose_blas_core(argv);  // the kernels mpipe itself runs, so results compare bitwise
  int provided = 0;  // MULTIPLE: the executor's communication progress thread
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  doctest::Context context(argc, argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // One report, from rank 0; the other ranks print only their failures (a check that
  // fails on rank 3 alone must say what it saw).
  if (rank != 0) context.setOption("minimal", true);
  int failed = context.run() != 0 ? 1 : 0;
  // A check that failed on any rank fails the run on every rank.
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
