// Out-of-line part of the check macros, so the throwing path stays out of hot code.
#include "mpipe/core/error.hpp"

namespace mpipe {

void throw_check_failure(const char* file, int line, const char* expr,
                         const std::string& message) {
  std::string text = cat(file, ":", line, ": check `", expr, "` failed");
  if (!message.empty()) text += ": " + message;
  throw Error(text);
}

}  // namespace mpipe
