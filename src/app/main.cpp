// mpipe's entry point.
#include "mpipe/app/commands.hpp"
#include "mpipe/core/sanitizer.hpp"

int main(int argc, char** argv) { return mpipe::run_main(argc, argv); }
