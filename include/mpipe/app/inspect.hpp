// `mpipe inspect`: what a checkpoint file holds, without MPI.
#pragma once
#include <string>

namespace mpipe {

// `mpipe inspect FILE [--stats] [--verify]`: returns the exit code.
// `print`: "config" prints only the run's options (a file for train --config), "model"
// only its layer list (a model file for --model); "" the whole summary.
int run_inspect(const std::string& path, bool stats, bool verify, const std::string& print = "");

}  // namespace mpipe
