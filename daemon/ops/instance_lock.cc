#include "daemon/ops/instance_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
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
  // O_NOFOLLOW: a symlink planted at the lock path by another user must never make tsd truncate
  // and write the file it points to (tsd may run as root).
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) {
    if (errno == ELOOP) {
      return absl::PermissionDeniedError(absl::StrCat(
          "lock file ", path, " is a symbolic link; tsd refuses to follow it (another user may ",
          "have planted it). Remove it, check who created it, and start tsd again"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot open lock file ", path, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    const bool regular = S_ISREG(st.st_mode);
    const uid_t owner = st.st_uid;
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "lock file ", path, regular ? "" : " is not a regular file",
        regular ? absl::StrCat(" is owned by uid ", owner, ", not by tsd's uid ", geteuid()) : "",
        "; tsd refuses to use it. Remove it (and check who created it), then start tsd again"));
  }
  // A second name for the file (a hard link another user planted where fs.protected_hardlinks
  // is off) would let the truncate below reach a file of tsd's uid that is not the lock.
  if (st.st_nlink != 1) {
    const nlink_t links = st.st_nlink;
    close(fd);
    return absl::PermissionDeniedError(absl::StrCat(
        "lock file ", path, " has ", links,
        " links: another name points at the same file, which may be a file of tsd's uid planted "
        "there; tsd refuses to truncate it. Remove ",
        path, " (check who created it), then start tsd again"));
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
