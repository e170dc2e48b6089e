// Command-line parsing, the error policy (one line on rank 0, exit 2 for user errors,
// no hang), the train command's report and the plan command.
#include "mpipe/app/commands.hpp"

#include <mpi.h>
#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>

#include "mpipe/backend/cpu/ops.hpp"
#include "mpipe/core/version.hpp"
#include "mpipe/io/checkpoint.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/io/config_file.hpp"
#include "mpipe/io/metrics.hpp"
#include "mpipe/io/trace.hpp"
#include "mpipe/pipeline/watchdog.hpp"

namespace mpipe {

namespace {

constexpr int exit_user_error = 2;

// Set by SIGTERM / SIGUSR1 (what Slurm sends before preempting or at the time limit).
volatile std::sig_atomic_t g_stop_signal = 0;
static_assert(std::atomic<int>::is_always_lock_free, "the stop handler counts signals in an atomic");
bool g_output_is_pipe[3] = {};
pid_t g_main_thread = 0;
extern "C" void on_stop_signal(int signal) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  // The kernel gives a process's signal to any thread (MPI's, the progress thread);
  // the main thread must have it too, to leave a write it is blocked in.
  if (g_main_thread != 0 && ::syscall(SYS_gettid) != g_main_thread) {
    ::syscall(SYS_tgkill, ::getpid(), g_main_thread, signal);
    errno = saved_errno;
    return;
  }
  g_stop_signal = signal;
  stop_signals_received.fetch_add(1, std::memory_order_relaxed);  // lock-free: safe in a handler
  // SIGTERM to mpirun: Open MPI's mpirun sends SIGTERM to the ranks and then stops
  // reading their output until it kills them (odls_base_sigkill_timeout later). A rank
  // blocked on a full output pipe would never reach its checkpoint, so from here on
  // output that cannot go at once is dropped (fcntl is async-signal-safe).
  for (int fd : {1, 2})
    if (g_output_is_pipe[fd])
      if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0) ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  errno = saved_errno;
}

// Whether `environment` (main's envp) sets `name`; at preinit time getenv may not be ready.
bool environment_has(char** environment, std::string_view name) {
  for (char** e = environment; e && *e; ++e)
    if (std::string_view(*e).starts_with(name) && (*e)[name.size()] == '=') return true;
  return false;
}

}  // namespace

// Without SA_RESTART: a write already blocked on a full pipe returns. Output may be
// dropped where it goes to a pipe, a socket, or (mpirun's default) a terminal of the
// launcher's own; never on a user's terminal. Only system calls: main.cpp calls this
// before any constructor has run.
void install_stop_handlers(char** environment) {
  const bool under_mpirun =
      environment_has(environment, "OMPI_COMM_WORLD_SIZE") && !environment_has(environment, "SLURM_STEP_ID");
  for (int fd : {1, 2}) {
    struct stat st{};
    g_output_is_pipe[fd] = ::fstat(fd, &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ||
                                                     (under_mpirun && ::isatty(fd)));
  }
  g_main_thread = static_cast<pid_t>(::syscall(SYS_gettid));
  struct sigaction action{};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGUSR1, &action, nullptr);
}

namespace {

constexpr int exit_internal_error = 1;

// Threads per rank when --threads is 0: the cores the launcher bound this rank to, or,
// when it did not bind (all cores visible), the node's cores shared by its ranks.
int default_threads(const Communicator& world) {
  cpu_set_t set;
  int visible = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const int online = visible;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) visible = CPU_COUNT(&set);
  // Collective on every rank whatever its binding, so that no rank is left waiting.
  int local = 1;
  if (world.size() > 1) local = Communicator::node(world).size();
  if (visible < online) return std::max(1, visible);  // bound: use what we were given
  return std::max(1, visible / local);
}

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

// Per-stage figures of a partition for one micro-batch: what plan prints and train echoes.
struct StageFigures {
  double params = 0, activation = 0, boundary = 0, stash = 0;  // FLOPs: flop_costs()
  // Activation bytes held with `live` micro-batches in flight: without remat each keeps
  // its activations; with remat only its input, plus one micro-batch's while recomputing.
  // A stage that splits its backwards (zero bubble) also keeps W's output gradients, and
  // under remat its recomputation lives until W.
  double held(int live, bool remat, bool split = false) const {
    const double each = activation + (split ? stash : 0);
    return remat && !split ? live * boundary + activation : live * each;
  }
};

std::vector<StageFigures> stage_figures(const Model& model, const Partition& part, int micro) {
  const auto shapes = model.shapes(micro);
  std::vector<StageFigures> out(part.stages());
  for (int s = 0; s < part.stages(); ++s) {
    for (int i = part.begin(s); i < part.end(s); ++i) {
      const Cost c = model.layer(i).cost(shapes[i]);
      out[s].params += c.param_bytes / 4;
      out[s].activation += c.activation_bytes;
      // A Linear whose next layer on the stage has no W keeps its dy in its own output's
      // buffer (Stage::backward): no stash of its own.
      const bool in_output = dynamic_cast<const Linear*>(&model.layer(i)) && i + 1 < part.end(s) &&
                             !model.layer(i + 1).defers_weight();
      if (!in_output) out[s].stash += c.weight_stash_bytes;
    }
    out[s].boundary = static_cast<double>(shapes[part.begin(s)].numel()) * 4;
  }
  return out;
}

// Bytes of memory this process may still take: MemAvailable, or less where a cgroup
// (a Slurm job, a container) limits it. 0 when neither can be read.
double available_memory() {
  double available = 0;
  if (std::FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    double kb = 0;
    while (std::fscanf(f, "%63s %lf kB\n", key, &kb) == 2)
      if (std::strcmp(key, "MemAvailable:") == 0) available = kb * 1024;
    std::fclose(f);
  }
  double limit = 0, used = 0;
  if (std::FILE* f = std::fopen("/sys/fs/cgroup/memory.max", "r")) {
    if (std::fscanf(f, "%lf", &limit) != 1) limit = 0;  // "max": no limit
    std::fclose(f);
  }
  if (std::FILE* f = std::fopen("/sys/fs/cgroup/memory.current", "r")) {
    if (std::fscanf(f, "%lf", &used) != 1) used = 0;
    std::fclose(f);
  }
  if (limit > 0 && (available == 0 || limit - used < available)) available = std::max(0.0, limit - used);
  return available;
}

// fp32 floats per parameter a rank keeps: values, gradients and optimizer state, and with
// --overlap-steps a second copy of each to go back to.
double state_copies(const TrainConfig& config) {
  return (2.0 + static_cast<double>(Optimizer::state_names(config.optimizer).size())) *
         (config.pipeline.overlap_steps ? 2.0 : 1.0);
}

// `compute`: the lowered schedule train runs (the zero-bubble ones ordered for the
// partition's FLOPs).
void print_plan(const TrainConfig& config, const Model& model, const Partition& part, const GridShape& grid,
                const Schedule& compute) {
  const int K = grid.stages, D = grid.replicas, M = config.micro_batches;
  const int micro = config.batch_size / (M * D);
  std::printf("grid: %d replica%s x %d stage%s = %d rank%s, rank order %s\n", D, D > 1 ? "s" : "", K, K > 1 ? "s" : "",
              D * K, D * K > 1 ? "s" : "", grid.rank_order.c_str());
  std::printf("batch %d = %d replica%s x %d micro-batches of %d; schedule %s, remat %s\n", config.batch_size, D,
              D > 1 ? "s" : "", M, micro, config.pipeline.schedule.c_str(), config.pipeline.remat.c_str());
  const int v = config.pipeline.virtual_stages;
  const StageCosts flops = flop_costs(model, part, micro);
  const auto figures = stage_figures(model, part, micro);
  if (v > 1) {
    const std::vector<int> placement = compute.placement_table();
    const std::string where = placement == round_robin_placement(K, v) ? cat("model stage m on pipeline stage m mod ", K)
                              : placement == vee_placement(K)          ? cat("model stages s and ", 2 * K - 1, "-s on pipeline stage s (a V)")
                                                                       : std::string("placed by the schedule file");
    std::printf("virtual stages: %d per rank, %s (\"p\" below)\n", v, where.c_str());
  }
  std::printf("partition (%s): %s\n", config.pipeline.balance.empty() ? config.pipeline.partition.c_str() : "balance",
              part.to_text().c_str());
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
                config.pipeline.link_bandwidth == "auto" ? "measured" : "configured", links.c_str(), work.c_str(),
                comm.c_str());
  }
  const double states = state_copies(config);
  std::printf("%-6s %-9s %-28s %10s %12s %14s %16s %16s\n", "stage", "layers", "kinds", "params", "GFLOP/mb", "weights+state",
              "act. no remat", "act. remat");
  for (int s = 0; s < part.stages(); ++s) {
    std::string kinds;
    for (int i = part.begin(s); i < part.end(s); ++i) {
      const std::string k = model.layer(i).kind();
      if (kinds.find(k) == std::string::npos) kinds += (kinds.empty() ? "" : ",") + k;
    }
    if (kinds.size() > 28) kinds = kinds.substr(0, 25) + "...";
    const int live = in_flight(compute, compute.list_of(s), v > 1 ? s : -1);
    const bool split = compute.splits(compute.list_of(s));
    const StageFigures& f = figures[s];
    std::printf("%-6s %-9s %-28s %10s %12.3f %14s %16s %16s\n", (v > 1 ? cat(s, " p", compute.list_of(s)) : cat(s)).c_str(),
                cat(part.begin(s), "-", part.end(s) - 1).c_str(),
                kinds.c_str(), human_count(f.params).c_str(),
                (flops.forward[static_cast<std::size_t>(s)] + flops.backward[static_cast<std::size_t>(s)]) / 1e9,
                human_bytes(4.0 * f.params * states).c_str(), human_bytes(f.held(live, false, split)).c_str(),
                human_bytes(f.held(live, true, split)).c_str());
  }
  // Equal stages: the schedule built for unit costs, at unit costs; predicted: the one
  // that runs, at the partition's FLOPs.
  const Schedule unit = lower(make_schedule(config.pipeline.schedule, K, M, v, {nullptr, false, config.pipeline.in_flight}));
  const Schedule unit_overlapped = lower(make_schedule(config.pipeline.schedule, K, M, v, {nullptr, true, config.pipeline.in_flight}));
  const double theory = simulate(unit, StageCosts::unit(unit)).bubble_fraction;
  const double predicted = simulate(compute, flops).bubble_fraction;
  // The closed form of the equal-stage bubble where there is one (M >= K).
  const ScheduleKind* kind = find_schedule_kind(config.pipeline.schedule);
  std::string formula = M < K || !kind ? "" : kind->bubble_formula(config.pipeline.in_flight);
  if (formula.empty()) formula = "simulated";
  std::printf("bubble: %.1f%% for equal stages (%s), %.1f%% predicted from this partition's FLOPs\n", 100 * theory,
              formula.c_str(), 100 * predicted);
  // Post-validation: a stage starts the next step once its own part of this one is done.
  std::printf("bubble with --overlap-steps (steps back to back, no clipping or skip): %.1f%% for equal stages, %.1f%% "
              "predicted from this partition's FLOPs\n",
              100 * steady_state(unit_overlapped, StageCosts::unit(unit_overlapped)).bubble_fraction,
              100 * steady_state(compute, flops).bubble_fraction);
}

// Before any rank allocates (CPU): this rank's parameters, gradients, optimizer state
// and the activations of its in-flight micro-batches, against the memory the node has
// for each of its `node_ranks` ranks. UserError when it cannot fit.
void check_memory(const TrainConfig& config, Executor& exec, int node_ranks) {
  if (config.device != "cpu") return;  // the GPU's memory is the device's own affair
  const int K = exec.grid().stages(), M = config.micro_batches, D = exec.grid().replicas();
  const int stage = exec.grid().stage();
  const auto figures = stage_figures(exec.model(), exec.partition(), config.batch_size / (M * D));
  const Schedule& schedule = exec.schedule();
  const int live = in_flight(schedule, stage);
  const bool remat = config.pipeline.remat == "always" || (config.pipeline.remat == "except-last" && stage + 1 < K);
  const double states = state_copies(config);
  double weights = 0, activations = 0;  // over the rank's model stages
  for (const int m : schedule.stages_of(stage)) {
    weights += 4.0 * figures[m].params * states;
    activations +=
        figures[m].held(in_flight(schedule, stage, schedule.virtual_stages > 1 ? m : -1), remat, schedule.splits(stage));
  }
  const double need = weights + activations, have = available_memory() / std::max(1, node_ranks);
  if (have <= 0) return;  // nothing to go by
  MPIPE_REQUIRE(need <= have,
                "use more stages (--stages), --remat always, a smaller --batch-size or more --micro-batches, or a "
                "smaller model",
                "rank ", exec.grid().world_rank(), " (stage ", stage, ") needs about ", human_bytes(need),
                " (parameters, gradients and ", config.optimizer.kind, " state ", human_bytes(weights),
                ", activations of ", remat ? 1 : live, " micro-batch", (remat ? 1 : live) > 1 ? "es " : " ",
                human_bytes(activations), "), this node has ", human_bytes(have), " per rank for its ", node_ranks,
                " rank", node_ranks > 1 ? "s" : "");
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

// Phase statistics over steps, one set per rank, gathered to rank 0 for the table.
struct PhaseStats {
  double min[PhaseTimes::count], sum[PhaseTimes::count], max[PhaseTimes::count];
  double steps = 0, stage = 0, bubble = 0, weight = 0;
  PhaseStats() {
    std::fill(std::begin(min), std::end(min), std::numeric_limits<double>::infinity());
    std::fill(std::begin(sum), std::end(sum), 0.0);
    std::fill(std::begin(max), std::end(max), 0.0);
  }
  void add(const PhaseTimes& t, double bubble_fraction) {
    for (int i = 0; i < PhaseTimes::count; ++i) {
      min[i] = std::min(min[i], t[i]);
      sum[i] += t[i];
      max[i] = std::max(max[i], t[i]);
    }
    bubble += bubble_fraction;
    weight += t.weight;
    ++steps;
  }
};

// Gathers every rank's phase statistics to world rank 0, which prints the per-stage
// table and the bubble: measured, the schedule's at unit costs (`theory`), and the
// schedule simulated with each stage's mean forward, backward and W times of this run
// (into *simulated). Returns the rows (other ranks: nothing).
std::vector<StagePhases> phase_table(const PhaseStats& mine, const Communicator& world, const Schedule& schedule,
                                     int micro_batches, double theory, bool overlapped, double* simulated) {
  const int stages = schedule.stages, v = schedule.virtual_stages;
  constexpr int n = sizeof(PhaseStats) / sizeof(double);
  std::vector<PhaseStats> all(world.rank() == 0 ? world.size() : 0);
  MPI_CHECK(MPI_Gather(&mine, n, MPI_DOUBLE, all.data(), n, MPI_DOUBLE, 0, world.get()));
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
  std::printf("bubble: measured %.1f%% (mean over steps; every rank's idle up to the slowest one's end%s), schedule's "
              "theoretical %.1f%% (unit costs), %.1f%% simulated with the measured action times\n",
              100 * mine.bubble / mine.steps, overlapped ? ", steps back to back" : "", 100 * theory, 100 * *simulated);
  return rows;
}

// --time-limit in seconds: MINUTES (a number), or Slurm's forms MM:SS, H:MM:SS, D-H,
// D-H:MM, D-H:MM:SS. 0 when empty.
double parse_time_limit(const std::string& text) {
  if (text.empty()) return 0;
  const UserError bad(cat("--time-limit '", text, "' is not a duration"),
                      "give minutes (90) or [D-]H:MM:SS as Slurm writes it (1-12:00:00, 2:30:00, 45:00)");
  auto whole = [&](const std::string& part) {
    if (part.empty() || part.size() > 9 || !std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw bad;
    return std::stod(part);
  };
  std::string rest = text;
  double days = 0;
  const auto dash = rest.find('-');
  if (dash != std::string::npos) {
    days = whole(rest.substr(0, dash));
    rest = rest.substr(dash + 1);
  }
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    const auto colon = rest.find(':', at);
    parts.push_back(rest.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  double seconds = 0;
  if (dash != std::string::npos) {  // D-H, D-H:MM, D-H:MM:SS
    if (parts.size() > 3) throw bad;
    const double unit[] = {3600, 60, 1};
    for (std::size_t i = 0; i < parts.size(); ++i) seconds += whole(parts[i]) * unit[i];
  } else if (parts.size() == 1) {  // minutes, fractions allowed
    char* end = nullptr;
    const double minutes = std::strtod(parts[0].c_str(), &end);
    if (parts[0].empty() || *end != '\0' || !std::isfinite(minutes)) throw bad;
    seconds = minutes * 60;
  } else if (parts.size() == 2) {
    seconds = whole(parts[0]) * 60 + whole(parts[1]);
  } else if (parts.size() == 3) {
    seconds = whole(parts[0]) * 3600 + whole(parts[1]) * 60 + whole(parts[2]);
  } else {
    throw bad;
  }
  seconds += days * 86400;
  if (!(seconds > 0)) throw UserError(cat("--time-limit '", text, "' must be positive"), "e.g. --time-limit 90");
  return seconds;
}

// Whether a person watches rank 0's standard output. Open MPI forwards every rank's
// stdout through a pseudo-terminal of its own, a terminal even when mpirun's output goes
// to a file; there it is the launcher's stdout that counts. The launcher is the parent
// process when mpirun started this rank on its own node; a rank a remote daemon (orted,
// prted) started shows no live line. srun gives pipes (a terminal with --pty).
bool show_progress(const std::string& mode) {
  if (mode != "auto") return mode == "on";
  if (!isatty(STDOUT_FILENO)) return false;
  const pid_t parent = getppid();
  std::string name;
  if (std::FILE* f = std::fopen(cat("/proc/", parent, "/comm").c_str(), "r")) {
    char text[64] = {};
    if (std::fgets(text, sizeof text, f)) name = text;
    std::fclose(f);
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  static const char* const launchers[] = {"mpirun", "mpiexec", "orterun", "prterun", "orted", "prted"};
  if (std::find(std::begin(launchers), std::end(launchers), name) == std::end(launchers)) return true;
  char target[256] = {};
  const ssize_t n = readlink(cat("/proc/", parent, "/fd/1").c_str(), target, sizeof target - 1);
  if (n <= 0) return false;
  const std::string where(target, static_cast<std::size_t>(n));
  return where.rfind("/dev/pts/", 0) == 0 || where.rfind("/dev/tty", 0) == 0;
}

// Runs `phase` on every rank and agrees on the outcome, so that a rank that fails
// during set-up never leaves the others waiting in a collective. On failure the first
// failing rank prints its message and every rank returns the same exit code.
int agree(const Communicator& world, const std::function<void()>& phase) {
  int code = 0;
  std::string message;
  try {
    phase();
  } catch (const UserError& e) {
    code = exit_user_error;
    message = cat("mpipe: error: ", e.what(), "; hint: ", e.hint());
  } catch (const std::exception& e) {
    code = exit_internal_error;
    message = cat("mpipe: internal error on rank ", world.rank(), ": ", e.what());
  }
  // The worst code wins (internal over user error); the lowest rank with it speaks.
  int worst = code;
  world.allreduce(std::span<int>(&worst, 1), Reduce::max);
  if (worst == 0) return 0;
  int speaker = code == worst ? world.rank() : world.size();
  world.allreduce(std::span<int>(&speaker, 1), Reduce::min);
  if (speaker == world.rank()) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", message.c_str());
  }
  return worst;
}

}  // namespace

void add_train_options(CLI::App& cmd, TrainConfig& c) {
  c.device = "auto";  // the library default is the CPU; users get the GPU when there is one
  // An option given twice takes the last value, so scripts can append overrides.
  cmd.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  cmd.add_option("--config", "TOML file with any of these options (command-line values win)")
      ->check(CLI::ExistingFile);
  auto& m = c.model;
  auto& o = c.optimizer;
  auto& p = c.pipeline;
  cmd.add_option("--model", m.kind, "Model: a preset (gpt, mlp or resnet, sized by the options below) or a model file (TOML: see plan --print-model and --layer-kinds)")->capture_default_str();
  cmd.add_option("--layers", m.layers, "Transformer blocks (gpt), hidden blocks (mlp) or depth (resnet: 18, 34, 50, 101 or 152; default 18)")->capture_default_str();
  cmd.add_option("--d-model", m.d_model, "Channels of the residual stream (gpt)")->capture_default_str();
  cmd.add_option("--heads", m.heads, "Attention heads (gpt)")->capture_default_str();
  cmd.add_option("--seq-len", m.seq_len, "Tokens per sample (gpt)")->capture_default_str();
  cmd.add_option("--vocab", m.vocab, "Vocabulary size (gpt)")->capture_default_str();
  cmd.add_option("--head-chunks", m.head_chunks,
                 "The LM head as this many vocabulary chunks, layers a pipeline can put on different stages "
                 "(gpt; 1: one linear layer)")->capture_default_str();
  cmd.add_option("--hidden", m.hidden, "Width of the hidden layers (mlp)")->capture_default_str();
  cmd.add_option("--inputs", m.inputs, "Input features (mlp)")->capture_default_str();
  cmd.add_option("--classes", m.classes, "Output classes (mlp, resnet)")->capture_default_str();
  cmd.add_option("--image", m.image, "Input side in pixels (resnet; from 128 on ImageNet's 7x7/2 stem and max pool)")->capture_default_str();
  cmd.add_option("--channels", m.channels, "Input channels (resnet)")->capture_default_str();
  cmd.add_option("--width", m.width, "Channels of the first of the four stages (resnet)")->capture_default_str();
  cmd.add_option("--dropout", m.dropout, "Dropout probability")->capture_default_str();
  cmd.add_option("--data", c.data, "synthetic, text:PATH (bytes) or tokens:PATH (uint16)")->capture_default_str();
  cmd.add_option("--batch-size", c.batch_size, "Global mini-batch, in samples")->capture_default_str();
  cmd.add_option("--micro-batches", c.micro_batches, "Micro-batches per mini-batch and replica")->capture_default_str();
  cmd.add_option("--optimizer", o.kind, "adamw or sgd")->capture_default_str();
  cmd.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str();
  cmd.add_option("--min-lr-ratio", o.min_lr_ratio, "The decay ends at lr times this")->capture_default_str();
  cmd.add_option("--lr-schedule", o.lr_schedule,
                 "After the warm-up: cosine, linear or wsd decay to lr x --min-lr-ratio, or constant")
      ->capture_default_str();
  cmd.add_option("--lr-decay-steps", o.lr_decay_steps,
                 "The step the decay ends at, whatever --steps says (0: --steps); lets a run train in "
                 "several jobs, or be extended, without its schedule changing")
      ->capture_default_str();
  cmd.add_option("--wsd-decay", o.wsd_decay,
                 "wsd (warm-up, stable, decay): the last fraction of the decay steps that decays, linearly")
      ->capture_default_str();
  cmd.add_option("--weight-decay", o.weight_decay, "Decoupled weight decay (matrices only)")->capture_default_str();
  cmd.add_option("--momentum", o.momentum, "SGD momentum")->capture_default_str();
  cmd.add_option("--warmup", o.warmup, "Steps of linear learning-rate warm-up")->capture_default_str();
  cmd.add_option("--clip-grad", o.clip_grad, "Clip the global gradient norm to this (0: off)")->capture_default_str();
  cmd.add_option("--steps", c.steps, "Train up to this step")->capture_default_str();
  cmd.add_option("--seed", c.seed, "Seed of initialisation, data and dropout")
      ->check(CLI::Validator(
          [](std::string& text) {
            const bool digits = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos;
            return digits ? std::string() : "must be an integer from 0 to 2^64-1, got " + text;
          },
          "SEED"))
      ->capture_default_str();
  cmd.add_option("--threads", c.threads, "Threads per rank (BLAS and loops); 0: the cores given to the rank")
      ->capture_default_str();
  cmd.add_option("--log-every", c.log_every, "Print a line every N steps")->capture_default_str();
  cmd.add_option("--eval-data", c.eval_data,
                 "Held-out data to evaluate on (synthetic, text:PATH, tokens:PATH or hdf5:PATH; empty: none): forward "
                 "only, dropout off; loss and accuracy")
      ->capture_default_str();
  cmd.add_option("--eval-every", c.eval_every, "Evaluate every N steps, and at the end (0: only at the end)")
      ->capture_default_str();
  cmd.add_option("--eval-batches", c.eval_batches,
                 "Batches of --batch-size per evaluation (0: a file's every whole batch; 8 of endless data)")
      ->capture_default_str();
  cmd.add_option("--progress", c.progress,
                 "A live progress line on rank 0 between the logged steps: auto (when a person watches: "
                 "standard output, and under mpirun the launcher's, is a terminal), on or off")
      ->capture_default_str();
  cmd.add_option("--metrics", c.metrics, "Write one JSON object per step to FILE (the last line: the run's summary)");
  cmd.add_option("--summary", c.summary, "Write the run's summary (throughput, bubble, peak memory) as JSON to FILE");
  cmd.add_option("--trace", c.trace, "Write every rank's actions as a Chrome/Perfetto trace to FILE.json");
  cmd.add_option("--trace-steps", c.trace_steps, "Steps traced, after the first")->capture_default_str();
  cmd.add_option("--stages", p.grid.stages, "Pipeline stages K (0: world size / replicas)")->capture_default_str();
  cmd.add_option("--replicas", p.grid.replicas, "Data-parallel replicas D (0: world size / stages)")->capture_default_str();
  cmd.add_option("--rank-order", p.grid.rank_order, "pipeline (a replica's stages on consecutive ranks) or data")
      ->capture_default_str();
  std::string schedules;  // the table's, each with its note
  for (const ScheduleKind& kind : schedule_kinds())
    schedules += cat(kind.name, kind.help.empty() ? "" : cat(" (", kind.help, ")"), ", ");
  cmd.add_option("--schedule", p.schedule,
                 schedules + "or file:PATH (a line 'stage S: F0 F1 B0 ...' per stage; plan --write-schedule writes one)")
      ->capture_default_str();
  cmd.add_option("--virtual-stages", p.virtual_stages,
                 "Model stages per rank, for --schedule interleaved (2 or more; stage m on pipeline stage m mod K); "
                 "zbv sets 2 (stages s and 2K-1-s on pipeline stage s)")
      ->capture_default_str();
  cmd.add_option("--remat", p.remat, "Re-materialization: always, except-last or never")->capture_default_str();
  cmd.add_option("--batchnorm", p.batchnorm,
                 "BatchNorm's running statistics: micro (moved by each micro-batch, GPipe) or deferred (by the "
                 "mini-batch once per step, torchgpipe)")
      ->capture_default_str();
  cmd.add_option("--partition", p.partition, "Balance stages by uniform, params, flops or time")->capture_default_str();
  cmd.add_option("--balance", p.balance, "Layers per stage, e.g. 3,5 (overrides --partition)");
  cmd.add_option("--link-bandwidth", p.link_bandwidth,
                 "Links between stages, counted by --partition time (a stage's time includes moving its boundary "
                 "activations and gradients): auto (measured by train; plan does not count them), off, or GB/s")
      ->capture_default_str();
  cmd.add_option("--p2p-timeout", p.p2p_timeout, "Seconds a point-to-point wait may block")->capture_default_str();
  cmd.add_option("--comm-progress", p.comm_progress,
                 "How posted messages move while a rank computes: thread (a progress thread), layers (tests "
                 "between layers) or waits (only in waits: MPI's own progress)")
      ->capture_default_str();
  cmd.add_option("--comm-poll-us", p.comm_poll_us,
                 "Microseconds between the progress thread's tests while nothing moves (0: no pause)")
      ->capture_default_str();
  cmd.add_option("--comm-wait", p.comm_wait,
                 "How a wait passes the time once nothing moves: sleep (from 20 us to 1 ms between tests) or "
                 "spin (tests without pause: a few % faster on small models, but takes the core from every "
                 "other process on the node)")
      ->capture_default_str();
  cmd.add_option("--in-flight", p.in_flight,
                 "zb-h1, zb-h2, zbv: the most micro-batches (zbv: model stages of micro-batches) a rank holds "
                 "between their F and their W, memory traded for bubble (0: the schedule's own, K, 2K-1 and 2K; "
                 "1f1b: on each rank what 1F1B holds there, K - rank, so that no rank needs more activation memory "
                 "than under 1F1B)")
      ->transform(CLI::Validator(
          [](std::string& text) {
            static_assert(in_flight_of_1f1b == -1);
            if (text == "1f1b") text = "-1";
            else if (text.empty() || text.size() > 9 || text.find_first_not_of("0123456789") != std::string::npos)
              return "must be a number of micro-batches (0: the schedule's own) or 1f1b, got " + text;
            return std::string();
          },
          "N|1f1b"))
      ->capture_default_str();
  cmd.add_flag("--overlap-steps,!--no-overlap-steps", p.overlap_steps,
               "Post-validation: each rank updates as soon as its part of a step is done and starts the next "
               "step while the world agrees on the loss and norm; a step that needs clipping or a skip is undone "
               "and redone (bitwise the same training). Lets zb-h2 fill its warm-up with the last step's "
               "cool-down")
      ->capture_default_str();
  cmd.add_option("--device", c.device, "cpu, cuda (one GPU per rank: node-local rank modulo GPUs) or auto")
      ->capture_default_str();
  cmd.add_option("--precision", c.precision, "fp32, or bf16 on a GPU (fp32 master weights and optimizer state)")
      ->capture_default_str();
  cmd.add_option("--checkpoint-dir", c.checkpoint_dir, "Write HDF5 checkpoints DIR/ckpt-<step>.h5 (created if missing)");
  cmd.add_option("--checkpoint-every", c.checkpoint_every, "Steps between checkpoints (0: only the final one)")
      ->capture_default_str();
  cmd.add_option("--time-limit", c.time_limit,
                 "Stop in time: once the next step and a checkpoint would not fit in this much time from the "
                 "start (MINUTES, or Slurm's [D-]H:MM:SS / MM:SS), write a checkpoint and exit 75, as on SIGTERM");
  cmd.add_option("--keep", c.keep, "Complete checkpoints to keep (0: all)")->capture_default_str();
  cmd.add_option("--resume", c.resume, "auto (newest good checkpoint in --checkpoint-dir), never, or a file")
      ->capture_default_str();
  cmd.add_flag("--overwrite", c.overwrite,
               "Let this run replace the checkpoints of another run in --checkpoint-dir (deleted once its first "
               "checkpoint is in place); without it such a directory is refused");
}

// CLI11 2.1 reads config files only for the top-level app, so a subcommand's file is
// applied here, the way CLI11 applies one: each key fills the option of the same name
// unless the command line already gave it. Unknown keys and sections are errors.
int run_plan(const TrainConfig& config, int ranks, const std::string& write_schedule) {
  MPIPE_REQUIRE(ranks > 0, "e.g. --ranks 4", "--ranks must be positive, got ", ranks);
  validate(config, ranks);
  const GridShape grid = resolve_grid(config.pipeline.grid, ranks);
  Model model(config.model);
  const int micro = config.batch_size / (config.micro_batches * grid.replicas);
  std::vector<double> measured;
  if (config.pipeline.balance.empty() && config.pipeline.partition == "time") {
    cpu::set_threads(config.threads > 0 ? config.threads : 1);
    measured = measure_layer_times(model, micro, config.seed);
  }
  // plan has no links to measure: a configured bandwidth counts, auto does not.
  const double link = parse_link_bandwidth(config.pipeline.link_bandwidth);
  const std::vector<double> links =
      link > 0 && grid.stages > 1 ? std::vector<double>(static_cast<std::size_t>(grid.stages), link) : std::vector<double>{};
  const std::vector<int> placement =
      make_schedule(config.pipeline.schedule, grid.stages, config.micro_batches, config.pipeline.virtual_stages)
          .placement_table();
  const Partition part =
      choose_partition(config.pipeline.balance, config.pipeline.partition, model, grid.stages, micro, measured, placement, links);
  std::printf("mpipe %s (git %s) plan for %d ranks\n", version(), git_hash(), ranks);
  std::printf("layers (%d):", model.size());
  for (int i = 0; i < model.size(); ++i) std::printf(" %d:%s", i, model.layer(i).kind().c_str());
  std::printf("\n");
  const StageCosts flops = flop_costs(model, part, micro);
  const Schedule s =
      make_schedule(config.pipeline.schedule, grid.stages, config.micro_batches, config.pipeline.virtual_stages,
                    {&flops, config.pipeline.overlap_steps, config.pipeline.in_flight});
  const Schedule lowered = lower(s);
  print_plan(config, model, part, grid, lowered);
  if (config.pipeline.partition == "time" && config.pipeline.balance.empty() && grid.stages > 1 && links.empty())
    std::printf("links: not counted (%s)\n", config.pipeline.link_bandwidth == "off"
                                                  ? "--link-bandwidth off"
                                                  : "plan cannot measure them; give --link-bandwidth GB/s");
  std::printf("ranks:");
  for (int r = 0; r < ranks; ++r) std::printf(" %d=s%d/r%d", r, grid.stage_of(r), grid.replica_of(r));
  std::printf("\n");
  print_schedule_grid(lowered);
  if (!write_schedule.empty()) {
    std::ofstream out(write_schedule);
    out << cat("# mpipe schedule ", s.name, ": ", grid.stages, " stages, ", config.micro_batches,
               " micro-batches; train with --schedule file:", write_schedule,
               s.virtual_stages > 1 ? cat(" --virtual-stages ", s.virtual_stages) : std::string(), "\n")
        << s.to_text();
    out.close();
    MPIPE_REQUIRE(out.good(), "give a path in a directory you can write", "--write-schedule: cannot write '",
                  write_schedule, "'");
    std::printf("schedule written to %s\n", write_schedule.c_str());
  }
  return 0;
}

// Rank 0, before training: --metrics, --trace and --summary each name a file that can be
// written (not a directory, not a FIFO, in a directory that exists), and no two of them,
// nor one of them and the data file, are the same file.
void check_output_files(const TrainConfig& c) {
  namespace fs = std::filesystem;
  struct Output {
    const char* option;
    std::string path;
    const char* example;
  };
  std::vector<Output> outputs;
  if (!c.metrics.empty()) outputs.push_back({"--metrics", c.metrics, "metrics.jsonl"});
  if (!c.trace.empty()) outputs.push_back({"--trace", c.trace, "trace.json"});
  if (!c.summary.empty()) outputs.push_back({"--summary", c.summary, "summary.json"});
  for (const Output& o : outputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(o.path, ec);
    if (fs::exists(st)) {
      MPIPE_REQUIRE(!fs::is_directory(st), cat("give a file, e.g. ", (fs::path(o.path) / o.example).string()), o.option,
                    " '", o.path, "' is a directory");
      MPIPE_REQUIRE(fs::is_regular_file(st) || fs::is_character_file(st), "give a regular file", o.option, " '",
                    o.path, "' is not a regular file (a FIFO would block)");
      MPIPE_REQUIRE(::access(o.path.c_str(), W_OK) == 0, "choose a file you can write", o.option, " '", o.path,
                    "' is not writable");
    } else {
      const fs::path parent = fs::path(o.path).has_parent_path() ? fs::path(o.path).parent_path() : fs::path(".");
      MPIPE_REQUIRE(fs::is_directory(parent, ec), cat("create '", parent.string(), "' first, or choose another path"),
                    o.option, " '", o.path, "': no directory '", parent.string(), "'");
      MPIPE_REQUIRE(::access(parent.c_str(), W_OK | X_OK) == 0, "choose a directory you can write to", o.option, " '",
                    o.path, "': directory '", parent.string(), "' is not writable");
    }
  }
  auto same = [](const std::string& a, const std::string& b) {
    std::error_code ec1, ec2;
    const fs::path pa = fs::weakly_canonical(a, ec1), pb = fs::weakly_canonical(b, ec2);
    if (ec1 || ec2 || pa != pb) return false;
    return !fs::is_character_file(pa, ec1);  // /dev/null may take them all
  };
  // The inputs are files no output may overwrite (the two inputs may be one file).
  const std::string data = data_file(c.data), eval_data = data_file(c.eval_data);
  if (!data.empty()) outputs.push_back({"--data", data, ""});
  if (!eval_data.empty() && !(!data.empty() && same(data, eval_data))) outputs.push_back({"--eval-data", eval_data, ""});
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      MPIPE_REQUIRE(!same(outputs[i].path, outputs[j].path), "give each output its own file", outputs[i].option, " and ",
                    outputs[j].option, " name the same file '", outputs[j].path, "'");
}

int run_train(const TrainConfig& options, const Communicator& world) {
  const auto started = std::chrono::steady_clock::now();  // --time-limit counts from here
  const bool root = world.rank() == 0;
  TrainConfig config = options;
  std::unique_ptr<Executor> exec;
  std::unique_ptr<MetricsWriter> metrics;
  double time_limit_s = 0;
  int code = agree(world, [&] {
    validate(config, world.size());
    time_limit_s = parse_time_limit(config.time_limit);
    if (root) check_checkpoint_options(config, /*create=*/true);
    if (root) check_output_files(config);
  });
  if (code) return code;
  // Every rank sees the directory rank 0 made (a shared file system), or says it does not.
  if ((code = agree(world, [&] { check_checkpoint_options(config); }))) return code;
  // One job per checkpoint directory, and a run id for the checkpoints this run writes.
  CheckpointDir checkpoint_dir(config);
  if ((code = agree(world, [&] {
         if (root) checkpoint_dir.lock();
       })))
    return code;
  checkpoint_dir.begin(world);
  // Collective, and only once every rank's options are known good.
  std::string device_line;
  if ((code = agree(world, [&] { device_line = resolve_device(config, world); }))) return code;
  if ((code = agree(world, [&] {
         if (root && !config.metrics.empty()) metrics = std::make_unique<MetricsWriter>(config.metrics);
         exec = std::make_unique<Executor>(config, world);
       })))
    return code;
  cpu::set_threads(config.threads > 0 ? config.threads : default_threads(world));
  if ((code = agree(world, [&] { exec->connect(); }))) return code;
  const int node_ranks = world.size() > 1 ? Communicator::node(world).size() : 1;
  if ((code = agree(world, [&] {
         check_memory(config, *exec, node_ranks);
         exec->allocate();
       })))
    return code;
  int64_t first_step = 0;
  std::string resumed_from;
  double load_seconds = 0;
  if ((code = agree(world, [&] {
         const auto start = std::chrono::steady_clock::now();
         resumed_from = resume(*exec, checkpoint_dir, &first_step);
         load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
       })))
    return code;
  // Checkpoints of another run in the directory: refused, or replaced under --overwrite.
  if ((code = agree(world, [&] {
         if (root) checkpoint_dir.claim();
       })))
    return code;
  if (!config.trace.empty()) exec->start_trace_clock();
  // Heartbeats from here to the end (after a collective, so every rank starts them
  // together): a rank stopped before or inside a checkpoint, or before the end of
  // training, is named within --p2p-timeout.
  Watchdog watchdog(world, exec->grid().name(), config.pipeline.p2p_timeout);

  const auto& m = config.model;
  const Grid& grid = exec->grid();
  if (root) {
    std::printf("mpipe %s (git %s): %s model, %d layers, %lld parameters, %d thread%s per rank\n", version(), git_hash(),
                m.kind.c_str(), exec->model().size(), static_cast<long long>(exec->model().parameter_count()),
                cpu::threads(), cpu::threads() > 1 ? "s" : "");
    std::printf("%s\n", device_line.c_str());
    if (grid.stages() > 1 || grid.replicas() > 1) std::printf("communication: %s\n", exec->progress().describe().c_str());
    if (time_limit_s > 0) {
      const long long t = std::llround(time_limit_s);
      std::printf("time limit: %lld:%02lld:%02lld (--time-limit %s): a checkpoint and exit %d before it\n", t / 3600,
                  t % 3600 / 60, t % 60, config.time_limit.c_str(), exit_preempted);
    }
    if (const Dataset* data = exec->dataset()) std::printf("data: %s\n", data->describe().c_str());
    if (const Dataset* data = exec->eval_dataset()) std::printf("eval data: %s\n", data->describe().c_str());
    print_plan(config, exec->model(), exec->partition(), grid.shape(), exec->schedule());
    if (grid.stages() > 1 && grid.stages() <= 8 && config.micro_batches <= 8) print_schedule_grid(exec->schedule());
    std::printf("%s, lr %g, %d steps\n", config.optimizer.kind.c_str(), config.optimizer.lr, config.steps);
    if (!resumed_from.empty())
      std::printf("resumed from %s: %lld steps done (checked and loaded in %.2f s)\n", resumed_from.c_str(),
                  static_cast<long long>(first_step), load_seconds);
    std::fflush(stdout);
  }

  const bool overlapped = config.pipeline.overlap_steps;
  const double theory = bubble_fraction(exec->schedule(), StageCosts::unit(exec->schedule()), overlapped);
  const int64_t tokens_per_sample = exec->model().tokens();
  PhaseStats stats;
  stats.stage = grid.stage();
  std::vector<double> step_seconds;  // rank 0, for the summary's median
  step_seconds.reserve(static_cast<std::size_t>(config.steps));
  const bool progress = root && show_progress(config.progress);
  const auto run_start = std::chrono::steady_clock::now();
  double longest_step = 0, checkpoint_seconds = 0;  // for --time-limit
  // Writes the checkpoint of `done` completed steps on every rank; false if it failed.
  int64_t last_saved = resumed_from.empty() ? -1 : first_step;
  auto checkpoint = [&](int64_t done) {
    if (config.checkpoint_dir.empty() || done == last_saved) return true;
    try {
      const SaveResult saved = save_checkpoint(*exec, checkpoint_dir, done, &watchdog);
      last_saved = done;
      checkpoint_seconds = saved.write_seconds + saved.verify_seconds;
      if (root)
        std::printf("checkpoint %s written: %s in %.2f s (%.0f MB/s), verified in %.2f s\n", saved.path.c_str(),
                    human_bytes(saved.bytes).c_str(), saved.write_seconds, saved.bytes / 1e6 / saved.write_seconds,
                    saved.verify_seconds);
      return true;
    } catch (const std::exception& e) {
      if (root) std::fprintf(stderr, "mpipe: error: %s\n", e.what());
      return false;
    }
  };
  bool preempted = false;
  std::string output_error;  // rank 0: an output file that could not be written
  // --time-limit: stop once the next step plus a checkpoint would not fit. Each rank asks
  // on its own clock; the step's allreduce makes every rank stop after the same step.
  auto time_is_up = [&] {
    if (time_limit_s <= 0) return false;
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    const double save = checkpoint_seconds > 0 ? checkpoint_seconds : longest_step;
    return elapsed + longest_step + save >= time_limit_s;
  };
  // A metrics line that cannot be written (a full disk) stops the run with the others at
  // the next step boundary, with a checkpoint.
  auto to_metrics = [&](auto&& write) {
    if (!metrics || !output_error.empty()) return;
    try {
      write(*metrics);
    } catch (const UserError& e) {
      output_error = cat("mpipe: error: ", e.what(), "; hint: ", e.hint());
      exec->request_stop();
    }
  };
  // One validated step's result: statistics, the log line, metrics, the progress line.
  auto report = [&](const StepResult& r) {
    const int64_t step = r.step;
    longest_step = std::max(longest_step, r.seconds);
    if (step > first_step) stats.add(exec->last_times(), r.bubble_fraction);  // the first step sizes the arenas
    if (!root) return;
    if (step > first_step) step_seconds.push_back(r.seconds);
    const double samples_per_s = config.batch_size / r.seconds;
    const double tokens_per_s = samples_per_s * static_cast<double>(tokens_per_sample);
    to_metrics([&](MetricsWriter& out) { out.write(r, samples_per_s, tokens_per_s); });
    if (r.skipped)
      std::printf("step %lld: non-finite loss or gradients (norm %g); update skipped on every rank\n",
                  static_cast<long long>(step + 1), r.grad_norm);
    if (progress) std::printf("\r\033[K");  // the progress line gives way to a log line
    if ((step + 1) % config.log_every == 0 || step == first_step || step + 1 == config.steps) {
      std::printf("step %6lld/%d | loss %.6f | lr %.3e | grad norm %8.4f | %8.2f ms | bubble %4.1f%% | ",
                  static_cast<long long>(step + 1), config.steps, r.loss, r.lr, r.grad_norm, r.seconds * 1e3,
                  100 * r.bubble_fraction);
      if (tokens_per_sample > 0) std::printf("%.0f tok/s\n", tokens_per_s);
      else std::printf("%.0f samples/s\n", samples_per_s);
      std::fflush(stdout);
    }
    if (progress && step + 1 < config.steps) {
      // On a terminal: one line that updates in place. Batch logs get plain lines only.
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
      const double eta = elapsed / static_cast<double>(step + 1 - first_step) * static_cast<double>(config.steps - step - 1);
      std::printf("step %lld/%d | loss %.4f | %.0f %s | ETA %d:%02d", static_cast<long long>(step + 1), config.steps,
                  r.loss, tokens_per_sample > 0 ? tokens_per_s : samples_per_s, tokens_per_sample > 0 ? "tok/s" : "samples/s",
                  static_cast<int>(eta) / 60, static_cast<int>(eta) % 60);
      std::fflush(stdout);
    }
  };
  try {
    for (int64_t step = first_step; step < config.steps; ++step) {
      if (g_stop_signal) exec->request_stop();
      if (time_is_up()) exec->request_stop();  // no signal: the message names the time limit
      // With --overlap-steps the results are of earlier steps (this one's once settled).
      bool stop = false;
      for (const StepResult& r : exec->advance(step)) {
        report(r);
        stop = stop || r.stop;
      }
      const bool save = config.checkpoint_every > 0 && (step + 1) % config.checkpoint_every == 0 && step + 1 < config.steps;
      const bool eval = !config.eval_data.empty() &&
                        ((config.eval_every > 0 && (step + 1) % config.eval_every == 0) || step + 1 == config.steps);
      // A checkpoint, an evaluation, a stop and the end need this step's agreed update.
      if (stop || save || eval || step + 1 == config.steps)
        if (const std::optional<StepResult> r = exec->settle()) {
          report(*r);
          stop = stop || r->stop;
        }
      if (stop) {
        // Every rank saw the same flag in the step's allreduce: stop here, together.
        preempted = true;
        if (root)
          std::printf("step %lld: %s; checkpointing and exiting with code %d\n", static_cast<long long>(step + 1),
                      !output_error.empty() ? "an output file cannot be written"
                      : g_stop_signal       ? "stop signal received"
                                            : "--time-limit reached",
                      output_error.empty() ? exit_preempted : exit_user_error);
        if (!checkpoint(step + 1)) return exit_internal_error;
        break;
      }
      if (save && !checkpoint(step + 1)) return exit_internal_error;
      if (eval) {
        const EvalResult e = exec->evaluate();  // every rank
        if (!root) continue;
        if (progress) std::printf("\r\033[K");
        std::printf("eval step %lld | loss %.6f | %s %.2f%% | %lld samples", static_cast<long long>(step + 1), e.loss,
                    tokens_per_sample > 0 ? "token accuracy" : "accuracy", 100 * e.accuracy,
                    static_cast<long long>(e.samples));
        if (tokens_per_sample > 0) std::printf(" | perplexity %.3f", std::exp(e.loss));
        std::printf("\n");
        std::fflush(stdout);
        to_metrics([&](MetricsWriter& out) { out.write_eval(step, e); });
      }
    }
  } catch (const TimeoutError& e) {
    // A wait passed --p2p-timeout: name the ranks that stopped answering, once.
    std::fflush(stdout);
    roll_call(world.get(), e.what(), std::min(config.pipeline.p2p_timeout, 3.0), &watchdog);
  } catch (const std::exception& e) {
    // One rank failed mid-run: the others may be waiting on it, so end the whole job.
    std::fflush(stdout);
    std::fprintf(stderr, "mpipe: error: %s\n", e.what());
    std::fflush(stderr);
    MPI_Abort(world.get(), exit_internal_error);
  }
  if (!preempted && !checkpoint(config.steps)) return exit_internal_error;
  // An output that failed mid-run ends the run as an error on every rank, after its checkpoint.
  int output_failed = root && !output_error.empty() ? 1 : 0;
  world.broadcast(std::span<int>(&output_failed, 1), 0);
  if (output_failed) {
    if (root) {
      std::fflush(stdout);
      std::fprintf(stderr, "%s\n", output_error.c_str());
    }
    return exit_user_error;
  }
  // The closing gathers are collectives: a rank stopped by now is named, not waited for.
  rendezvous(world, "the end of training", config.pipeline.p2p_timeout, &watchdog);
  double simulated = 0;
  std::vector<StagePhases> phases = phase_table(stats, world, exec->schedule(), config.micro_batches, theory, overlapped, &simulated);
  double peak = static_cast<double>(exec->peak_activation_bytes());
  std::vector<double> peaks(root ? world.size() : 0);
  MPI_CHECK(MPI_Gather(&peak, 1, MPI_DOUBLE, peaks.data(), 1, MPI_DOUBLE, 0, world.get()));
  if (!config.trace.empty()) {
    if ((code = agree(world, [&] { write_trace(*exec, config.trace); }))) return code;
    if (root)
      std::printf("trace of steps 2-%d written to %s\n", std::min(config.trace_steps + 1, config.steps), config.trace.c_str());
  }
  if (root) {
    std::printf("peak activation memory per rank:");
    for (double p : peaks) std::printf(" %s", human_bytes(p).c_str());
    std::printf("\n");
    if (config.pipeline.overlap_steps)
      std::printf("overlap-steps: %lld updates made ahead of their agreement, %lld undone and redone (clipping or "
                  "non-finite)\n",
                  static_cast<long long>(exec->speculated()), static_cast<long long>(exec->rolled_back()));
    RunSummary summary;
    summary.steps = static_cast<long long>(step_seconds.size());
    if (!step_seconds.empty()) {
      std::sort(step_seconds.begin(), step_seconds.end());
      summary.median_step_s = step_seconds[step_seconds.size() / 2];
      summary.samples_per_s = config.batch_size / summary.median_step_s;
      summary.tokens_per_s = summary.samples_per_s * static_cast<double>(tokens_per_sample);
    }
    summary.bubble = stats.steps > 0 ? stats.bubble / stats.steps : 0.0;
    summary.theoretical_bubble = theory;
    summary.simulated_bubble = simulated;
    summary.peak_bytes_per_rank = peaks;
    summary.phases = std::move(phases);
    const std::string json = summary_json(*exec, summary);
    try {
      if (metrics) metrics->write_line(json);
      if (!config.summary.empty()) write_summary(config.summary, json);
    } catch (const UserError& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
      return exit_user_error;
    }
  }
  return preempted ? exit_preempted : 0;
}

// `plan --layer-kinds`: the registry, as a user reads it.
static int print_layer_kinds() {
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

int run_main(int argc, char** argv) {
  // MPI comes up first for train, so that under mpirun only rank 0 reports.
  const bool training = argc > 1 && std::strcmp(argv[1], "train") == 0;
  int rank = 0, already = 0;
  MPI_Initialized(&already);  // tests call run_main with MPI up
  const bool own_mpi = training && !already;
  if (training) install_stop_handlers(environ);  // again: a test may call run_main
  if (own_mpi) {
    // MULTIPLE for the communication progress thread (Progress falls back without it).
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
  if (training) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  auto finish = [&](int code) {
    if (own_mpi) MPI_Finalize();
    return code;
  };

  CLI::App app{"mpipe: GPipe micro-batch pipeline-parallel training on MPI", "mpipe"};
  app.set_version_flag("--version", cat("mpipe ", version(), " (git ", git_hash(), ")"));
  app.require_subcommand(1);
  TrainConfig train_config, plan_config;
  CLI::App* train = app.add_subcommand("train", "Train a model (under mpirun/srun: one stage per rank)");
  add_train_options(*train, train_config);
  CLI::App* plan = app.add_subcommand("plan", "Print the grid, partition, schedule and bubble for --ranks, without MPI");
  add_train_options(*plan, plan_config);
  int plan_ranks = 1;
  plan->add_option("--ranks", plan_ranks, "Number of ranks to plan for")->capture_default_str();
  std::string write_schedule;
  plan->add_option("--write-schedule", write_schedule,
                   "Also write the schedule's actions per stage to this file, for editing and --schedule file:PATH");
  bool print_model = false, layer_kinds_help = false;
  plan->add_flag("--print-model", print_model,
                 "Print only the model's layer list as a model file (mpipe plan --model gpt --print-model > m.toml; "
                 "mpipe train --model m.toml)");
  plan->add_flag("--layer-kinds", layer_kinds_help, "List the layer kinds a model file may use, with their options");
  CLI::App* inspect = app.add_subcommand("inspect", "Show a checkpoint: tree, shapes, parameter counts, step, config");
  std::string inspect_path;
  bool inspect_stats = false, inspect_verify = false, inspect_config = false, inspect_model = false;
  inspect->add_option("file", inspect_path, "Checkpoint file (ckpt-*.h5)")->required();
  inspect->add_flag("--stats", inspect_stats, "Per-tensor min, max, mean, std and norm");
  inspect->add_flag("--verify", inspect_verify, "Check every checksum; exit code 2 on damage");
  inspect->add_flag("--config", inspect_config,
                    "Print only the run's options, as a file for 'train --config' (mpipe inspect CKPT --config > "
                    "run.toml)");
  inspect->add_flag("--model", inspect_model,
                    "Print only the model's layer list, as a model file for 'train --model' (mpipe inspect CKPT --model > "
                    "m.toml)");

  try {
    app.parse(argc, argv);
    if (train->parsed()) apply_config_file(*train);
    if (plan->parsed()) apply_config_file(*plan);
    // A model file has its own sizes: the presets' options would be ignored.
    for (const auto& [command, config] : {std::pair{train, &train_config}, std::pair{plan, &plan_config}}) {
      if (!command->parsed()) continue;
      // A schedule that always runs a fixed number of model stages per rank (zbv: two)
      // sets --virtual-stages unless given.
      if (const ScheduleKind* kind = find_schedule_kind(config->pipeline.schedule);
          kind && kind->virtual_stages > 1 && config->pipeline.virtual_stages == 1)
        config->pipeline.virtual_stages = kind->virtual_stages;
      // ResNet's depth is one of five: 18 unless given.
      if (config->model.kind == "resnet" && command->get_option("--layers")->count() == 0) config->model.layers = 18;
      if (is_preset(config->model.kind)) continue;
      for (const char* name : {"--layers", "--d-model", "--heads", "--seq-len", "--vocab", "--hidden", "--inputs", "--classes",
                               "--image", "--channels", "--width", "--dropout"})
        MPIPE_REQUIRE(command->get_option(name)->count() == 0, "set it in the model file (mpipe plan --layer-kinds lists the keys)",
                      name, " sizes the presets (gpt, mlp, resnet); model file '", config->model.kind, "' has its own");
    }
  } catch (const CLI::CallForHelp& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::CallForAllHelp& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::CallForVersion& e) {
    return finish(rank == 0 ? app.exit(e) : 0);
  } catch (const CLI::ParseError& e) {
    // No subcommand parsed: name what was typed (a mistyped "trian" is not a subcommand).
    const bool none = !train->parsed() && !plan->parsed() && !inspect->parsed();
    if (none && argc > 1 && argv[1][0] != '-') {
      if (rank == 0)
        std::fprintf(stderr, "mpipe: error: unknown command '%s'; hint: use mpipe train, plan or inspect (mpipe --help)\n",
                     argv[1]);
      return finish(exit_user_error);
    }
    if (rank == 0)
      std::fprintf(stderr, "mpipe: error: %s; hint: see 'mpipe %s--help'\n", e.what(),
                   train->parsed() ? "train " : plan->parsed() ? "plan " : inspect->parsed() ? "inspect " : "");
    return finish(exit_user_error);
  } catch (const UserError& e) {
    if (rank == 0) std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return finish(exit_user_error);
  }

  if (train->parsed()) {
    int code = exit_internal_error;
    try {
      const Communicator world = Communicator::borrow(MPI_COMM_WORLD);
      code = run_train(train_config, world);
    } catch (const std::exception& e) {
      // Outside the guarded phases: one line, then end every rank.
      std::fflush(stdout);
      std::fprintf(stderr, "mpipe: error on rank %d: %s\n", rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, exit_internal_error);
    }
    return finish(code);
  }
  try {
    if (inspect->parsed())
      return run_inspect(inspect_path, inspect_stats, inspect_verify, inspect_config ? "config" : inspect_model ? "model" : "");
    if (layer_kinds_help) return print_layer_kinds();
    if (print_model) {
      std::fputs(model_spec(plan_config.model).to_toml().c_str(), stdout);
      return 0;
    }
    return run_plan(plan_config, plan_ranks, write_schedule);
  } catch (const UserError& e) {
    std::fprintf(stderr, "mpipe: error: %s; hint: %s\n", e.what(), e.hint().c_str());
    return exit_user_error;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mpipe: internal error: %s\n", e.what());
    return exit_internal_error;
  }
}

}  // namespace mpipe
