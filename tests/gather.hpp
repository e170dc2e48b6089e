// Helpers of the test binaries that run the executor across ranks: the world
// communicator, and a run's parameters gathered to one rank.
#pragma once
#include <mpi.h>

#include <vector>

#include "mpipe/pipeline/executor.hpp"

namespace mpipe::test {

inline const Communicator& world() {
  static const Communicator w = Communicator::borrow(MPI_COMM_WORLD);
  return w;
}

// Replica `replica`'s parameter values in global layer order (tied copies left out),
// gathered to rank 0 of `comm` in rank order: with --rank-order pipeline a replica's
// stages are in order. Read from the host values, brought up to date first on a GPU.
inline std::vector<float> gather_params(Executor& e, const Communicator& comm, int replica = 0) {
  std::vector<float> mine;
  if (e.grid().replica() == replica) {
    e.download_state();
    const float* values = e.params().params().data();
    for (const ParamEntry& entry : e.params().entries())
      if (!entry.tied_copy)
        mine.insert(mine.end(), values + entry.param_offset, values + entry.param_offset + entry.numel());
  }
  int count = static_cast<int>(mine.size());
  std::vector<int> counts(comm.size()), offsets(comm.size());
  MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm.get());
  int total = 0;
  for (int r = 0; r < comm.size(); ++r) offsets[r] = total, total += counts[r];
  std::vector<float> all(comm.rank() == 0 ? total : 0);
  MPI_Gatherv(mine.data(), count, MPI_FLOAT, all.data(), counts.data(), offsets.data(), MPI_FLOAT, 0, comm.get());
  return all;
}

}  // namespace mpipe::test
