// Idle-class threads (core/background.hpp).
#include "mpipe/core/background.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/sysinfo.h>

#include <algorithm>

namespace mpipe {

void become_background_thread() {
  sched_param idle{};
  pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
  cpu_set_t any;
  CPU_ZERO(&any);
  for (int cpu = 0; cpu < std::min(get_nprocs_conf(), CPU_SETSIZE); ++cpu) CPU_SET(cpu, &any);
  pthread_setaffinity_np(pthread_self(), sizeof any, &any);
}

}  // namespace mpipe
