// The CPUs the calling thread may run on (its affinity mask), for the NUMA tests.
#pragma once

#include <sched.h>

#include <vector>

namespace tsd::testing {

inline std::vector<int> AllowedCpus() {
  cpu_set_t set;
  std::vector<int> out;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}

}  // namespace tsd::testing
