// Process grid and communicator construction.
#include "mpipe/pipeline/plan/grid.hpp"

#include <algorithm>

#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

GridShape resolve_grid(GridShape g, int world) {
  MPIPE_REQUIRE(g.rank_order == "pipeline" || g.rank_order == "data" || g.rank_order == "auto",
                "use --rank-order pipeline, data or auto", "unknown rank order '", g.rank_order, "'");
  if (g.rank_order == "auto") g.rank_order = "pipeline";  // train chooses on several hosts, before this
  MPIPE_REQUIRE(g.stages >= 0 && g.replicas >= 0, "use positive counts", "--stages and --replicas must not be negative");
  if (g.stages == 0 && g.replicas == 0) g.replicas = 1;
  if (g.stages == 0) {
    MPIPE_REQUIRE(world % g.replicas == 0, cat("launch a multiple of ", g.replicas, " ranks"),
                  "world size ", world, " is not divisible by --replicas ", g.replicas);
    g.stages = world / g.replicas;
  } else if (g.replicas == 0) {
    MPIPE_REQUIRE(world % g.stages == 0, cat("launch a multiple of ", g.stages, " ranks"),
                  "world size ", world, " is not divisible by --stages ", g.stages);
    g.replicas = world / g.stages;
  }
  MPIPE_REQUIRE(g.stages * g.replicas == world, cat("launch ", g.stages * g.replicas, " ranks, or change --stages/--replicas"),
                "world size ", world, " is not --replicas ", g.replicas, " x --stages ", g.stages);
  return g;
}

Grid::Grid(const Communicator& world, const GridShape& shape) : world_(&world), shape_(shape) {
  MPIPE_CHECK(shape.stages * shape.replicas == world.size(), "grid ", shape.replicas, "x", shape.stages,
              " on ", world.size(), " ranks");
  stage_ = shape.stage_of(world.rank());
  replica_ = shape.replica_of(world.rank());
  pipeline_ = Communicator::split(world, replica_, stage_);
  data_ = Communicator::split(world, stage_, replica_);
}

std::string Grid::name() const {
  return cat("rank ", world_rank(), " (stage ", stage_, ", replica ", replica_, ")", on_host(world_rank()));
}

void Grid::connect_tied(std::vector<int> stages) {
  std::sort(stages.begin(), stages.end());
  stages.erase(std::unique(stages.begin(), stages.end()), stages.end());
  if (stages.size() < 2) stages.clear();  // all on one stage: summed there
  tied_stages_ = stages;
  const bool member = std::find(stages.begin(), stages.end(), stage_) != stages.end();
  tied_ = Communicator::split(*world_, member ? replica_ : MPI_UNDEFINED, stage_);
}

int Grid::tied_rank(int stage) const {
  const auto it = std::find(tied_stages_.begin(), tied_stages_.end(), stage);
  MPIPE_CHECK(it != tied_stages_.end(), "stage ", stage, " is not in the tied group");
  return static_cast<int>(it - tied_stages_.begin());
}


}  // namespace mpipe
