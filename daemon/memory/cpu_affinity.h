// The CPUs this thread may run on (sched_getaffinity), read in one place for every part that
// sizes or places work by them: the optimizer's workers (how many, and where to pin them), the
// threads that fault a fresh mapping in, and NUMA placement (which nodes have CPUs the daemon may
// use). A taskset, a cgroup cpuset or systemd's CPUAffinity= narrows this set below the machine's.
#pragma once

#include <vector>

namespace tsd {

// The CPU numbers this thread may run on, ascending. Empty when the kernel does not say (a failed
// sched_getaffinity): the workers are then not pinned, and NUMA placement finds no node's CPUs
// usable and stays off.
std::vector<int> AllowedCpus();

// How many CPUs this thread may run on; 1 when the kernel does not say.
int AllowedCpuCount();

}  // namespace tsd
