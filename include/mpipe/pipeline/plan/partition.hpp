// Partitioning a model's flat layer list into K contiguous stages.
//
// `--balance a,b,...` gives layers per stage. Otherwise each layer gets a cost
// (uniform, params, flops, or measured time) and the partition that minimises the
// largest stage cost is found exactly by dynamic programming (not a greedy cut).
#pragma once
#include <string>
#include <vector>

#include "mpipe/nn/model.hpp"
#include "mpipe/pipeline/schedule/schedule.hpp"

namespace mpipe {

struct Partition {
  std::vector<int> bounds;        // K·v + 1 layer indices: model stage s owns [bounds[s], bounds[s+1])
  std::vector<double> layer_cost; // the costs it was made from (empty for --balance)
  // When communication was counted: each model stage's cost of moving its boundary
  // activations and gradients (in the costs' unit), and the links' cost per byte, link l
  // joining pipeline stage l to l + 1 (mod K). Both empty otherwise.
  std::vector<double> comm_cost, link_cost_per_byte;
  std::vector<int> placement;     // [model stage] -> its pipeline stage; empty: model stage = pipeline stage
  int stages() const { return static_cast<int>(bounds.size()) - 1; }  // model stages
  // The pipeline stage (the rank of a replica) holding model stage `s`.
  int pipeline_stage(int s) const { return placement.empty() ? s : placement[static_cast<std::size_t>(s)]; }
  int begin(int stage) const { return bounds[stage]; }
  int end(int stage) const { return bounds[stage + 1]; }
  int stage_of(int layer) const;  // the stage holding global layer `layer`
  double stage_cost(int stage) const;  // compute alone
  double stage_total(int stage) const { return stage_cost(stage) + (comm_cost.empty() ? 0.0 : comm_cost[stage]); }
  std::string to_text() const;    // "0-3 | 4-7"
};

// From --balance; UserError if the counts are not positive or do not add up.
Partition partition_from_balance(const std::vector<int>& layers_per_stage, int layers);
// Largest stage costs this close (relative) count as a tie: a FLOP or timing model is
// no more precise than that.
inline constexpr double partition_near = 0.01;

// Minimises the largest stage cost over contiguous partitions into `stages` non-empty
// ranges, exactly; among the partitions within `partition_near` of it, the one with the
// fewest bytes crossing its cuts (`boundary_bytes`, when given: see boundary_bytes()),
// then the most even stages. With `link_cost_per_byte` (needs boundary_bytes), a stage's
// cost is its layers' plus the bytes of both its cuts times the cost per byte of the link
// each crosses (link l joins model stage l to l + 1; index l mod size): a stage moves its
// input and output activations and gradients in its own time, which is how a pipeline
// pays for them where messages do not overlap its compute. UserError if there are more
// stages than layers.
Partition partition_min_max(const std::vector<double>& layer_costs, int stages,
                            const std::vector<double>& boundary_bytes = {},
                            const std::vector<double>& link_cost_per_byte = {});
// Bytes that cross a cut before layer b, at [b] (1 <= b < layers; [0] and [layers] are
// 0): its input activation per micro-batch of `micro` samples, and the same again for
// the gradient that comes back (none for token inputs).
// With `skips`, each skip (Model::skips()) counts on every cut it crosses: its message
// goes straight from producer to consumer, once, but a partition that cuts fewer skips
// moves fewer bytes (and, cut inside a U, holds less).
std::vector<double> boundary_bytes(const Model& model, int micro, bool skips = true);
// Each skip's bytes one way for a micro-batch of `micro` samples, by Model::skips() index.
std::vector<double> skip_bytes(const Model& model, int micro);

// Per-layer costs for `method` (uniform | params | flops) at one micro-batch of `micro`
// samples. `time` is measured by the caller (measure_layer_times).
std::vector<double> layer_costs(const Model& model, const std::string& method, int micro);
// Forward + backward seconds of each layer on one micro-batch, measured in turn on this
// process (each layer's parameters exist only while it is measured).
std::vector<double> measure_layer_times(Model& model, int micro, unsigned long long seed);

// The partition `balance` (--balance: layers per model stage) or, without it, --partition `method`
// asks for: the exact min-max of the layer costs with the cut sizes of boundary_bytes(),
// into the model stages of `placement` (each one's pipeline stage, from
// Schedule::placement_table(); empty: one per pipeline stage); `measured`: the layer times
// of --partition time, and `link_seconds_per_byte` (--partition time only: the costs are
// then seconds) the links between pipeline ranks, link r from rank r to r + 1 mod stages.
// A cut between two model stages of one rank crosses no link.
Partition choose_partition(const std::vector<int>& balance, const std::string& method, const Model& model, int stages,
                           int micro, const std::vector<double>& measured = {}, const std::vector<int>& placement = {},
                           const std::vector<double>& link_seconds_per_byte = {});

// Each model stage's forward, whole backward and weight-gradient FLOPs at one micro-batch
// of `micro` samples: the costs the zero-bubble schedules are ordered for (the same on
// every rank: the model and the partition are).
StageCosts flop_costs(const Model& model, const Partition& partition, int micro);

// --link-bandwidth: "auto" (measured by train), "off", or GB/s (> 0). Seconds per byte
// for a number, 0 for off, -1 for auto; UserError otherwise.
double parse_link_bandwidth(const std::string& text);

std::vector<int> parse_balance(const std::string& text);  // "2,3,3"; UserError if malformed

}  // namespace mpipe
