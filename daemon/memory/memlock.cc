#include "daemon/memory/memlock.h"

#include <sys/resource.h>

#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace tsd {
namespace {

bool HasCapIpcLock() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("CapEff:", 0) != 0) continue;
    const uint64_t caps = std::stoull(line.substr(7), nullptr, 16);
    constexpr int kCapIpcLock = 14;
    return (caps >> kCapIpcLock) & 1;
  }
  return false;
}

}  // namespace

MemlockProbe ProbeMemlock(uint64_t pool_bytes) {
  MemlockProbe p;
  rlimit rl{};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= pool_bytes || HasCapIpcLock()) {
    p.can_lock = true;
    return p;
  }
  p.reason =
      absl::StrCat("the memlock limit (RLIMIT_MEMLOCK) is ", wire::FormatBytes(rl.rlim_cur),
                   ", below the pool's ", wire::FormatBytes(pool_bytes),
                   ": regions are populated but not locked and may be swapped. Raise it with "
                   "LimitMEMLOCK=infinity in the systemd unit, `ulimit -l unlimited`, or "
                   "run with CAP_IPC_LOCK");
  return p;
}

}  // namespace tsd
