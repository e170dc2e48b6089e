// Sizes and counts as people read them, the phase table of a run, the op profile of a
// step, and the opening lines of a training run.
#include "mpipe/app/report.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>

#include "mpipe/app/plan.hpp"
#include "mpipe/app/process.hpp"
#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/io/checkpoint.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, ++u;
  char text[32];
  std::snprintf(text, sizeof text, u ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return text;
}

std::string fixed(double x, int digits) {
  char text[32];
  std::snprintf(text, sizeof text, "%.*f", digits, x);
  return text;
}

std::string human_count(double n) {
  char text[32];
  if (n >= 1e9) std::snprintf(text, sizeof text, "%.2fG", n / 1e9);
  else if (n >= 1e6) std::snprintf(text, sizeof text, "%.2fM", n / 1e6);
  else if (n >= 1e3) std::snprintf(text, sizeof text, "%.1fk", n / 1e3);
  else std::snprintf(text, sizeof text, "%.0f", n);
  return text;
}


std::vector<StagePhases> phase_table(const PhaseStats& mine, const Communicator& world, const Schedule& schedule,
                                     int micro_batches, double theory, bool overlapped, double* simulated) {
  const int stages = schedule.stages, v = schedule.virtual_stages;
  const std::vector<PhaseStats> all = world.gather(mine, 0);
  if (world.rank() != 0 || mine.steps == 0) return {};
  std::vector<StagePhases> rows(static_cast<std::size_t>(stages));
  StageCosts measured = StageCosts::unit(schedule);
  std::printf("time per step in ms, min / avg / max over %g steps (the first excluded) and replicas\n", mine.steps);
  std::printf("%-6s", "stage");
  for (int i = 0; i < PhaseTimes::count; ++i) std::printf(" %20s", PhaseTimes::name(i));
  std::printf("\n");
  for (int s = 0; s < stages; ++s) {
    StagePhases& row = rows[static_cast<std::size_t>(s)];
    double count = 0;
    std::fill(std::begin(row.min), std::end(row.min), std::numeric_limits<double>::infinity());
    double weight = 0;
    for (const PhaseStats& r : all) {
      if (static_cast<int>(r.stage) != s) continue;
      for (int i = 0; i < PhaseTimes::count; ++i) {
        row.min[i] = std::min(row.min[i], r.min[i]);
        row.avg[i] += r.sum[i];
        row.max[i] = std::max(row.max[i], r.max[i]);
      }
      weight += r.weight;
      count += r.steps;
    }
    for (double& a : row.avg) a /= count;
    // Per action: a recomputation is part of its backward; model stages of one pipeline
    // stage share its times evenly.
    for (const int m : schedule.stages_of(s)) {
      measured.forward[m] = row.avg[0] / (micro_batches * v);
      measured.backward[m] = (row.avg[1] + row.avg[2]) / (micro_batches * v);
      measured.weight[m] = weight / count / (micro_batches * v);
    }
    std::printf("%-6d", s);
    for (int i = 0; i < PhaseTimes::count; ++i)
      std::printf(" %20s", cat(std::round(row.min[i] * 1e4) / 10, "/", std::round(row.avg[i] * 1e4) / 10, "/",
                               std::round(row.max[i] * 1e4) / 10).c_str());
    std::printf("\n");
  }
  *simulated = bubble_fraction(schedule, measured, overlapped);
  if (stages == 1) {
    std::printf("bubble: none, one pipeline stage (no stage waits on another; idle above is waiting for replicas)\n");
    return rows;
  }
  std::printf("bubble: measured %.1f%% (mean over steps; every rank's idle up to the slowest one's end%s), schedule's "
              "theoretical %.1f%% (unit costs), %.1f%% simulated with the measured action times\n",
              100 * mine.bubble / mine.steps, overlapped ? ", steps back to back" : "", 100 * theory, 100 * *simulated);
  return rows;
}

// Rank 0's opening lines: the program, the model, the device, the plan.
void print_header(const TrainConfig& config, const Executor& exec, const std::string& device_line,
                  const std::string& order_line, double time_limit_s,
                  const std::string& resumed_from, std::int64_t first_step, double load_seconds) {
  const Grid& grid = exec.grid();
  // The model's entries, not --layers: a GPT of 4 blocks is 8 (embedding, 4 blocks, norm, head, loss).
  std::printf("mpipe %s (git %s): %s model, %d layer entries (mpipe plan lists them), %lld parameters, %d thread%s per rank\n", version(), git_hash(),
              config.model.kind.c_str(), exec.model().size(), static_cast<long long>(exec.model().parameter_count()),
              cpu::threads(), cpu::threads() > 1 ? "s" : "");
  std::printf("%s\n", device_line.c_str());
  if (grid.stages() > 1 || grid.replicas() > 1) std::printf("communication: %s\n", exec.progress().describe().c_str());
  if (time_limit_s > 0) {
    const long long t = std::llround(time_limit_s);
    std::printf("time limit: %lld:%02lld:%02lld (--time-limit %s): a checkpoint and exit %d before it\n", t / 3600,
                t % 3600 / 60, t % 60, config.time_limit.c_str(), exit_preempted);
  }
  if (const Dataset* data = exec.dataset())
    std::printf("data: %s%s\n", data->describe().c_str(),
                exec.prefetching() ? "; each step's batch read during the step before (--prefetch)" : "");
  if (const Dataset* data = exec.eval_dataset()) std::printf("eval data: %s\n", data->describe().c_str());
  print_plan(exec.plan(), exec.model());
  if (host_count() > 1) std::printf("%s\n", describe_hosts().c_str());
  if (!order_line.empty()) std::printf("%s\n", order_line.c_str());
  // A node gone silent is named within --p2p-timeout, but the job ends only when mpirun
  // gives up on that node's daemon. Its keepalives must do so before mpipe's abort (3 s
  // after naming it, across hosts): once the abort has sent mpirun's kill towards that
  // node, keepalives no longer apply (data waits unacknowledged) and TCP's
  // retransmissions take about 15 minutes.
  if (const double lost = mpirun_lost_node_s(); host_count() > 1 && lost >= config.pipeline.p2p_timeout + 3)
    std::printf("note: across hosts, a node that goes silent (its link or power) ends the job only once mpirun's TCP "
                "keepalives give up on its daemon, %s here, and only if that comes within --p2p-timeout + 3 s (%g s; "
                "else about 15 minutes); launch with 'mpirun --mca oob_tcp_keepalive_time 1 --mca "
                "oob_tcp_keepalive_intvl 1 --mca oob_tcp_keepalive_probes 2' (3 s)\n",
                std::isinf(lost) ? "never (oob_tcp_keepalive_time 0)" : cat(lost, " s after it goes silent").c_str(),
                config.pipeline.p2p_timeout + 3);
  if (grid.stages() > 1 && grid.stages() <= 8 && config.micro_batches <= 8) print_schedule_grid(exec.schedule());
  std::printf("%s, lr %g, %d steps%s\n", config.optimizer.kind.c_str(), config.optimizer.lr, config.steps,
              exec.optimizer().sharded() ? cat(", state sharded over ", grid.replicas(), " replicas").c_str()
              : config.pipeline.shard_optimizer ? " (--shard-optimizer: one replica, nothing to shard)" : "");
  if (!resumed_from.empty())
    std::printf("resumed from %s: %lld steps done (checked and loaded in %.2f s)%s\n", resumed_from.c_str(),
                static_cast<long long>(first_step), load_seconds,
                config.init_from.empty() ? "" : cat("; --init-from ", config.init_from, " not applied").c_str());
  else if (!config.init_from.empty())
    std::printf("initialized from %s (--init-from): step 0, a fresh optimizer\n", config.init_from.c_str());
  std::fflush(stdout);
}

// check_memory (report.hpp): this rank's sizes against its node's memory.
void check_memory(const Plan& plan, int world_rank, int node_ranks) {
  if (plan.options.device != Device::cpu) return;  // the GPU's memory is the device's own affair
  const int stage = plan.grid.stage_of(world_rank);
  const int live = in_flight(plan.schedule, stage);
  bool remat = false;
  for (const int m : plan.schedule.stages_of(stage)) remat = remat || plan.remat_stage(stage, m);
  const double weights = plan.weight_bytes(stage), activations = plan.activation_bytes(stage),
               inputs = plan.inputs_bytes(stage);
  const double need = plan.rank_bytes(stage), node_share = available_memory() / std::max(1, node_ranks);
  // --memory-per-rank, where given and smaller, is the limit (what --remat auto planned for).
  const double limit = plan.options.memory_per_rank;
  const bool given = limit > 0 && (node_share <= 0 || limit < node_share);
  const double have = given ? limit : node_share;
  if (have <= 0) return;  // nothing to go by
  MPIPE_REQUIRE(need <= have,
                cat("use more stages (--stages), ", remat ? "" : "--remat always, ",
                    plan.options.checkpoint_copy ? "--checkpoint-async off, " : "",
                    "a smaller --batch-size or more --micro-batches, ",
                    plan.grid.replicas > 1 && !plan.options.shard_optimizer ? "--shard-optimizer, " : "", "or a smaller model"),
                "rank ", world_rank, " (stage ", stage, ")", on_host(world_rank), " needs about ", human_bytes(need),
                " (parameters, gradients", plan.grid.replicas > 1 ? ", their sums' buffers" : "", " and ", plan.options.optimizer.kind, " state",
                plan.options.checkpoint_copy ? ", a copy for --checkpoint-async " : " ", human_bytes(weights),
                ", activations of ", remat ? 1 : live, " micro-batch", (remat ? 1 : live) > 1 ? "es " : " ",
                human_bytes(activations), ", inputs ", human_bytes(inputs), "), ",
                given ? cat("--memory-per-rank gives it ", human_bytes(have))
                      : cat("this node has ", human_bytes(have), " per rank for its ", node_ranks, " rank",
                            node_ranks > 1 ? "s" : ""));
}

void op_profile_table(std::int64_t step, const ops::OpTimes& mine, double step_seconds, int stage, Device device,
                      const Communicator& world) {
  // Per rank: stage, the step's seconds, each kind's seconds, ops not timed.
  constexpr int fields = 3 + ops::kOpKinds;
  std::vector<double> row = {static_cast<double>(stage), step_seconds};
  row.insert(row.end(), mine.seconds.begin(), mine.seconds.end());
  row.push_back(static_cast<double>(mine.untimed));
  const std::vector<double> all = world.gather(std::span<const double>(row), 0, nullptr);
  // Each rank's ops that took the most, by name: fixed-width records gathered as text.
  constexpr int top = 5;
  constexpr std::size_t width = 32;
  std::string names(top * width, '\0');
  std::vector<double> times(top, 0.0);
  const std::vector<ops::NamedTime> mine_top = mine.top(top);
  for (std::size_t i = 0; i < mine_top.size(); ++i) {
    std::strncpy(names.data() + i * width, mine_top[i].name, width - 1);
    times[i] = mine_top[i].seconds;
  }
  const std::vector<char> all_names = world.gather(std::span<const char>(names.data(), names.size()), 0, nullptr);
  const std::vector<double> all_times = world.gather(std::span<const double>(times), 0, nullptr);
  if (world.rank() != 0) return;
  const auto ranks = static_cast<int>(all.size() / fields);
  // The kinds some rank ran; the others would be empty columns.
  std::vector<int> kinds;
  for (int k = 0; k < ops::kOpKinds; ++k)
    for (int r = 0; r < ranks; ++r)
      if (all[static_cast<std::size_t>(r * fields + 2 + k)] > 0) {
        kinds.push_back(k);
        break;
      }
  const bool gpu = device == Device::cuda;
  std::printf("\nops of step %lld by kind (--profile-ops; %s), ms and share of the step:\n| rank | stage | step |",
              static_cast<long long>(step),
              gpu ? "each op's GPU time, between CUDA events on the compute stream" : "each op's wall time");
  for (const int k : kinds) std::printf(" %s |", ops::name(static_cast<ops::OpKind>(k)));
  std::printf(" %s |\n|---|---|---|", gpu ? "outside ops (GPU idle, waits, messages)" : "outside ops (waits, messages, host)");
  for (std::size_t k = 0; k < kinds.size(); ++k) std::printf("---|");
  std::printf("---|\n");
  double untimed = 0;
  for (int r = 0; r < ranks; ++r) {
    const double* f = all.data() + static_cast<std::ptrdiff_t>(r) * fields;
    const double wall = f[1];
    double in_ops = 0;
    std::printf("| %d | %.0f | %.1f |", r, f[0], 1e3 * wall);
    for (const int k : kinds) {
      const double s = f[2 + k];
      in_ops += s;
      std::printf(" %.1f (%.0f%%) |", 1e3 * s, wall > 0 ? 100.0 * s / wall : 0.0);
    }
    const double outside = std::max(0.0, wall - in_ops);
    std::printf(" %.1f (%.0f%%) |\n", 1e3 * outside, wall > 0 ? 100.0 * outside / wall : 0.0);
    untimed += f[2 + ops::kOpKinds];
  }
  if (untimed > 0)
    std::printf("(%.0f ops past the profile's events were not timed: their time counts as outside ops)\n", untimed);
  std::printf("the ops that took the most, by name (ms):\n");
  for (int r = 0; r < ranks; ++r) {
    std::printf("  rank %d:", r);
    for (int i = 0; i < top; ++i) {
      const char* name = all_names.data() + (static_cast<std::size_t>(r) * top + static_cast<std::size_t>(i)) * width;
      if (*name) std::printf("%s %s %.1f", i ? "," : "", name, 1e3 * all_times[static_cast<std::size_t>(r * top + i)]);
    }
    std::printf("\n");
  }
  std::fflush(stdout);
}

}  // namespace mpipe
