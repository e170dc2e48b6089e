// The options of `train` and `plan` as the command line and --config files give them
// (words and numbers: TrainConfig), their checks, and the typed RunOptions and the Plan
// made from them. Nothing below the app reads a TrainConfig.
#pragma once
#include <cstdint>
#include <string>

#include "mpipe/io/checkpoint.hpp"
#include "mpipe/nn/model.hpp"
#include "mpipe/nn/optimizer.hpp"
#include "mpipe/pipeline/plan/grid.hpp"
#include "mpipe/pipeline/plan/plan.hpp"

namespace mpipe {

// --p2p-timeout unless given (seconds).
inline constexpr double default_p2p_timeout = 600.0;

struct PipelineConfig {
  GridShape grid{0, 0, "auto"};    // --stages, --replicas (0: inferred), --rank-order
  std::string schedule = "gpipe";  // a name of schedule_kinds(), or file:PATH
  int virtual_stages = 1;          // model stages per rank (interleaved; 2 for zbv)
  std::string remat = "never";     // remat_names
  std::string batchnorm = "micro"; // batchnorm_names: when BatchNorm's running statistics move
  std::string partition = "flops"; // partition_names
  std::string balance;             // "a,b,..." layers per stage; overrides partition
  std::string link_bandwidth = "auto";  // auto | off | GB/s: links counted by --partition time
  double p2p_timeout = default_p2p_timeout;  // seconds a point-to-point wait may block
  std::string comm_progress = "auto";  // auto | thread | layers | waits (pipeline/comm/progress.hpp)
  double comm_poll_us = 5000;      // the progress thread's poll interval while nothing moves, microseconds
  std::string comm_wait = "sleep";  // comm_wait_names: how a wait passes the time once nothing moves
  int in_flight = 0;               // zero-bubble schedules: micro-batches (zbv: model stages) held from F to W; 0: the schedule's own
  std::string memory_per_rank;     // SIZE (e.g. 8GiB) --remat auto fits each rank into; empty: not given
  bool overlap_steps = false;      // update ahead of the step's agreement, checked after the next pass (Executor::advance)
  bool shard_optimizer = false;    // optimizer state sharded over each stage's replicas (ZeRO-1)
};

struct TrainConfig {
  ModelConfig model;
  OptimizerConfig optimizer;
  PipelineConfig pipeline;
  std::string config_file;  // --config, if given: an input no output may overwrite
  std::string data = "synthetic";
  std::string eval_data;    // held-out data (same specs as data); empty: no evaluation
  std::string data_packing = "windows";  // packing_names: where a window of text or tokens starts
  std::int64_t eot_id = -1;  // the end-of-text id of --data-packing documents; -1: the shards' format's
  std::string tokenizer;    // --tokenizer: the file that turns text: data into ids (kept in each checkpoint); empty: none
  std::string prefetch = "auto";  // auto | on | off: the next step's batch read while a step computes
  int eval_every = 0;       // steps between evaluations (and one at the end); 0: only at the end
  int eval_batches = 0;     // batches per evaluation; 0: a file's every whole batch, 8 of synthetic data
  // --sample-every: every N steps (0: never) a continuation of sample_prompt by
  // sample_tokens in the log (app/sample.hpp).
  int sample_every = 0;
  int sample_tokens = 64;
  std::string sample_prompt = "\n";
  int batch_size = 32;      // global mini-batch, in samples
  int micro_batches = 1;    // per replica
  int steps = 100;          // the step training runs up to
  std::uint64_t seed = 1;
  int threads = 0;          // 0: every core the process may use
  int log_every = 10;
  std::string progress = "auto";  // auto | on | off: the live progress line on rank 0
  std::string metrics;      // JSON-lines file, or empty
  std::string summary;      // JSON summary written at the end, or empty
  std::string trace;        // Chrome/Perfetto trace of every rank's actions, or empty
  int trace_steps = 5;      // steps traced, after the first
  int profile_ops = 0;      // --profile-ops: the step (1 to steps) whose ops are timed by kind; 0: none
  std::string checkpoint_dir;    // where checkpoints go; empty: none
  int checkpoint_every = 0;      // steps between checkpoints; 0: only the final one
  // on: the checkpoints of --checkpoint-every written by a thread while training goes on
  // (io/checkpoint_async.hpp); the final one, and one at a stop, are written at once.
  // auto: on where MPI takes calls from two threads (MPI_THREAD_MULTIPLE), else off.
  std::string checkpoint_async = "auto";
  int keep = 0;                  // complete checkpoints kept; 0: all
  std::string resume = "auto";   // auto | never | PATH
  std::string init_from;         // a safetensors file (mpipe export) a fresh run starts from; empty: the seed's
  bool overwrite = false;        // checkpoint_dir may hold another run's checkpoints: replace them
  std::string time_limit;        // stop, checkpoint and exit 75 before this much time: MINUTES or [D-]H:MM:SS
  std::string device = "cpu";    // cpu | cuda | auto; resolve_device() turns auto into one
  std::string precision = "fp32";  // fp32 | bf16 (GPU): compute and message precision
  // on | off: on a GPU, each action of a micro-batch (F, B, W, a recomputation) recorded
  // and launched as one CUDA graph from the third step on (Stage::graphed).
  std::string cuda_graphs = "off";
  // on | off: images (N, C, H, W) lie in memory as NHWC (channels last) in every image
  // layer: on a GPU cuDNN's NHWC convolutions and kernels of its own, with no transposes;
  // on the CPU each image op swaps to channels first and back (the same bits, slower).
  std::string channels_last = "off";
};

// Checks everything that needs neither the model's layers nor communication; UserError
// on a problem. `world` is the number of ranks, or 0 when not known yet. make_plan()
// checks the rest (the schedule, --balance, stages against layers).
void validate(const TrainConfig& config, int world = 0);

// The options as typed values (validate() first: a word it has not checked is an
// internal error). A device of "auto" counts as the CPU: a run resolves it first.
RunOptions run_options(const TrainConfig& config);
// Whether --checkpoint-every's checkpoints are written in the background (--checkpoint-async
// on or auto, with a --checkpoint-dir and --checkpoint-every): what the plan counts the
// copy's memory for. auto falls back to writing at the step where MPI cannot.
bool background_checkpoints(const TrainConfig& config);

// The run's plan, its options checked first (validate). Collective over `world` when
// --partition time measures (layer times on world rank 0, the links between the ranks);
// rank-local otherwise. train makes it in phases of its own (app/train.cpp).
Plan plan_run(const TrainConfig& config, const Communicator& world);

// What a run's checkpoints need of its options, with the options' text for each
// checkpoint's `config` attribute.
CheckpointOptions checkpoint_options(const TrainConfig& config);
// Checks --checkpoint-dir and --resume before training; UserError on a problem. With
// `create` (one rank), a missing --checkpoint-dir is created first, parents included.
void check_checkpoint_options(const TrainConfig& config, bool create = false);

// --time-limit in seconds: MINUTES (a number), or Slurm's forms MM:SS, H:MM:SS, D-H,
// D-H:MM, D-H:MM:SS. 0 when empty; UserError when it is not a positive duration.
double parse_time_limit(const std::string& text);
// --memory-per-rank: bytes, or a number with B, KB, MB, GB, TB (powers of 1000) or KiB,
// MiB, GiB, TiB (of 1024). UserError for anything else or a size that is not positive.
double parse_memory_size(const std::string& text);

// Rank 0, before training: --metrics, --trace and --summary each name a file that can be
// written (not a directory, not a FIFO, in a directory that exists), and no two of them,
// nor one of them and the data file, are the same file.
void check_output_files(const TrainConfig& config);

}  // namespace mpipe
