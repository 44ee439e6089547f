// Whether the daemon may lock its whole pool in RAM: true with CAP_IPC_LOCK or an
// RLIMIT_MEMLOCK at least as large as the pool. Checked once at start.
#pragma once

#include <cstdint>
#include <string>

namespace tsd {

struct MemlockProbe {
  bool can_lock = false;
  std::string reason;  // why not, with what to do about it
};

MemlockProbe ProbeMemlock(uint64_t pool_bytes);

}  // namespace tsd
