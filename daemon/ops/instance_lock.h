// InstanceLock keeps a second daemon off a live socket. It holds an flock() on "<socket>.lock"
// for the daemon's lifetime and records the holder's pid there, so a refusal can say who holds
// the socket. A socket file without a lock holder is stale (a daemon that crashed) and is replaced.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tsd {

class InstanceLock final {
 public:
  // Takes the lock for `socket_path`, or fails with FAILED_PRECONDITION naming the holder's pid.
  static absl::StatusOr<InstanceLock> Acquire(const std::string& socket_path);
  InstanceLock(InstanceLock&& other) noexcept : fd_(other.fd_), path_(std::move(other.path_)) {
    other.fd_ = -1;
  }
  InstanceLock& operator=(InstanceLock&&) = delete;
  InstanceLock(const InstanceLock&) = delete;
  ~InstanceLock();

 private:
  InstanceLock(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  std::string path_;
};

}  // namespace tsd
