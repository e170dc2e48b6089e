// Files a test writes live in a directory of this process's own (mkdtemp under TMPDIR),
// removed with everything in it when the process ends: no two test cases, ranks or test
// binaries that ctest runs at once share a name, and no file is left behind.
#pragma once
#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace mpipe::testing {

inline std::filesystem::path test_file(const std::string& name) {
  struct Directory {
    std::filesystem::path path;
    Directory() {
      std::string pattern = (std::filesystem::temp_directory_path() / "mpipe-test-XXXXXX").string();
      if (!::mkdtemp(pattern.data())) throw std::runtime_error("cannot create a directory for the test's files");
      path = pattern;
    }
    ~Directory() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  };
  static const Directory directory;
  return directory.path / name;
}

}  // namespace mpipe::testing
