// Data files read as a run goes (an HDF5 file by part, token shards memory-mapped): the
// file as it was opened, checked before each batch's read, and a read-only memory map.
#pragma once
#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace mpipe {

// UserError naming `what` unless the file behind `fd` still has the size and
// modification time of `opened`: a file truncated or rewritten under a run would be read
// as zeros, as a crash (a memory map past its end) or as other data, without an error.
void check_unchanged(int fd, const struct stat& opened, const std::string& what);

// A regular file mapped read-only and shared (the page cache's pages, not a copy): what
// a batch reads comes in page by page, and dropped() gives pages back, so resident
// memory stays flat however large the file. Move-only.
class MappedFile {
 public:
  // UserError (naming `noun` 'path' and `option`) for a missing, non-regular or empty file.
  MappedFile(const std::string& path, const std::string& noun, const std::string& option);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&&) = delete;
  MappedFile(const MappedFile&) = delete;
  ~MappedFile();

  const unsigned char* bytes() const { return bytes_; }
  std::uint64_t size() const { return static_cast<std::uint64_t>(opened_.st_size); }
  const std::string& path() const { return path_; }
  int descriptor() const { return fd_; }
  void check_unchanged(const std::string& what) const { mpipe::check_unchanged(fd_, opened_, what); }
  // Unmaps bytes [at, at + count), widened to 64 KiB blocks, from this process (the page
  // cache keeps them): the
  // pages a window touched leave the resident set once it is copied.
  void drop(std::uint64_t at, std::uint64_t count) const;
  // Bytes [at, at + count) by pread, not through the map (a pass over the whole file
  // that leaves the resident set as it was).
  void read(std::uint64_t at, std::uint64_t count, void* into) const;

 private:
  std::string path_;
  int fd_ = -1;
  struct stat opened_ {};
  const unsigned char* bytes_ = nullptr;
};

}  // namespace mpipe
