#include "daemon/memory/cpu_affinity.h"

#include <sched.h>

namespace tsd {

std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  }
  return cpus;
}

int AllowedCpuCount() {
  const size_t n = AllowedCpus().size();
  return n == 0 ? 1 : static_cast<int>(n);
}

}  // namespace tsd
