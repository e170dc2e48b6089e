// The version and git hash recorded at build time.
#pragma once
namespace mpipe {
const char* version();
const char* git_hash();
}  // namespace mpipe
