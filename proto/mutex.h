// tsd::Mutex: std::mutex with clang's thread-safety capability annotations.
//
// libstdc++'s std::mutex carries no capability attribute, so clang's -Wthread-safety cannot check
// GUARDED_BY/REQUIRES annotations against it. This thin wrapper adds them while staying a plain
// std::mutex underneath, so ThreadSanitizer (which does not see Debian's uninstrumented
// absl::Mutex) still sees every lock and unlock. Both the daemon and the C++ client use it.
#pragma once

#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace tsd {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool TryLock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }
  // For code that asserts a lock the analysis cannot follow (e.g. a condition variable's wait).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

  // BasicLockable, so std::condition_variable_any and std::unique_lock work with it.
  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

// Scoped lock of a tsd::Mutex (the annotated counterpart of std::lock_guard).
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_.Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// Waits on a tsd::Mutex held by the caller (through a MutexLock). std::condition_variable needs a
// std::unique_lock<std::mutex>; this adopts the native mutex for the wait and releases ownership
// afterwards, so the MutexLock stays the owner as far as the analysis is concerned.
class CondVar {
 public:
  void Wait(Mutex& mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu.native(), std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  template <typename Pred>
  void Wait(Mutex& mu, Pred pred) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu.native(), std::adopt_lock);
    cv_.wait(lock, pred);
    lock.release();
  }
  // Returns false on timeout.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex& mu, std::chrono::duration<Rep, Period> d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu.native(), std::adopt_lock);
    bool ok = cv_.wait_for(lock, d) == std::cv_status::no_timeout;
    lock.release();
    return ok;
  }
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace tsd
