// Schedules on a clock, in one process: simulate(), the steady state of steps back to
// back, the bubble, and render(), the step-by-stage grid.
#include "mpipe/pipeline/schedule/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <sstream>
#include <tuple>

#include "mpipe/core/error.hpp"

namespace mpipe {

StageCosts StageCosts::uniform(int stages, double forward, double backward, double weight) {
  StageCosts c;
  c.forward.assign(stages, forward);
  c.backward.assign(stages, backward);
  c.weight.assign(stages, weight < 0 ? backward / 2 : weight);
  return c;
}

StageCosts StageCosts::unit(const Schedule& s) {
  const double v = s.virtual_stages;
  return uniform(s.model_stages(), 1.0 / v, 2.0 / v);
}

Simulation simulate(const Schedule& s, const StageCosts& costs, int steps) {
  const int stages = s.model_stages();
  MPIPE_CHECK(static_cast<int>(costs.forward.size()) == stages && static_cast<int>(costs.backward.size()) == stages,
              "costs for ", costs.forward.size(), " stages, schedule has ", stages);
  MPIPE_CHECK(costs.weight.size() == costs.backward.size(), "weight costs for ", costs.weight.size(), " stages");
  MPIPE_CHECK(steps >= 1, "simulate ", steps, " steps");
  Simulation sim;
  sim.start.resize(s.stages);
  sim.end.resize(s.stages);
  for (int st = 0; st < s.stages; ++st) {
    sim.start[st].assign(s.actions[st].size(), 0.0);
    sim.end[st].assign(s.actions[st].size(), 0.0);
  }
  // Arrival time of each message: key (step, receiving model stage, kind of the receive, micro-batch).
  std::map<std::tuple<int, int, ActionKind, int>, double> arrivals;
  std::vector<std::size_t> next(s.stages, 0);  // over all steps: step next / size, action next % size
  std::vector<double> clock(s.stages, 0.0), backward_cost(stages);
  for (int m = 0; m < stages; ++m)
    backward_cost[m] = s.splits(s.list_of(m)) ? costs.backward[m] - costs.weight[m] : costs.backward[m];
  double busy = 0.0;
  bool progress = true;
  while (progress) {
    progress = false;
    for (int st = 0; st < s.stages; ++st) {
      const std::size_t size = s.actions[st].size();
      while (next[st] < size * static_cast<std::size_t>(steps)) {
        const int step = static_cast<int>(next[st] / size);
        const std::size_t index = next[st] % size;
        const Action& a = s.actions[st][index];
        const int m = s.stage_of(st, a);
        double start = clock[st], end = start;
        switch (a.kind) {
          case ActionKind::forward: end = start + costs.forward[m]; busy += costs.forward[m]; break;
          case ActionKind::backward: end = start + backward_cost[m]; busy += backward_cost[m]; break;
          case ActionKind::weight: end = start + costs.weight[m]; busy += costs.weight[m]; break;
          case ActionKind::send_act:
            arrivals[{step, m + 1, ActionKind::recv_act, a.micro_batch}] = start + costs.message;
            break;
          case ActionKind::send_grad:
            arrivals[{step, m - 1, ActionKind::recv_grad, a.micro_batch}] = start + costs.message;
            break;
          case ActionKind::recv_act:
          case ActionKind::recv_grad: {
            const auto it = arrivals.find({step, m, a.kind, a.micro_batch});
            if (it == arrivals.end()) goto blocked;  // its send has not run yet
            end = std::max(start, it->second);
            arrivals.erase(it);
            break;
          }
        }
        if (step == 0) {
          sim.start[st][index] = start;
          sim.end[st][index] = end;
        }
        clock[st] = end;
        ++next[st];
        progress = true;
      }
    blocked:;
    }
  }
  for (int st = 0; st < s.stages; ++st) {
    if (next[st] < s.actions[st].size() * static_cast<std::size_t>(steps)) {
      sim.deadlock = true;
      const Action& a = s.actions[st][next[st] % s.actions[st].size()];
      // Said in the schedule's own words (F and B), not the lowered receive (RF, RB).
      const bool activation = a.kind == ActionKind::recv_act;
      sim.blocked += cat(sim.blocked.empty() ? "" : "; ", "stage ", st, " waits before ", activation ? "F" : "B",
                         a.micro_batch, " for the ", activation ? "activation" : "gradient", " of micro-batch ",
                         a.micro_batch);
    }
    sim.makespan = std::max(sim.makespan, clock[st]);
  }
  if (sim.makespan > 0) sim.bubble_fraction = 1.0 - busy / (s.stages * sim.makespan);
  return sim;
}

double bubble_fraction(const Schedule& lowered, const StageCosts& costs, bool back_to_back) {
  return back_to_back ? steady_state(lowered, costs).bubble_fraction : simulate(lowered, costs).bubble_fraction;
}

SteadyState steady_state(const Schedule& lowered, const StageCosts& costs) {
  // Steps back to back settle into a period within a few steps (each stage's lag behind
  // the one before is bounded by one step): the makespan's growth from 4 to 8 steps.
  const Simulation one = simulate(lowered, costs, 1), four = simulate(lowered, costs, 4), eight = simulate(lowered, costs, 8);
  SteadyState r;
  if (one.deadlock || four.deadlock || eight.deadlock) return r;
  r.period = (eight.makespan - four.makespan) / 4.0;
  const double busy = (1.0 - one.bubble_fraction) * lowered.stages * one.makespan;  // one step's compute
  if (r.period > 0) r.bubble_fraction = std::max(0.0, 1.0 - busy / (lowered.stages * r.period));
  return r;
}

std::string render(const Schedule& s, const StageCosts& costs) {
  const Simulation sim = simulate(s, costs);
  // One column per unit of time (per 1/v with virtual stages); a compute action fills its
  // columns with its label.
  const double unit = 1.0 / s.virtual_stages;
  const std::size_t width = s.virtual_stages == 1 ? 4 : 6;
  const auto columns = static_cast<std::size_t>(std::ceil(sim.makespan / unit - 1e-9));
  std::ostringstream out;
  out << "time    ";
  for (std::size_t c = 0; c < columns; ++c) {
    const std::string label = c % 5 == 0 ? cat(std::round(static_cast<double>(c) * unit * 100) / 100) : std::string();
    out << label << std::string(label.size() < width ? width - label.size() : 1, ' ');
  }
  out << "\n";
  for (int st = 0; st < s.stages; ++st) {
    std::string idle(width, ' ');  // a column where the stage computes nothing
    idle[0] = '.';
    std::vector<std::string> cells(columns, idle);
    for (std::size_t i = 0; i < s.actions[st].size(); ++i) {
      const Action& a = s.actions[st][i];
      if (!a.is_compute() || i >= sim.end[st].size() || sim.end[st][i] <= sim.start[st][i]) continue;
      std::string label = to_string(a);
      label.resize(width, ' ');
      const auto first = static_cast<std::size_t>(std::floor(sim.start[st][i] / unit + 1e-9));
      const auto last = static_cast<std::size_t>(std::ceil(sim.end[st][i] / unit - 1e-9));
      for (std::size_t c = first; c < columns && c < last; ++c) cells[c] = label;
    }
    out << "stage " << st << (st < 10 ? " " : "");
    for (const auto& cell : cells) out << cell;
    out << "\n";
  }
  out << cat("makespan ", std::round(sim.makespan * 1000) / 1000, ", bubble ", std::round(sim.bubble_fraction * 1000) / 10,
             "%\n");
  return out.str();
}

}  // namespace mpipe
