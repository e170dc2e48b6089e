// The plan command, and the plan as train prints it.
#pragma once
#include <string>

#include "mpipe/app/config.hpp"

namespace mpipe {

// The grid, batch split, partition, memory per stage and bubbles of `plan` (for `model`).
void print_plan(const Plan& plan, const Model& model);
// The step-by-stage grid of a lowered schedule at unit costs (its makespan and bubble
// alone beyond 16 stages or micro-batches).
void print_schedule_grid(const Schedule& lowered);

// `mpipe plan`: prints the plan for `ranks` ranks, no MPI; with `write_schedule`, also
// writes the schedule there as a schedule file. Returns the exit code.
// `ranks_per_node` > 0: the ranks on nodes of that many, in blocks; --rank-order auto
// then chooses as train would (pipeline/comm/hosts.hpp).
int run_plan(const TrainConfig& config, int ranks, const std::string& write_schedule = "", int ranks_per_node = 0);
// `plan --layer-kinds`: the registry, as a user reads it.
int print_layer_kinds();

}  // namespace mpipe
