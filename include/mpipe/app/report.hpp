// What rank 0 prints about a run besides the plan: sizes and counts as people read them,
// and the table of phase times per stage gathered from every rank.
#pragma once
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "mpipe/app/config.hpp"
#include "mpipe/backend/op_profile.hpp"
#include "mpipe/io/metrics.hpp"
#include "mpipe/pipeline/run/executor.hpp"

namespace mpipe {

std::string human_bytes(double bytes);  // "1.5 MiB"
std::string fixed(double x, int digits);  // "%.*f"
std::string human_count(double n);  // "1.2k", "3.40M"

// Before any rank allocates (CPU), from the plan alone: this rank's parameters,
// gradients, optimizer state and the activations of its in-flight micro-batches, against
// the memory the node has for each of its `node_ranks` ranks. UserError when it cannot
// fit (sizes no allocation could take included: they must not end as std::bad_alloc).
void check_memory(const Plan& plan, int world_rank, int node_ranks);

// Phase statistics over steps, one set per rank, gathered to rank 0 for the table.
struct PhaseStats {
  double min[PhaseTimes::count], sum[PhaseTimes::count], max[PhaseTimes::count];
  double steps = 0, stage = 0, bubble = 0, weight = 0;
  PhaseStats() {
    std::fill(std::begin(min), std::end(min), std::numeric_limits<double>::infinity());
    std::fill(std::begin(sum), std::end(sum), 0.0);
    std::fill(std::begin(max), std::end(max), 0.0);
  }
  void add(const PhaseTimes& t, double bubble_fraction) {
    for (int i = 0; i < PhaseTimes::count; ++i) {
      min[i] = std::min(min[i], t[i]);
      sum[i] += t[i];
      max[i] = std::max(max[i], t[i]);
    }
    bubble += bubble_fraction;
    weight += t.weight;
    ++steps;
  }
};

// Collective: gathers every rank's phase statistics to world rank 0, which prints the
// per-stage table and the bubble: measured, the schedule's at unit costs (`theory`), and
// the schedule simulated with each stage's mean forward, backward and W times of this run
// (into *simulated). Returns the rows (other ranks: nothing).
std::vector<StagePhases> phase_table(const PhaseStats& mine, const Communicator& world, const Schedule& schedule,
                                     int micro_batches, double theory, bool overlapped, double* simulated);

// Collective: every rank's op times of step `step` (--profile-ops) to world rank 0, which
// prints them by kind, one row per rank, with the step's wall time and what no op
// accounts for (waits, messages, host code; on a GPU, its idle time too).
void op_profile_table(std::int64_t step, const ops::OpTimes& mine, double step_seconds, int stage,
                      Device device, const Communicator& world);

// Rank 0's opening lines of a training run: the program, the model, the device, the
// plan, and where the weights come from (a checkpoint resumed, --init-from).
void print_header(const TrainConfig& config, const Executor& exec, const std::string& device_line,
                  const std::string& order_line, double time_limit_s, const std::string& resumed_from,
                  std::int64_t first_step, double load_seconds);

}  // namespace mpipe
