// Schedules as data: generators, lowering, validation and simulation over a grid of
// (K, M), the text form, and the partitioner against brute force.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>

#include "mpipe/nn/model.hpp"
#include "mpipe/pipeline/plan/partition.hpp"
#include "mpipe/pipeline/schedule/schedule.hpp"
#include "temp_dir.hpp"

using namespace mpipe;

// The model stages per rank a built-in schedule runs with (the table's: interleaved any v >= 2).
bool fits(const std::string& name, int v) {
  const int wants = find_schedule_kind(name)->virtual_stages;
  return wants == 0 ? v > 1 : v == wants;
}

TEST_CASE("the schedule table: each entry's placement, formula and --in-flight rule are its generator's") {
  // Every closed form the table may give, as a function of (K, M, v).
  const std::map<std::string, std::function<double(int, int, int)>> formulas = {
      {"(K-1)/(M+K-1)", [](int K, int M, int) { return (K - 1.0) / (M + K - 1.0); }},
      {"(K-1)/(3M+K-1)", [](int K, int M, int) { return (K - 1.0) / (3.0 * M + K - 1.0); }},
      {"(K-1)/(1.5M+K-1)", [](int K, int M, int) { return (K - 1.0) / (1.5 * M + K - 1.0); }},
      {"(K-1)/(vM+K-1)", [](int K, int M, int v) { return (K - 1.0) / (static_cast<double>(v) * M + K - 1.0); }},
  };
  CHECK(schedule_names().size() == schedule_kinds().size());
  CHECK(find_schedule_kind("file:x") == nullptr);
  CHECK(schedule_choices().find("zb-h2") != std::string::npos);  // the help once lost it
  for (const ScheduleKind& kind : schedule_kinds()) {
    CAPTURE(kind.name);
    CHECK(find_schedule_kind(kind.name) == &kind);
    for (const int in_flight : {0, in_flight_of_1f1b}) {
      const bool refused_1f1b = !kind.refuses_in_flight_1f1b.empty() && in_flight == in_flight_of_1f1b;
      for (int K : {1, 2, 3, 4, 6})
        for (int M = K; M <= 3 * K; ++M) {
          const int v = kind.virtual_stages == 0 ? 2 : kind.virtual_stages;
          if (kind.name == "interleaved" && M % K != 0) continue;
          CAPTURE(K);
          CAPTURE(M);
          CAPTURE(in_flight);
          if (in_flight != 0 && (!kind.takes_in_flight || refused_1f1b)) {
            CHECK_THROWS_AS(make_schedule(kind.name, K, M, v, {nullptr, false, in_flight}), UserError);
            continue;
          }
          const Schedule s = make_schedule(kind.name, K, M, v, {nullptr, false, in_flight});
          CHECK(s.placement_table() == kind.placement(K, v));
          const std::string formula = kind.bubble_formula(in_flight);
          if (formula.empty()) continue;
          REQUIRE(formulas.count(formula) == 1);
          CHECK(simulate(lower(s), StageCosts::unit(s)).bubble_fraction == doctest::Approx(formulas.at(formula)(K, M, v)));
        }
    }
  }
}

TEST_CASE("every generated schedule is valid for K <= 16 and M <= 64, M < K included, v <= 4") {
  for (const std::string& name : schedule_names())
    for (int v : {1, 2, 3, 4}) {
      if (!fits(name, v)) continue;
      for (int K : {1, 2, 3, 4, 5, 8, 13, 16})
        for (int M : {1, 2, 3, 4, 7, 8, 16, 31, 64}) {
          if (name == "interleaved" && M % K != 0) continue;
          const Schedule s = lower(make_schedule(name, K, M, v));
          const auto problem = validate(s);
          INFO(name << " K=" << K << " M=" << M << " v=" << v << ": " << problem.value_or(""));
          CHECK(!problem.has_value());
        }
    }
}

TEST_CASE("interleaved: 1F1B's bubble divided by about v, at most M·v micro-batch stages in flight") {
  for (int K : {2, 4, 8})
    for (int v : {2, 3, 4})
      for (int groups : {1, 2, 4, 8}) {
        const int M = groups * K;
        INFO("K=" << K << " v=" << v << " M=" << M);
        const Schedule s = interleaved_schedule(K, v, M);
        const double bubble = simulate(lower(s), StageCosts::unit(s)).bubble_fraction;
        const double one_f_one_b = simulate(lower(one_f_one_b_schedule(K, M)), StageCosts::uniform(K)).bubble_fraction;
        // Megatron-LM's figure: the 1F1B bubble's (K-1) forward-backward times shrink to (K-1)/v.
        CHECK(bubble == doctest::Approx(static_cast<double>(K - 1) / (v * M + K - 1)));
        CHECK(bubble < one_f_one_b);
        for (int stage = 0; stage < K; ++stage) CHECK(in_flight(s, stage) <= M * v);
      }
  // The figure: K = 4, M = 8, v = 2: 15.8% (1F1B 27.3%).
  const Schedule s = interleaved_schedule(4, 2, 8);
  CHECK(simulate(lower(s), StageCosts::unit(s)).bubble_fraction == doctest::Approx(3.0 / 19));
  // Stage 0 holds model stages 0 and 4: the first group's forwards on 0, then on 4.
  CHECK(s.to_text().find("stage 0: 0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4") == 0);
  CHECK(s.to_text().find("stage 3: 3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1") != std::string::npos);
  CHECK_THROWS_WITH_AS(make_schedule("interleaved", 4, 6, 2), doctest::Contains("6 is not a multiple of 4"), UserError);
  CHECK_THROWS_WITH_AS(make_schedule("interleaved", 4, 8, 1), doctest::Contains("nothing to interleave"), UserError);
  CHECK_THROWS_WITH_AS(make_schedule("1f1b", 4, 8, 2), doctest::Contains("runs one stage per rank"), UserError);
}

TEST_CASE("zb-h2: zb-h1's bubble at unit costs with a longer warm-up, 2(K - s) - 1 before B and 2K - 1 before W") {
  for (int K : {1, 2, 3, 4, 5, 8})
    for (int M : {1, 2, 3, 4, 8, 16, 33}) {
      INFO("K=" << K << " M=" << M);
      const Schedule s = zb_h2_schedule(K, M);
      REQUIRE(!validate(lower(s)));
      const double bubble = simulate(lower(s), StageCosts::uniform(K, 1.0, 2.0, 1.0)).bubble_fraction;
      if (M >= K) CHECK(bubble == doctest::Approx(static_cast<double>(K - 1) / (3 * M + K - 1)));
      for (int stage = 0; stage < K; ++stage) {
        int before_b = 0, peak_b = 0;
        for (const Action& a : s.actions[stage]) {
          before_b += a.kind == ActionKind::forward ? 1 : a.kind == ActionKind::backward ? -1 : 0;
          peak_b = std::max(peak_b, before_b);
        }
        CHECK(peak_b <= 2 * (K - stage) - 1);
        CHECK(in_flight(s, stage) <= 2 * K - 1);
      }
      if (M >= 2 * K) CHECK(in_flight(s, 0) == 2 * K - 1);  // the longer warm-up: stage 0 holds more
    }
  // Where W is cheaper than F and B (this project's CPU GPT: F 3.4, B 3.6, W 2.5 ms) the
  // queued forwards fill what zb-h1 leaves idle: 11.8% against 15.1% at K = 4, M = 8;
  // and where a middle stage is slower.
  const StageCosts cpu = StageCosts::uniform(4, 3.4, 6.1, 2.5);
  CHECK(simulate(lower(zb_h2_schedule(4, 8)), cpu).bubble_fraction == doctest::Approx(0.118).epsilon(0.01));
  CHECK(simulate(lower(zb_h1_schedule(4, 8)), cpu).bubble_fraction == doctest::Approx(0.151).epsilon(0.01));
  StageCosts slow = StageCosts::uniform(4, 1.0, 2.0, 1.0);
  slow.forward[1] = 1.3, slow.backward[1] = 2.6, slow.weight[1] = 1.3;
  CHECK(simulate(lower(zb_h2_schedule(4, 8)), slow).bubble_fraction <
        simulate(lower(zb_h1_schedule(4, 8)), slow).bubble_fraction);
}

TEST_CASE("zbv: two model stages per rank in a V, the bound of a synchronized step at 1F1B's memory") {
  for (int K : {1, 2, 3, 4, 5, 8})
    for (int M : {1, 2, 3, 4, 8, 16, 33}) {
      INFO("K=" << K << " M=" << M);
      const Schedule s = zbv_schedule(K, M);
      REQUIRE(!validate(lower(s)));
      // Rank r holds model stages r and 2K-1-r: the first and the last on rank 0.
      for (int rank = 0; rank < K; ++rank) CHECK(s.stages_of(rank) == std::vector<int>{rank, 2 * K - 1 - rank});
      // Unit costs: each model stage is half a rank's layers, F = B = W = 1/2.
      const Simulation sim = simulate(lower(s), StageCosts::unit(s));
      const double zb_h1 = simulate(lower(zb_h1_schedule(K, M)), StageCosts::uniform(K, 1.0, 2.0, 1.0)).bubble_fraction;
      const double bound = static_cast<double>(K - 1) / (6 * M + K - 1);  // the last rank waits K-1 half forwards
      CHECK(sim.bubble_fraction >= bound - 1e-12);
      if (M >= K) {
        // Within 6 half-unit ticks of the bound, and below zb-h1 wherever there is a bubble.
        CHECK(sim.makespan <= (6 * M + K - 1 + 6) / 2.0 + 1e-9);
        if (K > 1) CHECK(sim.bubble_fraction < zb_h1);
      }
      // 1F1B's memory: at most 2K micro-batch model stages (K micro-batches of a whole
      // rank) between F and W on any rank.
      for (int rank = 0; rank < K; ++rank) {
        CHECK(s.splits(rank));
        CHECK(in_flight(s, rank) <= 2 * K);
      }
    }
  // The point: K = 4, M = 8 at the bound, 3/51 = 5.9% (zb-h1 11.1%, 1F1B 27.3%).
  const Schedule s = zbv_schedule(4, 8);
  CHECK(simulate(lower(s), StageCosts::unit(s)).bubble_fraction == doctest::Approx(3.0 / 51));
  // Rank 0 runs the model's first stage's warm-up, then the last stage's 1F1B with its Ws;
  // the last rank turns the V: the activation of 3F0 goes to 4F0 on the same rank.
  CHECK(s.to_text().find("stage 0: 0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7B0 7W0") == 0);
  CHECK(s.to_text().find("stage 3: 3F0 4F0 3F1 4F1") != std::string::npos);
  CHECK(lower(s).to_text().find("stage 3: 3RF0 3F0 3SF0 4RF0 4F0 4SF0") != std::string::npos);
  CHECK_THROWS_WITH_AS(make_schedule("zbv", 4, 8, 3), doctest::Contains("two model stages per rank"), UserError);
}

TEST_CASE("steps back to back (--overlap-steps) and --in-flight: zb-h2 and zbv reach no bubble, memory for bubble") {
  // A synchronized step keeps its warm-up: zb-h2 11.1% at K = 4, M = 8. Back to back the
  // next step's warm-up fills this one's cool-down: none left. 1F1B gains nothing (its
  // last stage is done first).
  const auto steady = [](const Schedule& s) { return steady_state(lower(s), StageCosts::unit(s)).bubble_fraction; };
  CHECK(simulate(lower(zb_h2_schedule(4, 8)), StageCosts::unit(zb_h2_schedule(4, 8))).bubble_fraction ==
        doctest::Approx(3.0 / 27));
  CHECK(steady(zb_h2_schedule(4, 8)) == doctest::Approx(0.0));
  CHECK(steady(one_f_one_b_schedule(4, 8)) == doctest::Approx(3.0 / 11));
  // zbv's order for one step keeps 3/51 back to back: its first rank both starts and ends
  // the step, with gaps. Ordered for steps back to back (the window search) none, at 1F1B's
  // memory; with 3K model stages between F and W (1.5 times the memory) the list
  // scheduler's order has none either, and no rank holds more than that.
  CHECK(steady(zbv_schedule(4, 8)) == doctest::Approx(3.0 / 51));
  const ScheduleOptions back_to_back{nullptr, true};
  for (const auto& [K, M] : std::vector<std::pair<int, int>>{{2, 4}, {2, 8}, {3, 6}, {3, 12}, {4, 8}, {4, 16}, {4, 32}, {5, 10}, {5, 20}, {6, 12}}) {
    INFO("K=" << K << " M=" << M);
    const Schedule s = zbv_schedule(K, M, back_to_back);
    REQUIRE(!validate(lower(s)));
    CHECK(steady(s) < 1e-9);
    for (int rank = 0; rank < K; ++rank) CHECK(in_flight(s, rank) <= 2 * K);
  }
  for (int K : {2, 3, 4}) {
    INFO("K=" << K);
    ScheduleOptions more;
    more.in_flight = 3 * K;
    const Schedule wide = zbv_schedule(K, 2 * K, more);
    REQUIRE(!validate(lower(wide)));
    CHECK(steady(wide) < 1e-9);
    for (int rank = 0; rank < K; ++rank) CHECK(in_flight(wide, rank) <= 3 * K);
  }
  // Less memory than the schedule's own: valid, slower; too little for any order of the V
  // is a UserError naming the least that works; other schedules have no such limit.
  ScheduleOptions one;
  one.in_flight = 1;
  const Schedule tight = zb_h1_schedule(4, 8, one);
  REQUIRE(!validate(lower(tight)));
  for (int rank = 0; rank < 4; ++rank) CHECK(in_flight(tight, rank) == 1);
  CHECK_THROWS_WITH_AS(make_schedule("zbv", 4, 8, 2, one), doctest::Contains("--in-flight 1 leaves zbv on 4 stages no order"),
                       UserError);
  try {
    make_schedule("zbv", 4, 8, 2, one);
  } catch (const UserError& e) {
    CHECK(e.hint() == "use --in-flight 2 or more");
  }
  CHECK_THROWS_WITH_AS(make_schedule("1f1b", 4, 8, 1, one), doctest::Contains("--schedule 1f1b has its own"), UserError);
}

TEST_CASE("ordered for steps back to back: valid, within the schedule's memory, never slower back to back than its one-step order") {
  const auto period = [](const Schedule& s, const StageCosts& costs) { return steady_state(lower(s), costs).period; };
  std::mt19937 random(11);
  std::uniform_real_distribution<double> cost(0.1, 3.0);
  for (const std::string name : {"zb-h1", "zb-h2", "zbv"})
    for (int K : {1, 2, 3, 4, 5, 6})
      for (int M : {1, 2, 3, 5, 8, 12, 16}) {
        INFO(name << " K=" << K << " M=" << M);
        const int v = name == "zbv" ? 2 : 1;
        const Schedule one = make_schedule(name, K, M, v);
        const Schedule steps = make_schedule(name, K, M, v, {nullptr, true});
        REQUIRE(!validate(lower(steps)));
        const StageCosts unit = StageCosts::unit(one);
        CHECK(period(steps, unit) <= period(one, unit) + 1e-9);
        for (int rank = 0; rank < K; ++rank)
          CHECK(in_flight(steps, rank) <= (name == "zb-h1" ? K : name == "zb-h2" ? 2 * K - 1 : 2 * K));
        // With costs: never slower back to back than the orders built for one step.
        StageCosts costs = StageCosts::uniform(K * v, 0.0, 0.0, 0.0);
        for (int m = 0; m < K * v; ++m) {
          costs.forward[m] = cost(random);
          costs.weight[m] = cost(random) / 2;
          costs.backward[m] = costs.weight[m] + cost(random);
        }
        const Schedule costed = make_schedule(name, K, M, v, {&costs, true});
        REQUIRE(!validate(lower(costed)));
        CHECK(period(costed, costs) <= period(make_schedule(name, K, M, v, {&costs}), costs) + 1e-9);
        CHECK(period(costed, costs) <= period(one, costs) + 1e-9);
      }
}

TEST_CASE("zero-bubble schedules ordered for real costs: valid for any costs, never slower than the unit-cost order") {
  std::mt19937 random(7);
  std::uniform_real_distribution<double> cost(0.0, 3.0);
  for (const std::string name : {"zb-h1", "zb-h2", "zbv"})
    for (int K : {1, 2, 3, 4, 6, 8})
      for (int M : {1, 2, 3, 5, 8, 16})
        for (int trial = 0; trial < 4; ++trial) {
          const int v = name == "zbv" ? 2 : 1;
          StageCosts costs = StageCosts::uniform(K * v, 0.0, 0.0, 0.0);
          for (int m = 0; m < K * v; ++m) {
            // Some stages without cost at all (an embedding, a loss alone), W up to the whole backward.
            const bool empty = trial == 3 && m % 3 == 0;
            costs.forward[m] = empty ? 0.0 : cost(random);
            costs.weight[m] = empty ? 0.0 : cost(random) / 2;
            costs.backward[m] = costs.weight[m] + (empty ? 0.0 : cost(random));
          }
          INFO(name << " K=" << K << " M=" << M << " trial " << trial);
          const Schedule ordered = lower(make_schedule(name, K, M, v, {&costs}));
          REQUIRE(!validate(ordered));
          const Schedule unit = lower(make_schedule(name, K, M, v));
          CHECK(simulate(ordered, costs).makespan <= simulate(unit, costs).makespan + 1e-9);
          for (int rank = 0; rank < K; ++rank) CHECK(in_flight(ordered, rank) <= (name == "zb-h1" ? K : 2 * K));
        }
  // ZB-V where W is cheaper than F and B (this project's CPU GPT: W about 0.75 F): the
  // order for those costs against the unit-cost one, K = 2, M = 8.
  const StageCosts cheap_w = StageCosts::uniform(4, 1.0, 1.75, 0.75);
  const double ordered = simulate(lower(zbv_schedule(2, 8, {&cheap_w})), cheap_w).bubble_fraction;
  const double unit = simulate(lower(zbv_schedule(2, 8)), cheap_w).bubble_fraction;
  CHECK(ordered < 0.03);
  CHECK(unit > 0.06);
}

TEST_CASE("gpipe's simulated bubble is (K-1)/(M+K-1) with equal stages") {
  for (int K : {1, 2, 4, 8, 16})
    for (int M : {1, 2, 4, 8, 32, 64}) {
      const Simulation sim = simulate(lower(gpipe_schedule(K, M)), StageCosts::uniform(K, 1.0, 2.0));
      CHECK(!sim.deadlock);
      CHECK(sim.bubble_fraction == doctest::Approx(static_cast<double>(K - 1) / (M + K - 1)));
      CHECK(sim.makespan == doctest::Approx(3.0 * (M + K - 1)));
    }
}

TEST_CASE("defer_forwards: the last stage's forwards from a micro-batch on move to just before their backwards") {
  const Schedule gpipe = lower(gpipe_schedule(2, 4));
  CHECK(defer_forwards(gpipe, 1, 4).to_text() == gpipe.to_text());  // none
  const Schedule all = defer_forwards(gpipe, 1, 0);
  CHECK(all.to_text() == "stage 0: F0 SF0 F1 SF1 F2 SF2 F3 SF3 RB0 B0 RB1 B1 RB2 B2 RB3 B3\n"
                         "stage 1: RF0 F0 B0 SB0 RF1 F1 B1 SB1 RF2 F2 B2 SB2 RF3 F3 B3 SB3\n");
  CHECK(defer_forwards(gpipe, 1, 2).to_text() == "stage 0: F0 SF0 F1 SF1 F2 SF2 F3 SF3 RB0 B0 RB1 B1 RB2 B2 RB3 B3\n"
                                                 "stage 1: RF0 F0 RF1 F1 B0 SB0 B1 SB1 RF2 F2 B2 SB2 RF3 F3 B3 SB3\n");
  // Valid for every schedule and split point; the deferred stage then holds one
  // micro-batch at a time (those not deferred aside), and at equal costs no step is longer
  // than the named schedule's, rematerialized there (each B recomputing its F first).
  for (const ScheduleKind& kind : schedule_kinds())
    for (const int K : {1, 2, 4})
      for (const int M : {4, 8}) {
        const int v = kind.name == "zbv" ? 2 : kind.name == "interleaved" ? 2 : 1;
        if (kind.name == "interleaved" && M % K != 0) continue;
        const Schedule named = lower(make_schedule(kind.name, K, M, v));
        const int last = named.model_stages() - 1;
        for (const int from : {0, M / 2}) {
          CAPTURE(kind.name);
          CAPTURE(K);
          CAPTURE(M);
          CAPTURE(from);
          const Schedule deferred = defer_forwards(named, last, from);
          CHECK(!validate(deferred));
          const int list = named.list_of(last);
          if (from == 0 && !named.splits(list)) CHECK(in_flight(deferred, list, v > 1 ? last : -1) == 1);
          const StageCosts costs = StageCosts::uniform(named.model_stages(), 1.0, 2.0);
          StageCosts recomputing = costs;
          recomputing.backward[static_cast<std::size_t>(last)] += costs.forward[static_cast<std::size_t>(last)];
          CHECK(simulate(deferred, costs).makespan <= simulate(named, recomputing).makespan + 1e-9);
        }
      }
}

TEST_CASE("1f1b has gpipe's bubble but at most K - s micro-batches in flight on stage s") {
  for (int K : {2, 4, 8})
    for (int M : {1, 4, 16, 64}) {
      const Schedule s = one_f_one_b_schedule(K, M);
      const double bubble = simulate(lower(s), StageCosts::uniform(K)).bubble_fraction;
      CHECK(bubble == doctest::Approx(static_cast<double>(K - 1) / (M + K - 1)));
      for (int stage = 0; stage < K; ++stage) {
        int live = 0, peak = 0;
        for (const Action& a : s.actions[stage]) {
          live += a.kind == ActionKind::forward ? 1 : -1;
          peak = std::max(peak, live);
        }
        CHECK(peak == std::min(K - stage, M));
      }
    }
}

TEST_CASE("zb-h1: a third of 1F1B's bubble at unit costs, K between F and W, K - s between F and B") {
  for (int K : {1, 2, 3, 4, 5, 8})
    for (int M : {1, 2, 3, 4, 8, 16, 33}) {
      INFO("K=" << K << " M=" << M);
      const Schedule s = zb_h1_schedule(K, M);
      // F = 1, B + W = 2, split into B = W = 1.
      const double bubble = simulate(lower(s), StageCosts::uniform(K, 1.0, 2.0, 1.0)).bubble_fraction;
      const double one_f_one_b = simulate(lower(one_f_one_b_schedule(K, M)), StageCosts::uniform(K)).bubble_fraction;
      CHECK(bubble <= one_f_one_b + 1e-12);
      // From M >= K on, the lower bound: the last stage's wait for the first forward.
      if (M >= K) CHECK(bubble == doctest::Approx(static_cast<double>(K - 1) / (3 * M + K - 1)));
      for (int stage = 0; stage < K; ++stage) {
        CHECK(s.splits(stage));
        int before_b = 0, before_w = 0, peak_b = 0;
        for (const Action& a : s.actions[stage]) {
          before_b += a.kind == ActionKind::forward ? 1 : a.kind == ActionKind::backward ? -1 : 0;
          before_w += a.kind == ActionKind::forward ? 1 : a.kind == ActionKind::weight ? -1 : 0;
          peak_b = std::max(peak_b, before_b);
        }
        CHECK(peak_b <= K - stage);
        CHECK(in_flight(s, stage) <= K);
      }
      CHECK(in_flight(s, 0) == std::min(K, M));
    }
  // The figure: K = 4, M = 8 predicted 11.1% (1F1B: 27.3%).
  CHECK(simulate(lower(zb_h1_schedule(4, 8)), StageCosts::uniform(4, 1.0, 2.0, 1.0)).bubble_fraction ==
        doctest::Approx(3.0 / 27));
  // Its text, as the zero-bubble paper draws it: stage 0 does 1F1B with each W right after
  // its B, the last stage defers Ws into what would be its bubble.
  const std::string text = zb_h1_schedule(4, 8).to_text();
  CHECK(text.find("stage 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5") != std::string::npos);
  CHECK(text.find("stage 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1") != std::string::npos);
}

TEST_CASE("zb-h1 and zb-h2 at 1F1B's memory (--in-flight 1f1b): K - s between F and W, (K-1)/(1.5M+K-1) at unit costs") {
  ScheduleOptions as_1f1b;
  as_1f1b.in_flight = in_flight_of_1f1b;
  std::mt19937 random(5);
  std::uniform_real_distribution<double> cost(0.1, 3.0);
  for (const std::string name : {"zb-h1", "zb-h2"})
    for (int K : {1, 2, 3, 4, 5, 8})
      for (int M : {1, 2, 3, 4, 7, 8, 16, 33}) {
        INFO(name << " K=" << K << " M=" << M);
        const Schedule s = make_schedule(name, K, M, 1, as_1f1b);
        REQUIRE(!validate(lower(s)));
        const Schedule one_f_one_b = one_f_one_b_schedule(K, M);
        // Every rank holds what 1F1B holds on it, F to W against F to B: its memory.
        for (int stage = 0; stage < K; ++stage) {
          CHECK(s.splits(stage));
          CHECK(in_flight(s, stage) == in_flight(one_f_one_b, stage));
        }
        const double bubble = simulate(lower(s), StageCosts::uniform(K, 1.0, 2.0, 1.0)).bubble_fraction;
        CHECK(bubble <= simulate(lower(one_f_one_b), StageCosts::uniform(K)).bubble_fraction + 1e-12);
        // Each W fills half of what 1F1B's backward leaves: 1F1B's bubble with M 1.5 times larger.
        if (M >= K) CHECK(bubble == doctest::Approx((K - 1.0) / (1.5 * M + K - 1)));
        // For any costs and steps back to back the limit holds as well.
        StageCosts costs = StageCosts::uniform(K, 0.0, 0.0, 0.0);
        for (int m = 0; m < K; ++m) {
          costs.forward[m] = cost(random);
          costs.weight[m] = cost(random) / 2;
          costs.backward[m] = costs.weight[m] + cost(random);
        }
        for (const bool back_to_back : {false, true}) {
          const Schedule costed = make_schedule(name, K, M, 1, {&costs, back_to_back, in_flight_of_1f1b});
          REQUIRE(!validate(lower(costed)));
          for (int stage = 0; stage < K; ++stage) CHECK(in_flight(costed, stage) <= in_flight(one_f_one_b, stage));
        }
      }
  // The K = 4, M = 8: 20.0% against 1F1B's 27.3% and zb-h1's own 11.1% at K micro-batches.
  CHECK(simulate(lower(zb_h1_schedule(4, 8, as_1f1b)), StageCosts::uniform(4, 1.0, 2.0, 1.0)).bubble_fraction ==
        doctest::Approx(3.0 / 15));
  // The V holds 1F1B's first rank's memory on every rank already; 1F1B's later ranks' would starve its turn.
  CHECK_THROWS_WITH_AS(make_schedule("zbv", 4, 8, 2, as_1f1b), doctest::Contains("--in-flight 1f1b with --schedule zbv"),
                       UserError);
  CHECK_THROWS_WITH_AS(make_schedule("gpipe", 4, 8, 1, as_1f1b), doctest::Contains("--schedule gpipe has its own"), UserError);
}

TEST_CASE("backwards run in ascending micro-batch order on every model stage of every schedule") {
  for (const std::string& name : schedule_names()) {
    const bool interleaved = name == "interleaved";
    const Schedule s = make_schedule(name, 4, interleaved ? 12 : 9, interleaved ? 3 : name == "zbv" ? 2 : 1);
    for (int stage = 0; stage < s.stages; ++stage) {
      std::map<int, int> last;  // model stage -> its last backward
      for (const Action& a : s.actions[stage])
        if (a.kind == ActionKind::backward) {
          const int m = s.stage_of(stage, a);
          CHECK(a.micro_batch == (last.count(m) ? last[m] : -1) + 1);
          last[m] = a.micro_batch;
        }
    }
  }
}

TEST_CASE("the validator finds broken schedules and says where") {
  Schedule s = lower(gpipe_schedule(2, 2));
  SUBCASE("a receive never sent deadlocks") {
    Schedule broken = s;
    auto& list = broken.actions[0];
    list.erase(std::find(list.begin(), list.end(), Action{ActionKind::send_act, 1}));
    const auto problem = validate(broken);
    REQUIRE(problem);
    CHECK(problem->find("RF1") != std::string::npos);
  }
  SUBCASE("a backward before its forward") {
    Schedule broken = gpipe_schedule(1, 2);
    std::swap(broken.actions[0][0], broken.actions[0][2]);  // B0 F1 F0 B1
    const auto problem = validate(lower(broken));
    REQUIRE(problem);
    CHECK(problem->find("before its forward") != std::string::npos);
  }
  SUBCASE("backwards out of order") {
    Schedule broken = gpipe_schedule(1, 2);
    std::swap(broken.actions[0][2], broken.actions[0][3]);
    const auto problem = validate(lower(broken));
    REQUIRE(problem);
    CHECK(problem->find("ascend") != std::string::npos);
  }
  SUBCASE("weight gradients: each once, after its B, ascending, on every micro-batch of a splitting stage") {
    auto problem_of = [](const std::string& line) {
      Schedule one = parse_schedule(line, "test");
      return validate(lower(one)).value_or("");
    };
    CHECK(problem_of("stage 0: F0 B0 W0 F1 B1 W1") == "");
    CHECK(problem_of("stage 0: F0 W0 B0 F1 B1 W1").find("W0 before its backward") != std::string::npos);
    CHECK(problem_of("stage 0: F0 B0 W0 W0 F1 B1 W1").find("W0 twice") != std::string::npos);
    CHECK(problem_of("stage 0: F0 B0 F1 B1 W1 W0").find("(weight gradients must ascend)") != std::string::npos);
    CHECK(problem_of("stage 0: F0 B0 W0 F1 B1").find("micro-batch 1 has no W") != std::string::npos);
  }
  SUBCASE("a cycle of waits is a deadlock, reported with the grid") {
    // Stage 0 waits for micro-batch 0's gradient before sending its activation.
    Schedule broken = lower(gpipe_schedule(2, 1));  // stage 0: F0 SF0 RB0 B0
    auto& list = broken.actions[0];
    std::rotate(list.begin(), list.begin() + 2, list.begin() + 3);  // RB0 F0 SF0 B0
    const auto problem = validate(broken);
    REQUIRE(problem);
    CHECK(problem->find("deadlock: stage 0 waits before B0 for the gradient of micro-batch 0") != std::string::npos);
    CHECK(problem->find("stage 1 waits before F0 for the activation of micro-batch 0") != std::string::npos);
  }
}

TEST_CASE("actions round-trip through their text form") {
  const Schedule s = lower(one_f_one_b_schedule(3, 5));
  for (const auto& list : s.actions)
    for (const Action& a : list) CHECK(parse_action(to_string(a)) == a);
  CHECK(to_string({ActionKind::send_grad, 12}) == "SB12");
  CHECK_THROWS(parse_action("X3"));
  CHECK_THROWS(parse_action("F"));
  CHECK(s.to_text().find("stage 2: RF0 F0 B0 SB0") == 0 + s.to_text().find("stage 2:"));
}

TEST_CASE("render draws the diagonal of gpipe") {
  const std::string grid = render(lower(gpipe_schedule(2, 2)), StageCosts::uniform(2, 1.0, 1.0));
  // Stage 0's B0 waits for stage 1's, one tick later.
  CHECK(grid.find("stage 0 F0  F1  .   .   B0  B1  ") != std::string::npos);
  CHECK(grid.find("stage 1 .   F0  F1  B0  B1  .   ") != std::string::npos);
  CHECK(grid.find("bubble 33.3%") != std::string::npos);
}

TEST_CASE("the partitioner finds the exact min-max split (brute force agrees)") {
  const std::vector<std::vector<double>> cases = {
      {1, 1, 1, 1, 1, 1, 1, 1}, {5, 1, 1, 1, 1, 5}, {9, 1, 2, 8, 3, 3, 7, 1, 1, 6}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
  for (const auto& costs : cases)
    for (int K = 1; K <= 5; ++K) {
      const Partition p = partition_min_max(costs, K);
      double worst = 0;
      for (int s = 0; s < K; ++s) {
        CHECK(p.end(s) > p.begin(s));
        worst = std::max(worst, p.stage_cost(s));
      }
      // Brute force over all cut positions.
      const int L = static_cast<int>(costs.size());
      double best = 1e300;
      std::function<void(int, int, double)> search = [&](int start, int stages_left, double so_far) {
        if (stages_left == 1) {
          double c = 0;
          for (int i = start; i < L; ++i) c += costs[i];
          best = std::min(best, std::max(so_far, c));
          return;
        }
        double c = 0;
        for (int end = start + 1; end <= L - stages_left + 1; ++end) {
          c += costs[end - 1];
          search(end, stages_left - 1, std::max(so_far, c));
        }
      };
      search(0, K, 0.0);
      CHECK(worst == best);  // integer costs: a near tie is never within 1% here
    }
}

// Calls visit(bounds) for every partition of L layers into K non-empty contiguous stages
// (bounds: K + 1 layer indices, as Partition::bounds).
static void for_each_partition(int L, int K, const std::function<void(const std::vector<int>&)>& visit) {
  std::vector<int> bounds = {0};
  std::function<void(int)> search = [&](int start) {
    if (static_cast<int>(bounds.size()) == K) {
      bounds.push_back(L);
      visit(bounds);
      bounds.pop_back();
      return;
    }
    for (int cut = start; cut <= L - (K - static_cast<int>(bounds.size())); ++cut) {
      bounds.push_back(cut);
      search(cut + 1);
      bounds.pop_back();
    }
  };
  search(1);
}

TEST_CASE("among near-optimal partitions: the fewest bytes across cuts, then the most even (brute force agrees)") {
  // Random costs and boundary sizes; every partition of L layers into K stages listed.
  std::mt19937 engine(7);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int trial = 0; trial < 60; ++trial) {
    const int L = 3 + trial % 8, K = 1 + trial % std::min(L, 5);
    std::vector<double> costs(L), bytes(static_cast<std::size_t>(L) + 1, 0.0);
    for (double& c : costs) c = std::floor(uniform(engine) * 20) + 1 + (trial % 3 == 0 ? uniform(engine) * 0.1 : 0.0);
    for (int b = 1; b < L; ++b) bytes[static_cast<std::size_t>(b)] = std::floor(uniform(engine) * 4) * 100;
    const Partition p = partition_min_max(costs, K, bytes);
    struct Found {
      double worst, crossing, squares;
    };
    std::vector<Found> all;
    for_each_partition(L, K, [&](const std::vector<int>& bounds) {
      Found f{0, 0, 0};
      for (int s = 0; s < K; ++s) {
        double c = 0;
        for (int i = bounds[s]; i < bounds[s + 1]; ++i) c += costs[static_cast<std::size_t>(i)];
        f.worst = std::max(f.worst, c);
        f.squares += c * c;
        if (s > 0) f.crossing += bytes[static_cast<std::size_t>(bounds[s])];
      }
      all.push_back(f);
    });
    double best = 1e300;
    for (const Found& f : all) best = std::min(best, f.worst);
    double fewest = 1e300, evenest = 1e300;
    for (const Found& f : all)
      if (f.worst <= best * (1 + partition_near)) fewest = std::min(fewest, f.crossing);
    for (const Found& f : all)
      if (f.worst <= best * (1 + partition_near) && f.crossing == fewest) evenest = std::min(evenest, f.squares);
    double worst = 0, crossing = 0, squares = 0;
    for (int s = 0; s < K; ++s) {
      worst = std::max(worst, p.stage_cost(s));
      squares += p.stage_cost(s) * p.stage_cost(s);
      if (s > 0) crossing += bytes[static_cast<std::size_t>(p.begin(s))];
    }
    INFO("trial ", trial, ": L ", L, ", K ", K, ", partition ", p.to_text());
    CHECK(worst <= best * (1 + partition_near));
    CHECK(crossing == fewest);
    CHECK(squares == doctest::Approx(evenest).epsilon(1e-12));
  }
}

TEST_CASE("with link costs a stage costs its layers plus both cuts over their links: exact (brute force agrees)") {
  std::mt19937 engine(11);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int trial = 0; trial < 80; ++trial) {
    const int L = 3 + trial % 8, K = 2 + trial % std::min(L - 1, 4);
    std::vector<double> costs(L), bytes(static_cast<std::size_t>(L) + 1, 0.0);
    for (double& c : costs) c = std::floor(uniform(engine) * 20) + 1;
    for (int b = 1; b < L; ++b) bytes[static_cast<std::size_t>(b)] = std::floor(uniform(engine) * 8) * 1000;
    // Per link (some slow, some fast), as many as there are cuts, or fewer (reused mod size).
    std::vector<double> link(static_cast<std::size_t>(1 + trial % (K - 1)));
    for (double& l : link) l = uniform(engine) < 0.5 ? 1e-3 : 1e-2;
    const Partition p = partition_min_max(costs, K, bytes, link);
    const auto stage = [&](int s, int begin, int end) {
      double c = 0;
      for (int i = begin; i < end; ++i) c += costs[static_cast<std::size_t>(i)];
      if (begin > 0) c += bytes[static_cast<std::size_t>(begin)] * link[static_cast<std::size_t>(s - 1) % link.size()];
      if (end < L) c += bytes[static_cast<std::size_t>(end)] * link[static_cast<std::size_t>(s) % link.size()];
      return c;
    };
    double best = 1e300;
    for_each_partition(L, K, [&](const std::vector<int>& bounds) {
      double worst = 0;
      for (int s = 0; s < K; ++s) worst = std::max(worst, stage(s, bounds[s], bounds[s + 1]));
      best = std::min(best, worst);
    });
    INFO("trial ", trial, ": L ", L, ", K ", K, ", partition ", p.to_text());
    REQUIRE(p.comm_cost.size() == static_cast<std::size_t>(K));
    double worst = 0;
    for (int s = 0; s < K; ++s) {
      CHECK(p.stage_total(s) == doctest::Approx(stage(s, p.begin(s), p.end(s))).epsilon(1e-12));
      worst = std::max(worst, p.stage_total(s));
    }
    CHECK(worst <= best * (1 + partition_near));
    CHECK(worst >= best);
  }
  // A slow link moves a cut off a big activation that the compute alone would cut at.
  const std::vector<double> costs = {1, 1, 1, 1.5}, bytes = {0, 10, 1000, 10, 0};
  CHECK(partition_min_max(costs, 2, bytes).to_text() == "0-1 | 2-3");
  CHECK(partition_min_max(costs, 2, bytes, {1e-4}).to_text() == "0-1 | 2-3");  // 2.6 against 3.001
  const Partition slow = partition_min_max(costs, 2, bytes, {1e-2});           // 12 against 3.1
  CHECK(slow.to_text() == "0-2 | 3-3");
  CHECK(slow.comm_cost == std::vector<double>{0.1, 0.1});
  CHECK(partition_min_max(costs, 2, bytes).comm_cost.empty());
}

TEST_CASE("--link-bandwidth: auto, off, or a positive number of GB/s") {
  CHECK(parse_link_bandwidth("auto") == -1);
  CHECK(parse_link_bandwidth("off") == 0);
  CHECK(parse_link_bandwidth("12.5") == doctest::Approx(1.0 / 12.5e9));
  CHECK_THROWS_AS(parse_link_bandwidth("fast"), UserError);
  CHECK_THROWS_AS(parse_link_bandwidth("0"), UserError);
  CHECK_THROWS_AS(parse_link_bandwidth("-3"), UserError);
  CHECK_THROWS_AS(parse_link_bandwidth("1e999"), UserError);
  CHECK_THROWS_AS(parse_link_bandwidth("nan"), UserError);
  CHECK_THROWS_AS(parse_link_bandwidth("4 GB/s"), UserError);
}

TEST_CASE("GPT-2 small on 8 stages: the loss stays with the LM head, no stage of the loss alone") {
  ModelConfig m;
  m.kind = "gpt";
  m.layers = 12;
  m.d_model = 768;
  m.heads = 12;
  m.seq_len = 1024;
  m.vocab = 50257;
  const Model model(m);
  const int micro = 2;
  for (int K : {2, 4, 8}) {
    const Partition p = partition_min_max(layer_costs(model, "flops", micro), K, boundary_bytes(model, micro));
    INFO("K ", K, ": ", p.to_text());
    const int loss = model.size() - 1, head = model.size() - 2;
    // (the head alone is 474.3 GFLOP, with the loss 475.0: the exact min-max split them)
    CHECK(p.stage_of(loss) == p.stage_of(head));
    for (int s = 0; s < K; ++s) CHECK(p.end(s) - p.begin(s) >= 1);
  }
}

TEST_CASE("partition errors are user errors") {
  CHECK_THROWS_AS(partition_min_max({1, 1}, 3), UserError);
  CHECK_THROWS_AS(partition_from_balance({2, 2}, 5), UserError);
  CHECK_THROWS_AS(partition_from_balance({0, 5}, 5), UserError);
  CHECK_THROWS_AS(parse_balance("2,x"), UserError);
  CHECK(partition_from_balance(parse_balance("2,3"), 5).to_text() == "0-1 | 2-4");
}

TEST_CASE("schedule files: every built-in schedule round-trips through its text, and runs as itself") {
  for (int K = 1; K <= 5; ++K)
    for (int M = 1; M <= 8; ++M)
      for (const std::string& name : schedule_names()) {
        const int v = name == "interleaved" || name == "zbv" ? 2 : 1;
        if (M % K != 0 && name == "interleaved") continue;
        CAPTURE(K);
        CAPTURE(M);
        CAPTURE(name);
        const Schedule s = make_schedule(name, K, M, v);
        const Schedule back = parse_schedule("# written by a test\n" + s.to_text() + "\n", "test");
        CHECK(back.stages == K);
        CHECK(back.micro_batches == M);
        CHECK(back.actions == s.actions);
        const auto path = mpipe::testing::test_file("schedule.txt");
        std::ofstream(path) << s.to_text();
        const Schedule read = make_schedule("file:" + path.string(), K, M, v);
        CHECK(read.actions == s.actions);
        CHECK(read.placement_table() == s.placement_table());  // zbv's V comes back from the lines
        std::filesystem::remove(path);
      }
}

TEST_CASE("schedule files: a broken one is one user error naming the file, the line or stage, and the rule") {
  const auto path = mpipe::testing::test_file("broken_schedule.txt");
  const std::string spec = "file:" + path.string();
  auto refused = [&](const std::string& text, int stages, int micro_batches) -> std::string {
    std::ofstream(path) << text;
    try {
      make_schedule(spec, stages, micro_batches);
    } catch (const UserError& e) {
      return e.what();
    }
    return "(accepted)";
  };
  auto says = [](const std::string& message, const std::string& part) {
    CAPTURE(message);
    CHECK(message.find(part) != std::string::npos);
  };
  struct Case {
    const char* text;
    int stages, micro_batches;
    const char* says;
  };
  for (const Case& c : {
           Case{"stage 0: F0 B0 F1 B1\nstage 1: F0 F1 B0 B1\n", 2, 2, "schedule.txt': deadlock: stage 0 waits before B0 for the gradient"},
           Case{"stage 0: F0 F1 B1 B0\n", 1, 2, "': stage 0: B0 after B1 (backwards must ascend)"},
           Case{"stage 0: F1 F0 B0 B1\n", 1, 2, "': stage 0: F1 before F0 (forwards must ascend)"},
           Case{"stage 0: F0 B1 F1 B0\n", 1, 2, "': stage 0: B1 before its forward"},
           Case{"stage 0: F0 F1 B0\n", 1, 2, "': stage 0: micro-batch 1 is missing F or B"},
           Case{"stage 0: F0 F1 F2 B0 B1 B2\n", 1, 2, "': stage 0: F2 is beyond the 2 micro-batches"},
           Case{"stage 0: F0 B0\nstage 1: F0 B0\n", 3, 1, "' has 2 stages, the run 3"},
           Case{"stage 0: F0 B0\nstage 2: F0 B0\n", 2, 1, "' has 2 stage lines but a stage 2"},
           Case{"stage 0: F0 B0\nstage 0: F0 B0\n", 2, 1, "' line 2: stage 0 again"},
           Case{"stage 0: F0 SF0 B0\n", 1, 1, "' line 1: SF0 is a communication action"},
           Case{"stage 0: F0 X0\n", 1, 1, "' line 1: 'X0' is not an action"},
           Case{"stages 0: F0 B0\n", 1, 1, "' line 1: expected 'stage N:'"},
           Case{"# nothing\n", 1, 1, "' has no stage lines"},
           Case{"stage 0: F0 B0 1F1 1B1\nstage 1: 1F0 1B0 F1 B1\n", 2, 2, "': stage 0: 1F1 is not on one of its model stages (0 of 2)"},
           Case{"stage 0: F99999999999\n", 1, 1, "' line 1: 'F99999999999' is not an action"},
       })
    says(refused(c.text, c.stages, c.micro_batches), c.says);
  // Virtual stages: every model stage of the list, each micro-batch on each.
  std::ofstream(path) << "stage 0: 0F0 2F0 2B0 0B0\nstage 1: 1F0 3F0 3B0 1B0\n";
  CHECK(make_schedule(spec, 2, 1, 2).virtual_stages == 2);
  std::ofstream(path) << "stage 0: 0F0 0B0\nstage 1: 1F0 3F0 3B0 1B0\n";
  CHECK_THROWS_WITH_AS(make_schedule(spec, 2, 1, 2), doctest::Contains("stage 0: micro-batch 0 on model stage 2 is missing F or B"),
                       UserError);
  std::ofstream(path) << "stage 0: 0F0 2F0 2B0 0B0\nstage 1: 1F0 3F0 3B0 1B0\n";
  CHECK_THROWS_WITH_AS(make_schedule(spec, 2, 1, 1), doctest::Contains("2F0 is not on one of its model stages (0 of 2)"),
                       UserError);
  // A file places its model stages by the lines that name them: a V, or any other
  // placement with v stages per line; one model stage on two lines is refused.
  std::ofstream(path) << "stage 0: 0F0 3F0 3B0 0B0\nstage 1: 1F0 2F0 2B0 1B0\n";
  CHECK(make_schedule(spec, 2, 1, 2).placement_table() == vee_placement(2));
  std::ofstream(path) << "stage 0: 0F0 1F0 1B0 0B0\nstage 1: 2F0 3F0 3B0 2B0\n";
  CHECK(make_schedule(spec, 2, 1, 2).placement_table() == std::vector<int>{0, 0, 1, 1});
  std::ofstream(path) << "stage 0: 0F0 1F0 1B0 0B0\nstage 1: 1F0 2F0 3F0 3B0 2B0 1B0\n";
  CHECK_THROWS_WITH_AS(make_schedule(spec, 2, 1, 2), doctest::Contains("model stage 1 is on stage 0 and on stage 1 (1F0)"),
                       UserError);
  std::ofstream(path) << "stage 0: 0F0 1F0 2F0 2B0 1B0 0B0\nstage 1: 3F0 3B0\n";
  CHECK_THROWS_WITH_AS(make_schedule(spec, 2, 1, 2), doctest::Contains("stage 0 runs model stages 0, 1, 2, not 2"), UserError);
  std::filesystem::remove(path);
  says(refused("", 1, 1), "' has no stage lines");
  std::filesystem::remove(path);
  CHECK_THROWS_WITH_AS(make_schedule(spec, 1, 1), doctest::Contains("is not a regular file"), UserError);
  CHECK_THROWS_WITH_AS(make_schedule("zb-h9", 1, 1), "unknown schedule 'zb-h9'", UserError);
}
