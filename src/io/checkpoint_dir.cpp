// A run's hold on its checkpoint directory: the lock file, the run id, and which
// checkpoints the run may delete (docs/checkpoint-format.md, "Ownership").
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "mpipe/data/hdf5.hpp"
#include "mpipe/io/checkpoint.hpp"
#include "mpipe/pipeline/comm/hosts.hpp"

namespace mpipe {

namespace fs = std::filesystem;

namespace {

std::string crc_text(std::uint32_t crc) {
  char text[16];
  std::snprintf(text, sizeof text, "%08x", static_cast<unsigned>(crc));
  return text;
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// The whole of a small file, or nothing when it cannot be read.
std::optional<std::string> read_small_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// The value of `key=` in a lock line ("host=a pid=1 ..."), or "".
std::string field(const std::string& text, const std::string& key) {
  std::istringstream words(text);
  for (std::string word; words >> word;)
    if (word.rfind(key + "=", 0) == 0) return word.substr(key.size() + 1);
  return "";
}

// Seconds since the file was last modified (the holder's refresh), or -1.
double age_of(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return -1;
  return std::difftime(std::time(nullptr), st.st_mtime);
}

// Whether process `pid` of this host has ended: gone, or a zombie not yet reaped (a rank
// of a job mpirun aborted, whose parent has exited: until init reaps it, kill() finds it).
bool process_ended(long pid) {
  if (::kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat_file(cat("/proc/", pid, "/stat"));
  std::string stat_line;
  std::getline(stat_file, stat_line);
  const std::size_t name_end = stat_line.rfind(')');  // "pid (name) STATE ...": the name may hold spaces
  return name_end != std::string::npos && name_end + 2 < stat_line.size() && stat_line[name_end + 2] == 'Z';
}

// Why the job that wrote lock `text` is gone, or "" while it may still run.
std::string stale_reason(const std::string& text, double age) {
  const std::string job = field(text, "job"), restart = field(text, "restart");
  const std::string my_job = env_or("SLURM_JOB_ID", "-");
  if (job != "-" && job == my_job && restart != env_or("SLURM_RESTART_COUNT", "0"))
    return cat("it is this Slurm job ", job, " before its requeue");
  const std::string host = field(text, "host");
  if (host == this_host()) {
    const long pid = std::strtol(field(text, "pid").c_str(), nullptr, 10);
    if (pid > 0 && process_ended(pid))
      return cat("process ", pid, " on this host has ended");
    return "";  // that process runs here: the lock is live however old its time
  }
  if (age > CheckpointDir::stale_lock_seconds) return cat("it was not refreshed for ", static_cast<long>(age), " s");
  return "";
}

std::string describe_holder(const std::string& text) {
  std::string s = cat("host ", field(text, "host"), ", pid ", field(text, "pid"));
  if (const std::string job = field(text, "job"); !job.empty() && job != "-") s += cat(", Slurm job ", job);
  if (const std::string started = field(text, "started"); !started.empty()) s += cat(", started ", started);
  return s;
}

std::string list_names(const std::vector<std::string>& paths) {
  std::string s;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    if (i == 3 && paths.size() > 4) {
      s += cat(", … ", fs::path(paths.back()).filename().string());
      break;
    }
    s += (i ? ", " : "") + fs::path(paths[i]).filename().string();
  }
  return s;
}

}  // namespace

CheckpointDir::CheckpointDir(const CheckpointOptions& options)
    : options_(options), lock_path_(options.dir.empty() ? "" : (fs::path(options.dir) / ".mpipe.lock").string()) {}

CheckpointDir::~CheckpointDir() { release(); }

void CheckpointDir::lock() {
  if (dir_.empty() || held_) return;
  char started[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(started, sizeof started, "%Y-%m-%dT%H:%M:%S", std::localtime(&now));
  lock_text_ = cat("host=", this_host(), " pid=", ::getpid(), " job=", env_or("SLURM_JOB_ID", "-"),
                   " restart=", env_or("SLURM_RESTART_COUNT", "0"), " started=", started, "\n");
  const std::string in_use_hint =
      cat("wait for that job, choose another --checkpoint-dir, or delete ", lock_path_, " if that job is gone");
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int fd = ::open(lock_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      const bool written = ::write(fd, lock_text_.data(), lock_text_.size()) == static_cast<ssize_t>(lock_text_.size());
      ::close(fd);
      if (!written) {
        ::unlink(lock_path_.c_str());
        throw UserError(cat("cannot write the lock file '", lock_path_, "' (disk full?)"),
                        "free space there or choose another --checkpoint-dir");
      }
      held_ = true;
      refresher_ = std::thread([this] {
        std::unique_lock<std::mutex> guard(mutex_);
        while (!wake_.wait_for(guard, std::chrono::duration<double>(lock_refresh_seconds), [this] { return stopping_; }))
          ::utimensat(AT_FDCWD, lock_path_.c_str(), nullptr, 0);  // "still here"
      });
      return;
    }
    if (errno != EEXIST)
      throw UserError(cat("cannot create the lock file '", lock_path_, "': ", std::strerror(errno)),
                      "choose a --checkpoint-dir you can write to");
    const auto other = read_small_file(lock_path_);
    if (!other) continue;  // released meanwhile: try again
    const double age = age_of(lock_path_);
    const std::string why = stale_reason(*other, age);
    if (why.empty())
      throw UserError(cat("checkpoint directory '", dir_, "' is in use by another job (", describe_holder(*other),
                          "; lock refreshed ", static_cast<long>(std::max(0.0, age)), " s ago)"),
                      in_use_hint);
    // Take the stale lock over: move it aside, and only if what moved is the lock
    // judged stale (another job may have taken it over in between) drop it.
    const std::string aside = cat(lock_path_, ".stale-", ::getpid());
    if (::rename(lock_path_.c_str(), aside.c_str()) != 0) continue;
    if (read_small_file(aside) != other) {
      ::rename(aside.c_str(), lock_path_.c_str());
      continue;
    }
    ::unlink(aside.c_str());
    std::fprintf(stderr, "mpipe: warning: taking over the lock of a job that is gone (%s): %s\n",
                 describe_holder(*other).c_str(), why.c_str());
  }
  throw UserError(cat("checkpoint directory '", dir_, "' is in use by another job (its lock file keeps changing)"),
                  in_use_hint);
}

void CheckpointDir::release() {
  if (!held_) return;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (refresher_.joinable()) refresher_.join();
  if (read_small_file(lock_path_) == lock_text_) ::unlink(lock_path_.c_str());  // still ours
  held_ = false;
}

void CheckpointDir::begin(const Communicator& world) {
  if (world.rank() == 0) {
    std::random_device entropy;
    const std::uint64_t bits = (static_cast<std::uint64_t>(entropy()) << 32) ^ entropy() ^
                               static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) ^
                               static_cast<std::uint64_t>(::getpid());
    char id[17];
    std::snprintf(id, sizeof id, "%016llx", static_cast<unsigned long long>(bits));
    run_id_ = id;
  }
  world.broadcast(run_id_, 0);
}

void CheckpointDir::adopt(const std::string& run_id) {
  if (!run_id.empty()) run_id_ = run_id;
}

std::string CheckpointDir::adopt_tokenizer(const std::string& path, const Communicator& world, bool text_data) {
  const std::optional<TokenizerFile>& mine = options_.tokenizer;
  std::string refusal, bytes, name, kind;
  int held = 0;  // the checkpoint holds one
  if (world.rank() == 0) {
    quiet_hdf5();
    const Hdf5Lock hdf5;
    Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose);
    std::string problem;
    std::optional<TokenizerFile> theirs = file.ok() ? read_checkpoint_tokenizer(file.get(), &problem) : std::nullopt;
    if (!problem.empty()) {
      refusal = cat("checkpoint '", path, "': ", problem);
    } else if (theirs && mine && theirs->bytes != mine->bytes) {
      refusal = cat("checkpoint '", path, "' was trained with tokenizer '", theirs->name, "' (crc32 ",
                    crc_text(theirs->crc32()), "); --tokenizer '", mine->source, "' is another file (crc32 ",
                    crc_text(mine->crc32()), ")");
    } else if (!theirs && mine) {
      refusal = cat("checkpoint '", path, "' holds no tokenizer (its run had none); --tokenizer '", mine->source,
                    "' would change what its token ids mean");
    } else if (theirs && !mine && text_data) {
      refusal = cat("checkpoint '", path, "' was trained on text encoded by tokenizer '", theirs->name,
                    "'; without --tokenizer this run would read the text's bytes as its ids");
    } else if (theirs && !mine) {
      held = 1;
      bytes = std::move(theirs->bytes);
      name = theirs->name;
      kind = theirs->kind;
    }
  }
  world.broadcast(refusal, 0);
  if (!refusal.empty()) return refusal;
  world.broadcast(std::span<int>(&held, 1), 0);
  if (!held) return "";
  world.broadcast(bytes, 0);
  world.broadcast(name, 0);
  world.broadcast(kind, 0);
  options_.tokenizer =
      TokenizerFile{.name = name, .kind = kind, .bytes = std::move(bytes), .source = cat(path, ":", checkpoint_tokenizer_path)};
  return "";
}

void CheckpointDir::claim() {
  if (dir_.empty()) return;
  std::vector<std::string> others, unreadable;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const std::string path = entry.path().string();
    if (checkpoint_step_of_name(path) < 0) continue;
    const auto id = checkpoint_run_id(path);
    if (!id) unreadable.push_back(path);
    else if (*id != run_id_) others.push_back(path);
  }
  std::sort(others.begin(), others.end());
  std::sort(unreadable.begin(), unreadable.end());
  if (!unreadable.empty() && options_.resume != "auto")  // (--resume auto has named each already)
    std::fprintf(stderr, "mpipe: warning: %zu checkpoint file%s in '%s' cannot be read (%s); left as they are\n",
                 unreadable.size(), unreadable.size() > 1 ? "s" : "", dir_.c_str(), list_names(unreadable).c_str());
  if (others.empty()) return;
  const std::string what = cat(others.size(), " checkpoint", others.size() > 1 ? "s" : "", " of another run (",
                               list_names(others), ")");
  MPIPE_REQUIRE(options_.overwrite,
                "give --overwrite to replace them once this run's first checkpoint is written, or choose another "
                "--checkpoint-dir",
                "checkpoint directory '", dir_, "' holds ", what,
                options_.resume == "never" ? "" : " that this run does not continue");
  replace_ = others;
  std::printf("--overwrite: %s in %s will be deleted once this run's first checkpoint is in place\n", what.c_str(),
              dir_.c_str());
}

void CheckpointDir::make_way(const std::string& final_path) {
  std::error_code ec;
  if (!fs::exists(final_path, ec)) return;
  if (const auto it = std::find(replace_.begin(), replace_.end(), final_path); it != replace_.end()) {
    replace_.erase(it);
    std::printf("replacing %s of another run (--overwrite)\n", final_path.c_str());
    return;
  }
  // Never written over: damaged (its bytes tell what went wrong), or a checkpoint of this
  // run from beyond the step it resumed from (--resume PATH), which a user may want back.
  const auto id = checkpoint_run_id(final_path);
  const bool was_skipped = std::find(skipped_.begin(), skipped_.end(), final_path) != skipped_.end();
  std::string aside = cat(final_path, ".replaced-", static_cast<long long>(std::time(nullptr)));
  for (int n = 1; fs::exists(aside, ec); ++n)  // one moved aside in the same second stays too
    aside = cat(final_path, ".replaced-", static_cast<long long>(std::time(nullptr)), "-", n);
  fs::rename(final_path, aside, ec);
  if (ec) throw Error(cat("cannot move '", final_path, "' out of the way: ", ec.message()));
  std::fprintf(stderr, "mpipe: warning: '%s' %s; moved to '%s'\n", final_path.c_str(),
               !id              ? "could not be read as a checkpoint"
               : was_skipped    ? "failed its checks when this run resumed"
               : *id == run_id_ ? "is this run's, from beyond the step it resumed from"
                                : "is another run's",
               aside.c_str());
}

void CheckpointDir::after_save(const std::string& final_path) {
  std::error_code ec;
  for (const std::string& path : replace_) {
    if (fs::remove(path, ec)) std::printf("deleted %s of another run (--overwrite)\n", path.c_str());
    else if (ec) std::fprintf(stderr, "mpipe: warning: cannot delete '%s': %s\n", path.c_str(), ec.message().c_str());
  }
  replace_.clear();
  if (options_.keep <= 0) return;
  // This run's own complete checkpoints, oldest first; only files older than the new one
  // go, and only beyond --keep.
  std::vector<std::string> own;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    const std::string path = entry.path().string();
    if (checkpoint_step_of_name(path) >= 0 && checkpoint_run_id(path) == run_id_) own.push_back(path);
  }
  std::sort(own.begin(), own.end());
  for (std::size_t i = 0; i + static_cast<std::size_t>(options_.keep) < own.size(); ++i)
    if (own[i] < final_path) fs::remove(own[i], ec);
}

}  // namespace mpipe
