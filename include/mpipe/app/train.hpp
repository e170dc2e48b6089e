// The train command.
#pragma once
#include "mpipe/app/config.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

// Runs training on `world` (MPI initialised); returns the exit code of this rank.
int run_train(const TrainConfig& config, const Communicator& world);

}  // namespace mpipe
