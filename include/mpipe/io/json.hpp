// JSON output (metrics lines, the run summary, traces) through nlohmann::json: objects
// keep their keys in the order written, and numbers go out at a stated precision.
#pragma once
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include <nlohmann/json.hpp>

#include "mpipe/core/error.hpp"

namespace mpipe {

using Json = nlohmann::ordered_json;

// `value` to `digits` significant digits (9 make a float32 round-trip), as the shortest
// text that reads back to it; null for NaN and infinities, which JSON has not.
inline Json json_number(double value, int digits = 9) {
  if (!std::isfinite(value)) return nullptr;
  char text[40];
  std::snprintf(text, sizeof text, "%.*g", digits, value);
  return std::strtod(text, nullptr);
}

// The error of an output file that could not be written (`error`: errno, 0 for EIO): a
// full disk says so. `what`: "trace"; `option`: "--trace".
inline UserError write_error(const std::string& path, const char* what, const char* option, int error) {
  if (error == 0) error = EIO;
  const bool full = error == ENOSPC || error == EDQUOT || error == EFBIG;  // the only ones free space mends
  return UserError(cat("cannot write ", what, " file '", path, "': ", std::strerror(error)),
                   full ? cat("free space there, or give ", option, " a file on another file system")
                        : cat("give ", option, " a file you can write"));
}

// Closes an output file; UserError when anything written to it (or the open) failed: a
// full disk is said, never reported as written.
inline void close_output(std::FILE* out, const std::string& path, const char* what, const char* option) {
  const bool failed = !out || std::ferror(out);
  if ((out && std::fclose(out) != 0) || failed) throw write_error(path, what, option, errno);
}

}  // namespace mpipe
