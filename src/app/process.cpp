// What this process runs on: the stop signals (SIGTERM, SIGUSR1), its threads and
// memory, whether a person watches its output, and the device.
#include "mpipe/app/process.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string_view>

#include "mpipe/backend/cpu/blas_core.hpp"
#include "mpipe/backend/cuda/runtime.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

namespace {

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

bool stop_signalled() { return g_stop_signal != 0; }

namespace {
bool under_mpirun() { return std::getenv("OMPI_MCA_orte_hnp_uri") != nullptr; }  // mpirun (ORTE) sets it for its ranks
}  // namespace

double mpirun_param(const std::string& name, double fallback) {
  if (const char* value = std::getenv(("OMPI_MCA_" + name).c_str())) return std::atof(value);
  // The files mpirun reads, the user's before the system's: "name = value" lines.
  const char* home = std::getenv("HOME");
  for (const std::string& path : {std::string(home ? home : "") + "/.openmpi/mca-params.conf",
                                  std::string("/etc/openmpi/openmpi-mca-params.conf")}) {
    std::ifstream file(path);
    for (std::string line; std::getline(file, line);) {
      const std::size_t equals = line.find('=');
      if (line.empty() || line[0] == '#' || equals == std::string::npos) continue;
      std::string key = line.substr(0, equals);
      key.erase(std::remove_if(key.begin(), key.end(), [](unsigned char c) { return std::isspace(c); }), key.end());
      if (key == name) return std::atof(line.c_str() + equals + 1);
    }
  }
  return fallback;
}

double mpirun_kill_grace() { return under_mpirun() ? mpirun_param("odls_base_sigkill_timeout", 1) : -1; }

double mpirun_lost_node_s() {
  if (!under_mpirun()) return -1;
  const double idle = mpirun_param("oob_tcp_keepalive_time", 300);
  if (idle <= 0) return std::numeric_limits<double>::infinity();  // keepalives off
  return idle + mpirun_param("oob_tcp_keepalive_intvl", 20) * mpirun_param("oob_tcp_keepalive_probes", 9);
}

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

int rank_threads(int requested, const Communicator& world) {
  if (requested <= 0) return default_threads(world);
  cpu_set_t set;
  int cores = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cores = CPU_COUNT(&set);
  cores = std::max(1, cores);
  // More threads than cores only wait on each other (a step 100 times slower at 100000):
  // each rank runs as many as it has cores, and the lowest rank that had to says so once.
  const int capped = std::min(requested, cores);
  int first = capped < requested ? world.rank() : world.size();
  if (world.size() > 1) world.allreduce(std::span<int>(&first, 1), Reduce::min);
  if (first == world.rank())
    std::fprintf(stderr, "mpipe: warning: --threads %d is more than the %d core%s rank %d may use; it runs %d thread%s (a rank "
                 "runs no more threads than it has cores)\n", requested, cores, cores == 1 ? "" : "s", world.rank(), capped,
                 capped == 1 ? "" : "s");
  return capped;
}

double resident_bytes() {
  double pages = 0, resident = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%lf %lf", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<double>(sysconf(_SC_PAGESIZE));
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

std::string parent_name() {
  std::string name;
  if (std::FILE* f = std::fopen(cat("/proc/", getppid(), "/comm").c_str(), "r")) {
    char text[64] = {};
    if (std::fgets(text, sizeof text, f)) name = text;
    std::fclose(f);
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  return name;
}

// Whether a person watches rank 0's standard output. Open MPI forwards every rank's
// stdout through a pseudo-terminal of its own, a terminal even when mpirun's output goes
// to a file; there it is the launcher's stdout that counts. The launcher is the parent
// process when mpirun started this rank on its own node; a rank a remote daemon (orted,
// prted) started shows no live line. srun gives pipes (a terminal with --pty).
bool show_progress(const std::string& mode) {
  if (mode != "auto") return mode == "on";
  if (!isatty(STDOUT_FILENO)) return false;
  const std::string name = parent_name();
  static const char* const launchers[] = {"mpirun", "mpiexec", "orterun", "prterun", "orted", "prted"};
  if (std::find(std::begin(launchers), std::end(launchers), name) == std::end(launchers)) return true;
  char target[256] = {};
  const ssize_t n = readlink(cat("/proc/", getppid(), "/fd/1").c_str(), target, sizeof target - 1);
  if (n <= 0) return false;
  const std::string where(target, static_cast<std::size_t>(n));
  return where.rfind("/dev/pts/", 0) == 0 || where.rfind("/dev/tty", 0) == 0;
}

std::string resolve_device(TrainConfig& config, const Communicator& world) {
  // Every rank counts its GPUs; a rank without one makes "auto" the CPU everywhere and
  // "cuda" a user error everywhere, so no rank is left alone on a device.
  std::string why;
  int gpus = config.device == "cpu" ? 0 : cuda::device_count(&why);
  int fewest = gpus;
  world.allreduce(std::span<int>(&fewest, 1), Reduce::min);
  const std::string asked = config.device;  // "auto" is resolved here; errors name what was asked
  if (config.device == "auto") config.device = fewest > 0 ? "cuda" : "cpu";
  if (config.device == "cuda" && fewest == 0) {
    // Name the first rank without a GPU, and its reason, on every rank.
    int first = gpus == 0 ? world.rank() : world.size();
    world.allreduce(std::span<int>(&first, 1), Reduce::min);
    std::string reason = why;
    world.broadcast(reason, first);
    throw UserError(cat("--device cuda but rank ", first, " has no usable GPU (", reason, ")"),
                    "run on GPU nodes, check CUDA_VISIBLE_DEVICES and the driver, or use --device cpu");
  }
  MPIPE_REQUIRE(config.device == "cuda" || config.precision == "fp32",
                "use --precision fp32 on the CPU, or run on GPU nodes",
                "--precision bf16 needs a GPU, and ",
                asked == "auto" ? "--device auto found none on every rank, so it chose the CPU" : "--device cpu chose the CPU");
  MPIPE_REQUIRE(config.device == "cuda" || config.cuda_graphs == "off", "use --cuda-graphs off on the CPU, or run on GPU nodes",
                "--cuda-graphs on needs a GPU, and --device ", config.device == "cpu" ? "cpu" : "auto", " chose the CPU");
  if (config.device == "cpu") return "device: cpu; BLAS " + cpu::blas_description();
  // Node-local rank modulo the GPUs this rank sees: one GPU per rank with one rank per
  // GPU, or ranks sharing GPUs round-robin when there are more ranks than GPUs.
  const Communicator node = Communicator::node(world);
  const int ordinal = node.rank() % gpus;
  cuda::init(ordinal);
  const cuda::DeviceProperties p = cuda::properties(ordinal);
  return cat("device: cuda, ", p.name, " (sm_", p.major, p.minor, ", ", p.memory_bytes >> 30, " GiB); ", gpus,
             " GPU(s) and ", node.size(), " rank(s) per node; precision ", config.precision, "; MPI ",
             mpi_cuda_aware() ? "CUDA-aware (messages from device memory)" : "not CUDA-aware (messages staged in pinned host memory)");
}

}  // namespace mpipe
