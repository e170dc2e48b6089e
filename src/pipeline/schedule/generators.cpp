// The schedule table and dispatch by name, with the generators that need no search:
// gpipe, 1f1b and interleaved.
#include "mpipe/pipeline/schedule/schedule.hpp"

#include <algorithm>
#include <string>

#include "mpipe/core/error.hpp"

namespace mpipe {

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
      const int within = k % (K * v), local = within / K;  // which of the list's model stages
      return Action{kind, k / (K * v) * K + within % K, (kind == ActionKind::forward ? local : v - 1 - local) * K + list};
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

std::string gpipe_bubble(int) { return "(K-1)/(M+K-1)"; }
// ZB-H1's and ZB-H2's: a third of 1F1B's with their own memory, and with 1F1B's memory
// from F to W (in_flight_of_1f1b) about half.
std::string zero_bubble_formula(int in_flight) {
  return in_flight == 0 ? "(K-1)/(3M+K-1)" : in_flight == in_flight_of_1f1b ? "(K-1)/(1.5M+K-1)" : "";
}
std::string no_formula(int) { return ""; }
std::vector<int> one_per_rank(int stages, int) { return round_robin_placement(stages, 1); }
std::vector<int> vee(int stages, int) { return vee_placement(stages); }

Schedule interleaved_checked(int stages, int micro_batches, int virtual_stages, const ScheduleOptions&) {
  MPIPE_REQUIRE(micro_batches % stages == 0,
                cat("use --micro-batches ", (micro_batches / stages + 1) * stages, " (a multiple of the ", stages,
                    " stages), as Megatron-LM does"),
                "--schedule interleaved runs the micro-batches in groups of the ", stages, " stages; ", micro_batches,
                " is not a multiple of ", stages);
  return interleaved_schedule(stages, virtual_stages, micro_batches);
}

std::vector<ScheduleKind> make_kinds() {
  std::vector<ScheduleKind> k;
  k.push_back({"gpipe", "", 1, one_per_rank,
               [](int K, int M, int, const ScheduleOptions&) { return gpipe_schedule(K, M); }, false, "", false,
               gpipe_bubble});
  k.push_back({"1f1b", "", 1, one_per_rank,
               [](int K, int M, int, const ScheduleOptions&) { return one_f_one_b_schedule(K, M); }, false, "", false,
               gpipe_bubble});
  k.push_back({"zb-h1", "zero bubble: backward split into input and weight gradients", 1, one_per_rank,
               [](int K, int M, int, const ScheduleOptions& o) { return zero_bubble_checked("zb-h1", zb_h1_schedule, K, M, o); },
               true, "", true, zero_bubble_formula});
  k.push_back({"zb-h2", "zb-h1 with a longer warm-up, about twice 1F1B's memory", 1, one_per_rank,
               [](int K, int M, int, const ScheduleOptions& o) { return zero_bubble_checked("zb-h2", zb_h2_schedule, K, M, o); },
               true, "", true, zero_bubble_formula});
  k.push_back({"interleaved", "with --virtual-stages", 0, round_robin_placement, interleaved_checked, false, "", false,
               [](int) -> std::string { return "(K-1)/(vM+K-1)"; }});
  // The V holds K micro-batches' worth on every rank (1F1B's first rank); what 1F1B holds
  // on the later ranks leaves its last rank one micro-batch across the turn: starved.
  k.push_back({"zbv", "zero bubble on two model stages per rank placed in a V", 2, vee,
               [](int K, int M, int, const ScheduleOptions& o) { return zero_bubble_checked("zbv", zbv_schedule, K, M, o); },
               true, "the V already holds 1F1B's first rank's memory on every rank", true, no_formula});
  return k;
}

}  // namespace

const std::vector<ScheduleKind>& schedule_kinds() {
  static const std::vector<ScheduleKind> kinds = make_kinds();
  return kinds;
}

const ScheduleKind* find_schedule_kind(const std::string& name) {
  for (const ScheduleKind& k : schedule_kinds())
    if (k.name == name) return &k;
  return nullptr;
}

std::vector<std::string> schedule_names() {
  std::vector<std::string> names;
  for (const ScheduleKind& k : schedule_kinds()) names.push_back(k.name);
  return names;
}

std::string schedule_choices() {
  std::vector<std::string> names = schedule_names();
  names.push_back("file:PATH");
  return either(names);
}

Schedule make_schedule(const std::string& name, int stages, int micro_batches, int virtual_stages,
                       const ScheduleOptions& options) {
  const ScheduleKind* kind = find_schedule_kind(name);
  if (options.in_flight != 0 && !(kind && kind->takes_in_flight)) {
    std::vector<std::string> taking;
    for (const ScheduleKind& k : schedule_kinds())
      if (k.takes_in_flight) taking.push_back(k.name);
    throw UserError(cat("--in-flight sets the zero-bubble schedules' memory; --schedule ", name, " has its own"),
                    cat("leave --in-flight out, or use --schedule ", either(taking)));
  }
  MPIPE_REQUIRE(!(kind && options.in_flight == in_flight_of_1f1b && !kind->refuses_in_flight_1f1b.empty()),
                cat("use --schedule zb-h1 --in-flight 1f1b, or ", name, " with a number of model stages (its own: 2K)"),
                "--in-flight 1f1b with --schedule ", name, ": ", kind ? kind->refuses_in_flight_1f1b : "");
  if (kind) {
    const int v = virtual_stages;
    if (kind->virtual_stages == 0) {
      MPIPE_REQUIRE(v >= 2, cat("give --virtual-stages 2 (or more) with --schedule ", name), "--schedule ", name,
                    " with --virtual-stages ", v, ": nothing to interleave");
    } else if (kind->virtual_stages > 1) {
      MPIPE_REQUIRE(v == kind->virtual_stages,
                    cat("leave --virtual-stages out (", name, " sets ", kind->virtual_stages, "), or give --virtual-stages ",
                        kind->virtual_stages),
                    "--schedule ", name, " runs ", kind->virtual_stages == 2 ? "two" : std::to_string(kind->virtual_stages),
                    " model stages per rank, not --virtual-stages ", v);
    } else {
      std::vector<std::string> virtual_ones;
      for (const ScheduleKind& k : schedule_kinds())
        if (k.virtual_stages != 1) virtual_ones.push_back(k.name);
      MPIPE_REQUIRE(v == 1, cat("use --schedule ", either(virtual_ones), " (or a schedule file) with --virtual-stages"),
                    "--schedule ", name, " runs one stage per rank, not --virtual-stages ", v);
    }
    return kind->generate(stages, micro_batches, v, options);
  }
  if (name.rfind("file:", 0) == 0 && name.size() > 5)
    return load_schedule_file(name.substr(5), name, stages, micro_batches, virtual_stages);
  throw UserError(cat("unknown schedule '", name, "'"), cat("use --schedule ", schedule_choices()));
}

}  // namespace mpipe
