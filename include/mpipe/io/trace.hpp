// Timeline output: every rank's actions merged into one Chrome / Perfetto trace (one
// track per rank).
#pragma once
#include <string>
#include <vector>

#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

// Collective: gathers every rank's trace events to world rank 0, which writes `path`
// as Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing).
void write_trace(const Executor& exec, const std::string& path);

}  // namespace mpipe
