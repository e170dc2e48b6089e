// The plan command, and the plan as train prints it: grid, batch split, partition, memory
// per stage, bubbles and the schedule's grid; `plan --layer-kinds`.
#include "mpipe/app/plan.hpp"

#include <cstdio>
#include <fstream>

#include "mpipe/app/report.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/toml_text.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/nn/registry.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

void print_plan(const Plan& plan, const Model& model) {
  const RunOptions& o = plan.options;
  const Partition& part = plan.partition;
  const Schedule& schedule = plan.schedule;
  const int K = plan.grid.stages, D = plan.grid.replicas, M = o.micro_batches, v = o.virtual_stages;
  std::printf("grid: %d replica%s x %d stage%s = %d rank%s, rank order %s\n", D, D > 1 ? "s" : "", K, K > 1 ? "s" : "",
              D * K, D * K > 1 ? "s" : "", plan.grid.rank_order.c_str());
  std::printf("batch %d = %d replica%s x %d micro-batches of %d; schedule %s, remat %s\n", o.batch_size, D,
              D > 1 ? "s" : "", M, plan.micro_batch_size, o.schedule.c_str(), to_string(o.remat));
  if (v > 1) {
    const std::vector<int> placement = schedule.placement_table();
    const std::string where = placement == round_robin_placement(K, v) ? cat("model stage m on pipeline stage m mod ", K)
                              : placement == vee_placement(K)          ? cat("model stages s and ", 2 * K - 1, "-s on pipeline stage s (a V)")
                                                                       : std::string("placed by the schedule file");
    std::printf("virtual stages: %d per rank, %s (\"p\" below)\n", v, where.c_str());
  }
  std::printf("partition (%s): %s\n", o.balance.empty() ? to_string(o.partition) : "balance", part.to_text().c_str());
  // Skips: where each one's message goes (straight from its producer's rank to its
  // consumer's, past the stages between) and its size.
  const std::vector<double> skip_sizes = skip_bytes(model, plan.micro_batch_size);
  for (std::size_t k = 0; k < model.skips().size(); ++k) {
    const Model::Skip& skip = model.skips()[k];
    const int from = part.stage_of(skip.producer), to = part.stage_of(skip.consumer);
    const std::string route =
        from == to ? cat("within stage ", from, ": no message")
                   : cat("stage ", from, " -> ", to, " (pipeline stage ", part.pipeline_stage(from), " -> ", part.pipeline_stage(to),
                         "), ", human_bytes(skip_sizes[k]), " a micro-batch each way", to - from > 1 ? cat(", past ", to - from - 1, " stage", to - from > 2 ? "s" : "") : "");
    std::printf("skip '%s': layer %d -> %d, %s\n", skip.name.c_str(), skip.producer, skip.consumer, route.c_str());
  }
  if (!part.comm_cost.empty()) {
    // Link l joins model stage l to l + 1; with virtual stages the last one returns to rank 0.
    std::string links, work, comm;
    for (int l = 0; l < (v > 1 ? K : K - 1); ++l)
      links += cat(l ? ", " : "", l, "->", (l + 1) % K, " ",
                   fixed(1e-9 / part.link_cost_per_byte[static_cast<std::size_t>(l)], 2), " GB/s");
    for (int s = 0; s < part.stages(); ++s) {
      work += cat(s ? " / " : "", fixed(1e3 * part.stage_cost(s), 3));
      comm += cat(s ? " / " : "", fixed(1e3 * part.comm_cost[static_cast<std::size_t>(s)], 3));
    }
    std::printf("links (%s): %s; per micro-batch, ms by stage: compute %s, links %s\n",
                plan.links_measured ? "measured" : "configured", links.c_str(), work.c_str(), comm.c_str());
  }
  // The optimizer's state per rank whole, and with replicas also 1/D of it
  // (--shard-optimizer; "*" marks the one this run keeps).
  const bool shards = D > 1, sharded = shards && o.shard_optimizer;
  std::printf("%-6s %-9s %-28s %10s %12s %11s %11s %11s", "stage", "layers", "kinds", "params", "GFLOP/mb", "weights",
              "grads", sharded ? "optimizer" : shards ? "optimizer*" : "optimizer");
  if (shards) std::printf(" %12s", cat("opt. 1/", D, sharded ? "*" : "").c_str());
  std::printf(" %16s %16s %16s\n", "act. no remat", "act. selective", "act. remat");
  for (int s = 0; s < part.stages(); ++s) {
    std::string kinds;
    for (int i = part.begin(s); i < part.end(s); ++i) {
      const std::string k = model.layer(i).kind();
      if (kinds.find(k) == std::string::npos) kinds += (kinds.empty() ? "" : ",") + k;
    }
    if (kinds.size() > 28) kinds = kinds.substr(0, 25) + "...";
    const int live = plan.named_in_flight[static_cast<std::size_t>(s)];  // as named: the columns are what-ifs
    const int live_remat = plan.remat_in_flight(s);  // the last stage's forwards deferred
    const bool split = schedule.splits(schedule.list_of(s));
    const StageMemory& f = plan.memory[static_cast<std::size_t>(s)];
    const auto at = static_cast<std::size_t>(s);
    // Per model stage: its share of its rank's weights.
    const int p = schedule.list_of(s);
    double rank_params = 0;
    for (const int m : schedule.stages_of(p)) rank_params += plan.memory[static_cast<std::size_t>(m)].params;
    const double share = rank_params > 0 ? f.params / rank_params : 0.0;
    const Plan::WeightMemory whole = plan.weight_memory(p, false), piece = plan.weight_memory(p, true);
    std::printf("%-6s %-9s %-28s %10s %12.3f %11s %11s %11s",
                (v > 1 ? cat(s, " p", schedule.list_of(s)) : cat(s)).c_str(), cat(part.begin(s), "-", part.end(s) - 1).c_str(),
                kinds.c_str(), human_count(f.params).c_str(), (plan.flops.forward[at] + plan.flops.backward[at]) / 1e9,
                human_bytes(share * whole.values).c_str(), human_bytes(share * whole.gradients).c_str(),
                human_bytes(share * whole.state).c_str());
    if (shards) std::printf(" %12s", human_bytes(share * piece.state).c_str());
    std::printf(" %16s %16s %16s\n", human_bytes(f.held(live, false, split)).c_str(),
                human_bytes(f.held(live, false, split, true)).c_str(),
                human_bytes(f.held(plan.send_ring(live_remat), true, split)).c_str());
  }
  if (shards)
    std::printf("* the optimizer state this run keeps per rank: whole, or 1/%d of it with --shard-optimizer (%s)\n", D,
                sharded ? "on" : "off");
  if (!plan.stage_remat.empty()) {
    // --remat auto's choice per stage, what each rank then holds, and what recomputing costs.
    std::printf("remat auto (--memory-per-rank %s):", human_bytes(plan.options.memory_per_rank).c_str());
    for (int p = 0; p < K; ++p) {
      double extra = 0, work = 0;
      Remat mode = Remat::never;
      std::string mixed;
      for (const int m : schedule.stages_of(p)) {
        const auto at = static_cast<std::size_t>(m);
        mode = plan.stage_remat[at];
        work += plan.flops.forward[at] + plan.flops.backward[at];
        if (plan.remat_whole[at] > 0) mixed = cat(" (", plan.remat_whole[at], " of every ", plan.remat_window[at], " micro-batches wholly)");
        if (plan.deferred_from(m) < M)
          mixed += mixed.empty() ? " (forwards deferred to their backwards)" : ", deferred to their backwards";
        // Per micro-batch: a rematerialized forward again, unless deferred; a selective
        // one's recomputed parts.
        double again = 0;
        for (int mb = 0; mb < M; ++mb)
          again += plan.rematerialize(m, mb) ? (mb < plan.deferred_from(m) ? plan.flops.forward[at] : 0.0)
                   : mode == Remat::selective ? plan.memory[at].recompute_flops
                                              : 0.0;
        extra += again / M;
      }
      std::printf("%s stage %d %s%s, %s + %s, recompute +%.1f%% FLOPs", p ? ";" : "", p, to_string(mode), mixed.c_str(),
                  human_bytes(plan.weight_bytes(p)).c_str(), human_bytes(plan.activation_bytes(p)).c_str(),
                  work > 0 ? 100 * extra / work : 0.0);
    }
    std::printf("\n");
  }
  if (plan.options.checkpoint_copy) {
    // --checkpoint-async: each writer's copy, part of what the memory check counts.
    std::printf("checkpoint copy (--checkpoint-async) per writing rank:");
    for (int p = 0; p < K; ++p)
      std::printf(" %s", human_bytes(plan.weight_memory(p, plan.options.shard_optimizer).checkpoint_copy).c_str());
    std::printf(" (values and %s state, in host memory)\n", plan.options.optimizer.kind.c_str());
  }
  if (K == 1) {
    // One pipeline stage waits on no other: a percentage (always 0) suggested there could be.
    std::printf("bubble: none, one pipeline stage (no stage waits on another)\n");
  } else {
    std::printf("bubble: %.1f%% for equal stages (%s), %.1f%% predicted from this partition's FLOPs\n",
                100 * plan.equal_bubble, plan.bubble_formula.c_str(), 100 * plan.predicted_bubble);
    // Post-validation: a stage starts the next step once its own part of this one is done.
    std::printf("bubble with --overlap-steps (steps back to back, no clipping or skip): %.1f%% for equal stages, %.1f%% "
                "predicted from this partition's FLOPs\n",
                100 * plan.equal_overlap_bubble, 100 * plan.predicted_overlap_bubble);
  }
  // Split backwards: the last stage's top layers whose W is cheap (weights_in_backward_from).
  for (int s = 0; s < part.stages(); ++s) {
    const WeightsInBackward whole = weights_in_backward(model, part.begin(s), part.end(s));
    const int from = whole.from;
    const StageMemory& f = plan.memory[static_cast<std::size_t>(s)];
    if (!schedule.splits(schedule.list_of(s)) || from >= part.end(s)) continue;
    std::printf("split backward: stage %d's layers %d-%d compute their weight gradients in B (W would cost %.1f%% of the "
                "stage's backward), and give back %s a micro-batch there\n",
                s, from, part.end(s) - 1, 100 * whole.share, human_bytes(f.released).c_str());
  }
}

void print_schedule_grid(const Schedule& lowered) {
  constexpr int widest = 16;  // a grid beyond this many stages or micro-batches is no longer read at a glance
  if (lowered.stages > widest || lowered.micro_batches > widest) {
    const Simulation sim = simulate(lowered, StageCosts::unit(lowered));
    std::printf("schedule %s (forward 1 unit, backward 2 = B 1 + W 1 where split): makespan %g, bubble %.1f%% (drawn "
                "for up to %d stages and micro-batches)\n", lowered.name.c_str(), sim.makespan, 100 * sim.bubble_fraction,
                widest);
    return;
  }
  std::printf("schedule %s (forward 1 unit, backward 2 = B 1 + W 1 where split):\n%s", lowered.name.c_str(),
              render(lowered, StageCosts::unit(lowered)).c_str());
}

namespace {

// --memory-per-rank: the largest model of a preset's family that fits it on `ranks`
// ranks with this grid, schedule and remat (--remat auto choosing per stage), each rank's
// weights, gradients, optimizer state, activations and inputs counted as the plan counts
// them (the FLOPs partition): a GPT by its blocks at this width, a ResNet by its width
// at this depth. Unsharded, and with replicas also with --shard-optimizer.
void print_largest(const RunOptions& options, int ranks) {
  const bool gpt = options.model.kind == "gpt" || options.model.kind == "llama", resnet = options.model.kind == "resnet";
  if (options.memory_per_rank <= 0 || (!gpt && !resnet)) return;
  struct Fit {
    int size = 0;
    double params = 0;
  };
  // The search stops here: each try builds and plans the model (the partition is exact,
  // its cost grows with the square of the layers), and no pipeline trains more blocks
  // than this (a ResNet's width is the preset's own limit).
  constexpr int most = 4096;
  const auto largest = [&](bool shard) {
    const auto fits = [&](int size, Fit* fit) {
      RunOptions o = options;
      (gpt ? o.model.layers : o.model.width) = size;
      o.shard_optimizer = shard;
      o.partition = PartitionBy::flops;
      try {
        validate(o.model);
        const Model model(o.model);
        const Plan plan = make_plan(o, ranks, model);
        for (int s = 0; s < plan.grid.stages; ++s)
          if (plan.rank_bytes(s) > o.memory_per_rank) return false;
        *fit = {size, static_cast<double>(model.parameter_count())};
        return true;
      } catch (const UserError&) {
        return false;  // too small for the grid, or a size the preset does not take
      }
    };
    Fit best;
    int low = 0, high = 1;  // low fits (0: none found yet), high is the next to try
    while (high <= most && fits(high, &best)) low = high, high *= 2;
    if (low == 0) {  // 1 does not fit or is refused: the first size that fits at all, up to 64
      for (int size = 2; size <= 64 && low == 0; ++size)
        if (fits(size, &best)) low = size;
      if (low == 0) return Fit{};
      high = low * 2;
      while (high <= most && fits(high, &best)) low = high, high *= 2;
    }
    high = std::min(high, most + 1);
    while (high - low > 1) {  // low fits, high does not (or is past the search)
      const int middle = low + (high - low) / 2;
      Fit f;
      if (fits(middle, &f)) low = middle, best = f;
      else high = middle;
    }
    if (best.size != low) fits(low, &best);
    return best;
  };
  const auto text = [&](const Fit& f) {
    if (f.size == 0) return std::string("none (not even the smallest)");
    return cat(gpt ? "--layers " : "--width ", f.size, f.size < most ? "" : gpt ? " or more (the search stops there)" : " (the most --width takes)", " (",
               human_count(f.params), " parameters)");
  };
  const int replicas = resolve_grid(options.grid, ranks).replicas;
  std::printf("largest %s within --memory-per-rank %s: %s", gpt ? "GPT of this width" : "ResNet of this depth",
              human_bytes(options.memory_per_rank).c_str(), text(largest(false)).c_str());
  if (replicas > 1) std::printf("; with --shard-optimizer over %d replicas: %s", replicas, text(largest(true)).c_str());
  std::printf("\n");
}

}  // namespace

int run_plan(const TrainConfig& config, int ranks, const std::string& write_schedule, int ranks_per_node) {
  MPIPE_REQUIRE(ranks > 0, "e.g. --ranks 4", "--ranks must be positive, got ", ranks);
  MPIPE_REQUIRE(ranks_per_node >= 0, "e.g. --ranks-per-node 4", "--ranks-per-node must not be negative, got ",
                ranks_per_node);
  validate(config, ranks);
  const RunOptions options = run_options(config);
  Model model(options.model);
  MeasuredCosts measured;  // plan measures the layers on its own process, and no links
  if (needs_measurement(options)) {
    cpu::set_threads(config.threads > 0 ? config.threads : 1);
    measured.layer_seconds =
        measure_layer_times(model, micro_batch_size(options, resolve_grid(options.grid, ranks).replicas), options.seed);
  }
  Plan plan = make_plan(options, ranks, model, measured);
  // On nodes of ranks_per_node ranks (block placement): the rank order train would choose.
  std::string order_line;
  if (ranks_per_node > 0 && ranks_per_node < ranks) {
    std::vector<std::string> hosts(static_cast<std::size_t>(ranks));
    for (int r = 0; r < ranks; ++r) hosts[static_cast<std::size_t>(r)] = cat("node", r / ranks_per_node);
    std::string why;
    const std::string order = choose_rank_order(plan, model, hosts, &why, std::max(0.0, options.link_seconds_per_byte));
    const bool choosing = config.pipeline.grid.rank_order == "auto" && plan.grid.stages > 1 && plan.grid.replicas > 1;
    if (choosing && order != plan.grid.rank_order) {
      RunOptions chosen = options;
      chosen.grid.rank_order = order;
      plan = make_plan(chosen, ranks, model, measured);
    }
    order_line = cat("nodes: ", (ranks + ranks_per_node - 1) / ranks_per_node, " of ", ranks_per_node,
                     " ranks; bytes a step sends out of its busiest node: ", why,
                     choosing ? cat("; --rank-order auto chooses ", plan.grid.rank_order) : std::string());
  }
  std::printf("mpipe %s (git %s) plan for %d ranks\n", version(), git_hash(), ranks);
  std::printf("layers (%d):", model.size());
  for (int i = 0; i < model.size(); ++i) std::printf(" %d:%s", i, model.layer(i).kind().c_str());
  std::printf("\n");
  // Counted as Hugging Face counts them: a tied weight once.
  const std::string count = std::to_string(model.parameter_count());
  std::string grouped;
  for (std::size_t i = 0; i < count.size(); ++i) grouped += cat(i > 0 && (count.size() - i) % 3 == 0 ? "," : "", count[i]);
  std::printf("parameters: %s%s\n", grouped.c_str(), model.ties().empty() ? "" : " (a tied weight once)");
  print_plan(plan, model);
  if (!order_line.empty()) std::printf("%s\n", order_line.c_str());
  print_largest(options, ranks);
  if (needs_measurement(options) && plan.grid.stages > 1 && plan.partition.link_cost_per_byte.empty())
    std::printf("links: not counted (%s)\n", options.link_seconds_per_byte == 0
                                                  ? "--link-bandwidth off"
                                                  : "plan cannot measure them; give --link-bandwidth GB/s");
  std::printf("ranks:");
  for (int r = 0; r < ranks; ++r) std::printf(" %d=s%d/r%d", r, plan.grid.stage_of(r), plan.grid.replica_of(r));
  std::printf("\n");
  print_schedule_grid(plan.schedule);
  if (!write_schedule.empty()) {
    const int K = plan.grid.stages, v = plan.schedule.virtual_stages;
    std::ofstream out(write_schedule);
    out << cat("# mpipe schedule ", plan.schedule.name, ": ", K, " stages, ", options.micro_batches,
               " micro-batches; train with --schedule file:", write_schedule,
               v > 1 ? cat(" --virtual-stages ", v) : std::string(), "\n")
        << compute_only(plan.schedule).to_text();
    out.close();
    MPIPE_REQUIRE(out.good(), "give a path in a directory you can write", "--write-schedule: cannot write '",
                  write_schedule, "'");
    std::printf("schedule written to %s\n", write_schedule.c_str());
  }
  return 0;
}

// `plan --layer-kinds`: the registry, as a user reads it.
int print_layer_kinds() {
  const auto value_text = [](const OptionValue& v) {
    return std::visit(
        [](const auto& x) -> std::string {
          using V = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<V, bool>) return x ? "true" : "false";
          else if constexpr (std::is_same_v<V, std::string>) return x;
          else return shortest_text(x);
        },
        v);
  };
  std::printf("Layer kinds of a model file ([[layer]] tables, kind = \"...\"), with their options:\n");
  for (const LayerKind& kind : layer_kinds()) {
    std::printf("\n%s: %s\n", kind.name.c_str(), kind.help.c_str());
    for (const OptionSpec& o : kind.options)
      std::printf("  %-10s %s%s\n", o.name.c_str(), o.help.c_str(),
                  o.fallback ? cat(" (default ", value_text(*o.fallback), ")").c_str() : " (required)");
  }
  return 0;
}

}  // namespace mpipe
