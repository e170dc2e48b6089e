// The options of train and plan: their checks, their typed form and the plan made from them.
#include "mpipe/app/config.hpp"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "mpipe/app/config_file.hpp"
#include "mpipe/core/error.hpp"
#include "mpipe/data/dataset.hpp"
#include "mpipe/io/checkpoint_format.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

// The index of `word` in an option's words, or -1.
template <std::size_t N>
int word_index(const std::string& word, const std::array<const char*, N>& names) {
  for (std::size_t i = 0; i < N; ++i)
    if (word == names[i]) return static_cast<int>(i);
  return -1;
}

template <class Enum, std::size_t N>
Enum parsed(const std::string& word, const std::array<const char*, N>& names) {
  const int i = word_index(word, names);
  MPIPE_CHECK(i >= 0, "'", word, "' is not checked by validate()");
  return static_cast<Enum>(i);
}

}  // namespace

void validate(const TrainConfig& c, int world) {
  validate(c.model);
  validate(c.optimizer);
  const auto& p = c.pipeline;
  MPIPE_REQUIRE(c.batch_size > 0, "e.g. --batch-size 32", "--batch-size must be positive, got ", c.batch_size);
  MPIPE_REQUIRE(c.micro_batches > 0, "e.g. --micro-batches 4", "--micro-batches must be positive, got ", c.micro_batches);
  MPIPE_REQUIRE(c.steps > 0, "e.g. --steps 100", "--steps must be positive, got ", c.steps);
  MPIPE_REQUIRE(c.threads >= 0, "e.g. --threads 2, or 0 for every core", "--threads must be >= 0, got ", c.threads);
  MPIPE_REQUIRE(c.log_every > 0, "e.g. --log-every 10", "--log-every must be positive, got ", c.log_every);
  MPIPE_REQUIRE(c.trace_steps >= 0, "e.g. --trace-steps 5", "--trace-steps must be >= 0, got ", c.trace_steps);
  MPIPE_REQUIRE(c.profile_ops >= 0 && c.profile_ops <= c.steps, "name one of the run's steps, e.g. --profile-ops 5 (0: none)",
                "--profile-ops ", c.profile_ops, " is not a step of this run (1 to --steps ", c.steps, ")");
  MPIPE_REQUIRE(c.eval_every >= 0, "e.g. --eval-every 100", "--eval-every must be >= 0, got ", c.eval_every);
  MPIPE_REQUIRE(c.checkpoint_async == "auto" || c.checkpoint_async == "on" || c.checkpoint_async == "off", "use auto, on or off",
                "--checkpoint-async must be auto, on or off, got '", c.checkpoint_async, "'");
  MPIPE_REQUIRE(c.sample_every >= 0, "e.g. --sample-every 100", "--sample-every must be >= 0, got ", c.sample_every);
  MPIPE_REQUIRE(c.sample_tokens >= 1 && c.sample_tokens <= 100000, "e.g. --sample-tokens 64",
                "--sample-tokens must be from 1 to 100000, got ", c.sample_tokens);
  MPIPE_REQUIRE(c.eval_batches >= 0, "e.g. --eval-batches 8, or 0 for a file's every batch", "--eval-batches must be >= 0, got ",
                c.eval_batches);
  MPIPE_REQUIRE(!c.eval_data.empty() || (c.eval_every == 0 && c.eval_batches == 0), "give --eval-data, e.g. hdf5:test.h5",
                "--eval-every and --eval-batches need --eval-data");
  MPIPE_REQUIRE(c.tokenizer.empty() || c.data.rfind("text:", 0) == 0,
                "tokens: files are already ids (write them with 'mpipe tokenize'); give --data text:PATH, or drop --tokenizer",
                "--tokenizer '", c.tokenizer, "' turns text into ids, and --data '", c.data, "' is not text: data");
  MPIPE_REQUIRE(c.progress == "auto" || c.progress == "on" || c.progress == "off", "use --progress auto, on or off",
                "unknown --progress '", c.progress, "'");
  MPIPE_REQUIRE(word_index(c.data_packing, packing_names) >= 0, "use --data-packing windows or documents",
                "unknown --data-packing '", c.data_packing, "'");
  MPIPE_REQUIRE(c.eot_id >= -1, "give the end-of-text id, e.g. --eot-id 50256 (-1: the shards' own)", "--eot-id must be >= 0, got ",
                c.eot_id);
  MPIPE_REQUIRE(word_index(c.prefetch, prefetch_names) >= 0, "use --prefetch auto, on or off", "unknown --prefetch '",
                c.prefetch, "'");
  MPIPE_REQUIRE(word_index(p.remat, remat_names) >= 0,
                "use --remat never, selective, except-last, always or auto", "unknown --remat '", p.remat, "'");
  if (!p.memory_per_rank.empty()) parse_memory_size(p.memory_per_rank);  // throws UserError when malformed
  MPIPE_REQUIRE(p.remat != "auto" || !p.memory_per_rank.empty(), "e.g. --remat auto --memory-per-rank 8GiB",
                "--remat auto needs --memory-per-rank (the memory each rank may fill)");
  MPIPE_REQUIRE(word_index(p.batchnorm, batchnorm_names) >= 0, "use --batchnorm micro or deferred",
                "unknown --batchnorm '", p.batchnorm, "'");
  MPIPE_REQUIRE(p.p2p_timeout > 0, "e.g. --p2p-timeout 600", "--p2p-timeout must be positive, got ", p.p2p_timeout);
  if (!c.time_limit.empty()) parse_time_limit(c.time_limit);  // throws UserError when malformed
  // A run stopped in time exits 75 for its batch script to requeue it: without a
  // checkpoint to continue from, the requeued run would start again from step 0.
  MPIPE_REQUIRE(c.time_limit.empty() || !c.checkpoint_dir.empty(), "give --checkpoint-dir DIR (its checkpoint is what the next run continues)",
                "--time-limit stops the run in time to write a checkpoint, and there is no --checkpoint-dir");
  parse_progress_mode(p.comm_progress);  // throws UserError for an unknown name
  parse_link_bandwidth(p.link_bandwidth);  // likewise
  MPIPE_REQUIRE(p.comm_poll_us >= 0 && p.comm_poll_us <= 1e6, "e.g. --comm-poll-us 5000 (0: no pause)",
                "--comm-poll-us must be between 0 and 1000000, got ", p.comm_poll_us);
  MPIPE_REQUIRE(word_index(p.comm_wait, comm_wait_names) >= 0, "use --comm-wait sleep or spin",
                "unknown --comm-wait '", p.comm_wait, "'");
  MPIPE_REQUIRE(c.device == "cpu" || c.device == "cuda" || c.device == "auto", "use --device cpu, cuda or auto",
                "unknown --device '", c.device, "'");
  MPIPE_REQUIRE(c.precision == "fp32" || c.precision == "bf16", "use --precision fp32 or bf16",
                "unknown --precision '", c.precision, "'");
  MPIPE_REQUIRE(c.precision == "fp32" || c.device != "cpu", "use --device cuda (or auto on GPU nodes) with bf16",
                "--precision bf16 needs a GPU; the CPU backend computes in fp32");
  MPIPE_REQUIRE(c.cuda_graphs == "on" || c.cuda_graphs == "off", "use --cuda-graphs on or off",
                "unknown --cuda-graphs '", c.cuda_graphs, "'");
  MPIPE_REQUIRE(c.cuda_graphs == "off" || c.device != "cpu", "use --device cuda (or auto on GPU nodes) with --cuda-graphs on",
                "--cuda-graphs on needs a GPU; the CPU backend launches no kernels");
  MPIPE_REQUIRE(c.channels_last == "on" || c.channels_last == "off", "use --channels-last on or off",
                "unknown --channels-last '", c.channels_last, "'");
  GridShape grid = p.grid;
  if (world > 0) grid = resolve_grid(grid, world);
  const int replicas = std::max(1, grid.replicas);
  // Each message's tag tells its (model stage,) micro-batch apart (message_tag).
  MPIPE_REQUIRE(p.virtual_stages >= 1 && p.virtual_stages <= 64, "e.g. --virtual-stages 2 with --schedule interleaved",
                "--virtual-stages must be between 1 and 64, got ", p.virtual_stages);
  MPIPE_REQUIRE(c.micro_batches <= max_tagged_messages, cat("use at most ", max_tagged_messages, " micro-batches"),
                "--micro-batches ", c.micro_batches, " is too many");
  const int v = p.virtual_stages, stages = std::max(1, grid.stages);
  MPIPE_REQUIRE(v == 1 || static_cast<std::int64_t>(c.micro_batches) * stages * v <= max_tagged_messages,
                "use fewer micro-batches or virtual stages", "--micro-batches ", c.micro_batches, " x ", stages,
                " stages x --virtual-stages ", v, " is more than ", max_tagged_messages, " messages tags can tell apart");
  MPIPE_REQUIRE(c.micro_batches <= c.batch_size, "use at most one micro-batch per sample",
                "--micro-batches ", c.micro_batches, " exceeds --batch-size ", c.batch_size);
  if (replicas == 1)
    MPIPE_REQUIRE(c.batch_size % c.micro_batches == 0, "pick --micro-batches dividing --batch-size",
                  "--batch-size ", c.batch_size, " is not divisible by --micro-batches ", c.micro_batches);
  else
    MPIPE_REQUIRE(c.batch_size % (static_cast<std::int64_t>(c.micro_batches) * replicas) == 0,
                  cat("pick a --batch-size that is a multiple of ", c.micro_batches * replicas),
                  "--batch-size ", c.batch_size, " does not split into --micro-batches ", c.micro_batches, " x ",
                  replicas, " replicas");
  if (!p.balance.empty())
    parse_balance(p.balance);
  else
    MPIPE_REQUIRE(word_index(p.partition, partition_names) >= 0, "use --partition uniform, params, flops or time",
                  "unknown --partition '", p.partition, "'");
}

bool background_checkpoints(const TrainConfig& c) {
  return c.checkpoint_async != "off" && !c.checkpoint_dir.empty() && c.checkpoint_every > 0;
}

RunOptions run_options(const TrainConfig& c) {
  const PipelineConfig& p = c.pipeline;
  RunOptions o;
  o.model = c.model;
  o.optimizer = c.optimizer;
  o.data = c.data;
  o.eval_data = c.eval_data;
  o.tokens = {.packing = parsed<Packing>(c.data_packing, packing_names), .eot_id = c.eot_id};
  o.eval_batches = c.eval_batches;
  o.prefetch = parsed<PrefetchMode>(c.prefetch, prefetch_names);
  o.batch_size = c.batch_size;
  o.micro_batches = c.micro_batches;
  o.steps = c.steps;
  o.seed = c.seed;
  o.grid = p.grid;
  o.schedule = p.schedule;
  o.virtual_stages = p.virtual_stages;
  o.in_flight = p.in_flight;
  o.overlap_steps = p.overlap_steps;
  o.shard_optimizer = p.shard_optimizer;
  o.checkpoint_copy = background_checkpoints(c);
  o.remat = parsed<Remat>(p.remat, remat_names);
  if (!p.memory_per_rank.empty()) o.memory_per_rank = parse_memory_size(p.memory_per_rank);
  o.batchnorm = parsed<BatchNormRule>(p.batchnorm, batchnorm_names);
  if (p.balance.empty()) o.partition = parsed<PartitionBy>(p.partition, partition_names);
  else o.balance = parse_balance(p.balance);
  o.link_seconds_per_byte = parse_link_bandwidth(p.link_bandwidth);
  o.p2p_timeout = p.p2p_timeout;
  o.comm_progress = parse_progress_mode(p.comm_progress);
  o.comm_poll_s = p.comm_poll_us * 1e-6;
  o.comm_wait = parsed<CommWait>(p.comm_wait, comm_wait_names);
  o.device = c.device == "cuda" ? Device::cuda : Device::cpu;
  o.precision = c.precision == "bf16" ? DType::bf16 : DType::f32;
  o.cuda_graphs = c.cuda_graphs == "on";
  o.channels_last = c.channels_last == "on";
  o.trace_steps = c.trace.empty() ? 0 : c.trace_steps;
  return o;
}

Plan plan_run(const TrainConfig& config, const Communicator& world) {
  validate(config, world.size());
  const RunOptions options = run_options(config);
  return make_plan(options, world.size(), Model(options.model), measure_costs(options, world));
}

CheckpointOptions checkpoint_options(const TrainConfig& c) {
  return {.dir = c.checkpoint_dir, .keep = c.keep, .resume = c.resume, .overwrite = c.overwrite, .config_text = to_toml(c)};
}

void check_checkpoint_options(const TrainConfig& c, bool create) {
  MPIPE_REQUIRE(c.checkpoint_every >= 0, "e.g. --checkpoint-every 100", "--checkpoint-every must be >= 0, got ",
                c.checkpoint_every);
  MPIPE_REQUIRE(c.keep >= 0, "e.g. --keep 3 (0 keeps all)", "--keep must be >= 0, got ", c.keep);
  if (c.checkpoint_dir.empty()) {
    MPIPE_REQUIRE(c.checkpoint_every == 0, "give --checkpoint-dir DIR", "--checkpoint-every needs --checkpoint-dir");
  } else {
    std::error_code ec;
    if (create && !fs::is_directory(c.checkpoint_dir, ec)) {
      fs::create_directories(c.checkpoint_dir, ec);
      if (ec) {
        // Name the part of the path that is in the way: a regular file, or a directory
        // this user may not write to.
        fs::path blocker = fs::path(c.checkpoint_dir);
        std::error_code e2;
        while (blocker.has_parent_path() && blocker != blocker.parent_path() && !fs::exists(blocker, e2))
          blocker = blocker.parent_path();
        const std::string hint =
            fs::exists(blocker, e2) && !fs::is_directory(blocker, e2)
                ? cat("'", blocker.string(), "' is a file, not a directory: choose another --checkpoint-dir")
                : "choose a --checkpoint-dir under a directory you can write to";
        throw UserError(cat("cannot create checkpoint directory '", c.checkpoint_dir, "': ", ec.message()), hint);
      }
    }
    MPIPE_REQUIRE(fs::is_directory(c.checkpoint_dir, ec), "give a directory (it is created if missing)",
                  "checkpoint directory '", c.checkpoint_dir, "' is not a directory");
    MPIPE_REQUIRE(::access(c.checkpoint_dir.c_str(), W_OK | X_OK) == 0, "choose a directory you can write to",
                  "checkpoint directory '", c.checkpoint_dir, "' is not writable");
  }
  if (c.resume != "auto" && c.resume != "never") {
    MPIPE_REQUIRE(fs::is_regular_file(c.resume), "give --resume auto, never or an existing checkpoint file",
                  "--resume: no checkpoint file '", c.resume, "'");
  }
}


double parse_memory_size(const std::string& text) {
  const std::string hint = "give bytes or a size with its unit, e.g. --memory-per-rank 8GiB or 500MB";
  std::size_t used = 0;
  double number = 0;
  try {
    number = std::stod(text, &used);
  } catch (const std::logic_error&) {
    throw UserError(cat("--memory-per-rank '", text, "' is not a size"), hint);
  }
  const std::string unit = text.substr(used);
  double scale = 0;
  const std::pair<const char*, double> units[] = {{"", 1},          {"B", 1},          {"KB", 1e3},       {"MB", 1e6},
                                                  {"GB", 1e9},       {"TB", 1e12},      {"PB", 1e15},      {"EB", 1e18},
                                                  {"KiB", 0x1p10},   {"MiB", 0x1p20},   {"GiB", 0x1p30},   {"TiB", 0x1p40},
                                                  {"PiB", 0x1p50},   {"EiB", 0x1p60}};
  for (const auto& [name, factor] : units)
    if (unit == name) scale = factor;
  MPIPE_REQUIRE(scale > 0, hint, "--memory-per-rank '", text, "': unknown unit '", unit, "'");
  MPIPE_REQUIRE(std::isfinite(number) && number > 0, hint, "--memory-per-rank must be positive, got '", text, "'");
  // Beyond what 64 bits address, a size is a typo (or would overflow where it is counted).
  MPIPE_REQUIRE(number * scale <= 0x1p64, hint, "--memory-per-rank '", text, "' is more than a 64-bit machine addresses (16 EiB)");
  MPIPE_REQUIRE(number * scale < 0x1p64, hint, "--memory-per-rank '", text,
                "' is all that a 64-bit machine addresses (16 EiB = 2^64 bytes), one byte more than a size can be");
  return number * scale;
}

namespace {
constexpr double max_time_limit_s = 365.0 * 86400;
}  // namespace

double parse_time_limit(const std::string& text) {
  if (text.empty()) return 0;
  const UserError bad(cat("--time-limit '", text, "' is not a duration"),
                      "give minutes (90) or [D-]H:MM:SS as Slurm writes it (1-12:00:00, 2:30:00, 45:00)");
  auto whole = [&](const std::string& part) {
    if (part.empty() || part.size() > 9 || !std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
      throw bad;
    return std::stod(part);
  };
  // A field after the first: minutes or seconds below 60 (hours below 24 after a day).
  auto below = [&](const std::string& part, double limit) {
    const double value = whole(part);
    if (value >= limit)
      throw UserError(cat("--time-limit '", text, "': ", part, " is not below ", limit, " in its place"),
                      "give minutes (90) or [D-]H:MM:SS as Slurm writes it (1-12:00:00, 2:30:00, 45:00)");
    return value;
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
    const double unit[] = {3600, 60, 1}, limit[] = {24, 60, 60};
    for (std::size_t i = 0; i < parts.size(); ++i) seconds += below(parts[i], limit[i]) * unit[i];
  } else if (parts.size() == 1) {  // minutes, fractions allowed
    char* end = nullptr;
    const double minutes = std::strtod(parts[0].c_str(), &end);
    if (parts[0].empty() || *end != '\0' || !std::isfinite(minutes)) throw bad;
    seconds = minutes * 60;
  } else if (parts.size() == 2) {
    seconds = whole(parts[0]) * 60 + below(parts[1], 60);
  } else if (parts.size() == 3) {
    seconds = whole(parts[0]) * 3600 + below(parts[1], 60) * 60 + below(parts[2], 60);
  } else {
    throw bad;
  }
  seconds += days * 86400;
  if (!(seconds > 0)) throw UserError(cat("--time-limit '", text, "' must be positive"), "e.g. --time-limit 90");
  // Beyond a year no job is given (and the seconds would overflow where they are counted).
  if (seconds > max_time_limit_s)
    throw UserError(cat("--time-limit '", text, "' is more than a year (365-00:00:00, ", max_time_limit_s / 60, " minutes)"),
                    "give the job's time limit, or leave --time-limit out: no limit");
  return seconds;
}


namespace {
// A file that begins with HDF5's signature (checkpoints and HDF5 data do).
bool is_hdf5_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[8] = {};
  return in.read(head, sizeof head) && std::memcmp(head, "\211HDF\r\n\032\n", sizeof head) == 0;
}
}  // namespace

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
  // One file by its path (links resolved), or by its inode (a hard link is another name of it).
  auto same = [](const std::string& a, const std::string& b) {
    std::error_code ec1, ec2;
    const fs::path pa = fs::weakly_canonical(a, ec1), pb = fs::weakly_canonical(b, ec2);
    const bool one = (!ec1 && !ec2 && pa == pb) || (fs::equivalent(a, b, ec1) && !ec1);
    return one && !fs::is_character_file(a, ec2);  // /dev/null may take them all
  };
  // No output may be the checkpoint directory's lock (io/checkpoint_dir.cpp's DIR/.mpipe.lock): written
  // over, the next run would find it held by nobody it can name, and a run taking it over
  // would delete the output.
  const std::string lock = c.checkpoint_dir.empty() ? "" : (fs::path(c.checkpoint_dir) / ".mpipe.lock").string();
  for (const Output& o : outputs)
    MPIPE_REQUIRE(lock.empty() || !same(o.path, lock), cat("choose another file for ", o.option), o.option, " '", o.path,
                  "' is the lock file of --checkpoint-dir '", c.checkpoint_dir, "', which keeps a second job out of it");
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
      // A link to nothing: the file would be made where it points, if there is a there.
      MPIPE_REQUIRE(!fs::is_symlink(fs::symlink_status(o.path, ec)), "give a file, or a link to one that exists",
                    o.option, " '", o.path, "' is a link to nothing ('", fs::read_symlink(o.path, ec).string(), "')");
      const fs::path parent = fs::path(o.path).has_parent_path() ? fs::path(o.path).parent_path() : fs::path(".");
      MPIPE_REQUIRE(fs::is_directory(parent, ec), cat("create '", parent.string(), "' first, or choose another path"),
                    o.option, " '", o.path, "': no directory '", parent.string(), "'");
      MPIPE_REQUIRE(::access(parent.c_str(), W_OK | X_OK) == 0, "choose a directory you can write to", o.option, " '",
                    o.path, "': directory '", parent.string(), "' is not writable");
    }
  }
  // No output may be a checkpoint: one under a checkpoint's name in the checkpoint
  // directory (it would replace the file a run resumes from), or any HDF5 file.
  for (const Output& o : outputs) {
    const fs::path parent = fs::path(o.path).has_parent_path() ? fs::path(o.path).parent_path() : fs::path(".");
    MPIPE_REQUIRE(c.checkpoint_dir.empty() || checkpoint_step_of_name(o.path) < 0 || !same(parent.string(), c.checkpoint_dir),
                  "choose a file outside the checkpoint's names", o.option, " '", o.path,
                  "' is a checkpoint's name in --checkpoint-dir '", c.checkpoint_dir, "'");
    MPIPE_REQUIRE(!is_hdf5_file(o.path), "choose another file: this one is a checkpoint or data", o.option, " '",
                  o.path, "' is an HDF5 file");
  }
  // The inputs are files no output may overwrite (two inputs may be one file).
  std::vector<Output> inputs;
  if (!is_preset(c.model.kind)) inputs.push_back({"--model", c.model.kind, ""});
  if (!c.config_file.empty()) inputs.push_back({"--config", c.config_file, ""});
  if (c.pipeline.schedule.rfind("file:", 0) == 0) inputs.push_back({"--schedule", c.pipeline.schedule.substr(5), ""});
  if (const std::string data = data_file(c.data); !data.empty()) inputs.push_back({"--data", data, ""});
  if (const std::string eval = data_file(c.eval_data); !eval.empty()) inputs.push_back({"--eval-data", eval, ""});
  if (!c.init_from.empty()) inputs.push_back({"--init-from", c.init_from, ""});
  if (!c.tokenizer.empty()) inputs.push_back({"--tokenizer", c.tokenizer, ""});
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      MPIPE_REQUIRE(!same(outputs[i].path, outputs[j].path), "give each output its own file", outputs[i].option, " and ",
                    outputs[j].option, " name the same file '", outputs[j].path, "'");
  for (const Output& o : outputs)
    for (const Output& in : inputs)
      MPIPE_REQUIRE(!same(o.path, in.path), cat("choose another file for ", o.option), o.option, " '", o.path,
                    "' is the ", in.option, " file: the run would overwrite its input");
}


}  // namespace mpipe
