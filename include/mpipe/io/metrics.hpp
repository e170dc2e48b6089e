// The run's numbers as JSON: one object per step (--metrics, JSON lines) and the
// end-of-run summary (its last line, and --summary), numbers with 9 significant digits
// so float32 values round-trip.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);  // UserError if it cannot be opened
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  // Each throws UserError when the line cannot be written (a full disk).
  void write(const StepResult& r, double samples_per_s, double tokens_per_s);
  // An evaluation after step `step` (0-based, as StepResult::step).
  void write_eval(std::int64_t step, const EvalResult& e);
  void write_line(const std::string& json);

 private:
  void check(int printed);
  std::string path_;
  std::FILE* file_ = nullptr;
};

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
  std::vector<double> device_peak_bytes_per_rank;  // on a GPU: all device memory mpipe held (cuda::device_bytes_peak)
  std::vector<StagePhases> phases;           // per stage; empty when no step was timed
  // CPU seconds over the whole run, per rank: the process's, and its progress thread's
  // (0 without one), which shares the rank's cores with the compute.
  std::vector<double> cpu_s_per_rank, progress_thread_cpu_s_per_rank;
  // Bytes each rank sent over the run: to neighbouring stages, and of skips (straight from
  // a skip's producer to its consumer).
  std::vector<double> sent_bytes_per_rank, skip_bytes_per_rank;
};

// One JSON object (one line) describing the run: throughput, bubble, peak memory per
// stage and rank, and the configuration that produced them.
std::string summary_json(const Executor& exec, const RunSummary& summary);

// Writes `json` and a newline to `path` (--summary); UserError when it cannot (full disk).
void write_summary(const std::string& path, const std::string& json);

}  // namespace mpipe
