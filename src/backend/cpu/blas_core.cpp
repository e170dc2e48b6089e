// OpenBLAS's kernels: see blas_core.hpp.
#include "mpipe/backend/cpu/blas_core.hpp"

#include <unistd.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <string_view>

extern "C" char* openblas_get_corename(void);
extern "C" char* openblas_get_config(void);

namespace mpipe::cpu {

namespace {
// Where the previous exec's choice is recorded: the core the library had taken itself.
constexpr const char* kTakenFor = "MPIPE_BLAS_CORE_WAS";

const char* best_core() {
#if defined(__x86_64__)
  __builtin_cpu_init();  // the checks below include the OS's saving of the vector state
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
  return nullptr;
}
}  // namespace

// OpenBLAS's x86-64 cores whose single-precision kernels use AVX2/FMA or AVX-512.
bool vector_core(std::string_view core) {
  constexpr std::array<std::string_view, 7> known{"Haswell", "SkylakeX", "CooperLake", "SapphireRapids",
                                                  "Zen",     "Excavator", "Skylake"};
  for (std::string_view k : known)
    if (core.size() == k.size() && strncasecmp(core.data(), k.data(), k.size()) == 0) return true;
  return false;
}

std::string blas_core() { return openblas_get_corename() ? openblas_get_corename() : "unknown"; }

void choose_blas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv(kTakenFor)) return;  // the user's, or chosen already
  if (const char* keep = std::getenv("MPIPE_BLAS_CORE"); keep && std::strcmp(keep, "keep") == 0) return;
  const char* taken = openblas_get_corename();
  const char* best = best_core();
  if (!taken || !best || vector_core(taken)) return;
  setenv(kTakenFor, taken, 1);
  setenv("OPENBLAS_CORETYPE", best, 1);
  // The program's own path, not /proc/self/exe: the process keeps its name ("mpipe",
  // not "exe") for ps, pgrep and top.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);
  }
  // No exec (no /proc): go on with the library's kernels, and say nothing was chosen.
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kTakenFor);
}

std::string blas_description() {
  std::string config = openblas_get_config() ? openblas_get_config() : "OpenBLAS";
  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ...": the name and version.
  const std::size_t second_space = config.find(' ', config.find(' ') + 1);
  std::string line = config.substr(0, second_space);
  line += ", " + blas_core() + " kernels";
  if (const char* taken = std::getenv(kTakenFor); taken && std::getenv("OPENBLAS_CORETYPE"))
    line += std::string(" (chosen by mpipe: the library took this CPU for ") + taken + "; MPIPE_BLAS_CORE=keep leaves its choice)";
  return line;
}

}  // namespace mpipe::cpu
