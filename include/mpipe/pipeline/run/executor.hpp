// The executor: the one interpreter of lowered schedules, and the only code that
// touches both the communicators and the layers.
//
// Each rank runs one pipeline stage of one replica: a contiguous range of layers, or with
// --virtual-stages v the v model stages the schedule places on it, of a model cut into
// K·v: s, s + K, ... for interleaved (messages then wrap from the last rank to the first),
// s and 2K-1-s for zbv (the model goes down the ranks and back up; the first rank holds
// the loss, and the turn on the last rank is a message to itself). A step:
// zero gradients, draw this replica's share of the mini-batch, post every receive,
// walk the rank's action list (F, B, W, sends, receives), sum gradients over replicas
// in buckets started while the last backward still runs, sum tied-weight gradients
// between the stages holding them (started as soon as they are final), agree on the
// loss and the global gradient norm, clip, update. With one rank it is the plain
// single-process trainer.
//
// The executor is the action loop and the step around it; the parts it drives are
// objects of their own:
// - Plan (pipeline/plan/plan.hpp): everything decided before the run, made once.
// - Stage (pipeline/run/stage.hpp): a model stage's layers, its micro-batches' state and
//   buffers from F to B (W), and its F, B and W actions; they tell the rank their times
//   and finished gradients through StageHooks, which the executor implements.
// - Transport (pipeline/comm/transport.hpp): messages between model stages, to the ranks the
//   schedule's placement names.
// - Reducer (pipeline/comm/reducer.hpp): the sums over replicas and tied weights, the world's
//   agreement on loss, norms and stop, running statistics over replicas.
// - StepDevice (pipeline/run/step_device.hpp): the CPU or the GPU, chosen once: where the
//   batch lives, how compute is timed (CUDA events on a GPU, so phase times, the bubble
//   and traces show GPU time without the host waiting on each action), the loss sum.
// - Timeline (pipeline/run/timeline.hpp): the phase times and the trace.
// - --overlap-steps' updates ahead and their rollback: pipeline/run/overlap.{hpp,cpp}.
// Every posted request is kept moving by Progress while the rank computes
// (pipeline/comm/progress.hpp).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/core/arena.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/nn/params.hpp"
#include "mpipe/pipeline/plan/grid.hpp"
#include "mpipe/pipeline/run/overlap.hpp"
#include "mpipe/pipeline/plan/partition.hpp"
#include "mpipe/pipeline/plan/plan.hpp"
#include "mpipe/pipeline/run/prefetch.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/comm/reducer.hpp"
#include "mpipe/pipeline/schedule/schedule.hpp"
#include "mpipe/pipeline/run/stage.hpp"
#include "mpipe/pipeline/run/step_device.hpp"
#include "mpipe/pipeline/run/timeline.hpp"
#include "mpipe/pipeline/comm/transport.hpp"

namespace mpipe {

struct StepResult {
  std::int64_t step = 0;
  double loss = 0.0;            // mean over the mini-batch's loss rows
  double grad_norm = 0.0;       // global, before clipping
  float lr = 0.0f;
  bool skipped = false;         // non-finite loss or gradients: no update anywhere
  double seconds = 0.0;
  double bubble_fraction = 0.0; // measured: every rank's idle share up to the slowest rank's end of the pipeline
  bool stop = false;            // some rank asked to stop after this step
  bool time_limit = false;      // some rank's --time-limit is up
  bool rolled_back = false;     // --overlap-steps: the update made ahead was undone, the agreed one made
};

// One evaluation: the mean loss per row, the fraction of rows predicted right (tokens
// for a model of tokens), over `samples` samples.
struct EvalResult {
  double loss = 0, accuracy = 0;
  std::int64_t samples = 0;    // evaluated: whole batches
  std::int64_t available = 0;  // in the held-out file (0: synthetic, unbounded)
};

// Runs `f` for step `step`, naming this rank and stage on an error that does not name
// them yet (the action loop names its action already).
template <class F>
auto named_errors(const Grid& grid, std::int64_t step, F&& f) {
  try {
    return f();
  } catch (const std::exception& e) {
    const std::string what = e.what();
    if (what.rfind("rank ", 0) == 0) throw;
    rethrow_as(e, cat(grid.name(), " at step ", step, " during the gradient reduction or update: ", what));
  }
}

// A reader of the training state on the host that an update must not overtake.
class StateReader {
 public:
  virtual void finish() = 0;  // returns once the reader is done with the state

 protected:
  ~StateReader() = default;
};

class Executor : StageHooks {
 public:
  // Runs `plan` (made for world.size() ranks) on `world`. Three phases so that a failure
  // on one rank never leaves another in a collective: the constructor does only local
  // work (the model); connect() is collective (the grid's communicators, the tied
  // group) and opens the data; allocate() is local again (parameters, buffers).
  Executor(const Plan& plan, const Communicator& world);
  void connect();
  void allocate();
  ~Executor() override;

  // One training step, its agreement waited for: the validated result of `step`.
  StepResult step(std::int64_t step);
  // The training loop's step. Without --overlap-steps it is step(). With it, the step's
  // update is made ahead of its agreement and the call returns without waiting for it:
  // the results it returns are of earlier steps, now validated (none for the first, then
  // the previous step's; after a lost bet also this one's). settle() validates the step
  // still in flight, if any: before a checkpoint, an evaluation or the end.
  std::span<const StepResult> advance(std::int64_t step);
  std::optional<StepResult> settle();
  // --overlap-steps: updates made ahead of their agreement, and how many were undone.
  std::int64_t speculated() const { return speculated_; }
  std::int64_t rolled_back() const { return rolled_back_; }
  // Forward and backward over the mini-batch of `step` with every gradient reduction
  // (replicas, tied weights) but no update; returns the mean loss.
  double compute_gradients(std::int64_t step);

  // Forward only over --eval-data (dropout off, no remat, no update), the batches of
  // --eval-batches; collective. The trace and the step times do not see it.
  EvalResult evaluate();

  const Plan& plan() const { return plan_; }
  const RunOptions& options() const { return plan_.options; }
  const Grid& grid() const { return *grid_; }
  // The messages between model stages and of skips (bytes sent, for tests and benchmarks).
  const Transport& transport() const { return *transport_; }
  const Partition& partition() const { return plan_.partition; }
  const Schedule& schedule() const { return plan_.schedule; }
  Model& model() { return model_; }
  const Model& model() const { return model_; }
  ParamStore& params() { return *params_; }
  const ParamStore& params() const { return *params_; }
  Optimizer& optimizer() { return *optimizer_; }
  const Optimizer& optimizer() const { return *optimizer_; }
  // Optimizer updates made so far (Adam's t); a checkpoint carries it.
  std::int64_t updates() const { return updates_; }
  void set_updates(std::int64_t updates) { updates_ = updates; }
  // A stop (preemption) asked for on this rank; step() agrees on it over every rank and
  // reports it in StepResult::stop (and `time_limit`: this rank's --time-limit is up, in
  // StepResult::time_limit, so that every rank can say why).
  void request_stop(bool time_limit = false) {
    stop_requested_ = true;
    time_limit_reached_ = time_limit_reached_ || time_limit;
  }
  // Something still reading the values and optimizer state where training keeps them on
  // the host (a background checkpoint's copy, --checkpoint-async): each update first lets
  // it finish (StateReader::finish), nullptr for none.
  void set_state_reader(StateReader* reader) { state_reader_ = reader; }
  const Dataset* dataset() const { return dataset_.get(); }
  const Dataset* eval_dataset() const { return eval_dataset_.get(); }
  // --prefetch: whether this rank reads each next batch while a step computes, and the
  // batches so read (started, and of them used).
  bool prefetching() const { return prefetch_ != nullptr; }
  std::int64_t prefetched() const { return prefetch_ ? prefetch_->taken() : 0; }
  const Arena& arena() const { return *persistent_; }
  Device device() const { return device_; }
  bool cuda_aware() const { return cuda_aware_; }
  // GPU only: training state to the host mirrors (before a checkpoint) and back (after
  // loading one). No-ops on the CPU.
  void download_state();
  void upload_state();
  const PhaseTimes& last_times() const { return timeline_.times(); }
  // How posted messages keep moving (the mode in effect, after any fallback).
  const Progress& progress() const { return *progress_; }
  // Peak bytes of activations and scratch held by this rank at once so far (its arenas'
  // live bytes together: Gauge).
  std::size_t peak_activation_bytes() const;
  // The events recorded for --trace (steps 1 .. trace_steps); times from the trace clock.
  const std::vector<TraceEvent>& trace_events() const { return timeline_.events(); }
  // Collective: sets a common time origin on every rank (after a barrier).
  void start_trace_clock();

 private:
  using Clock = std::chrono::steady_clock;
  StepResult step_unchecked(std::int64_t step);
  EvalResult evaluate_unchecked();
  std::span<const StepResult> advance_unchecked(std::int64_t step);
  // After the pipeline pass: the sums over replicas and tied weights, then the
  // agreement posted with this rank's `pipeline_seconds` and its compute less `dropped`
  // (of a dropped pass); finish_agree() waits for it.
  void reduce_and_agree(std::int64_t step, double pipeline_seconds, double dropped);
  void finish_agree(std::int64_t step);
  double agreed_loss() const;
  StepResult agreed_result(std::int64_t step) const;  // from agreed_
  // The agreed update needs no clipping and no skip: the one an update ahead makes.
  bool plain_update(const StepResult& r) const;
  void update(StepResult& r);  // the agreed update: clipped, or skipped where non-finite
  // --overlap-steps: waits for the agreement of the step updated ahead and checks the
  // bet; lost, goes back and makes the agreed update. `pass_done`: a pipeline pass ran
  // on the updated parameters since (its sums are finished, then it is dropped).
  StepResult validate_pending(bool pass_done);
  // training: forward and backward over the step's batch; otherwise forward only over
  // batch `step` of the held-out data.
  void run_pipeline(std::int64_t step, bool training = true);
  // The action loop of one pass: this rank's list, one switch over the action kinds.
  void run_actions(std::int64_t step, bool training);
  // This replica's share of batch `step` into the device's batch: read ahead by the
  // prefetch thread, or read now; then the next one's read started.
  void read_batch(std::int64_t step, bool training);
  // The dataset's fill of samples [begin, end) of this replica's share of batch `step`
  // into those rows of (inputs, targets); end -1: to the share's end.
  void fill_batch(std::int64_t step, bool training, const Tensor& inputs, const Tensor& targets, std::int64_t begin = 0,
                  std::int64_t end = -1) const;

  // StageHooks: what the rank's stages tell it.
  void begin_compute(ComputeKind kind, int micro_batch, int stage) override;
  void end_compute(ComputeKind kind, int micro_batch, int stage, Clock::time_point start) override;
  void waited(double seconds) override { timeline_.times().p2p_wait += seconds; }
  void gradients_final(int layer) override { reducer_->gradients_final(layer); }
  int traced_stage(int stage) const { return plan_.schedule.virtual_stages > 1 ? stage : -1; }

  const Plan plan_;
  const Schedule& schedule_ = plan_.schedule;
  const Partition& partition_ = plan_.partition;
  const Communicator& world_;
  Model model_;
  std::unique_ptr<Grid> grid_;
  // The model stages this rank runs, ascending: its pipeline stage's one, or the v the
  // schedule places on it (interleaved: s, s + K, ...; zbv: s and 2K-1-s).
  std::vector<Stage> stages_;
  std::vector<int> local_of_;  // [model stage]: its index in stages_, or -1 on another rank
  bool needs_batch() const;  // this rank reads batches: the first stage's inputs, or targets
  bool holds_first() const;  // the model's first stage (the inputs) is one of this rank's
  bool holds_last() const;   // the model's last stage (the loss) is one of this rank's
  std::vector<int> layers() const;  // this rank's, ascending
  const int micro_;          // samples per micro-batch
  std::vector<Shape> shapes_;
  Device device_ = Device::cpu;  // where tensors live
  DType dtype_ = DType::f32;  // of activations, their gradients and the messages
  bool cuda_aware_ = false;
  std::unique_ptr<StepDevice> device_ops_;  // the device's part of a step: batch, timing, loss, copies
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<Dataset> dataset_, eval_dataset_;
  std::unique_ptr<Prefetch> prefetch_;  // after the batch and the data it reads: ended first
  Gauge activations_;  // before the arenas that count in it
  std::unique_ptr<Arena> persistent_, scratch_;
  std::unique_ptr<SlotPool> slots_;
  std::unique_ptr<Progress> progress_;    // before the transport and the reducer, which use it
  std::unique_ptr<Transport> transport_;
  std::unique_ptr<Reducer> reducer_;
  Reducer::Agreed agreed_;                         // the last step's
  double loss_sum_ = 0.0, correct_sum_ = 0.0;      // the last pass's
  double pipeline_seconds_ = 0.0;  // this rank's last pipeline pass, from its start to its last action
  std::int64_t step_ = 0;          // the pass running (what the stages' hooks record)
  // Training passes this process ran: --cuda-graphs records from the third, once the
  // first two have sized every arena and scratch and made the libraries' choices.
  std::int64_t training_passes_ = 0;
  // --overlap-steps
  std::array<StepResult, 2> results_{};  // what advance() returns
  bool pending_ = false;                 // a step updated ahead of its agreement
  std::int64_t pending_step_ = -1;
  double pending_seconds_ = 0;           // this rank's cycle of the step updated ahead
  bool speculate_ = true;                // the next step updates ahead
  std::int64_t speculated_ = 0, rolled_back_ = 0;
  std::unique_ptr<UpdateBackup> backup_;  // what an update made ahead replaces
  std::int64_t updates_ = 0;
  Timeline timeline_;
  int fail_rank_ = -1, fail_step_ = -1;            // MPIPE_TEST_FAIL=RANK:STEP[:stall|:gather|:lose-skip]
  bool fail_stall_ = false, fail_gather_ = false, fail_lose_skip_ = false;
  bool stop_requested_ = false, time_limit_reached_ = false;
  StateReader* state_reader_ = nullptr;
};

}  // namespace mpipe
