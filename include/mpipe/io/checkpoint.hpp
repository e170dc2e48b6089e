// HDF5 checkpoints: one file per checkpoint, written in parallel by the ranks of
// replica 0 (each its own layers, MPI-IO), keyed by global layer index and parameter
// name so it loads onto any stage count K and replica count D. Written under a
// temporary name, verified, then renamed; every dataset carries a CRC-32 checked on
// load. Format: docs/checkpoint-format.md.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mpipe/pipeline/executor.hpp"

namespace mpipe {

inline constexpr const char* checkpoint_format = "mpipe-checkpoint";
inline constexpr int checkpoint_format_version = 1;
// Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its checkpoint: a batch
// script requeues on it (75 is EX_TEMPFAIL, "try again later").
inline constexpr int exit_preempted = 75;

// DIR/ckpt-<step as 8 digits>.h5
std::string checkpoint_path(const std::string& dir, std::int64_t step);
// A string that changes whenever the parameter layout would: model kind, sizes,
// every parameter's layer, name and shape.
std::string model_signature(const Model& model);

// Checks a checkpoint file without MPI: HDF5, format and version, (when given) the
// model signature, every dataset present with a checksum, and (read_data) the CRC-32
// of every dataset's data. Returns the problem, or nothing.
std::optional<std::string> verify_checkpoint(const std::string& path, const std::string* signature = nullptr,
                                             bool read_data = true);

// Checks --checkpoint-dir and --resume before training; UserError on a problem. With
// `create` (one rank), a missing --checkpoint-dir is created first, parents included.
void check_checkpoint_options(const TrainConfig& config, bool create = false);

struct SaveResult {
  std::string path;
  double bytes = 0;           // file size
  double write_seconds = 0;   // create, write, close and fsync
  double verify_seconds = 0;  // re-read every checksum, rename, prune
};

// Collective over the world. Replica 0 writes step `step`'s checkpoint (the state after
// `step` completed steps); world rank 0 verifies it, renames it into place and prunes
// to --keep. Throws on every rank if it failed anywhere; the previous checkpoints are
// untouched then.
SaveResult save_checkpoint(Executor& exec, std::int64_t step);

// Collective: resumes as --resume asks. auto tries the checkpoints of --checkpoint-dir
// newest first, skipping (with a warning) any whose structure or data does not check
// out; PATH must load. Returns the file loaded (and sets *step to the completed steps
// it holds), or "" when there is nothing to resume. UserError if PATH is bad, or if
// every candidate failed while loading.
std::string resume(Executor& exec, std::int64_t* step);

// Collective: every rank loads its stage's parameters and optimizer state from `path`.
// Returns the number of completed steps the checkpoint holds.
std::int64_t load_checkpoint(Executor& exec, const std::string& path);

// `mpipe inspect FILE [--stats] [--verify]`: returns the exit code.
int run_inspect(const std::string& path, bool stats, bool verify, bool config_only = false);

}  // namespace mpipe
