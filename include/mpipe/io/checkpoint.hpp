// HDF5 checkpoints, collectively: one file per checkpoint, written in parallel by the
// ranks of replica 0 (each its own layers, MPI-IO), under a temporary name, verified,
// then renamed; resumed and loaded by every rank onto any stage count K and replica
// count D. The file's format, which needs no MPI: checkpoint_format.hpp.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "mpipe/io/checkpoint_format.hpp"
#include "mpipe/io/checkpoint_tokenizer.hpp"
#include "mpipe/pipeline/run/executor.hpp"
#include "mpipe/pipeline/comm/watchdog.hpp"

namespace mpipe {

// Exit code of a run stopped by SIGTERM/SIGUSR1 after writing its checkpoint: a batch
// script requeues on it (75 is EX_TEMPFAIL, "try again later").
inline constexpr int exit_preempted = 75;

// What a run asks of its checkpoints: where they go, which to resume, how many to keep,
// and the run's options as text (each checkpoint's `config` attribute).
struct CheckpointOptions {
  std::string dir;             // --checkpoint-dir; empty: none
  int keep = 0;                // complete checkpoints kept; 0: all
  std::string resume = "auto"; // auto | never | PATH
  bool overwrite = false;      // the directory may hold another run's checkpoints: replace them
  std::string config_text;     // TOML that `train --config` reads (app/config_file.hpp)
  std::optional<TokenizerFile> tokenizer;  // --tokenizer's file (or the resumed checkpoint's), kept in each checkpoint
};

// A training run's hold on --checkpoint-dir (docs/checkpoint-format.md, "Ownership").
// Every run has a run id, written into each checkpoint it makes; a resumed run keeps
// the id of the checkpoint it continues. The run deletes (prunes to --keep) only files
// of its own id, takes the directory's lock file so that no second job writes there,
// and refuses a directory holding another run's checkpoints unless --overwrite.
class CheckpointDir {
 public:
  // Nothing is taken yet. Without --checkpoint-dir every call but run_id() is a no-op.
  explicit CheckpointDir(const CheckpointOptions& options);
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
  // Collective, once checkpoint `path` is loaded: its tokenizer against the run's. A run
  // without --tokenizer keeps the checkpoint's (its checkpoints hold it too). Returns why
  // the run must not continue it ("" when it may; the same on every rank): --tokenizer
  // gives another file's bytes than the checkpoint's, or the checkpoint holds none; or
  // `text_data` (the run reads text: data) without --tokenizer where the checkpoint's run
  // encoded its text with one (this run would read the text's bytes as ids).
  std::string adopt_tokenizer(const std::string& path, const Communicator& world, bool text_data);
  const std::string& run_id() const { return run_id_; }
  const CheckpointOptions& options() const { return options_; }
  // The run's options as text, once they are final (the device resolved).
  void set_config_text(const std::string& text) { options_.config_text = text; }
  // The tokenizer each checkpoint keeps (nothing: none).
  void set_tokenizer(std::optional<TokenizerFile> tokenizer) { options_.tokenizer = std::move(tokenizer); }
  // Rank 0, once resuming is decided: lists the checkpoints in DIR of another run.
  // UserError unless --overwrite; with it, they are deleted (each named) once this
  // run's first checkpoint is in place.
  void claim();
  // Rank 0, resuming: `path` was skipped (it failed its checks, or to load).
  void skipped(const std::string& path) { skipped_.push_back(path); }
  // Rank 0, before a checkpoint is renamed to `final_path`: a file there is moved aside
  // (named .replaced-<time>) rather than lost, whatever it is (unreadable, damaged and
  // skipped at resume, or this run's own from beyond the step it resumed from), unless
  // it is another run's that --overwrite replaces.
  void make_way(const std::string& final_path);
  // Rank 0, after a checkpoint is in place: deletes the other run's files under
  // --overwrite (each named on stdout), and this run's own beyond --keep.
  void after_save(const std::string& final_path);

  static constexpr double stale_lock_seconds = 120;
  static constexpr double lock_refresh_seconds = 10;

 private:
  void release();

  CheckpointOptions options_;
  const std::string& dir_ = options_.dir;
  std::string lock_path_, run_id_, lock_text_;
  bool held_ = false;
  std::vector<std::string> replace_;  // other runs' files, deleted after the first save
  std::vector<std::string> skipped_;  // files resume skipped
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
  double copy_wait_seconds = 0;  // --checkpoint-async: the next update's wait for the copy (this rank's)
};

// Collective over the world. Replica 0 writes step `step`'s checkpoint (the state after
// `step` completed steps); world rank 0 verifies it, renames it into place and prunes
// to --keep. Throws on every rank if it failed anywhere; the previous checkpoints are
// untouched then. `liveness`: the run's watchdog (its heartbeats name a rank stopped
// before or within the checkpoint); without one, a watchdog for this checkpoint alone.
SaveResult save_checkpoint(Executor& exec, CheckpointDir& dir, std::int64_t step, Watchdog* liveness = nullptr);

// What a checkpoint is written from: this rank's parameter values and each optimizer
// state in host memory (the live ones, or --checkpoint-async's copy), and the updates
// made so far.
struct SaveSource {
  const float* params = nullptr;
  std::vector<const float*> states;
  std::int64_t updates = 0;
};
// The watchdog's deadline for a checkpoint's write: --p2p-timeout, and the file at 10 MB/s.
double write_deadline(const Executor& exec);
// The live state (on a GPU after download_state()).
SaveSource live_source(Executor& exec);
// save_checkpoint after its rendezvous: the write from `source`, the agreement, world
// rank 0's verification, rename and pruning. Its collectives go over `world` and
// `pipeline` (the grid's, or duplicates of them for a write on another thread); HDF5
// calls hold hdf5_mutex().
SaveResult commit_checkpoint(const Executor& exec, CheckpointDir& dir, std::int64_t step, const SaveSource& source,
                             const Communicator& world, const Communicator& pipeline);

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

}  // namespace mpipe
