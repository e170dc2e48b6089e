// `mpipe export`: a checkpoint's weights as a safetensors file, under the names other
// tools give them (io/weights.hpp).
#pragma once
#include <string>

namespace mpipe {

// `mpipe export CHECKPOINT OUT`: CHECKPOINT a file, or a run directory (its newest
// checkpoint that verifies). Returns the exit code; UserError for a bad input.
int run_export(const std::string& checkpoint, const std::string& out);

}  // namespace mpipe
