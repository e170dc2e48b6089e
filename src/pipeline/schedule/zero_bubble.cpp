// The zero-bubble schedules (zb-h1, zb-h2, zbv): a list scheduler on the simulator's clock
// and, for steps back to back, a search for gap-free windows.
#include "mpipe/pipeline/schedule/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <unordered_set>

#include "mpipe/core/error.hpp"

namespace mpipe {

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
// the scheduler's reaches the bound (K-1)/(6M+K-1) most often at that memory, and never
// far above it (docs/schedules.md); a limit of 3K reaches it, and with steps back to
// back there is no bubble at all (--in-flight).
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

// An --in-flight too small for any order is a UserError naming the smallest that works.
Schedule zero_bubble_checked(const std::string& name, Schedule (*generate)(int, int, const ScheduleOptions&), int stages,
                             int micro_batches, const ScheduleOptions& options) {
  const auto build = [&](const ScheduleOptions& o) { return generate(stages, micro_batches, o); };
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

}  // namespace mpipe
