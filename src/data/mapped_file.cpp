// Data files read as a run goes: the unchanged-file check and the read-only memory map.
#include "mpipe/data/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "mpipe/core/error.hpp"

namespace mpipe {

namespace {
constexpr std::uint64_t fault_around_bytes = 64 * 1024;  // /sys/kernel/debug/fault_around_bytes' default
}  // namespace

void check_unchanged(int fd, const struct stat& opened, const std::string& what) {
  struct stat now {};
  const bool same = ::fstat(fd, &now) == 0 && now.st_size == opened.st_size && now.st_mtim.tv_sec == opened.st_mtim.tv_sec &&
                    now.st_mtim.tv_nsec == opened.st_mtim.tv_nsec;
  if (!same)
    throw UserError(cat(what, " changed while training read it (", static_cast<long long>(opened.st_size), " bytes when opened, ",
                        static_cast<long long>(now.st_size), " now", now.st_size == opened.st_size ? ", modified" : "", ")"),
                    "leave a data file alone while a run reads it (write a new file and rename it over); resume from the last checkpoint");
}

MappedFile::MappedFile(const std::string& path, const std::string& noun, const std::string& option) : path_(path) {
  struct stat status {};
  MPIPE_REQUIRE(::stat(path.c_str(), &status) == 0, cat("no such file: check the path given to ", option), "cannot open ", noun,
                " '", path, "'");
  MPIPE_REQUIRE(!S_ISDIR(status.st_mode), "give one file of text or tokens, not a directory", noun, " '", path, "' is a directory");
  // Only regular files: a FIFO with no writer would block the open for ever, a device
  // (/dev/zero) has no size to map.
  MPIPE_REQUIRE(S_ISREG(status.st_mode), "give a regular file (not a FIFO, socket or device)", noun, " '", path,
                "' is not a regular file");
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MPIPE_REQUIRE(fd_ >= 0, cat("check the path given to ", option), "cannot open ", noun, " '", path, "': ", std::strerror(errno));
  if (::fstat(fd_, &opened_) != 0 || opened_.st_size <= 0) {
    ::close(fd_);
    fd_ = -1;
    throw UserError(cat(noun, " '", path, "' is empty"), "give a file with data in it");
  }
  void* map = ::mmap(nullptr, size(), PROT_READ, MAP_SHARED, fd_, 0);
  if (map == MAP_FAILED) {
    const int error = errno;
    ::close(fd_);
    fd_ = -1;
    throw UserError(cat("cannot map ", noun, " '", path, "' into memory: ", std::strerror(error)), "check the file and the address-space limit (ulimit -v)");
  }
  // Windows are read at random places: read ahead only what a window asks for.
  ::madvise(map, size(), MADV_RANDOM);
  bytes_ = static_cast<const unsigned char*>(map);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(other.fd_), opened_(other.opened_), bytes_(other.bytes_) {
  other.fd_ = -1;
  other.bytes_ = nullptr;
}

MappedFile::~MappedFile() {
  if (bytes_) ::munmap(const_cast<unsigned char*>(bytes_), size());
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::drop(std::uint64_t at, std::uint64_t count) const {
  // A page fault maps the page cache's pages around it too (Linux's fault-around, 64 KiB
  // by default, aligned): those go as well, or every window would leave ~64 KiB behind.
  static const std::uint64_t block = std::max<std::uint64_t>(static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE)), fault_around_bytes);
  const std::uint64_t first = at / block * block, end = std::min(size(), (at + count + block - 1) / block * block);
  if (end > first) ::madvise(const_cast<unsigned char*>(bytes_) + first, end - first, MADV_DONTNEED);
}

void MappedFile::read(std::uint64_t at, std::uint64_t count, void* into) const {
  auto* out = static_cast<char*>(into);
  while (count > 0) {
    const ssize_t got = ::pread(fd_, out, count, static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    MPIPE_REQUIRE(got > 0, "check the file and the disk", "cannot read '", path_, "' at byte ", at,
                  got < 0 ? cat(": ", std::strerror(errno)) : std::string(" (the file is shorter than when opened)"));
    out += got;
    at += static_cast<std::uint64_t>(got);
    count -= static_cast<std::uint64_t>(got);
  }
}

}  // namespace mpipe
