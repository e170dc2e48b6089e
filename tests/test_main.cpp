// doctest's main for every test binary: a failed check makes the process exit non-zero.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
