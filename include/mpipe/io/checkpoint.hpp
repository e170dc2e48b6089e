// HDF5 checkpoints: one file per checkpoint, written in parallel by the ranks of
// replica 0 (each its own layers, MPI-IO), keyed by global layer index and parameter
// name so it loads onto any stage count K and replica count D. Written under a
// temporary name, verified, then renamed; every dataset carries a CRC-32 checked on
// load. Format: docs/checkpoint-format.md.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mpipe/pipeline/executor.hpp"
#include "mpipe/pipeline/watchdog.hpp"

namespace mpipe {

inline constexpr const char* checkpoint_format = "mpipe-checkpoint";
inline constexpr int checkpoint_format_version = 2;  // 2: run id and a checksum of /train
inline constexpr int checkpoint_oldest_readable_version = 1;
// Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its checkpoint: a batch
// script requeues on it (75 is EX_TEMPFAIL, "try again later").
inline constexpr int exit_preempted = 75;

// DIR/ckpt-<step as 8 digits>.h5
std::string checkpoint_path(const std::string& dir, std::int64_t step);
// The step a checkpoint's file name gives, or -1 when the name is not ckpt-<8 digits>.h5.
std::int64_t checkpoint_step_of_name(const std::string& path);
// The run id a checkpoint file holds ("" for a version-1 file), or nothing when the
// file cannot be read as a checkpoint or its training state fails its checksum.
std::optional<std::string> checkpoint_run_id(const std::string& path);
// A string that changes whenever the parameter layout would: model kind, sizes,
// every parameter's layer, name and shape.
std::string model_signature(const Model& model);

// Checks a checkpoint file without MPI: HDF5, format and version, (when given) that
// it holds `model` (its signature; where they differ, the first layer that does),
// every dataset present with a checksum, and (read_data) the CRC-32 of every dataset's
// data. Returns the problem, or nothing.
std::optional<std::string> verify_checkpoint(const std::string& path, const Model* model = nullptr,
                                             bool read_data = true);

// Checks --checkpoint-dir and --resume before training; UserError on a problem. With
// `create` (one rank), a missing --checkpoint-dir is created first, parents included.
void check_checkpoint_options(const TrainConfig& config, bool create = false);

// A training run's hold on --checkpoint-dir (docs/checkpoint-format.md, "Ownership").
// Every run has a run id, written into each checkpoint it makes; a resumed run keeps
// the id of the checkpoint it continues. The run deletes (prunes to --keep) only files
// of its own id, takes the directory's lock file so that no second job writes there,
// and refuses a directory holding another run's checkpoints unless --overwrite.
class CheckpointDir {
 public:
  // Nothing is taken yet. Without --checkpoint-dir every call but run_id() is a no-op.
  explicit CheckpointDir(const TrainConfig& config);
  ~CheckpointDir();  // releases the lock if this rank holds it
  CheckpointDir(const CheckpointDir&) = delete;
  CheckpointDir& operator=(const CheckpointDir&) = delete;

  // One rank (world rank 0): takes DIR/.mpipe.lock, or throws UserError naming the job
  // that holds it. A lock whose holder is gone (same host and no such process, the same
  // Slurm job requeued, or not refreshed for stale_lock_seconds) is taken over with a
  // notice. While held, a thread refreshes the lock's time every few seconds.
  void lock();
  // Collective: every rank gets rank 0's fresh run id.
  void begin(const Communicator& world);
  // A resumed run continues the run of its checkpoint (an empty id keeps the fresh one).
  void adopt(const std::string& run_id);
  const std::string& run_id() const { return run_id_; }
  // Rank 0, once resuming is decided: lists the checkpoints in DIR of another run.
  // UserError unless --overwrite; with it, they are deleted (each named) once this
  // run's first checkpoint is in place.
  void claim();
  // Rank 0, before a checkpoint is renamed to `final_path`: a file of another run or an
  // unreadable one there is moved aside (named .replaced-<time>) rather than lost.
  void make_way(const std::string& final_path);
  // Rank 0, after a checkpoint is in place: deletes the other run's files under
  // --overwrite (each named on stdout), and this run's own beyond --keep.
  void after_save(const std::string& final_path);

  static constexpr double stale_lock_seconds = 120;
  static constexpr double lock_refresh_seconds = 10;

 private:
  void release();

  std::string dir_, lock_path_, run_id_, lock_text_, resume_;
  int keep_ = 0;
  bool overwrite_ = false, held_ = false;
  std::vector<std::string> replace_;  // other runs' files, deleted after the first save
  std::thread refresher_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
};

struct SaveResult {
  std::string path;
  double bytes = 0;           // file size
  double write_seconds = 0;   // create, write, close and fsync
  double verify_seconds = 0;  // re-read every checksum, rename, prune
};

// Collective over the world. Replica 0 writes step `step`'s checkpoint (the state after
// `step` completed steps); world rank 0 verifies it, renames it into place and prunes
// to --keep. Throws on every rank if it failed anywhere; the previous checkpoints are
// untouched then. `liveness`: the run's watchdog (its heartbeats name a rank stopped
// before or within the checkpoint); without one, a watchdog for this checkpoint alone.
SaveResult save_checkpoint(Executor& exec, CheckpointDir& dir, std::int64_t step, Watchdog* liveness = nullptr);

// Collective: resumes as --resume asks. auto tries the checkpoints of --checkpoint-dir
// newest first, skipping (with a warning) any whose structure or data does not check
// out; PATH must load. Returns the file loaded (and sets *step to the completed steps
// it holds), or "" when there is nothing to resume. UserError if PATH is bad, or if
// every candidate failed while loading.
// The run continues the loaded checkpoint's run id (dir.adopt).
std::string resume(Executor& exec, CheckpointDir& dir, std::int64_t* step);

// Collective: every rank loads its stage's parameters and optimizer state from `path`.
// Returns the number of completed steps the checkpoint holds; *run_id (when given) is
// the id of the run that wrote it ("" for a version-1 file).
std::int64_t load_checkpoint(Executor& exec, const std::string& path, std::string* run_id = nullptr);

// `mpipe inspect FILE [--stats] [--verify]`: returns the exit code.
// `print`: "config" prints only the run's options (a file for train --config), "model"
// only its layer list (a model file for --model); "" the whole summary.
int run_inspect(const std::string& path, bool stats, bool verify, const std::string& print = "");

}  // namespace mpipe
