// A thread that works only in the time the job's ranks leave idle: the async
// checkpoint's writer, the CPU's --prefetch reader.
#pragma once

namespace mpipe {

// Makes the calling thread one of the idle class (SCHED_IDLE: it runs only where a core
// has nothing else to run, and never preempts training), free to run on any core the job
// may use: a rank bound to one core (mpirun --bind-to core, srun --cpu-bind) would keep
// it on the core training never leaves, where a core left idle (another rank's waits, a
// GPU's host) is the time it can take. The kernel keeps it inside the job's cpuset
// (cgroups). Each part that is refused is left as it was: the thread then runs as any.
void become_background_thread();

}  // namespace mpipe
