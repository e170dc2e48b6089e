// The reducer: every sum a step needs beside the pipeline's own messages.
//
// - Gradients over replicas, in buckets of one layer each (the same messages for every K,
//   so the reduction order never depends on the partition), each started as soon as its
//   layer's last backward (or W) is done, so the sums move while the backward runs: a
//   GroupSum each (a reduce-scatter and an all-gather of our own, over Progress).
// - Tied weights (GPT's embedding and head, or each vocabulary chunk's rows of the table)
//   between the two stages holding an owner and a copy: one PairSum each, started early
//   with one replica on the CPU, after the replica sums otherwise (one summation order
//   for every K and D).
// - The loss, the per-layer gradient norms, the bubble and the stop flag agreed over the
//   world in one allreduce: each per-layer entry has exactly one non-zero contributor
//   (replica 0 of the stage holding it), and x + 0 = x, so the norm is bitwise the same
//   for every K and D.
// - BatchNorm's running statistics made equal over the replicas after an update.
// - With the optimizer sharded (--shard-optimizer, ZeRO-1), the values each replica
//   updated gathered by the others: every piece sent, in place, to every other replica.
// Every wait is through Progress, within --p2p-timeout.
#pragma once
#include <memory>
#include <string>
#include <span>
#include <vector>

#include "mpipe/nn/model.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/pipeline/plan/grid.hpp"
#include "mpipe/pipeline/comm/group_sum.hpp"
#include "mpipe/pipeline/comm/pair_sum.hpp"
#include "mpipe/pipeline/plan/partition.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/run/step_device.hpp"

namespace mpipe {

class Reducer {
 public:
  // A finished sum, for the trace.
  enum class Sum { replicas, tied };
  struct Done {
    Sum sum;
    int layer;
    Progress::Completion completion;
  };
  // What the world agreed on for a step.
  struct Agreed {
    double loss_sum = 0, norm_squared = 0;  // the norm summed in global layer order
    // Idle share of every rank's time in the pipeline up to the slowest rank's end:
    // 1 - Σ busy / (ranks × slowest), as simulate() counts it. A rank that is done early
    // (the last stage under 1F1B) idles until the slowest one is, and that is bubble too.
    double bubble = 0;
    bool stop = false, time_limit = false;  // some rank asked to stop; some rank's --time-limit is up
  };

  // Plans the sums of this rank's `layers` (ascending) in `params`; local work only.
  // `deferred_batchnorm`: running statistics move once per step (--batchnorm deferred).
  // `shard_optimizer`: the optimizer updates this replica's pieces only (shard_elements),
  // and the gather below brings the others'.
  Reducer(const Grid& grid, Model& model, const Partition& partition, ParamStore& params, std::vector<int> layers,
          const StepDevice& device, bool deferred_batchnorm, bool shard_optimizer, double timeout_s);
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  // Requests it can have in flight at once (for Progress's capacity).
  int requests() const;
  // Makes the tied sums' exchanges, which keep moving through `progress`.
  void connect(Progress& progress);

  // A step begins: the partner stages' tied parts may arrive from now on.
  void begin_step();
  // `layer`'s gradient is final (after the last micro-batch's backward or W of it).
  void gradients_final(int layer);
  // After the step's last action: every replica and tied sum done (staged through pinned
  // host memory on a GPU without CUDA-aware MPI).
  void reduce();
  // The sums reduce() waited for, with their times.
  std::span<const Done> done() const { return done_; }
  // Collective over the world: this rank's loss sum (its share, 0 where it holds no loss),
  // its seconds of compute (`busy`) in its `pipeline` seconds, and its stop request, with
  // the gradient norms of the layers it holds (and whether its stop is its time limit's). In two halves, so that a rank can go on
  // with the next step's pipeline while the sum moves (--overlap-steps): start_agree()
  // reads the gradient norms and posts the allreduce, finish_agree() waits for it. One
  // agreement in flight at a time.
  void start_agree(double loss_sum, double busy, double pipeline, bool stop, bool time_limit = false);
  Agreed finish_agree(std::int64_t step);
  bool agreeing() const { return agree_ticket_ != Progress::none; }
  // After an update (or a skipped step, `updated` false): the replicas' running
  // statistics made equal, by their mean (micro) or by applying the step's sums added up
  // over the replicas (deferred). `update`: the optimizer's count, for messages.
  void settle_buffers(bool updated, std::int64_t update);
  // Layers with step sums (deferred BatchNorm): cleared as a step begins.
  void clear_step_sums();
  // --shard-optimizer, after an update: this replica's pieces of the values go to every
  // other replica of the stage, theirs come in, in place (start_gather() posts them;
  // finish_gather() waits, within --p2p-timeout, and on a GPU refreshes what the layers
  // read). Nothing without sharding or replicas. `update`: the optimizer's count.
  void start_gather(std::int64_t update);
  void finish_gather();
  bool gathering() const { return gathering_; }

 private:
  struct Bucket {
    int lowest_layer;          // starts when this layer's last backward is done
    std::size_t begin, end;    // span of the gradient buffer
  };
  struct Exchange {            // one piece of a view, to or from one other replica
    int layer;
    std::size_t offset, count; // of the values
    int peer;                  // its replica
    int tag;                   // the view's entry index
    std::string what;          // for a wait that times out (made once: no step allocates)
  };
  struct TiedSpan {
    int layer;                 // final when this layer's last backward is done
    std::size_t offset, count; // of the gradient buffer
    int partner_stage;         // the pipeline stage holding the other side of the tie
    int tag;                   // the tie's index in the model
    std::unique_ptr<PairSum> sum;
  };
  template <class T>
  void sum_over_replicas(std::span<T> values, std::int64_t update);

  const Grid& grid_;
  Model& model_;
  ParamStore& params_;
  const StepDevice& device_;
  bool deferred_batchnorm_;
  double timeout_;
  Progress* progress_ = nullptr;
  std::vector<Bucket> buckets_;
  std::vector<std::unique_ptr<GroupSum>> bucket_sums_;  // [bucket], made by connect()
  std::vector<int> bucket_of_;                     // [layer] -> its bucket, or -1
  std::vector<TiedSpan> tied_spans_;
  std::vector<Exchange> sends_, receives_;          // --shard-optimizer's gather
  std::vector<Progress::Ticket> gather_tickets_;    // [sends, then receives]
  bool gathering_ = false;
  bool tied_early_ = false;  // tied sums start in the backward (one replica, on the CPU)
  cuda::PinnedBuffer grad_staging_;                // replica sums when MPI is not CUDA-aware
  std::vector<Done> done_;                         // reserved once
  std::vector<double> agree_buffer_;               // per layer, loss, busy, stop, time limit, each rank's pipeline time
  Progress::Ticket agree_ticket_ = Progress::none; // the agreement in flight
  std::vector<Layer*> deferred_;                   // layers (parts too) with step sums
  std::vector<double> settle_sums_;                // their sums, packed for the sum over replicas
  std::vector<float> settle_values_;               // the buffers, packed for their mean over replicas
};

}  // namespace mpipe
