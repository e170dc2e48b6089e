// Process grid and communicator construction.
#include "mpipe/pipeline/grid.hpp"

namespace mpipe {

GridShape resolve_grid(GridShape g, int world) {
  MPIPE_REQUIRE(g.rank_order == "pipeline" || g.rank_order == "data", "use --rank-order pipeline or data",
                "unknown rank order '", g.rank_order, "'");
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

void Grid::connect_tied(int owner_stage, int copy_stage) {
  const bool member = owner_stage != copy_stage && (stage_ == owner_stage || stage_ == copy_stage);
  tied_ = Communicator::split(*world_, member ? replica_ : MPI_UNDEFINED, stage_);
}


}  // namespace mpipe
