// What a path names, for the messages that refuse anything but a regular file: a FIFO
// with no writer would block an open for ever, a directory or device has no size to read.
#pragma once
#include <string>

namespace mpipe {

// "" for a regular file (or a link to one); otherwise what the path is, to follow
// "'PATH' ": "does not exist", "is a directory", "is a FIFO (named pipe)", "is a socket",
// "is a device", "cannot be examined (REASON)".
std::string not_a_file(const std::string& path);

}  // namespace mpipe
