// Standard output's failures: the start's check of the standard streams, the end's
// flush, and what generate asks between tokens.
#include "mpipe/app/output.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "mpipe/app/process.hpp"
#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {

bool fd_open(int fd) { return fcntl(fd, F_GETFD) != -1 || errno != EBADF; }

// The launcher (mpirun) that forwards this rank's output, when it is this process's parent:
// its pid, else 0.
pid_t launcher() {
  // Rank 0 alone speaks for the job's output.
  if (const char* rank = std::getenv("OMPI_COMM_WORLD_RANK"); rank && std::strcmp(rank, "0") != 0) return 0;
  const std::string name = parent_name();
  static const char* const launchers[] = {"mpirun", "mpiexec", "orterun", "prterun"};
  return std::find(std::begin(launchers), std::end(launchers), name) != std::end(launchers) ? getppid() : 0;
}

// Whether `fd` is the writing end of a pipe nobody reads any more: poll says POLLERR.
bool no_reader(int fd) {
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISFIFO(st.st_mode)) return false;
  pollfd p{fd, POLLOUT, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & POLLERR);
}

// The same for a descriptor of another process (/proc/PID/fd/N), opened for the question.
bool pipe_without_reader(const std::string& fd) {
  char target[256] = {};
  const ssize_t n = readlink(fd.c_str(), target, sizeof target - 1);
  if (n <= 0 || std::string(target, static_cast<std::size_t>(n)).rfind("pipe:", 0) != 0) return false;
  const int probe = open(fd.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (probe < 0) return false;
  const bool gone = no_reader(probe);
  close(probe);
  return gone;
}

// What errno would say of a write to standard output that cannot reach anyone: the
// launcher's closed (EBADF) or /dev/full (ENOSPC); with `readers`, this process's or the
// launcher's a pipe nobody reads (EPIPE). 0 when none of these.
int unreachable_stdout(bool readers) {
  if (readers && no_reader(STDOUT_FILENO)) return EPIPE;
  static const pid_t parent = launcher();
  if (parent == 0) return 0;
  const std::string fd = cat("/proc/", parent, "/fd/1");
  char target[256] = {};
  const ssize_t n = readlink(fd.c_str(), target, sizeof target - 1);
  if (n < 0) return errno == ENOENT ? EBADF : 0;
  if (std::string(target, static_cast<std::size_t>(n)) == "/dev/full") return ENOSPC;
  return readers && pipe_without_reader(fd) ? EPIPE : 0;
}

}  // namespace

bool standard_output_open() {
  const bool out_open = fd_open(STDOUT_FILENO);
  for (const int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) {
    if (fd_open(fd)) continue;
    const int null = open("/dev/null", fd == STDERR_FILENO ? O_WRONLY : O_RDONLY);
    if (null >= 0 && null != fd) {  // the lowest free number: fd itself, unless a lower one is closed too
      dup2(null, fd);
      close(null);
    }
  }
  return out_open;
}

std::string closed_stdout_line() {
  return "mpipe: error: cannot write to standard output: it is closed; hint: give the command an open standard output "
         "(a file, a pipe, or >/dev/null to discard it), not >&-";
}

bool stdout_failed(std::string* line, int* code, bool readers) {
  // The first failure's errno is kept: a flush after a failed one may find nothing left
  // to write, and only the stream's error flag says that a write failed.
  static int first_error = 0;
  errno = 0;
  int error = 0;
  if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
    if (first_error == 0) first_error = errno;
    error = first_error != 0 ? first_error : EIO;
  }
  if (error == 0) error = unreachable_stdout(readers);
  if (error == 0) return false;
  if (code) *code = error == EBADF ? exit_user_error : exit_internal_error;
  if (line)
    *line = error == EBADF ? closed_stdout_line()
                           : cat("mpipe: error: cannot write to standard output: ",
                                 error == EPIPE ? "Broken pipe (its reader has gone)" : std::strerror(error), "; hint: ",
                                 error == ENOSPC  ? "free space where standard output goes, or send it elsewhere"
                                 : error == EPIPE ? "keep what reads standard output reading until the command ends"
                                                  : "check where standard output goes");
  return true;
}

int finish_stdout(int code) {
  std::string line;
  int failed = 0;
  if (!stdout_failed(&line, &failed) || code != 0) return code;
  std::fprintf(stderr, "%s\n", line.c_str());
  return failed;
}

}  // namespace mpipe
