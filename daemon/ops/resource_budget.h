// ResourceBudget decides how many regions tsd may hold, from the process's limits. Every region
// costs the daemon one descriptor (its memfd) and one memory mapping, so a job allocating many
// small regions could otherwise exhaust RLIMIT_NOFILE (and then gRPC stops accepting
// connections) or vm.max_map_count (and then every mmap fails). At start the daemon raises its
// soft descriptor limit to the hard one, measures what it already uses, and lets regions take at
// most half of what is left below half of each limit: the other half stays in reserve for
// connections, request descriptors in flight, threads and libraries, so the control plane can
// always accept. The per-uid and per-job budgets are shares of that node budget unless the
// configuration names them.
#pragma once

#include <cstdint>
#include <string>

namespace tsd {

struct ResourceBudget {
  uint64_t nofile_limit = 0;   // RLIMIT_NOFILE after raising the soft limit to the hard one
  uint64_t max_map_count = 0;  // /proc/sys/vm/max_map_count
  uint64_t fds_at_start = 0;   // descriptors open when measured
  uint64_t maps_at_start = 0;  // mappings when measured
  uint64_t max_regions = 0;    // node budget: every job of every uid together
  uint64_t max_regions_per_uid = 0;
  uint64_t max_regions_per_job = 0;
  std::string raise_error;  // why the soft limit could not be raised (empty: raised or at hard)

  // key=value fields for the start-up log line.
  std::string Describe() const;
};

// Raises the soft RLIMIT_NOFILE to the hard limit (capped at 1<<20 when unlimited), measures the
// process, and derives the budgets. `per_uid` and `per_job` are the configured budgets (0: derive
// them: a quarter of the node budget per uid, the uid's budget per job); configured ones are
// capped at the node budget, which no setting can raise.
ResourceBudget MeasureResourceBudget(uint64_t per_uid, uint64_t per_job);

// Pure arithmetic of the above: the node budget is min(nofile/2 - fds - 32, maps/2 - maps - 512)
// (the constants: what the daemon opens and maps after measuring), and never below 1.
ResourceBudget DeriveResourceBudget(uint64_t nofile_limit, uint64_t max_map_count, uint64_t fds,
                                    uint64_t maps, uint64_t per_uid, uint64_t per_job);

}  // namespace tsd
