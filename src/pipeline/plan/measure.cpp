// The costs --partition time makes a plan from, measured across the ranks of a run.
#include <algorithm>
#include <cmath>
#include <exception>

#include "mpipe/core/error.hpp"
#include "mpipe/pipeline/plan/plan.hpp"

namespace mpipe {

namespace {

// A ping-pong of one typical boundary activation over each link in turn, every replica
// at once; the slowest replica's figure, in seconds per byte.
std::vector<double> measure_links(const RunOptions& options, const Grid& grid, const Model& model, int micro) {
  const int K = grid.stages();
  const std::vector<double> bytes = boundary_bytes(model, micro, false);  // activation + gradient per cut
  double sum = 0;
  for (std::size_t b = 1; b + 1 < bytes.size(); ++b) sum += bytes[b] / 2;
  const double mean = bytes.size() > 2 ? sum / static_cast<double>(bytes.size() - 2) : 0.0;
  const auto message = static_cast<std::size_t>(std::clamp(mean, 4096.0, 64.0 * 1024 * 1024));
  std::vector<double> cost(static_cast<std::size_t>(K), 0.0);
  // Link l joins stage l to l + 1; the last one, back to stage 0, carries messages only
  // under virtual stages.
  const int links = options.virtual_stages > 1 ? K : K - 1;
  for (int l = 0; l < links; ++l) {
    const int from = l, to = (l + 1) % K;
    if (grid.stage() == from) cost[static_cast<std::size_t>(l)] = grid.pipeline().ping_pong(to, message, true);
    if (grid.stage() == to) grid.pipeline().ping_pong(from, message, false);
  }
  for (double& c : cost) c /= static_cast<double>(message);
  grid.world().allreduce(std::span<double>(cost), Reduce::max);
  return cost;
}

}  // namespace

MeasuredCosts measure_costs(const RunOptions& options, const Communicator& world) {
  MeasuredCosts measured;
  if (!needs_measurement(options)) return measured;
  const GridShape shape = resolve_grid(options.grid, world.size());
  const int micro = micro_batch_size(options, shape.replicas);
  Model model(options.model);
  // On world rank 0 alone, so every rank cuts at the same layers; a failure is broadcast
  // as NaN so that no rank is left in the broadcast.
  measured.layer_seconds.assign(static_cast<std::size_t>(model.size()), 0.0);
  std::string problem;
  if (world.rank() == 0) {
    try {
      measured.layer_seconds = measure_layer_times(model, micro, options.seed);
    } catch (const std::exception& e) {
      problem = e.what();
      measured.layer_seconds.assign(measured.layer_seconds.size(), std::nan(""));
    }
  }
  world.broadcast(std::span<double>(measured.layer_seconds), 0);
  if (std::isnan(measured.layer_seconds[0]))
    throw Error(cat("measuring layer times on rank 0 failed", problem.empty() ? "" : ": " + problem));
  if (shape.stages > 1 && options.link_seconds_per_byte < 0) {
    const Grid grid(world, shape);
    measured.link_seconds_per_byte = measure_links(options, grid, model, micro);
  }
  return measured;
}

}  // namespace mpipe
