#include "daemon/ops/instance_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "proto/wire.h"

namespace tsd {

absl::StatusOr<InstanceLock> InstanceLock::Acquire(const std::string& socket_path) {
  const std::string path = wire::LockFilePath(socket_path);
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open lock file ", path, ": ", std::strerror(errno)));
  }
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char buf[32] = {};
    [[maybe_unused]] ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
    close(fd);
    std::string pid(absl::StripAsciiWhitespace(buf));
    return absl::FailedPreconditionError(absl::StrCat(
        "another tsd", pid.empty() ? "" : absl::StrCat(" (pid ", pid, ")"), " is already serving ",
        socket_path, "; stop it first (`kill ", pid.empty() ? "<pid>" : pid,
        "` or `systemctl stop tsd`) or start this one with another --socket"));
  }
  const std::string pid = absl::StrCat(getpid(), "\n");
  if (ftruncate(fd, 0) != 0 ||
      pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    close(fd);
    return absl::InternalError(
        absl::StrCat("cannot write lock file ", path, ": ", std::strerror(errno)));
  }
  return InstanceLock(fd, path);
}

InstanceLock::~InstanceLock() {
  if (fd_ < 0) return;
  unlink(path_.c_str());
  close(fd_);
}

}  // namespace tsd
