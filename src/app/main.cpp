// mpipe's entry point.
#include "mpipe/app/commands.hpp"

int main(int argc, char** argv) { return mpipe::run_main(argc, argv); }
