// Standard output's failures: a closed stdout refused at the start, a write that failed
// (a full disk, a reader gone, a closed descriptor) said once at the end, never exit 0.
#pragma once
#include <string>

namespace mpipe {

// Before anything else: a standard stream the caller closed (`>&-`) gets /dev/null under
// its number, so that no file this process opens later (a checkpoint, a metrics file)
// takes it and receives what printf writes; standard output's is opened read-only, so
// every write to it fails (EBADF) and is said. Returns whether standard output was open.
bool standard_output_open();

// The one line for a closed standard output ("mpipe: error: ...; hint: ...").
std::string closed_stdout_line();

// Flushes standard output and says whether it, or any write to it since the start,
// failed, or can reach nobody: under a launcher (mpirun) on this node, which rank 0's
// output goes through, the launcher's standard output closed or /dev/full; with
// `readers` (a command that has more to write: generate), also a pipe, this process's or
// the launcher's, whose reader has gone (at the end that is no failure: a reader may
// stop once it has what it wants, `grep -q`). `line`: the one line that says so ("mpipe:
// error: cannot write to standard output: No space left on device; hint: ..."); `code`:
// its exit code (1; 2 for a closed one, the caller's doing).
bool stdout_failed(std::string* line = nullptr, int* code = nullptr, bool readers = false);

// The end of every command: with `code` 0, a failed standard output is one line on stderr
// naming it and the cause, and exit 1 (2 for a closed one: the caller's doing). Any other
// code stands (its own line was said).
int finish_stdout(int code);

}  // namespace mpipe
