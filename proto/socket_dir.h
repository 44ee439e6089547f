// Checks that a socket's directory can be trusted, on both sides of the protocol. Another local
// user who owns the directory, or may write to it, can delete tsd's sockets or put sockets of
// their own in their place (for instance by creating the predictable default /tmp/tsd-$UID
// before tsd does). The daemon refuses such a directory before it binds; a client refuses it
// before it connects, so it never hands its gradients to whoever planted a socket.
#pragma once

#include <sys/types.h>

#include <string>

#include "absl/status/status.h"

namespace tsd::wire {

// The daemon's rule, for the directory that will hold its sockets: it must be a real directory
// (not a symbolic link) owned by `uid` (the daemon's effective uid) or by root, and writable by
// its owner alone: not by others, nor by its group, even when that is `socket_gid` (the socket
// group, whose members are clients of every uid). The error says why and what to do.
absl::Status CheckDaemonSocketDir(const std::string& dir, uid_t uid, gid_t socket_gid);

// The client's rule, for the directory of the socket it is about to connect to: not writable by
// others, and owned by root or by `uid` (the client's uid), or else inside a directory that
// only root controls (as systemd's /run/tsd, owned by the service's user, inside /run). The
// error says why and what to do.
absl::Status CheckClientSocketDir(const std::string& socket_path, uid_t uid);

}  // namespace tsd::wire
