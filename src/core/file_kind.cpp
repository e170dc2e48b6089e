#include "mpipe/core/file_kind.hpp"

#include <filesystem>
#include <system_error>

namespace mpipe {

std::string not_a_file(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) return "cannot be examined (" + ec.message() + ")";
  switch (status.type()) {
    case fs::file_type::regular: return "";
    case fs::file_type::not_found: return "does not exist";
    case fs::file_type::directory: return "is a directory";
    case fs::file_type::fifo: return "is a FIFO (named pipe)";
    case fs::file_type::socket: return "is a socket";
    case fs::file_type::block:
    case fs::file_type::character: return "is a device";
    default: return "is not a regular file";
  }
}

}  // namespace mpipe
