// doctest's main for the `cuda` tests: MPI around the run, then each rank takes GPU
// (node-local rank modulo visible GPUs). Without a usable GPU the binary says why and
// exits 77, which ctest reports as skipped (SKIP_RETURN_CODE), never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>
#include <mpi.h>

#include <cstdio>
#include <string>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/sanitizer.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

int main(int argc, char** argv) {
  int provided = 0;  // MULTIPLE: the executor's communication progress thread
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  // Listing the cases (-ltc, as tests/cuda/filters_cover.sh does) needs no GPU.
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "-ltc" || std::string(argv[i]) == "--list-test-cases") {
      doctest::Context list(argc, argv);
      const int rc = list.run();
      MPI_Finalize();
      return rc;
    }
  std::string why;
  const int gpus = mpipe::cuda::device_count(&why);
  if (gpus == 0) {
    if (rank == 0) std::printf("SKIPPED: no usable GPU (%s)\n", why.c_str());
    MPI_Finalize();
    return 77;
  }
  // The binding resolve_device() gives a training run.
  mpipe::cuda::init(mpipe::Communicator::node(mpipe::Communicator::borrow(MPI_COMM_WORLD)).rank() % gpus);
  if (rank == 0) {
    const auto p = mpipe::cuda::properties(mpipe::cuda::device());
    std::printf("GPU %d: %s (sm_%d%d, %d SMs)\n", mpipe::cuda::device(), p.name.c_str(), p.major, p.minor,
                p.multiprocessors);
  }
  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("out", "/dev/null");
  int failed = context.run() != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
