// Timeline output: every rank's actions merged into one Chrome / Perfetto trace (one
// track per rank), and the end-of-run summary.
#pragma once
#include <string>
#include <vector>

#include "mpipe/pipeline/executor.hpp"

namespace mpipe {

// Collective: gathers every rank's trace events to world rank 0, which writes `path`
// as Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing).
void write_trace(const Executor& exec, const std::string& path);

// Seconds one stage spent in each phase per step: min / mean / max over the timed steps
// and the stage's replicas (the console's "time per step" table).
struct StagePhases {
  double min[PhaseTimes::count] = {}, avg[PhaseTimes::count] = {}, max[PhaseTimes::count] = {};
};

struct RunSummary {
  double median_step_s = 0, samples_per_s = 0, tokens_per_s = 0, bubble = 0, theoretical_bubble = 0;
  double simulated_bubble = 0;  // the schedule simulated with the run's mean action times per stage
  long long steps = 0;
  std::vector<double> peak_bytes_per_rank;  // activations and scratch
  std::vector<StagePhases> phases;           // per stage; empty when no step was timed
};

// One JSON object (one line) describing the run: throughput, bubble, peak memory per
// stage and rank, and the configuration that produced them.
std::string summary_json(const Executor& exec, const RunSummary& summary);

// Writes `json` and a newline to `path` (--summary); UserError when it cannot (full disk).
void write_summary(const std::string& path, const std::string& json);

}  // namespace mpipe
