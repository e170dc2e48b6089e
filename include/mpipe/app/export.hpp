// `mpipe export`: a checkpoint's weights as a safetensors file, under the names other
// tools give them (io/weights.hpp).
#pragma once
#include <string>

namespace mpipe {

// `mpipe export CHECKPOINT OUT`: CHECKPOINT a file, or a run directory (its newest
// checkpoint that verifies); OUT a file, or a directory (a name ending in '/', or one that
// exists) for OUT/model.safetensors and, for GPT-2 and Llama, OUT/config.json. Returns the
// exit code; UserError for a bad input.
int run_export(const std::string& checkpoint, const std::string& out);

}  // namespace mpipe
