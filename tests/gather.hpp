// Helpers of the test binaries that run the executor across ranks: the world
// communicator, and a run's parameters gathered to one rank.
#pragma once
#include <mpi.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe::test {

inline const Communicator& world() {
  static const Communicator w = Communicator::borrow(MPI_COMM_WORLD);
  return w;
}

// Replica `replica`'s parameter values in global layer order (tied copies left out),
// gathered to rank 0 of `comm`: each rank sends its entries' (layer, index, size) and
// values, rank 0 puts them in order (a rank may hold several model stages). Read from
// the host values, brought up to date first on a GPU.
inline std::vector<float> gather_params(Executor& e, const Communicator& comm, int replica = 0) {
  std::vector<float> mine;
  std::vector<int> heads;  // (layer, index, numel) per entry
  if (e.grid().replica() == replica) {
    e.download_state();
    const float* values = e.params().params().data();
    for (const ParamEntry& entry : e.params().entries())
      if (!entry.tied_copy) {
        mine.insert(mine.end(), values + entry.param_offset, values + entry.param_offset + entry.numel());
        heads.insert(heads.end(), {entry.layer, entry.index, static_cast<int>(entry.numel())});
      }
  }
  auto gather = [&](auto& local, MPI_Datatype type) {
    int count = static_cast<int>(local.size());
    std::vector<int> counts(comm.size()), offsets(comm.size());
    MPI_Gather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, comm.get());
    int total = 0;
    for (int r = 0; r < comm.size(); ++r) offsets[r] = total, total += counts[r];
    std::remove_reference_t<decltype(local)> all(comm.rank() == 0 ? total : 0);
    MPI_Gatherv(local.data(), count, type, all.data(), counts.data(), offsets.data(), type, 0, comm.get());
    return all;
  };
  const std::vector<float> values = gather(mine, MPI_FLOAT);
  const std::vector<int> all_heads = gather(heads, MPI_INT);
  if (comm.rank() != 0) return {};
  struct Entry {
    int layer, index;
    std::size_t at, size;
  };
  std::vector<Entry> entries;
  for (std::size_t i = 0, at = 0; i < all_heads.size(); i += 3) {
    const auto size = static_cast<std::size_t>(all_heads[i + 2]);
    entries.push_back({all_heads[i], all_heads[i + 1], at, size});
    at += size;
  }
  std::stable_sort(entries.begin(), entries.end(),
                   [](const Entry& a, const Entry& b) { return a.layer != b.layer ? a.layer < b.layer : a.index < b.index; });
  std::vector<float> ordered;
  ordered.reserve(values.size());
  for (const Entry& en : entries) ordered.insert(ordered.end(), values.begin() + static_cast<long>(en.at),
                                                 values.begin() + static_cast<long>(en.at + en.size));
  return ordered;
}

}  // namespace mpipe::test
