// The executor on one process (MPI_COMM_SELF): the single-process trainer of the tests.
#pragma once
#include "mpipe/app/config.hpp"
#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe::test {

inline const Communicator& self_communicator() {
  static const Communicator self = Communicator::borrow(MPI_COMM_SELF);
  return self;
}

struct Trainer : Executor {
  explicit Trainer(const TrainConfig& config) : Executor(plan_run(config, self_communicator()), self_communicator()) {
    connect();
    allocate();
  }
};

}  // namespace mpipe::test
