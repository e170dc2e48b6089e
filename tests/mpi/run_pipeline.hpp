// The mpi tests' one training run: a config on the first `ranks` world ranks, its losses,
// norms and parameters gathered on rank 0 of the run; and the peak activation memory of
// a run against its plan's. Shared by the test files of mpi_tests.
#pragma once
#include <cstdio>
#include <vector>

#include <mpi.h>

#include "gather.hpp"
#include "mpipe/app/config.hpp"
#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe::test {

struct RunResult {
  std::vector<double> losses, norms;
  std::vector<int> skipped;
  std::int64_t speculated = 0, rolled_back = 0;  // --overlap-steps
  std::vector<float> params;  // every parameter in global layer order (rank 0 of the run)
  std::vector<float> replica_params;  // the same gathered from the last replica
  std::vector<std::vector<float>> tied;  // on the last stage: (owner values, copy values)
  std::size_t state_floats = 0, store_floats = 0;  // rank 0's optimizer state and parameter store
  bool prefetching = false;  // rank 0 read each next batch during the step before (--prefetch)
  std::int64_t prefetched = 0;  // batches it so read and used
};

// Runs `config` on the first `ranks` world ranks; the others sit this one out.
inline RunResult run(const TrainConfig& config, int ranks) {
  const Communicator sub = Communicator::split(world(), world().rank() < ranks ? 0 : MPI_UNDEFINED, world().rank());
  RunResult result;
  if (sub.null()) return result;
  try {
    Executor e(plan_run(config, sub), sub);
    e.connect();
    e.allocate();
    auto take = [&](const StepResult& r) {
      // Results come in step order, each once, with or without --overlap-steps.
      if (r.step != static_cast<std::int64_t>(result.losses.size())) throw Error(cat("result of step ", r.step, " out of order"));
      result.losses.push_back(r.loss);
      result.norms.push_back(r.grad_norm);
      result.skipped.push_back(r.skipped ? 1 : 0);
    };
    for (int step = 0; step < config.steps; ++step) {
      if (!config.pipeline.overlap_steps) {
        take(e.step(step));
        continue;
      }
      for (const StepResult& r : e.advance(step)) take(r);
      if (step % 3 == 1)  // a settle in the middle, as before a checkpoint
        if (const auto r = e.settle()) take(*r);
    }
    if (const auto r = e.settle()) take(*r);
    result.speculated = e.speculated();
    result.rolled_back = e.rolled_back();
    result.params = gather_params(e, sub, 0);
    result.replica_params = gather_params(e, sub, e.grid().replicas() - 1);
    result.state_floats = e.optimizer().state(0).size();
    result.store_floats = e.params().params().size();
    result.prefetching = e.prefetching();
    result.prefetched = e.prefetched();
  } catch (const std::exception& e) {
    // The other ranks would wait forever in a collective: fail the whole run now.
    std::fprintf(stderr, "rank %d: %s\n", world().rank(), e.what());
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  return result;
}


struct PeakMemory {
  int stage = 0;
  double measured = 0, predicted = 0;
};
inline PeakMemory peak_memory(const TrainConfig& c) {
  const Plan plan = plan_run(c, world());
  Executor exec(plan, world());
  exec.connect();
  exec.allocate();
  for (int step = 0; step < 2; ++step) exec.step(step);
  return {exec.grid().stage(), static_cast<double>(exec.peak_activation_bytes()), plan.activation_bytes(exec.grid().stage())};
}

}  // namespace mpipe::test
