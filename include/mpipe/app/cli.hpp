// The command line: `mpipe train` (under mpirun/srun or alone), `mpipe plan` and
// `mpipe inspect`. Thin: parse options (CLI11; --config files in app/config_file.hpp),
// then hand them to the command (app/train.hpp, app/plan.hpp, app/inspect.hpp).
#pragma once
#include <CLI/CLI.hpp>

#include "mpipe/app/config.hpp"

namespace mpipe {

// Registers the options shared by train and plan on `command`, writing into `config`.
void add_train_options(CLI::App& command, TrainConfig& config);

// The whole program; returns the exit code (0 ok, 2 bad input, 1 internal error).
int run_main(int argc, char** argv);

}  // namespace mpipe
