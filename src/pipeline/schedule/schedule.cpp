// Schedules as data: actions and their text, placement, lowering (the sends and receives)
// and validate(), the rules every lowered schedule keeps.
#include "mpipe/pipeline/schedule/schedule.hpp"

#include <algorithm>
#include <map>
#include <string>

#include "mpipe/core/error.hpp"

namespace mpipe {

std::string listed(const std::vector<int>& model_stages) {
  std::string out;
  for (const int m : model_stages) out += cat(out.empty() ? "" : ", ", m);
  return out;
}

namespace {

const char* prefix(ActionKind kind) {
  switch (kind) {
    case ActionKind::forward: return "F";
    case ActionKind::backward: return "B";
    case ActionKind::send_act: return "SF";
    case ActionKind::recv_act: return "RF";
    case ActionKind::send_grad: return "SB";
    case ActionKind::recv_grad: return "RB";
    case ActionKind::weight: return "W";
  }
  return "?";
}

}  // namespace

Schedule empty_schedule(const std::string& name, int stages, int micro_batches) {
  MPIPE_CHECK(stages >= 1 && micro_batches >= 1, "stages ", stages, " micro-batches ", micro_batches);
  Schedule s;
  s.name = name;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.actions.resize(stages);
  return s;
}

std::string to_string(const Action& a) {
  return (a.stage >= 0 ? std::to_string(a.stage) : std::string()) + prefix(a.kind) + std::to_string(a.micro_batch);
}

Action parse_action(const std::string& text) {
  auto digit = [](char c) { return c >= '0' && c <= '9'; };
  const auto letters = std::find_if_not(text.begin(), text.end(), digit);
  const auto stage_digits = letters - text.begin();
  for (ActionKind kind : {ActionKind::send_act, ActionKind::recv_act, ActionKind::send_grad, ActionKind::recv_grad,
                          ActionKind::forward, ActionKind::backward, ActionKind::weight}) {
    const std::string p = prefix(kind);
    const std::string rest(letters, text.end());
    // At most 9 digits each: every number fits an int.
    if (rest.size() > p.size() && rest.size() - p.size() <= 9 && stage_digits <= 9 && rest.compare(0, p.size(), p) == 0 &&
        std::all_of(rest.begin() + static_cast<long>(p.size()), rest.end(), digit))
      return {kind, std::stoi(rest.substr(p.size())), stage_digits > 0 ? std::stoi(text.substr(0, stage_digits)) : -1};
  }
  throw Error(cat("not an action: '", text, "'"));
}

std::string Schedule::to_text() const {
  std::string out;
  for (int s = 0; s < stages; ++s) {
    out += "stage ";
    out += std::to_string(s);
    out += ':';
    for (const Action& a : actions[s]) {
      out += ' ';
      out += to_string(a);
    }
    out += '\n';
  }
  return out;
}

std::vector<int> Schedule::stages_of(int list) const {
  std::vector<int> out;
  for (int m = 0; m < model_stages(); ++m)
    if (list_of(m) == list) out.push_back(m);
  return out;
}

int Schedule::local_of(int model_stage) const {
  int local = 0;
  for (int m = 0; m < model_stage; ++m) local += list_of(m) == list_of(model_stage);
  return local;
}

std::vector<int> Schedule::placement_table() const {
  return placement.empty() ? round_robin_placement(stages, virtual_stages) : placement;
}

std::vector<int> round_robin_placement(int stages, int virtual_stages) {
  std::vector<int> out(static_cast<std::size_t>(stages * virtual_stages));
  for (std::size_t m = 0; m < out.size(); ++m) out[m] = static_cast<int>(m) % stages;
  return out;
}

std::vector<int> vee_placement(int stages) {
  std::vector<int> out(static_cast<std::size_t>(2 * stages));
  for (int s = 0; s < stages; ++s) out[static_cast<std::size_t>(s)] = out[static_cast<std::size_t>(2 * stages - 1 - s)] = s;
  return out;
}

bool Schedule::splits(int stage) const {
  const auto& list = actions[static_cast<std::size_t>(stage)];
  return std::any_of(list.begin(), list.end(), [](const Action& a) { return a.kind == ActionKind::weight; });
}

int in_flight(const Schedule& schedule, int stage, int model_stage) {
  const ActionKind last = schedule.splits(stage) ? ActionKind::weight : ActionKind::backward;
  int live = 0, peak = 0;
  for (const Action& a : schedule.actions[static_cast<std::size_t>(stage)]) {
    if (model_stage >= 0 && schedule.stage_of(stage, a) != model_stage) continue;
    if (a.kind == ActionKind::forward) peak = std::max(peak, ++live);
    else if (a.kind == last) --live;
  }
  return peak;
}

Schedule lower(const Schedule& in) {
  Schedule out = in;
  for (int stage = 0; stage < in.stages; ++stage) {
    auto& list = out.actions[stage];
    list.clear();
    for (const Action& a : in.actions[stage]) {
      MPIPE_CHECK(a.is_compute(), "lower() takes compute-only schedules, got ", to_string(a));
      const int model_stage = in.stage_of(stage, a);
      const bool first = model_stage == 0, last = model_stage == in.model_stages() - 1;
      if (a.kind == ActionKind::forward) {
        if (!first) list.push_back({ActionKind::recv_act, a.micro_batch, a.stage});
        list.push_back(a);
        if (!last) list.push_back({ActionKind::send_act, a.micro_batch, a.stage});
      } else if (a.kind == ActionKind::weight) {
        list.push_back(a);  // nothing leaves the stage
      } else {
        if (!last) list.push_back({ActionKind::recv_grad, a.micro_batch, a.stage});
        list.push_back(a);
        if (!first) list.push_back({ActionKind::send_grad, a.micro_batch, a.stage});
      }
    }
  }
  return out;
}

Schedule defer_forwards(const Schedule& lowered, int model_stage, int from) {
  Schedule out = lowered;
  if (from >= lowered.micro_batches) return out;
  const int list = lowered.list_of(model_stage);
  const std::vector<Action>& in = lowered.actions[static_cast<std::size_t>(list)];
  const auto deferred = [&](const Action& a) {
    return lowered.stage_of(list, a) == model_stage && a.micro_batch >= from &&
           (a.kind == ActionKind::recv_act || a.kind == ActionKind::forward);
  };
  std::vector<Action>& actions = out.actions[static_cast<std::size_t>(list)];
  actions.clear();
  for (const Action& a : in) {
    if (deferred(a)) continue;
    if (a.kind == ActionKind::backward && a.micro_batch >= from && lowered.stage_of(list, a) == model_stage)
      for (const Action& f : in)  // its receive and forward, in their order
        if (deferred(f) && f.micro_batch == a.micro_batch) actions.push_back(f);
    actions.push_back(a);
  }
  return out;
}

Schedule compute_only(const Schedule& lowered) {
  Schedule out = lowered;
  for (auto& list : out.actions) std::erase_if(list, [](const Action& a) { return !a.is_compute(); });
  return out;
}

std::optional<std::string> validate(const Schedule& s) {
  if (static_cast<int>(s.actions.size()) != s.stages) return cat("schedule has ", s.actions.size(), " lists for ", s.stages, " stages");
  if (!s.placement.empty() &&
      (static_cast<int>(s.placement.size()) != s.model_stages() ||
       std::any_of(s.placement.begin(), s.placement.end(), [&](int list) { return list < 0 || list >= s.stages; })))
    return cat("schedule places ", s.placement.size(), " model stages on ", s.stages, " stages, not ", s.model_stages());
  const int stages = s.model_stages(), M = s.micro_batches;
  for (int st = 0; st < s.stages; ++st) {
    // Per model stage this list holds (its placement's, ascending): where each F, B and W is.
    const int v = s.virtual_stages;
    std::vector<std::vector<int>> forward_at(v, std::vector<int>(M, -1)), backward_at = forward_at, weight_at = forward_at;
    std::vector<int> last_backward(v, -1), last_weight(v, -1);
    // A B (W): once, after its F (B), in ascending order.
    auto follows = [&](const Action& a, int i, std::vector<int>& at, const std::vector<int>& prior, const char* prior_name,
                       int& last, const char* plural) -> std::string {
      if (at[a.micro_batch] >= 0) return cat("stage ", st, ": ", to_string(a), " twice");
      if (prior[a.micro_batch] < 0) return cat("stage ", st, ": ", to_string(a), " before its ", prior_name);
      if (a.micro_batch < last)
        return cat("stage ", st, ": ", to_string(a), " after ", a.stage >= 0 ? std::to_string(a.stage) : "",
                   a.kind == ActionKind::weight ? "W" : "B", last, " (", plural, " must ascend)");
      at[a.micro_batch] = i;
      last = a.micro_batch;
      return {};
    };
    // The compute actions' places first (the sends and receives around them follow them).
    const std::vector<int> mine = s.stages_of(st);
    if (static_cast<int>(mine.size()) != v)
      return cat("stage ", st, ": runs ", mine.size(), " model stages of the placement, not ", v);
    for (const Action& a : s.actions[st]) {
      const int m = s.stage_of(st, a);
      if (a.is_compute() && (m >= stages || s.list_of(m) != st))
        return cat("stage ", st, ": ", to_string(a), " is not on one of its model stages (", listed(mine), " of ", stages, ")");
    }
    for (int i = 0; i < static_cast<int>(s.actions[st].size()); ++i) {
      const Action& a = s.actions[st][i];
      if (a.micro_batch < 0 || a.micro_batch >= M)
        return cat("stage ", st, ": ", to_string(a), " is beyond the ", M, " micro-batches");
      const int m = s.stage_of(st, a);
      if (m >= stages || s.list_of(m) != st) return cat("stage ", st, ": ", to_string(a), " is on another stage");
      const int local = s.local_of(m);
      if (a.kind == ActionKind::forward) {
        if (forward_at[local][a.micro_batch] >= 0) return cat("stage ", st, ": ", to_string(a), " twice");
        if (a.micro_batch > 0 && forward_at[local][a.micro_batch - 1] < 0)
          return cat("stage ", st, ": ", to_string(a), " before ", a.stage >= 0 ? std::to_string(a.stage) : "", "F",
                     a.micro_batch - 1, " (forwards must ascend)");
        forward_at[local][a.micro_batch] = i;
      } else if (a.kind == ActionKind::backward) {
        if (auto problem = follows(a, i, backward_at[local], forward_at[local], "forward", last_backward[local], "backwards");
            !problem.empty())
          return problem;
      } else if (a.kind == ActionKind::weight) {
        if (auto problem = follows(a, i, weight_at[local], backward_at[local], "backward", last_weight[local], "weight gradients");
            !problem.empty())
          return problem;
      }
    }
    const bool split = s.splits(st);
    for (int local = 0; local < v; ++local)
      for (int mb = 0; mb < M; ++mb) {
        const std::string where = v == 1 ? std::string() : cat(" on model stage ", mine[static_cast<std::size_t>(local)]);
        if (forward_at[local][mb] < 0 || backward_at[local][mb] < 0)
          return cat("stage ", st, ": micro-batch ", mb, where, " is missing F or B");
        if (split && weight_at[local][mb] < 0)
          return cat("stage ", st, ": micro-batch ", mb, where, " has no W (a stage with W actions needs one per micro-batch)");
      }
  }
  // Every send matched by exactly one receive on the neighbour, and every receive by a send.
  std::map<std::tuple<int, ActionKind, int>, int> sends, receives;
  for (int st = 0; st < s.stages; ++st)
    for (const Action& a : s.actions[st]) {
      const int m = s.stage_of(st, a);
      if (a.kind == ActionKind::send_act) {
        if (m + 1 >= stages) return cat("stage ", st, ": ", to_string(a), " has no next stage");
        ++sends[{m + 1, ActionKind::recv_act, a.micro_batch}];
      } else if (a.kind == ActionKind::send_grad) {
        if (m == 0) return cat("stage ", st, ": ", to_string(a), " has no previous stage");
        ++sends[{m - 1, ActionKind::recv_grad, a.micro_batch}];
      } else if (a.kind == ActionKind::recv_act || a.kind == ActionKind::recv_grad) {
        ++receives[{m, a.kind, a.micro_batch}];
      }
    }
  // The text of a receive on model stage m.
  auto receive_text = [&](const std::tuple<int, ActionKind, int>& key) {
    const int m = std::get<0>(key);
    return to_string({std::get<1>(key), std::get<2>(key), s.virtual_stages > 1 ? m : -1});
  };
  for (const auto& [key, n] : sends)
    if (n != 1 || receives[key] != 1)
      return cat("stage ", s.list_of(std::get<0>(key)), ": ", n, " sends but ", receives[key], " receives of ",
                 receive_text(key));
  for (const auto& [key, n] : receives)
    if (!sends.count(key))
      return cat("stage ", s.list_of(std::get<0>(key)), ": ", receive_text(key), " is never sent");
  // Model stages with neighbours must exchange every micro-batch.
  for (int m = 0; m < stages; ++m)
    for (int mb = 0; mb < M; ++mb) {
      const std::string where = s.virtual_stages == 1 ? std::string() : cat(" on model stage ", m);
      if (m > 0 && !receives.count({m, ActionKind::recv_act, mb}))
        return cat("stage ", s.list_of(m), ": never receives the activation of micro-batch ", mb, where);
      if (m + 1 < stages && !receives.count({m, ActionKind::recv_grad, mb}))
        return cat("stage ", s.list_of(m), ": never receives the gradient of micro-batch ", mb, where);
    }
  const Simulation sim = simulate(s, StageCosts::unit(s));
  if (sim.deadlock) return cat("deadlock: ", sim.blocked, "\n", render(s, StageCosts::unit(s)));
  return std::nullopt;
}

}  // namespace mpipe
