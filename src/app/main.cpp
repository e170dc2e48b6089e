// mpipe's entry point.
#include <cstdio>
#include <cstring>

#include "mpipe/app/cli.hpp"
#include "mpipe/app/output.hpp"
#include "mpipe/app/process.hpp"
#include "mpipe/backend/cpu/blas_core.hpp"
#include "mpipe/core/sanitizer.hpp"

namespace {
// The executable's .preinit_array runs before the constructors of every shared library
// (glibc calls it with argc, argv, envp once all are loaded and relocated, ~5 ms after
// exec): from here on a stop signal during start-up means "stop after the first step".
void early_stop_handlers(int argc, char** argv, char** envp) {
  if (argc > 1 && std::strcmp(argv[1], "train") == 0) mpipe::install_stop_handlers(envp);
}
[[gnu::section(".preinit_array"), gnu::used]] void (*const preinit_entry)(int, char**, char**) = early_stop_handlers;
}  // namespace

int main(int argc, char** argv) {
  // Every command writes to standard output: a closed one is refused before any work.
  if (!mpipe::standard_output_open()) {
    std::fprintf(stderr, "%s\n", mpipe::closed_stdout_line().c_str());
    return mpipe::exit_user_error;
  }
  mpipe::cpu::choose_blas_core(argv);  // may re-execute this program with OpenBLAS's better kernels
  // A write to standard output that failed (a full disk, a reader gone) is said, never exit 0.
  return mpipe::finish_stdout(mpipe::run_main(argc, argv));
}
