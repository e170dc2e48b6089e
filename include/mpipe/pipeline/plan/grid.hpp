// The process grid: world = D replicas x K stages, and the communicators over it.
//
// Rank order `pipeline` (default) puts a replica's stages on consecutive ranks
// (rank = replica * K + stage), so pipeline neighbours share a node; `data` puts a
// stage's replicas on consecutive ranks (rank = stage * D + replica).
#pragma once
#include <string>
#include <vector>

#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

struct GridShape {
  int stages = 0;    // 0: inferred from the world size
  int replicas = 0;  // 0: inferred (1 when stages is inferred too)
  std::string rank_order = "pipeline";  // pipeline | data
  // Where world rank r sits, by the rank order (stages and replicas resolved).
  int stage_of(int rank) const { return rank_order == "pipeline" ? rank % stages : rank / replicas; }
  int replica_of(int rank) const { return rank_order == "pipeline" ? rank / stages : rank % replicas; }
  // The world rank at (stage, replica).
  int rank_of(int stage, int replica) const {
    return rank_order == "pipeline" ? replica * stages + stage : stage * replicas + replica;
  }
};

// Fills in whichever of stages/replicas is 0 from the world size; UserError when the
// world size is not replicas x stages.
GridShape resolve_grid(GridShape requested, int world_size);

class Grid {
 public:
  Grid(const Communicator& world, const GridShape& shape);

  const GridShape& shape() const { return shape_; }
  int stages() const { return shape_.stages; }
  int replicas() const { return shape_.replicas; }
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  int world_rank() const { return world_->rank(); }
  // "rank 3 (stage 1, replica 0)": how messages name this rank; "... on node7" in a job
  // on several hosts.
  std::string name() const;
  bool first_stage() const { return stage_ == 0; }
  bool last_stage() const { return stage_ == shape_.stages - 1; }

  const Communicator& world() const { return *world_; }
  const Communicator& pipeline() const { return pipeline_; }  // this replica's stages, rank = stage
  const Communicator& data() const { return data_; }          // this stage's replicas, rank = replica
  const Communicator& tied() const { return tied_; }          // the stages of tied weights; else null
  // Collective over the world: joins, in each replica, the stages holding the owners and
  // copies of tied weights (GPT's embedding and head, or the head's vocabulary chunks),
  // when there are two or more of them; ranks in stage order.
  void connect_tied(std::vector<int> stages);
  // The rank in tied() of the member holding `stage`.
  int tied_rank(int stage) const;

 private:
  const Communicator* world_;
  GridShape shape_;
  int stage_ = 0, replica_ = 0;
  Communicator pipeline_, data_, tied_;
  std::vector<int> tied_stages_;  // sorted, distinct
};

}  // namespace mpipe
