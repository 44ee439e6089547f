#include "daemon/ops/resource_budget.h"

#include <dirent.h>
#include <sys/resource.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace tsd {
namespace {

constexpr uint64_t kUnlimitedNofile = 1 << 20;  // what an unlimited RLIMIT_NOFILE is counted as
constexpr uint64_t kDefaultMapCount = 65530;    // the kernel's default, when /proc cannot be read
// What the daemon opens and maps after the budget is measured at start (the gRPC server, the side
// socket, the metrics endpoint, thread stacks and their guard pages), counted as used up front.
constexpr uint64_t kLaterDescriptors = 32;
constexpr uint64_t kLaterMappings = 512;

uint64_t CountOpenFds() {
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  uint64_t n = 0;
  while (const dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n > 0 ? n - 1 : 0;  // the directory's own descriptor
}

uint64_t CountMappings() {
  std::ifstream maps("/proc/self/maps");
  uint64_t n = 0;
  std::string line;
  while (std::getline(maps, line)) ++n;
  return n;
}

uint64_t ReadMaxMapCount() {
  std::ifstream f("/proc/sys/vm/max_map_count");
  uint64_t v = 0;
  if (f >> v && v > 0) return v;
  return kDefaultMapCount;
}

}  // namespace

ResourceBudget DeriveResourceBudget(uint64_t nofile_limit, uint64_t max_map_count, uint64_t fds,
                                    uint64_t maps, uint64_t per_uid, uint64_t per_job) {
  ResourceBudget b;
  b.nofile_limit = nofile_limit;
  b.max_map_count = max_map_count;
  b.fds_at_start = fds;
  b.maps_at_start = maps;
  const uint64_t fds_used = fds + kLaterDescriptors, maps_used = maps + kLaterMappings;
  const uint64_t fd_room = nofile_limit / 2 > fds_used ? nofile_limit / 2 - fds_used : 0;
  const uint64_t map_room = max_map_count / 2 > maps_used ? max_map_count / 2 - maps_used : 0;
  b.max_regions = std::max<uint64_t>(1, std::min(fd_room, map_room));
  b.max_regions_per_uid =
      per_uid == 0 ? std::max<uint64_t>(1, b.max_regions / 4) : std::min(per_uid, b.max_regions);
  b.max_regions_per_job = per_job == 0 ? b.max_regions_per_uid : std::min(per_job, b.max_regions);
  return b;
}

ResourceBudget MeasureResourceBudget(uint64_t per_uid, uint64_t per_job) {
  std::string raise_error;
  rlimit rl{};
  uint64_t nofile = 1024;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0) {
    if (rl.rlim_cur < rl.rlim_max) {
      rlimit raised = rl;
      raised.rlim_cur = rl.rlim_max;
      if (setrlimit(RLIMIT_NOFILE, &raised) == 0) {
        rl = raised;
      } else {
        raise_error = std::strerror(errno);
      }
    }
    nofile = rl.rlim_cur == RLIM_INFINITY ? kUnlimitedNofile : static_cast<uint64_t>(rl.rlim_cur);
  }
  ResourceBudget b = DeriveResourceBudget(nofile, ReadMaxMapCount(), CountOpenFds(),
                                          CountMappings(), per_uid, per_job);
  b.raise_error = raise_error;
  return b;
}

std::string ResourceBudget::Describe() const {
  return absl::StrCat("nofile_limit=", nofile_limit, " max_map_count=", max_map_count,
                      " fds=", fds_at_start, " maps=", maps_at_start, " max_regions=", max_regions,
                      " max_regions_per_uid=", max_regions_per_uid,
                      " max_regions_per_job=", max_regions_per_job);
}

}  // namespace tsd
