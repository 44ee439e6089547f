// Futex wait and wake on a 32-bit word in shared memory (the control page), for the doorbell
// between a training process and tsd. Shared (not FUTEX_PRIVATE) futexes, since the word lives in
// a memfd mapped by two processes.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

namespace tsd::wire {

// Sleeps while *word == expected, at most `timeout_ns` (or until woken). Spurious returns happen;
// callers re-check their condition.
inline void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{static_cast<time_t>(timeout_ns / 1000000000),
              static_cast<long>(timeout_ns % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

// Wakes every waiter on `word`.
inline void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace tsd::wire
