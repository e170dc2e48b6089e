// Defaults for AddressSanitizer builds (the asan preset); include in exactly one file
// of each executable (its main). Unused in other builds.
//
// Leak detection is off by default: Open MPI leaks at MPI_Finalize from components it
// dlopens and unloads, whose frames LeakSanitizer cannot name, so no suppression file
// can tell them from ours. ASAN_OPTIONS=detect_leaks=1 still turns it on for a run.
#pragma once
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
