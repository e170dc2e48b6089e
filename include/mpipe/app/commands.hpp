// The command line: `mpipe train` (under mpirun/srun or alone) and `mpipe plan`.
// Thin: parse options (CLI11; TOML config files in io/config_file.hpp), build, run, report.
#pragma once
#include <CLI/CLI.hpp>

#include "mpipe/pipeline/executor.hpp"

namespace mpipe {

// Registers the options shared by train and plan on `command`, writing into `config`.
void add_train_options(CLI::App& command, TrainConfig& config);

// Runs training on `world` (MPI initialised); returns the exit code of this rank.
int run_train(const TrainConfig& config, const Communicator& world);
// Prints the grid, partition, schedule and predicted bubble for `ranks` ranks, no MPI;
// with `write_schedule`, also writes the schedule there as a schedule file.
int run_plan(const TrainConfig& config, int ranks, const std::string& write_schedule = "");

// SIGTERM and SIGUSR1 (what Slurm and mpirun send) ask training to stop after the
// current step with a checkpoint, exit 75. `environment`: main's envp. main.cpp calls
// this for `train` before any shared library's constructor runs (cuBLASLt's take ~0.3 s,
// in which a signal would otherwise kill the rank), and run_main again.
void install_stop_handlers(char** environment);

// The whole program; returns the exit code (0 ok, 2 bad input, 1 internal error).
int run_main(int argc, char** argv);

}  // namespace mpipe
