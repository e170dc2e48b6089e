// The plan of a run: every fact about how it trains that follows from its options, the
// rank count and measured costs, made once by make_plan(), a pure function (no MPI).
// `mpipe plan` prints it, `train` prints the same object and runs it (Executor), and
// checkpoints, the summary and the memory check read it: nothing computes a plan fact
// twice.
//
// RunOptions are the options as typed values (enums, not words): the app parses and
// checks the command line into them (app/config.hpp); below the app nothing compares an
// option's text.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "mpipe/core/tensor.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/pipeline/plan/grid.hpp"
#include "mpipe/pipeline/plan/partition.hpp"
#include "mpipe/pipeline/comm/progress.hpp"
#include "mpipe/pipeline/schedule/schedule.hpp"

namespace mpipe {

// Each option's words in enum order: the one list that parsing and printing read.
// selective: every micro-batch keeps what is costly to recompute (GEMM inputs and
// outputs) and recomputes in its backward what is cheap and large (each layer's cost
// says which: recomputable_bytes), as Megatron-LM's selective recomputation.
// automatic: per stage the first of never, selective and always whose activations fit
// --memory-per-rank beside the stage's weights and state (Plan::stage_remat).
enum class Remat { never, except_last, always, selective, automatic };
inline constexpr std::array<const char*, 5> remat_names{"never", "except-last", "always", "selective", "auto"};
// When BatchNorm's running statistics move: each micro-batch (GPipe) or once per step
// toward the mini-batch's (torchgpipe).
enum class BatchNormRule { micro, deferred };
inline constexpr std::array<const char*, 2> batchnorm_names{"micro", "deferred"};
enum class PartitionBy { uniform, params, flops, time };
inline constexpr std::array<const char*, 4> partition_names{"uniform", "params", "flops", "time"};
// How a wait passes the time once nothing moves (docs/communication.md).
enum class CommWait { sleep, spin };
inline constexpr std::array<const char*, 2> comm_wait_names{"sleep", "spin"};
// --prefetch: the next step's batch read on a thread of its own while a step computes
// (pipeline/run/prefetch.hpp). automatic: as on (a GPU's host is otherwise idle; the CPU's
// reader takes only the time the ranks leave idle); the value stays for scripts that
// name it.
enum class PrefetchMode { automatic, on, off };
inline constexpr std::array<const char*, 3> prefetch_names{"auto", "on", "off"};

template <class Enum, std::size_t N>
const char* name_of(Enum value, const std::array<const char*, N>& names) {
  return names[static_cast<std::size_t>(value)];
}
inline const char* to_string(Remat r) { return name_of(r, remat_names); }
inline const char* to_string(BatchNormRule b) { return name_of(b, batchnorm_names); }
inline const char* to_string(PartitionBy p) { return name_of(p, partition_names); }
inline const char* to_string(CommWait w) { return name_of(w, comm_wait_names); }
inline const char* to_string(PrefetchMode p) { return name_of(p, prefetch_names); }

struct RunOptions {
  ModelConfig model;
  OptimizerConfig optimizer;
  std::string data = "synthetic";  // data spec (data/dataset.hpp)
  std::string eval_data;           // held-out data; empty: no evaluation
  TokenOptions tokens;             // --data-packing, --eot-id: how text and token files are cut
  int eval_batches = 0;            // batches per evaluation; 0: a file's every whole batch, 8 of endless data
  PrefetchMode prefetch = PrefetchMode::automatic;  // the next batch read while a step computes
  int batch_size = 32;             // global mini-batch, in samples
  int micro_batches = 1;           // per replica
  int steps = 100;                 // the step training runs up to (the learning-rate schedule's end)
  std::uint64_t seed = 1;
  GridShape grid;                  // as asked: 0 is inferred from the rank count
  std::string schedule = "gpipe";  // a name of schedule_kinds(), or file:PATH
  int virtual_stages = 1;          // model stages per rank
  int in_flight = 0;               // zero-bubble schedules' memory (ScheduleOptions::in_flight)
  bool overlap_steps = false;      // update ahead of the step's agreement (Executor::advance)
  bool shard_optimizer = false;    // each replica keeps and updates 1/D of its stage's optimizer state (ZeRO-1)
  bool checkpoint_copy = false;    // --checkpoint-async: writers keep a copy of their values and optimizer state
  Remat remat = Remat::never;
  BatchNormRule batchnorm = BatchNormRule::micro;
  PartitionBy partition = PartitionBy::flops;
  std::vector<int> balance;            // layers per model stage (--balance); empty: by `partition`
  double link_seconds_per_byte = -1;   // --link-bandwidth: -1 measured by train, 0 not counted, else configured
  double memory_per_rank = 0;          // --memory-per-rank, bytes (0: not given); what --remat auto fits into
  double p2p_timeout = 600;            // seconds a point-to-point wait may block
  ProgressMode comm_progress = ProgressMode::automatic;
  double comm_poll_s = 5e-3;           // the progress thread's pause while nothing moves
  CommWait comm_wait = CommWait::sleep;
  Device device = Device::cpu;         // resolved: never "auto" here
  DType precision = DType::f32;        // of activations, their gradients and the messages
  bool cuda_graphs = false;            // --cuda-graphs on (a GPU): actions launched as CUDA graphs
  bool channels_last = false;          // --channels-last on: images NHWC in memory (Pass::channels_last)
  int trace_steps = 0;                 // steps traced after the first (--trace); 0: no trace
};

// What --partition time counts, measured by the ranks of a run (measure_costs) or by
// `plan` on its own process: each layer's forward + backward seconds on one micro-batch,
// and the seconds per byte of each link between pipeline ranks (link r from rank r to
// r + 1 mod K). Empty: not measured.
struct MeasuredCosts {
  std::vector<double> layer_seconds;
  std::vector<double> link_seconds_per_byte;
};

// A model stage's memory for one micro-batch: what plan prints and the memory check uses.
struct StageMemory {
  double params = 0;      // parameters (floats)
  double activation = 0;  // bytes a forward keeps for its backward
  // The most its forward holds at once (its temporaries given back: a conv's columns):
  // what a micro-batch's arena grows to.
  double forward_peak = 0;
  double boundary = 0;    // bytes of the stage's input: all a rematerialized micro-batch keeps
  double output = 0;      // bytes of what it sends on (0 on the model's last stage): under remat kept until B
  // Skips that cross stages with an end here, per micro-batch: the message each way, kept
  // and received (Transport), for every micro-batch of the step (input_bytes counts M of them).
  double skips = 0;
  double stash = 0;       // bytes a split backward keeps from B to W (the dy of each weight layer)
  double recomputable = 0;  // of `activation`: what --remat selective recomputes instead of keeping
  double recompute_flops = 0;  // and what that costs its backward
  // One backward's scratch at its peak: the largest over the stage's layers of its dy,
  // its dx and its own temporaries (held once, whatever the micro-batches in flight);
  // under --remat selective with the layer's recomputed part beside them.
  double scratch = 0, selective_scratch = 0;
  // Unsplit, the input gradients between layers go into memory the forwards of the layers
  // after each allocated, where it has room (Stage::run_backward): `scratch` counts what
  // does not fit; a split backward's (zero bubble) keep that memory until W, hence all.
  double split_scratch = 0;
  // Split, on the model's last stage: the top layers whose weight gradients B computes
  // (weights_in_backward_from) give their forward memory back as B passes them:
  // `released` bytes of each micro-batch's, and B's scratch on them (`whole_scratch`, not
  // in split_scratch) comes before that.
  double released = 0, whole_scratch = 0;
  // At most one micro-batch at a time between its F and its B (zb-h1's last stage): the
  // others held wait for their W, `released` given back (set by make_plan).
  bool one_before_backward = false;
  // Activation bytes held with `live` micro-batches in flight: without remat each keeps
  // its activations; with remat only its input and output, plus one micro-batch's while
  // recomputing.
  // A stage that splits its backwards (zero bubble) also keeps W's output gradients, and
  // under remat its recomputation lives until W.
  // Under --remat selective each keeps its activations less the recomputable part; one
  // forward at a time holds its temporaries and its recomputable part whole (in the
  // scratch arena: it dies with the forward), and one backward a layer's recomputation
  // beside its temporaries (until W where split).
  // A rematerialized forward runs in the scratch arena, its backward's temporaries after
  // it: that arena grows to the larger of the two moments.
  double peak() const { return std::max(forward_peak, activation); }  // 0: no temporaries
  double held(int live, bool remat, bool split = false, bool selective = false) const {
    const double transient = peak() - activation;  // a slot's arena beyond what it keeps
    if (selective && split)
      return live * (activation - recomputable + transient + stash + recomputable) + std::max(recomputable, selective_scratch);
    if (selective) {
      const double kept = activation - recomputable;
      return std::max((std::max(live, 1) - 1) * kept + peak(), live * kept + selective_scratch);
    }
    if (remat && !split) return live * (boundary + output) + std::max(peak(), activation + scratch);
    // Each holds its activations; one at a time its forward's temporaries (the scratch
    // arena is empty then) or, in a backward, the scratch.
    if (!split) return (std::max(live, 1) - 1) * activation + std::max(peak(), activation + scratch);
    // Split: after B, what W needs and its stash; between F and B all it kept; in B the
    // scratch on the top layers first, then what they released gone.
    const double waiting = activation - released + stash;
    const double other = one_before_backward ? waiting : std::max(activation, waiting);
    return (std::max(live, 1) - 1) * other +
           std::max({peak() + stash, activation + whole_scratch, waiting + split_scratch});
  }
  // --remat auto between selective and always (not split): of every `live` consecutive
  // micro-batches, the last `whole` are rematerialized wholly (their input and output
  // kept, their forward run again in backward) and the others kept selectively.
  // `every`: the stage holds all the step's micro-batches at once (live = M, GPipe), so
  // the moments are three: the last whole forward, beside the selective ones and the
  // whole ones before it; the first backward, beside all; the first whole one's backward,
  // whose selective ones have had theirs (backwards run in micro-batch order). Otherwise
  // a window's selective ones may be in flight beside any backward.
  double held_mixed(int live, int whole, bool every = false) const {
    const double kept = activation - recomputable, ends = boundary + output;
    const double whole_backward = std::max(peak(), activation + scratch);
    if (every && whole > 0)
      return std::max({(live - whole) * kept + (whole - 1) * ends + peak(),
                       (live - whole) * kept + whole * ends + selective_scratch,
                       (whole - 1) * ends + whole_backward});
    // A forward's temporaries and recomputable part (peak() - kept) beside the others.
    return (live - whole) * kept + whole * ends +
           std::max({peak() - kept, selective_scratch, whole > 0 ? whole_backward : 0.0});
  }
};

struct Plan {
  RunOptions options;
  GridShape grid;            // resolved: stages K and replicas D (K · D ranks)
  int micro_batch_size = 1;  // samples per micro-batch: batch / (M · D)
  // Samples per replica and step: batch / D.
  int replica_batch() const { return micro_batch_size * options.micro_batches; }
  // K · v model stages, each on the pipeline stage the schedule's placement gives;
  // with --partition time and links counted, their costs.
  Partition partition;
  bool links_measured = false;  // the partition counts links measured by train (not configured)
  // Lowered and validated; the zero-bubble ones ordered for the partition's FLOPs.
  Schedule schedule;
  StageCosts flops;                 // per model stage, one micro-batch
  std::vector<StageMemory> memory;  // per model stage, one micro-batch
  // Per model stage, the micro-batches in flight at once under the schedule as named,
  // before the last stage's rematerialized forwards were deferred (deferred_from): what
  // plan's columns for the other --remat modes count.
  std::vector<int> named_in_flight;
  // Per model stage, the re-materialization it runs: --remat auto's choice (empty
  // otherwise: every stage runs options.remat).
  std::vector<Remat> stage_remat;
  // --remat auto, a selective model stage that rematerializes some micro-batches wholly:
  // remat_whole of every remat_window consecutive ones (the micro-batches it holds at
  // once), so that any window holds that many; empty or 0: none.
  std::vector<int> remat_whole, remat_window;
  // Bubbles: at equal stages (the schedule built for unit costs, at unit costs) and
  // predicted (`schedule` at `flops`), for one step and for steps back to back
  // (--overlap-steps); and `schedule` at unit costs the way this run steps (the phase
  // table's "theoretical").
  double equal_bubble = 0, predicted_bubble = 0, equal_overlap_bubble = 0, predicted_overlap_bubble = 0;
  double unit_cost_bubble = 0;
  std::string bubble_formula;  // the equal-stage closed form, or "simulated"

  // Whether micro-batch `mb`'s forward keeps only its input (re-materialization).
  // The mode model stage `model_stage` runs: --remat's, or under auto its choice.
  Remat remat_of(int model_stage) const {
    return stage_remat.empty() ? options.remat : stage_remat[static_cast<std::size_t>(model_stage)];
  }
  // --remat auto's mixed stages: how many of every remat_window micro-batches are
  // rematerialized wholly (0: none, or not auto).
  int whole_of(int model_stage) const {
    return remat_whole.empty() ? 0 : remat_whole[static_cast<std::size_t>(model_stage)];
  }
  // Whether `mode` keeps only its micro-batches' inputs on pipeline stage `stage` (the
  // memory rule of --remat: except-last keeps the last stage's whole).
  bool inputs_only(int stage, Remat mode) const {
    return mode == Remat::always || (mode == Remat::except_last && stage + 1 < grid.stages);
  }
  bool rematerialize(int model_stage, int micro_batch) const {
    if (const int whole = whole_of(model_stage); whole > 0) {  // auto: the last of each window
      const int window = remat_window[static_cast<std::size_t>(model_stage)];
      return micro_batch % window >= window - whole;
    }
    const Remat r = remat_of(model_stage);
    return r == Remat::always || (r == Remat::except_last && micro_batch != options.micro_batches - 1);
  }
  // The first micro-batch whose training forward on model stage `model_stage` is deferred
  // to its backward (options.micro_batches: none). Only on the model's last stage, whose
  // output goes to no other stage: a rematerialized forward there would only run again,
  // so it runs once, just before its backward, and costs no recompute. From the first
  // rematerialized micro-batch on, every later one too (one kept whole then keeps its
  // activations from F to the B that follows it), so that the forwards still run in
  // micro-batch order (the loss sum's order, BatchNorm's running statistics): all of them
  // under always and except-last, the last `whole` of auto's mixed ones.
  int deferred_from(int model_stage) const {
    if (model_stage + 1 != partition.stages()) return options.micro_batches;
    int first = 0;
    while (first < options.micro_batches && !rematerialize(model_stage, first)) ++first;
    return first;
  }
  // The micro-batches model stage `model_stage` holds at once rematerialized wholly: the
  // schedule's, but on the model's last stage with every forward deferred.
  int remat_in_flight(int model_stage) const;
  // The send buffers a stage with `live` micro-batches in flight takes in turn, of each
  // direction (Stage::attach): a send posted two actions ago has found its receive by the
  // time its buffer comes round again. Rematerialized, they are what a micro-batch keeps.
  int send_ring(int live) const { return std::min(options.micro_batches, live + 2); }
  // Whether the rematerialization of model stage `model_stage` costs no recompute: every
  // rematerialized forward deferred.
  bool remat_free(int model_stage) const {
    for (int mb = 0; mb < deferred_from(model_stage); ++mb)
      if (rematerialize(model_stage, mb)) return false;
    return true;
  }
  bool selective(int model_stage) const { return remat_of(model_stage) == Remat::selective; }
  // Whether some of its micro-batches are rematerialized wholly (their outputs then wait
  // in send buffers of their own until B).
  bool rematerializes(int model_stage) const {
    const Remat r = remat_of(model_stage);
    return r == Remat::always || r == Remat::except_last || whole_of(model_stage) > 0;
  }
  // Whether model stage `model_stage` of pipeline stage `stage` keeps only its
  // micro-batches' inputs.
  bool remat_stage(int stage, int model_stage) const { return inputs_only(stage, remat_of(model_stage)); }
  // Activation bytes of model stage `model_stage` (on pipeline stage `stage`) under `mode`.
  double activation_bytes(int stage, int model_stage, Remat mode) const;
  // Beyond its activations: each micro-batch in flight keeps its input until its backward
  // (remat counts them already), and the first model stage holds the step's batch.
  double input_bytes(int stage, int model_stage, Remat mode) const;
  // Bytes the rank of pipeline stage `stage` keeps for its parameters: their values
  // (fp32, and on a GPU in bf16 the compute copy too), their gradients, and the
  // optimizer's state, 1/D of it when `sharded` (--shard-optimizer, D > 1); with
  // --overlap-steps a second copy of each fp32 one to go back to.
  struct WeightMemory {
    double values = 0, gradients = 0, state = 0;
    double sums = 0;  // with replicas: the gradient sums' receive buffers, (D-1)/D of the gradients (GroupSum)
    // --checkpoint-async: a writer's copy of its values and optimizer state (the fp32
    // values, the state's share), held for the run (io/checkpoint_async.hpp).
    double checkpoint_copy = 0;
    double total() const { return values + gradients + state + sums + checkpoint_copy; }
  };
  WeightMemory weight_memory(int stage, bool sharded) const;
  // As this run keeps them (--shard-optimizer or not).
  double weight_bytes(int stage) const { return weight_memory(stage, options.shard_optimizer).total(); }
  // The activations its model stages hold at the schedule's peak.
  double activation_bytes(int stage) const;
  // Beyond them: each model stage's inputs (input_bytes).
  double inputs_bytes(int stage) const;
  // All the rank of pipeline stage `stage` needs: weights, activations and inputs.
  double rank_bytes(int stage) const { return weight_bytes(stage) + activation_bytes(stage) + inputs_bytes(stage); }
};

// Samples per micro-batch for `options` on a grid of `replicas`: batch / (M · D).
int micro_batch_size(const RunOptions& options, int replicas);

// The plan of `options` on `ranks` ranks for `model` (built from options.model), with
// the costs --partition time measured (none: the layers' FLOPs stand in, and links are
// counted only where configured). UserError when the grid, the schedule, --balance or
// --in-flight do not fit the model and the ranks.
Plan make_plan(const RunOptions& options, int ranks, const Model& model, const MeasuredCosts& measured = {});

// Whether make_plan wants measured costs for `options`: --partition time without --balance.
bool needs_measurement(const RunOptions& options);
// Collective over `world` (every rank with the same options): the layer times on world
// rank 0 (on a model of its own, broadcast so that every rank cuts at the same layers)
// and, unless configured or off, the links: a ping-pong of one typical boundary
// activation over each link in turn, every replica at once, the slowest replica's figure.
MeasuredCosts measure_costs(const RunOptions& options, const Communicator& world);

}  // namespace mpipe
