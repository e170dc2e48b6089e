// Schedules as data. A schedule is, for each stage, the ordered list of actions it
// runs in one training step: generators (gpipe, 1f1b, zb-h1) produce compute-only lists,
// lower() adds the sends and receives, validate() and simulate() are pure functions,
// and render() draws the step-by-stage grid. The executor interprets lowered lists.
//
// Text form of an action: F3 / B3 (forward / backward of micro-batch 3), W3 (its weight
// gradient, where the schedule splits the backward: B3 is then the input gradient alone),
// SF3 / RF3 (send / receive micro-batch 3's activation), SB3 / RB3 (send / receive its
// gradient).
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace mpipe {

enum class ActionKind : unsigned char { forward, backward, send_act, recv_act, send_grad, recv_grad, weight };

struct Action {
  ActionKind kind = ActionKind::forward;
  int micro_batch = 0;
  bool operator==(const Action&) const = default;
  bool is_compute() const {
    return kind == ActionKind::forward || kind == ActionKind::backward || kind == ActionKind::weight;
  }
};

std::string to_string(const Action& action);
Action parse_action(const std::string& text);  // Error on malformed text

struct Schedule {
  std::string name;
  int stages = 1;
  int micro_batches = 1;
  std::vector<std::vector<Action>> actions;  // [stage] -> ordered actions

  std::string to_text() const;  // one line per stage: "stage 0: F0 F1 B0 B1"
  // Whether `stage` splits its backwards: it has W actions, one per micro-batch.
  bool splits(int stage) const;
};

// Generators: compute-only lists, backward always in ascending micro-batch order.
Schedule gpipe_schedule(int stages, int micro_batches);
Schedule one_f_one_b_schedule(int stages, int micro_batches);
// ZB-H1 (Qi et al. 2023, zero bubble): B is the input gradient alone, W the weight
// gradient, which nothing waits for and which fills what would be bubbles. At most
// K - s micro-batches between F and B on stage s (1F1B's), at most K between F and W.
// Bubble at unit costs F = B = W: (K-1) / (3M + K-1), a third of 1F1B's.
Schedule zb_h1_schedule(int stages, int micro_batches);
// By name: gpipe, 1f1b, zb-h1, or file:PATH (a schedule file: parse_schedule, then checked for
// `stages` and `micro_batches` and by validate(), each problem a UserError naming the
// file, the stage and the action); UserError for an unknown name.
Schedule make_schedule(const std::string& name, int stages, int micro_batches);
// The built-in generators (file:PATH is not one).
std::vector<std::string> schedule_names();

// A schedule file's text: one line per stage, "stage S: F0 F1 B0 B1 ..." (forwards F,
// backwards B and, on a stage that splits them, weight gradients W of micro-batches, in
// the order the stage runs them; the sends and receives are inserted by lower()); blank
// lines and # comments are skipped. Stages 0 .. K-1,
// each once, in any order. UserError naming `source` and the line on a malformed one.
// Schedule::to_text() writes this form.
Schedule parse_schedule(const std::string& text, const std::string& source);

// The most micro-batches between their forward and backward (their W, where the stage
// splits) at once on `stage`: the activations the stage holds (without remat) at its peak.
int in_flight(const Schedule& schedule, int stage);

// Adds the receive before and the send after each compute action that needs one.
Schedule lower(const Schedule& compute_only);

// Per-stage costs for simulate(): seconds (or any unit) per forward / whole backward of
// one micro-batch, the part of that backward a W takes where a stage splits it (B then
// costs backward - weight), and the latency of one point-to-point message.
struct StageCosts {
  std::vector<double> forward, backward, weight;
  double message = 0.0;
  // weight < 0: half the backward.
  static StageCosts uniform(int stages, double forward = 1.0, double backward = 2.0, double weight = -1.0);
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
Simulation simulate(const Schedule& lowered, const StageCosts& costs);

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
