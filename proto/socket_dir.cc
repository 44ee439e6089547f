#include "proto/socket_dir.h"

#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tsd::wire {
namespace {

std::string Mode(mode_t m) { return absl::StrFormat("%04o", m & 07777); }

std::string ParentOf(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

}  // namespace

absl::Status CheckDaemonSocketDir(const std::string& dir, uid_t uid, gid_t socket_gid) {
  struct stat st {};
  if (lstat(dir.c_str(), &st) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot inspect socket directory ", dir, ": ", std::strerror(errno)));
  }
  const std::string fix = absl::StrCat(
      "; remove it (tsd creates it, mode 0750, when missing) or point --socket at a directory "
      "only tsd's uid (",
      uid, ") can write");
  if (S_ISLNK(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", dir, " is a symbolic link, which another user may redirect", fix));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory ", dir, " is not a directory", fix));
  }
  if (st.st_uid != uid && st.st_uid != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("socket directory ", dir, " belongs to uid ", st.st_uid, ", not to tsd's uid ",
                     uid, ": its owner could delete or replace tsd's sockets", fix));
  }
  if (st.st_mode & S_IWOTH) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", dir, " (mode ", Mode(st.st_mode),
        ") is writable by every user, who could delete or replace tsd's sockets", fix));
  }
  // The socket group's members are clients like any other uid: write access would let one of
  // them replace the sockets and impersonate tsd to every other member's trainers.
  if (st.st_mode & S_IWGRP) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", dir, " (mode ", Mode(st.st_mode), ") is writable by group ", st.st_gid,
        st.st_gid == socket_gid ? " (the socket group: every client)" : "",
        ", whose members could delete or replace tsd's sockets; run chmod g-w ", dir,
        " (connecting needs no write access to the directory)", fix));
  }
  return absl::OkStatus();
}

absl::Status CheckClientSocketDir(const std::string& socket_path, uid_t uid) {
  const std::string dir = ParentOf(socket_path);
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) return absl::OkStatus();  // the connect names the problem
  const std::string advice =
      "; a client does not trust a socket another user could have put there. Remove the "
      "directory and restart tsd (it creates it), or point TSD_SOCKET/--socket at tsd's real "
      "socket";
  if (st.st_mode & S_IWOTH) {
    return absl::PermissionDeniedError(
        absl::StrCat("refusing socket ", socket_path, ": its directory ", dir, " (mode ",
                     Mode(st.st_mode), ") is writable by every user", advice));
  }
  if (st.st_uid == 0 || st.st_uid == uid) return absl::OkStatus();
  // A directory of another uid (a service user's, such as systemd's /run/tsd) is trusted when
  // it sits in a directory that only root controls.
  struct stat parent {};
  const std::string up = ParentOf(dir);
  if (stat(up.c_str(), &parent) == 0 && parent.st_uid == 0 &&
      (parent.st_mode & (S_IWOTH | S_IWGRP)) == 0) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      absl::StrCat("refusing socket ", socket_path, ": its directory ", dir, " belongs to uid ",
                   st.st_uid, " (not to you, uid ", uid, ", nor to root) and lies in ", up,
                   ", where any user may create it", advice));
}

}  // namespace tsd::wire
