// The command line: `mpipe train` (and, as the project grows, plan and inspect).
// Thin: parse options (CLI11, TOML config files), build, run, report.
#pragma once
#include <CLI/CLI.hpp>

#include "mpipe/pipeline/trainer.hpp"

namespace mpipe {

// Registers the train options on `command`, writing into `config`.
void add_train_options(CLI::App& command, TrainConfig& config);
// Applies the command's --config TOML file, if given, under the command-line values.
void apply_config_file(CLI::App& command);
// Runs training as configured; returns the process exit code.
int run_train(const TrainConfig& config);

// The whole program; returns the exit code (0 ok, 2 bad input, 1 internal error).
int run_main(int argc, char** argv);

}  // namespace mpipe
