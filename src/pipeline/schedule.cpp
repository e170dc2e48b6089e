// Schedule generators, lowering, validation, simulation and rendering.
#include "mpipe/pipeline/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_set>

#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

// "0, 7": model stages for a message.
std::string listed(const std::vector<int>& model_stages) {
  std::string out;
  for (const int m : model_stages) out += cat(out.empty() ? "" : ", ", m);
  return out;
}

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

Schedule empty_schedule(const std::string& name, int stages, int micro_batches) {
  MPIPE_CHECK(stages >= 1 && micro_batches >= 1, "stages ", stages, " micro-batches ", micro_batches);
  Schedule s;
  s.name = name;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.actions.resize(stages);
  return s;
}

}  // namespace

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

// GPipe: every forward, then every backward (torchgpipe's clock: micro-batch m reaches
// stage s at tick m + s).
Schedule gpipe_schedule(int stages, int micro_batches) {
  Schedule s = empty_schedule("gpipe", stages, micro_batches);
  for (int stage = 0; stage < stages; ++stage) {
    for (int mb = 0; mb < micro_batches; ++mb) s.actions[stage].push_back({ActionKind::forward, mb});
    for (int mb = 0; mb < micro_batches; ++mb) s.actions[stage].push_back({ActionKind::backward, mb});
  }
  return s;
}

// 1F1B (PipeDream-Flush): stage s runs K-1-s warm-up forwards, then alternates one
// forward and one backward, then drains the remaining backwards. At most K-s
// micro-batches are in flight on stage s instead of M.
Schedule one_f_one_b_schedule(int stages, int micro_batches) {
  Schedule s = empty_schedule("1f1b", stages, micro_batches);
  for (int stage = 0; stage < stages; ++stage) {
    const int warmup = std::min(stages - 1 - stage, micro_batches);
    auto& list = s.actions[stage];
    int next_forward = 0, next_backward = 0;
    for (; next_forward < warmup; ++next_forward) list.push_back({ActionKind::forward, next_forward});
    while (next_forward < micro_batches) {
      list.push_back({ActionKind::forward, next_forward++});
      list.push_back({ActionKind::backward, next_backward++});
    }
    while (next_backward < micro_batches) list.push_back({ActionKind::backward, next_backward++});
  }
  return s;
}

// Megatron-LM's order (schedules.py, forward_backward_pipelining_with_interleaving): the
// k-th forward of a pipeline stage is micro-batch (k / Kv)·K + k % K on its model stage
// (k % Kv) / K; backwards likewise with the model stages in reverse.
Schedule interleaved_schedule(int stages, int virtual_stages, int micro_batches) {
  const int K = stages, v = virtual_stages, M = micro_batches;
  MPIPE_CHECK(v >= 1 && M % K == 0, "interleaved: ", M, " micro-batches on ", K, " stages");
  Schedule s = empty_schedule("interleaved", K, M);
  s.virtual_stages = v;
  const int total = M * v;
  for (int list = 0; list < K; ++list) {
    auto action = [&](ActionKind kind, int k) {
      const int within = k % (K * v), chunk = within / K;
      return Action{kind, k / (K * v) * K + within % K, (kind == ActionKind::forward ? chunk : v - 1 - chunk) * K + list};
    };
    const int warmup = std::min(total, (K - list - 1) * 2 + (v - 1) * K);
    auto& out = s.actions[list];
    for (int k = 0; k < warmup; ++k) out.push_back(action(ActionKind::forward, k));
    for (int k = 0; k < total - warmup; ++k) {
      out.push_back(action(ActionKind::forward, warmup + k));
      out.push_back(action(ActionKind::backward, k));
    }
    for (int k = total - warmup; k < total; ++k) out.push_back(action(ActionKind::backward, k));
  }
  return s;
}

namespace {

// The zero-bubble schedules' list scheduler, on the simulator's clock: each action takes
// its model stage's cost, results are there when their action ends (messages take no
// time), and the list whose next action can start earliest commits it (the lower list on
// a tie). A list runs the first of these that it can start when it is free: a forward
// (its input has arrived, fewer than `before_b` micro-batches of its model stages wait
// for their B and fewer than `before_w` for their W), its later model stage first; a
// backward (its gradient has arrived), its earlier model stage first; the pending W of the
// oldest micro-batch. When none can start yet it waits for the first that can. At unit
// costs this is list scheduling by ticks; with the stages' real costs (W cheaper than F
// and B, stages unequal) it orders the actions for them.
Schedule zero_bubble(Schedule s, const StageCosts& costs, const std::vector<int>& before_b, const std::vector<int>& before_w) {
  const int K = s.stages, M = s.micro_batches, S = s.model_stages();
  MPIPE_CHECK(static_cast<int>(costs.forward.size()) == S && costs.backward.size() == costs.forward.size() &&
                  costs.weight.size() == costs.forward.size(),
              "costs for ", costs.forward.size(), " model stages, the schedule has ", S);
  std::vector<int> forwards(S, 0), backwards(S, 0), weights(S, 0);
  constexpr double never = std::numeric_limits<double>::infinity();
  // When each action's result is there; infinity: not run yet.
  std::vector<std::vector<double>> forward_done(S, std::vector<double>(M, never)), backward_done = forward_done;
  std::vector<double> free_at(K, 0.0);
  std::vector<std::vector<int>> later_first(K);
  for (int list = 0; list < K; ++list) {
    later_first[list] = s.stages_of(list);
    std::reverse(later_first[list].begin(), later_first[list].end());
  }
  struct Choice {
    double start = never;
    ActionKind kind = ActionKind::forward;
    int stage = -1;
  };
  auto choose = [&](int list) {
    const double t = free_at[list];
    int to_b = 0, to_w = 0;
    for (const int m : later_first[list]) to_b += forwards[m] - backwards[m], to_w += forwards[m] - weights[m];
    std::vector<Choice> options;  // in order of preference
    for (const int m : later_first[list]) {
      const int f = forwards[m];
      // The last place is not taken while a later model stage of the list has still to
      // forward this micro-batch and holds none whose W would free a place: that forward
      // is on the way to every B of the earlier stage (the V's turn), so taking the place
      // could leave the list with nothing to run, ever.
      int keep = 0;
      for (const int later : later_first[list])
        if (later > m && forwards[later] <= f && forwards[later] < M && forwards[later] == weights[later]) keep = 1;
      if (f < M && to_b < before_b[list] && to_w + keep < before_w[list])
        options.push_back({m == 0 ? t : std::max(t, forward_done[m - 1][f]), ActionKind::forward, m});
    }
    for (auto it = later_first[list].rbegin(); it != later_first[list].rend(); ++it) {
      const int m = *it, b = backwards[m];
      if (b < forwards[m])
        options.push_back({std::max(t, m == S - 1 ? forward_done[m][b] : backward_done[m + 1][b]), ActionKind::backward, m});
    }
    int oldest = -1;
    for (const int m : later_first[list])
      if (weights[m] < backwards[m] && (oldest < 0 || weights[m] < weights[oldest])) oldest = m;
    if (oldest >= 0) options.push_back({t, ActionKind::weight, oldest});
    Choice best;
    for (const Choice& c : options)
      if (c.start <= t) return c;  // the first that can start now
    for (const Choice& c : options)
      if (c.start < best.start) best = c;  // else the first to become ready
    return best;
  };
  for (long left = 3L * S * M; left > 0; --left) {
    Choice next;
    int list = -1;
    for (int l = 0; l < K; ++l)
      if (const Choice c = choose(l); c.start < next.start) next = c, list = l;
    MPIPE_CHECK(list >= 0, s.name, " schedule for ", K, " stages and ", M, " micro-batches makes no progress");
    const int m = next.stage;
    Action a{next.kind, 0, S > K ? m : -1};
    double cost = 0;
    if (next.kind == ActionKind::forward) {
      a.micro_batch = forwards[m]++;
      cost = costs.forward[m];
      forward_done[m][a.micro_batch] = next.start + cost;
    } else if (next.kind == ActionKind::backward) {
      a.micro_batch = backwards[m]++;
      cost = costs.backward[m] - costs.weight[m];
      backward_done[m][a.micro_batch] = next.start + cost;
    } else {
      a.micro_batch = weights[m]++;
      cost = costs.weight[m];
    }
    s.actions[static_cast<std::size_t>(list)].push_back(a);
    free_at[list] = next.start + cost;
  }
  return s;
}

// Unit costs: F = B = W = 1 per model stage.
StageCosts unit_split(int model_stages) { return StageCosts::uniform(model_stages, 1.0, 2.0, 1.0); }

// Steps back to back (--overlap-steps) a list's part of a step runs from its first action
// to its last (its window), then its next step's begins: nothing waits for the other lists
// to finish. An order in which every list's window is at most L ticks at unit costs
// repeats every L ticks or sooner (the simulator runs each list's order as early as it
// can), and L = a list's own work is no bubble at all. The list scheduler above fills one
// step from its start, which leaves gaps in the window of a list that both begins and ends
// the step (the V's first rank). This search looks for windows of L directly: depth first,
// tick by tick at unit costs, every list runs one action per tick or waits; a list waits
// before its first action as long as it likes, after it only while its window has room;
// the memory limits are the list scheduler's; a B comes first (the later model stage's),
// then a forward (likewise), then the oldest W, then waiting; and a state already tried
// (what each model stage has run, how long each list has been at it) is not tried again,
// nor one from which a started list cannot end its remaining actions within its window
// (tail_fits()). At most `budget` states: nullopt when it finds none within them.
class WindowSearch {
 public:
  WindowSearch(const Schedule& empty, const std::vector<int>& before_b, const std::vector<int>& before_w)
      : s_(empty), before_b_(before_b), before_w_(before_w) {
    const int K = s_.stages, S = s_.model_stages();
    for (int list = 0; list < K; ++list) {
      lists_.push_back(s_.stages_of(list));
      work_.push_back(3 * s_.micro_batches * static_cast<int>(lists_.back().size()));
    }
    f_.assign(S, 0), b_.assign(S, 0), w_.assign(S, 0);
  }
  // A list's longest work: no window is shorter.
  int least() const { return *std::max_element(work_.begin(), work_.end()); }

  std::optional<Schedule> run(int window, long budget, std::uint64_t seed = 0) {
    const int K = s_.stages;
    random_ = seed;
    window_ = window, budget_ = budget, nodes_ = 0, aborted_ = false, left_ = 0;
    std::fill(f_.begin(), f_.end(), 0), std::fill(b_.begin(), b_.end(), 0), std::fill(w_.begin(), w_.end(), 0);
    start_.assign(K, -1), done_.assign(K, 0);
    for (const int w : work_) left_ += w;
    seen_.clear();
    Schedule out = s_;
    for (auto& list : out.actions) list.clear();
    out_ = &out;
    if (!visit(0)) return std::nullopt;
    return out;
  }

 private:
  struct Choice {
    int stage = -1;  // -1: wait
    ActionKind kind = ActionKind::forward;
  };

  bool visit(int t) {
    const int K = s_.stages, S = s_.model_stages(), M = s_.micro_batches;
    if (left_ == 0) return true;
    if (++nodes_ > budget_) {
      aborted_ = true;
      return false;
    }
    std::uint64_t key = 0x9e3779b97f4a7c15ULL;
    const auto mix = [&key](std::uint64_t v) {
      key ^= v + 0x9e3779b97f4a7c15ULL + (key << 6) + (key >> 2);
      key *= 0xbf58476d1ce4e5b9ULL;
    };
    for (int m = 0; m < S; ++m)
      mix(static_cast<std::uint64_t>(f_[m]) | static_cast<std::uint64_t>(b_[m]) << 21 | static_cast<std::uint64_t>(w_[m]) << 42);
    for (int list = 0; list < K; ++list) mix(static_cast<std::uint64_t>(start_[list] < 0 ? -1 : t - start_[list]));
    if (!seen_.insert(key).second) return false;
    // Each started list's remaining actions cannot start before their inputs can be there
    // (each F after its micro-batch's remaining earlier forwards, each B after all its
    // remaining forwards and the later stages' remaining backwards, each W after its B,
    // a model stage's actions of a kind one after another), and the list runs one per
    // tick: a list that cannot end them within its window has lost.
    if (!tail_fits(t)) return false;
    // Every list's choices, in order of preference, from what has run before this tick.
    const int per = 3 * static_cast<int>(lists_.front().size()) + 1;
    std::vector<Choice> options(static_cast<std::size_t>(K * per));
    std::vector<int> count(K, 0);
    for (int list = 0; list < K; ++list) {
      Choice* o = &options[static_cast<std::size_t>(list * per)];
      int& n = count[list];
      const std::vector<int>& mine = lists_[list];
      if (done_[list] == work_[list]) {
        o[n++] = {};
        continue;
      }
      int to_b = 0, to_w = 0;
      for (const int m : mine) to_b += f_[m] - b_[m], to_w += f_[m] - w_[m];
      for (auto it = mine.rbegin(); it != mine.rend(); ++it)
        if (b_[*it] < f_[*it] && (*it == S - 1 || b_[*it + 1] > b_[*it])) o[n++] = {*it, ActionKind::backward};
      for (auto it = mine.rbegin(); it != mine.rend(); ++it)
        if (f_[*it] < M && to_b < before_b_[list] && to_w < before_w_[list] && (*it == 0 || f_[*it - 1] > f_[*it]))
          o[n++] = {*it, ActionKind::forward};
      for (const int m : mine)
        if (w_[m] < b_[m]) o[n++] = {m, ActionKind::weight};
      if (start_[list] < 0) {
        o[n++] = {};
      } else {
        const int used = t - start_[list] + (work_[list] - done_[list]);
        if (used > window_) return false;  // cannot end within its window any more
        if (used < window_) o[n++] = {};
      }
      if (n == 0) return false;
      // A restart other than the first takes, now and then, its second choice first.
      if (random_ && n > 1 && o[1].stage >= 0 && next_random() % 8 == 0) std::swap(o[0], o[1]);
    }
    std::vector<int> pick(K, 0);
    for (;;) {
      bool acts = false;
      for (int list = 0; list < K; ++list) acts |= options[static_cast<std::size_t>(list * per + pick[list])].stage >= 0;
      if (acts) {  // everyone waiting changes nothing
        std::vector<int> started;
        for (int list = 0; list < K; ++list) {
          const Choice c = options[static_cast<std::size_t>(list * per + pick[list])];
          if (c.stage < 0) continue;
          int& n = c.kind == ActionKind::forward ? f_[c.stage] : c.kind == ActionKind::backward ? b_[c.stage] : w_[c.stage];
          out_->actions[list].push_back({c.kind, n, S > K ? c.stage : -1});
          ++n, ++done_[list], --left_;
          if (start_[list] < 0) start_[list] = t, started.push_back(list);
        }
        if (visit(t + 1)) return true;
        for (int list = 0; list < K; ++list) {
          const Choice c = options[static_cast<std::size_t>(list * per + pick[list])];
          if (c.stage < 0) continue;
          int& n = c.kind == ActionKind::forward ? f_[c.stage] : c.kind == ActionKind::backward ? b_[c.stage] : w_[c.stage];
          out_->actions[list].pop_back();
          --n, --done_[list], ++left_;
        }
        for (const int list : started) start_[list] = -1;
        if (aborted_) return false;
      }
      int list = 0;
      while (list < K && ++pick[list] == count[list]) pick[list++] = 0;
      if (list == K) return false;
    }
  }

  bool tail_fits(int t) {
    const int K = s_.stages, S = s_.model_stages(), M = s_.micro_batches;
    // Forwards run down the model stages and backwards up them, so f_ never grows with the
    // model stage and b_ never shrinks: the stages that have still to forward micro-batch i
    // are those from first_forward_[i] on, the ones still to run its B those up to
    // last_backward_[i].
    first_forward_.assign(M, 0), last_backward_.assign(M, -1);
    for (int m = 0; m < S; ++m) {
      for (int i = 0; i < f_[m]; ++i) ++first_forward_[i];     // the stages that have forwarded i
      for (int i = b_[m]; i < M; ++i) ++last_backward_[i];     // the stages that have still to run its B
    }
    for (int list = 0; list < K; ++list) {
      if (start_[list] < 0 || done_[list] == work_[list]) continue;
      const int end = start_[list] + window_;  // every action of the list ends by then
      release_.assign(static_cast<std::size_t>(std::max(0, end - t)) + 1, 0);
      bool late = false;
      const auto add = [&](int at) {
        if (at >= end) late = true;
        else ++release_[static_cast<std::size_t>(at - t)];
      };
      for (const int m : lists_[list]) {
        int previous = t - 1;
        for (int i = f_[m]; i < M; ++i) {
          previous = std::max(previous + 1, t + std::max(0, m - first_forward_[i]));  // after the earlier stages' forwards
          add(previous);
        }
        int b_previous = t - 1;
        b_at_.assign(M, t);
        for (int i = b_[m]; i < M; ++i) {
          // after every remaining forward of micro-batch i and the later stages' backwards
          b_previous = std::max(b_previous + 1, t + (S - first_forward_[i]) + std::max(0, last_backward_[i] - m));
          b_at_[i] = b_previous;
          add(b_previous);
        }
        int w_previous = t - 1;
        for (int i = w_[m]; i < M; ++i) {
          w_previous = std::max(w_previous + 1, i >= b_[m] ? b_at_[i] + 1 : t);
          add(w_previous);
        }
      }
      if (late) return false;
      // One action per tick: from each release time on, what is released then or later.
      int after = 0;
      for (int at = end - 1; at >= t; --at) {
        after += release_[static_cast<std::size_t>(at - t)];
        if (at + after > end) return false;
      }
    }
    return true;
  }

  std::uint64_t next_random() {  // splitmix64: the same on every rank
    std::uint64_t z = (random_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  Schedule s_;
  std::uint64_t random_ = 0;
  std::vector<int> before_b_, before_w_, work_;
  std::vector<std::vector<int>> lists_;
  std::vector<int> f_, b_, w_, start_, done_;
  std::vector<int> first_forward_, last_backward_, release_, b_at_;  // tail_fits()'s
  std::unordered_set<std::uint64_t> seen_;
  Schedule* out_ = nullptr;
  int window_ = 0, left_ = 0;
  long budget_ = 0, nodes_ = 0;
  bool aborted_ = false;
};

// The shortest windows the search finds within its budget, when they are shorter than
// `greedy`'s steady state at unit costs: the least possible first, then down from the
// greedy order's period one tick at a time.
std::optional<Schedule> windowed(const Schedule& empty, const std::vector<int>& before_b, const std::vector<int>& before_w,
                                 const Schedule& greedy) {
  const StageCosts unit = unit_split(empty.model_stages());
  const double period = steady_state(lower(greedy), unit).period;
  WindowSearch search(empty, before_b, before_w);
  const int least = search.least();
  if (period <= least + 1e-9) return std::nullopt;  // no bubble already
  // States per try: each costs about one pass over the model stages' micro-batches.
  const long work = static_cast<long>(empty.model_stages()) * empty.micro_batches;
  const long per_try = std::clamp(20'000'000L / work, 2000L, 20000L);
  constexpr int tries = 8;
  const auto attempt = [&](int window) -> std::optional<Schedule> {
    for (int i = 0; i < tries; ++i)
      if (auto found = search.run(window, per_try, static_cast<std::uint64_t>(i))) return found;
    return std::nullopt;
  };
  if (auto found = attempt(least)) return found;
  std::optional<Schedule> best;
  for (int window = static_cast<int>(std::ceil(period - 1e-9)) - 1; window > least; --window) {
    auto found = attempt(window);
    if (!found) break;
    best = std::move(found);
  }
  if (best && steady_state(lower(*best), unit).period < period - 1e-9) return best;
  return std::nullopt;
}

// With costs, the order built for them or the one built for unit costs, whichever the
// simulator finds shorter at those costs (a greedy order for the real costs is not always
// the better one: stages that differ can mislead it).
// options.back_to_back (--overlap-steps): shorter is the steady state's period, not one
// step's makespan. options.in_flight replaces every list's `before_w`: with a number, by
// it; with in_flight_of_1f1b (one model stage per list), by what 1F1B holds on that list
// from F to B, K - s.
Schedule ordered_for(const Schedule& empty, const ScheduleOptions& options, const std::vector<int>& before_b,
                     std::vector<int> before_w) {
  if (options.in_flight > 0) std::fill(before_w.begin(), before_w.end(), options.in_flight);
  if (options.in_flight == in_flight_of_1f1b) {
    MPIPE_CHECK(empty.virtual_stages == 1, "--in-flight 1f1b with ", empty.virtual_stages, " model stages per rank");
    for (int list = 0; list < empty.stages; ++list) before_w[static_cast<std::size_t>(list)] = empty.stages - list;
  }
  Schedule unit = zero_bubble(empty, unit_split(empty.model_stages()), before_b, before_w);
  std::optional<Schedule> windows;
  if (options.back_to_back) windows = windowed(empty, before_b, before_w, unit);
  if (!options.costs) return windows ? *windows : unit;
  const StageCosts& costs = *options.costs;
  const auto length = [&](const Schedule& s) {
    return options.back_to_back ? steady_state(lower(s), costs).period : simulate(lower(s), costs).makespan;
  };
  Schedule best = zero_bubble(empty, costs, before_b, before_w);
  for (Schedule* other : {&unit, windows ? &*windows : nullptr})
    if (other && length(*other) <= length(best)) best = *other;
  return best;
}

}  // namespace

// ZB-H1: at most K - s micro-batches between F and B on stage s (1F1B's), K between F
// and W, which keeps stage s from holding more micro-batches than stage 0 does under 1F1B.
Schedule zb_h1_schedule(int stages, int micro_batches, const ScheduleOptions& options) {
  std::vector<int> before_b(static_cast<std::size_t>(stages)), before_w(before_b.size(), stages);
  for (int s = 0; s < stages; ++s) before_b[static_cast<std::size_t>(s)] = stages - s;
  return ordered_for(empty_schedule("zb-h1", stages, micro_batches), options, before_b, before_w);
}

// ZB-H2: the paper's longer warm-up, 2(K - s) - 1 micro-batches between F and B and 2K - 1
// between F and W: more forwards wait in the first stages' queues, so a stage whose
// forward or B is slower than the next one's still finds work.
Schedule zb_h2_schedule(int stages, int micro_batches, const ScheduleOptions& options) {
  std::vector<int> before_b(static_cast<std::size_t>(stages)), before_w(before_b.size(), 2 * stages - 1);
  for (int s = 0; s < stages; ++s) before_b[static_cast<std::size_t>(s)] = 2 * (stages - s) - 1;
  return ordered_for(empty_schedule("zb-h2", stages, micro_batches), options, before_b, before_w);
}

// ZB-V: the V placement, at most 2K micro-batch model stages between F and W on a rank
// (1F1B's stage 0: K micro-batches of a whole rank's layers), no other limit. Of the
// orders tried at unit costs (B or F first, either model stage first, limits 2K-1 to 3K)
// the scheduler's reaches the bound (K-1)/(6M+K-1) most often at that memory: for
// 2 <= K <= 8 and K <= M <= 32 in all but 12 of 196 cases, at most 6 ticks above it (a
// limit of 3K reaches it in all, and with steps back to back no bubble at all: --in-flight).
// The V's turn (stages K-1 and K on the last rank) needs no wait beyond stage order: its
// message goes from the rank to itself.
Schedule zbv_schedule(int stages, int micro_batches, const ScheduleOptions& options) {
  Schedule s = empty_schedule("zbv", stages, micro_batches);
  s.virtual_stages = 2;
  s.placement = vee_placement(stages);
  const std::vector<int> before_b(static_cast<std::size_t>(stages), std::numeric_limits<int>::max()),
      before_w(before_b.size(), 2 * stages);
  return ordered_for(s, options, before_b, before_w);
}

std::vector<std::string> schedule_names() { return {"gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved", "zbv"}; }

Schedule parse_schedule(const std::string& text, const std::string& source) {
  const std::string hint = "write one line per stage, e.g. 'stage 0: F0 F1 B0 B1' (mpipe plan --write-schedule)";
  std::map<int, std::vector<Action>> lists;
  std::istringstream in(text);
  std::string line;
  int number = 0, micro_batches = 0;
  while (std::getline(in, line)) {
    ++number;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    std::istringstream words(line);
    std::string word;
    if (!(words >> word)) continue;  // blank
    const std::string at = cat(source, " line ", number);
    std::string label;
    words >> label;
    MPIPE_REQUIRE(word == "stage" && label.size() > 1 && label.back() == ':' &&
                      std::all_of(label.begin(), label.end() - 1, [](char c) { return c >= '0' && c <= '9'; }) &&
                      label.size() <= 6,
                  hint, at, ": expected 'stage N:', got '", word, " ", label, "'");
    const int stage = std::stoi(label.substr(0, label.size() - 1));
    MPIPE_REQUIRE(!lists.count(stage), "give each stage one line", at, ": stage ", stage, " again");
    auto& list = lists[stage];
    while (words >> word) {
      Action a;
      try {
        a = parse_action(word);
      } catch (const Error&) {
        throw UserError(cat(at, ": '", word, "' is not an action"), "write F<micro-batch>, B<micro-batch> or W<micro-batch>, e.g. F3");
      }
      MPIPE_REQUIRE(a.is_compute(), "give only F, B and W actions: the sends and receives are inserted", at, ": ", word,
                    " is a communication action");
      MPIPE_REQUIRE(a.micro_batch <= 16383, "use at most 16383 micro-batches", at, ": ", word, " is beyond them");
      micro_batches = std::max(micro_batches, a.micro_batch + 1);
      list.push_back(a);
    }
  }
  MPIPE_REQUIRE(!lists.empty(), hint, source, " has no stage lines");
  const int stages = static_cast<int>(lists.size());
  MPIPE_REQUIRE(lists.rbegin()->first == stages - 1, "number the stages 0 to K-1", source, " has ", stages,
                " stage lines but a stage ", lists.rbegin()->first);
  Schedule s = empty_schedule(source, stages, std::max(micro_batches, 1));
  for (auto& [stage, list] : lists) s.actions[static_cast<std::size_t>(stage)] = std::move(list);
  return s;
}

namespace {

// A schedule file with virtual stages places each model stage on the line whose actions
// name it (a model stage no line names stays on its round-robin line, where validate()
// finds it missing); every line must then hold --virtual-stages of them.
void place_from_actions(Schedule& s, const std::string& source) {
  const int stages = s.model_stages();
  s.placement = round_robin_placement(s.stages, s.virtual_stages);
  std::vector<int> named(static_cast<std::size_t>(stages), -1);
  for (int list = 0; list < s.stages; ++list)
    for (const Action& a : s.actions[static_cast<std::size_t>(list)]) {
      const int m = s.stage_of(list, a);
      if (m >= stages) continue;  // validate() names it
      int& on = named[static_cast<std::size_t>(m)];
      MPIPE_REQUIRE(on < 0 || on == list, "run each model stage's actions on one stage (rank)", source, ": model stage ", m,
                    " is on stage ", on, " and on stage ", list, " (", to_string(a), ")");
      on = list;
    }
  for (int m = 0; m < stages; ++m)
    if (named[static_cast<std::size_t>(m)] >= 0) s.placement[static_cast<std::size_t>(m)] = named[static_cast<std::size_t>(m)];
  for (int list = 0; list < s.stages; ++list) {
    const std::vector<int> mine = s.stages_of(list);
    const std::string names = listed(mine);
    MPIPE_REQUIRE(static_cast<int>(mine.size()) == s.virtual_stages,
                  cat("give each stage ", s.virtual_stages, " model stages (--virtual-stages)"), source, ": stage ", list,
                  " runs model stage", mine.size() == 1 ? " " : "s ", names.empty() ? "none" : names, ", not ",
                  s.virtual_stages);
  }
}

// A zero-bubble generator by name; an --in-flight too small for any order is a UserError
// naming the smallest that works.
Schedule zero_bubble_checked(const std::string& name, int stages, int micro_batches, const ScheduleOptions& options) {
  const auto build = [&](const ScheduleOptions& o) {
    return name == "zb-h1" ? zb_h1_schedule(stages, micro_batches, o)
           : name == "zb-h2" ? zb_h2_schedule(stages, micro_batches, o)
                             : zbv_schedule(stages, micro_batches, o);
  };
  MPIPE_REQUIRE(options.in_flight >= 0 || options.in_flight == in_flight_of_1f1b,
                "e.g. --in-flight 8, 1f1b, or 0 for the schedule's own", "--in-flight must be >= 0, got ", options.in_flight);
  // 1F1B's own memory always leaves an order: every rank can run F, B and W of one
  // micro-batch before the next (each holds at least one whole micro-batch).
  if (options.in_flight <= 0) return build(options);
  try {
    return build(options);
  } catch (const Error&) {  // no order fits: the list scheduler made no progress
    ScheduleOptions more = options;
    const int most = 2 * micro_batches * (name == "zbv" ? 2 : 1);  // every micro-batch's every stage: no limit at all
    for (more.in_flight = options.in_flight + 1; more.in_flight < most; ++more.in_flight) {
      try {
        build(more);
        break;
      } catch (const Error&) {
      }
    }
    throw UserError(cat("--in-flight ", options.in_flight, " leaves ", name, " on ", stages,
                        " stages no order that finishes: too few micro-batches between F and W"),
                    cat("use --in-flight ", more.in_flight, " or more"));
  }
}

}  // namespace

Schedule make_schedule(const std::string& name, int stages, int micro_batches, int virtual_stages,
                       const ScheduleOptions& options) {
  MPIPE_REQUIRE(options.in_flight == 0 || name == "zb-h1" || name == "zb-h2" || name == "zbv",
                "leave --in-flight out, or use --schedule zb-h1, zb-h2 or zbv",
                "--in-flight sets the zero-bubble schedules' memory; --schedule ", name, " has its own");
  if (name == "interleaved") {
    MPIPE_REQUIRE(virtual_stages >= 2, "give --virtual-stages 2 (or more) with --schedule interleaved",
                  "--schedule interleaved with --virtual-stages ", virtual_stages, ": nothing to interleave");
    MPIPE_REQUIRE(micro_batches % stages == 0, cat("use --micro-batches ", (micro_batches / stages + 1) * stages, " (a multiple of the ", stages, " stages), as Megatron-LM does"),
                  "--schedule interleaved runs the micro-batches in groups of the ", stages, " stages; ", micro_batches,
                  " is not a multiple of ", stages);
    return interleaved_schedule(stages, virtual_stages, micro_batches);
  }
  if (name == "zbv") {
    // The V holds K micro-batches' worth on every rank (1F1B's first rank); what 1F1B holds
    // on the later ranks leaves its last rank one micro-batch across the turn: starved.
    MPIPE_REQUIRE(options.in_flight != in_flight_of_1f1b,
                  "use --schedule zb-h1 --in-flight 1f1b, or zbv with a number of model stages (its own: 2K)",
                  "--in-flight 1f1b with --schedule zbv: the V already holds 1F1B's first rank's memory on every rank");
    MPIPE_REQUIRE(virtual_stages == 2, "leave --virtual-stages out (zbv sets 2), or give --virtual-stages 2",
                  "--schedule zbv runs two model stages per rank, not --virtual-stages ", virtual_stages);
    return zero_bubble_checked(name, stages, micro_batches, options);
  }
  const std::vector<std::string> names = schedule_names();
  MPIPE_REQUIRE(virtual_stages == 1 || std::find(names.begin(), names.end(), name) == names.end(),
                "use --schedule interleaved or zbv (or a schedule file) with --virtual-stages", "--schedule ", name,
                " runs one stage per rank, not --virtual-stages ", virtual_stages);
  if (name == "gpipe") return gpipe_schedule(stages, micro_batches);
  if (name == "1f1b") return one_f_one_b_schedule(stages, micro_batches);
  if (name == "zb-h1" || name == "zb-h2") return zero_bubble_checked(name, stages, micro_batches, options);
  if (name.rfind("file:", 0) == 0 && name.size() > 5) {
    const std::string path = name.substr(5), source = cat("schedule file '", path, "'");
    std::error_code ec;
    MPIPE_REQUIRE(std::filesystem::is_regular_file(path, ec), "give the path of a schedule file (mpipe plan --write-schedule)",
                  source, " is not a regular file");
    std::ifstream file(path);
    std::ostringstream text;
    text << file.rdbuf();
    MPIPE_REQUIRE(file.good() || file.eof(), "check the file's permissions", source, " cannot be read");
    Schedule s = parse_schedule(text.str(), source);
    s.name = name;
    MPIPE_REQUIRE(s.stages == stages, cat("write one line for each of the ", stages, " stages"), source, " has ",
                  s.stages, " stages, the run ", stages);
    s.micro_batches = micro_batches;  // validate() names an action beyond them, or one missing
    s.virtual_stages = virtual_stages;  // and an action on a stage beyond them
    if (virtual_stages > 1) place_from_actions(s, source);
    if (auto problem = validate(lower(s))) {
      const std::string first_line = problem->substr(0, problem->find('\n'));
      throw UserError(cat(source, ": ", first_line), "each stage runs F0, F1, ..., B0, B1, ... (and W0, W1, ... or none) in ascending order, each B after its F and each W after its B, with no cycle of waits (docs/schedules.md)");
    }
    return s;
  }
  throw UserError(cat("unknown schedule '", name, "'"), "use --schedule gpipe, 1f1b, zb-h1, zb-h2, interleaved, zbv or file:PATH");
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
      sim.blocked += cat(sim.blocked.empty() ? "" : "; ", "stage ", st, " waits at ", to_string(a), " (",
                         a.kind == ActionKind::recv_act ? "the activation" : "the gradient", " of micro-batch ", a.micro_batch,
                         ")");
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
    std::vector<std::string> cells(columns, "." + std::string(width - 1, ' '));
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
