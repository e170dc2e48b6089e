// Schedules as data. A schedule is, for each pipeline stage (one rank of a replica), the
// ordered list of actions it runs in one training step: generators (the schedule table
// below) produce compute-only lists, lower() adds the sends and receives, validate() and
// simulate() are pure functions, and render() draws the step-by-stage grid. The executor
// interprets lowered lists. Where each part lives: schedule.cpp (actions, placement,
// lowering, validate), generators.cpp (the table, gpipe, 1f1b, interleaved, dispatch),
// zero_bubble.cpp (zb-h1, zb-h2, zbv), schedule_file.cpp (file:PATH), simulate.cpp.
//
// Virtual stages: with v > 1 the model is cut into K·v stages and a schedule's placement
// says which pipeline stage (list) runs each: round robin (stage m on m mod K, as
// Megatron-LM's interleaved schedule) unless it says otherwise, e.g. the V of ZB-V
// (stages s and 2K-1-s on pipeline stage s); each action names the stage it runs. With
// v = 1 an action's stage is its list's (-1). Everything downstream (lowering, validation,
// simulation, the partition's owners, the transport's peers) asks the placement.
//
// Text form of an action: F3 / B3 (forward / backward of micro-batch 3), W3 (its weight
// gradient, where the schedule splits the backward: B3 is then the input gradient alone),
// SF3 / RF3 (send / receive micro-batch 3's activation), SB3 / RB3 (send / receive its
// gradient); with a stage, the stage first: 5F3 is micro-batch 3's forward on stage 5.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace mpipe {

enum class ActionKind : unsigned char { forward, backward, send_act, recv_act, send_grad, recv_grad, weight };

struct Action {
  ActionKind kind = ActionKind::forward;
  int micro_batch = 0;
  int stage = -1;  // the (virtual) stage it runs on; -1: its list's only one
  bool operator==(const Action&) const = default;
  bool is_compute() const {
    return kind == ActionKind::forward || kind == ActionKind::backward || kind == ActionKind::weight;
  }
};

std::string to_string(const Action& action);
Action parse_action(const std::string& text);  // Error on malformed text

struct Schedule {
  std::string name;
  int stages = 1;          // pipeline stages K: the lists
  int virtual_stages = 1;  // v: model stages per pipeline stage
  int micro_batches = 1;
  std::vector<std::vector<Action>> actions;  // [pipeline stage] -> ordered actions
  // [model stage] -> the pipeline stage running it; empty: round robin (m mod K).
  std::vector<int> placement;

  std::string to_text() const;  // one line per stage: "stage 0: F0 F1 B0 B1"
  // Whether pipeline stage `stage` splits its backwards: it has W actions, one per
  // micro-batch (and model stage).
  bool splits(int stage) const;
  int model_stages() const { return stages * virtual_stages; }
  // The model stage action `a` of list `list` runs on, and the list holding model stage `s`.
  int stage_of(int list, const Action& a) const { return a.stage >= 0 ? a.stage : list; }
  int list_of(int model_stage) const {
    return placement.empty() ? model_stage % stages : placement[static_cast<std::size_t>(model_stage)];
  }
  // The model stages of list `list`, ascending; `model_stage`'s index among its list's.
  std::vector<int> stages_of(int list) const;
  int local_of(int model_stage) const;
  // Every model stage's pipeline stage (the placement, filled in for round robin).
  std::vector<int> placement_table() const;
};

// Round robin (model stage m on pipeline stage m mod K) and the V of ZB-V (stages s and
// 2K-1-s on pipeline stage s: the model goes down the ranks and back up).
std::vector<int> round_robin_placement(int stages, int virtual_stages);
std::vector<int> vee_placement(int stages);
// "0, 7": model stages, for a message.
std::string listed(const std::vector<int>& model_stages);
// K empty lists of `name` over `micro_batches`, for a generator or a file to fill.
Schedule empty_schedule(const std::string& name, int stages, int micro_batches);

struct StageCosts;

// How the zero-bubble generators build: `costs` per model stage (null: unit costs);
// `back_to_back` (--overlap-steps): they also search, at unit costs, for an order whose
// every list runs its part of a step without a gap (then steps back to back have no
// bubble), and of that and the orders they build for the costs and for unit costs keep
// the one whose steps run back to back faster (steady_state()), not the one whose single
// step does; `in_flight` (--in-flight): the most micro-batches (model
// stages of micro-batches for zbv) a rank holds between their F and their W, 0: the
// schedule's own (K for zb-h1, 2K - 1 for zb-h2, 2K for zbv), in_flight_of_1f1b (zb-h1
// and zb-h2): on each rank what 1F1B holds there from F to B, K - s micro-batches on rank
// s, so that every rank's activation memory is 1F1B's on it (zbv refuses it: the V holds
// 1F1B's first rank's memory on every rank, and less would starve its turn).
inline constexpr int in_flight_of_1f1b = -1;
struct ScheduleOptions {
  const StageCosts* costs = nullptr;
  bool back_to_back = false;
  int in_flight = 0;
};

// Generators: compute-only lists, backward always in ascending micro-batch order. The
// zero-bubble ones (zb-h1, zb-h2, zbv) are built by list scheduling on the simulator's
// clock with the options' costs (StageCosts below), unit costs (F = B = W) when null:
// with the stages' real costs, where W is cheaper than F and B and stages differ, they
// order the actions for those (docs/schedules.md, "Ordered for the model's costs").
Schedule gpipe_schedule(int stages, int micro_batches);
Schedule one_f_one_b_schedule(int stages, int micro_batches);
// ZB-H1 (Qi et al. 2023, zero bubble): B is the input gradient alone, W the weight
// gradient, which nothing waits for and which fills what would be bubbles. At most
// K - s micro-batches between F and B on stage s (1F1B's), at most K between F and W.
// Bubble at unit costs F = B = W: (K-1) / (3M + K-1), a third of 1F1B's.
Schedule zb_h1_schedule(int stages, int micro_batches, const ScheduleOptions& options = {});
// ZB-H2: ZB-H1 with the paper's longer warm-up, at most 2(K - s) - 1 micro-batches between
// F and B and 2K - 1 between F and W (about twice 1F1B's memory). At equal costs it has
// ZB-H1's bubble, the bound of a step that ends in a synchronized optimizer step; it
// gains where W is cheaper than F and B or a middle stage is slower: the queued forwards
// fill the gaps (docs/schedules.md, "Ordered for the model's costs").
Schedule zb_h2_schedule(int stages, int micro_batches, const ScheduleOptions& options = {});
// Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): v model stages per pipeline
// stage, run in groups of K micro-batches (all of a group's forwards on one model stage,
// then on the next); K - 1 - s pipeline stages' worth of warm-up, twice, plus (v-1)·K.
// Bubble at equal costs (K-1) / (v·M + K-1): 1F1B's divided by about v, for v times the
// messages. M must be a multiple of K.
Schedule interleaved_schedule(int stages, int virtual_stages, int micro_batches);
// ZB-V (Qi et al. 2023, section 6: zero bubble on the V placement): two model stages per rank, the
// backward split into B and W as in ZB-H1. The first rank holds the model's first and
// last stages, so the forward goes down the ranks and comes back up, and a rank's two
// stages share its work in the warm-up and the drain. A rank runs a forward while it
// holds fewer than 2K micro-batch model stages between F and W (1F1B's stage 0 memory: K
// micro-batches of a whole rank's layers), the later model stage first, else a ready B,
// the earlier model stage first, else the oldest pending W. Bubble at unit costs at or
// near the bound of a synchronized step, (K-1)/(6M+K-1): the last rank waits K-1
// half-stage forwards for its first input.
Schedule zbv_schedule(int stages, int micro_batches, const ScheduleOptions& options = {});
// One of the three above for `options`; an --in-flight too small for any order is a
// UserError naming the smallest that works.
Schedule zero_bubble_checked(const std::string& name, Schedule (*generate)(int, int, const ScheduleOptions&), int stages,
                             int micro_batches, const ScheduleOptions& options);
// The built-in schedules, one entry each (as PyTorch's pipelining keys its schedule
// classes by name): dispatch (make_schedule), the --schedule help, plan's bubble formula
// and the tests read this table; nothing else lists schedule names.
struct ScheduleKind {
  std::string name;  // --schedule NAME
  std::string help;  // a phrase for --schedule's help; may be empty
  // Model stages per rank: a fixed count (1; 2 for zbv), or 0: --virtual-stages, 2 or more.
  int virtual_stages = 1;
  // [model stage] -> the pipeline stage running it, for `stages` ranks of `virtual_stages`.
  std::vector<int> (*placement)(int stages, int virtual_stages) = nullptr;
  // Compute-only lists for K stages, M micro-batches and v model stages per rank (checked
  // against virtual_stages by make_schedule); UserError for a (K, M) the schedule cannot run.
  Schedule (*generate)(int stages, int micro_batches, int virtual_stages, const ScheduleOptions& options) = nullptr;
  bool takes_in_flight = false;    // --in-flight sets its memory (the zero-bubble schedules)
  // Why it refuses --in-flight 1f1b (1F1B's memory on each rank), or "" where it takes it.
  std::string refuses_in_flight_1f1b;
  bool ordered_for_costs = false;  // its order depends on ScheduleOptions::costs and back_to_back
  // The closed form of its bubble at equal stages for M >= K under `in_flight`, e.g.
  // "(K-1)/(M+K-1)", or "" where there is none (plan then says "simulated").
  std::string (*bubble_formula)(int in_flight) = nullptr;
};
const std::vector<ScheduleKind>& schedule_kinds();
const ScheduleKind* find_schedule_kind(const std::string& name);  // null: no built-in of that name
// The built-in names, in the table's order (file:PATH is not one).
std::vector<std::string> schedule_names();
// "gpipe, 1f1b, ..., zbv or file:PATH": what --schedule takes, for help and hints.
std::string schedule_choices();

// By name: a built-in schedule of the table (its virtual_stages checked against
// `virtual_stages`), or file:PATH (a schedule file: parse_schedule, then checked for
// `stages`, `virtual_stages` and `micro_batches` and by validate(), each problem a
// UserError naming the file, the stage and the action); UserError for an unknown name.
// `options`: for the zero-bubble generators (UserError for an in_flight set with another
// schedule, or one too small for any order).
Schedule make_schedule(const std::string& name, int stages, int micro_batches, int virtual_stages = 1,
                       const ScheduleOptions& options = {});
// file:PATH's schedule (make_schedule's checks included).
Schedule load_schedule_file(const std::string& path, const std::string& name, int stages, int micro_batches,
                            int virtual_stages);

// A schedule file's text: one line per stage, "stage S: F0 F1 B0 B1 ..." (forwards F,
// backwards B and, on a stage that splits them, weight gradients W of micro-batches, in
// the order the stage runs them; the sends and receives are inserted by lower()); blank
// lines and # comments are skipped. Stages 0 .. K-1,
// each once, in any order. UserError naming `source` and the line on a malformed one.
// Schedule::to_text() writes this form.
Schedule parse_schedule(const std::string& text, const std::string& source);

// The most micro-batches between their forward and backward (their W, where the stage
// splits) at once on `stage`: the activations the stage holds (without remat) at its peak.
// `model_stage` >= 0: only the micro-batches in flight on that one of the stage's model stages.
int in_flight(const Schedule& schedule, int stage, int model_stage = -1);

// Adds the receive before and the send after each compute action that needs one.
Schedule lower(const Schedule& compute_only);
// The compute actions of a lowered schedule alone (what lower() was given).
Schedule compute_only(const Schedule& lowered);
// `lowered` with the forwards of micro-batches `from` and later on model stage
// `model_stage` (and their receives) moved to just before their backwards: for the
// model's last stage, whose rematerialized forwards need run only there (nothing goes on
// from them; Plan::deferred_from). Forwards and backwards keep their order.
Schedule defer_forwards(const Schedule& lowered, int model_stage, int from);

// Per model stage costs for simulate(): seconds (or any unit) per forward / whole backward
// of one micro-batch, the part of that backward a W takes where a stage splits it (B then
// costs backward - weight), and the latency of one point-to-point message.
struct StageCosts {
  std::vector<double> forward, backward, weight;
  double message = 0.0;
  // weight < 0: half the backward.
  static StageCosts uniform(int stages, double forward = 1.0, double backward = 2.0, double weight = -1.0);
  // Equal pipeline stages, forward 1 and backward 2 units each (W half of it), shared
  // evenly by their model stages: what `plan` and the unit-cost bubble use.
  static StageCosts unit(const Schedule& schedule);
};

struct Simulation {
  bool deadlock = false;
  std::string blocked;                         // what each stuck stage waits for
  double makespan = 0.0;
  double bubble_fraction = 0.0;                // 1 - busy / (stages * makespan)
  std::vector<std::vector<double>> start, end; // [stage][action index]
};

// Runs a lowered schedule on one process: sends never block, a receive waits for its
// send plus the message latency, compute actions take their stage's cost.
// With `steps` > 1 it runs that many steps back to back with nothing between them but
// each stage's own order (--overlap-steps: a stage starts the next step once its own part
// of this one is done); start and end then hold the first step's times.
Simulation simulate(const Schedule& lowered, const StageCosts& costs, int steps = 1);

// The steady state of steps run back to back (--overlap-steps): the time a step takes
// once they repeat, and the idle share of the stages in it, 1 - busy / (stages * period).
struct SteadyState {
  double period = 0.0, bubble_fraction = 0.0;
};
SteadyState steady_state(const Schedule& lowered, const StageCosts& costs);
// The bubble of one step (simulate()), or of steps back to back (steady_state()).
double bubble_fraction(const Schedule& lowered, const StageCosts& costs, bool back_to_back);

// Checks a lowered schedule: every micro-batch's forward and backward exactly once per
// stage, backward after forward, on a stage with W actions one W per micro-batch after
// its B, forwards, backwards and Ws each in ascending order (the
// order BatchNorm's statistics and the gradient sums see them: bitwise the same results
// under every schedule), every send matched by one receive on the neighbour, no
// deadlock. Returns the problem (its first line names the stage and the action), or nothing.
std::optional<std::string> validate(const Schedule& lowered);

// The step-by-stage grid of the compute actions, from a unit-cost simulation.
std::string render(const Schedule& lowered, const StageCosts& costs);

}  // namespace mpipe
