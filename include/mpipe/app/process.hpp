// What this process runs on: the stop signals, its threads and memory, whether a person
// watches its output, and the device (CPU or GPU) a run trains on.
#pragma once
#include <string>

#include "mpipe/app/config.hpp"
#include "mpipe/pipeline/comm/comm.hpp"

namespace mpipe {

// Exit codes: 0 ok, 2 bad input (a user error), 1 an internal error; 75 a run stopped in
// time with its checkpoint (exit_preempted, io/checkpoint.hpp).
inline constexpr int exit_user_error = 2;
inline constexpr int exit_internal_error = 1;

// SIGTERM and SIGUSR1 (what Slurm and mpirun send) ask training to stop after the
// current step with a checkpoint, exit 75. `environment`: main's envp. main.cpp calls
// this for `train` before any shared library's constructor runs (cuBLASLt's take ~0.3 s,
// in which a signal would otherwise kill the rank), and run_main again.
void install_stop_handlers(char** environment);
// Whether a stop signal has come.
bool stop_signalled();

// Under Open MPI's mpirun: the seconds a rank has, once a SIGTERM to mpirun reaches it,
// before mpirun's SIGKILL (odls_base_sigkill_timeout: mpirun sends SIGCONT, waits that
// long, SIGTERM, waits again, SIGKILL). From --mca (the environment) or an MCA parameter
// file; 1, Open MPI's default, where none sets it. -1 when not under mpirun (srun: the
// cluster's KillWait, Slurm's --signal).
double mpirun_kill_grace();
// Under mpirun: an MCA parameter as mpirun has it (--mca sets OMPI_MCA_NAME in the ranks;
// else the user's and the system's parameter files), or `fallback`, Open MPI's default.
double mpirun_param(const std::string& name, double fallback);
// Under mpirun: the seconds after a node goes silent (its link or power gone) before
// mpirun gives up on its daemon, and so before a job that mpipe aborted for it ends: the
// TCP keepalives on mpirun's links (oob_tcp_keepalive_time + _intvl x _probes; Open MPI's
// defaults 300 + 20 x 9); infinity with keepalives off; -1 when not under mpirun.
double mpirun_lost_node_s();

// Threads per rank when --threads is 0: the cores the launcher bound this rank to, or,
// when it did not bind (all cores visible), the node's cores shared by its ranks.
// Collective over `world`.
int default_threads(const Communicator& world);
// Threads per rank for --threads `requested`: default_threads for 0; else as many, but no
// more than the cores this rank may use (a warning, once, by the lowest rank capped).
// Collective over `world`.
int rank_threads(int requested, const Communicator& world);

// Bytes of memory this process may still take: MemAvailable, or less where a cgroup
// (a Slurm job, a container) limits it. 0 when neither can be read.
double available_memory();
// Bytes of this process resident in memory now (/proc/self/statm); 0 where unreadable.
double resident_bytes();

// Whether a person watches rank 0's standard output (--progress auto), or on / off.
bool show_progress(const std::string& mode);
// The command name of this process's parent (/proc/PPID/comm: "mpirun", "orted", "bash"),
// empty where it cannot be read.
std::string parent_name();

// Collective over `world`: resolves config.device ("auto": CUDA when every rank has a
// GPU), binds each rank to GPU (node-local rank modulo visible GPUs) and initialises it.
// UserError, agreed on every rank, when "cuda" is asked for and some rank has no usable
// GPU, or bf16 is asked for on the CPU. Returns a line describing the choice.
std::string resolve_device(TrainConfig& config, const Communicator& world);

}  // namespace mpipe
