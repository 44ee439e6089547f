// Conventions shared by the daemon and its clients beyond the messages of tsd.proto: where the
// sockets live, the limits of the side socket, and the helpers that move one datagram (with an
// optional file descriptor) over it. Both sides use exactly these, so the contract is in one place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tsd::wire {

// The protocol version; bumped with every incompatible change to tsd.proto or this header.
// Version 2: every call of a session travels on the side socket (bound to the caller's uid),
// with request ids and notices; gRPC keeps the sessionless calls.
inline constexpr uint32_t kProtocolVersion = 2;
// Largest datagram either side sends or accepts on the side socket.
inline constexpr size_t kMaxSideDatagramBytes = 64 * 1024;
// Largest side message once its fragments are put together: a reply (a registration's layout
// for 65,536 buckets, a long region list) ...
inline constexpr size_t kMaxSideMessageBytes = 16 * 1024 * 1024;
// ... and a request, which the daemon holds while it arrives (a registration of 65,536 buckets
// and 1,024 groups takes under 1 MiB).
inline constexpr size_t kMaxSideRequestBytes = 4 * 1024 * 1024;
// Names of jobs and regions: 1..kMaxNameBytes characters of [A-Za-z0-9._:/-], not starting with
// '/' or '.'.
inline constexpr size_t kMaxNameBytes = 128;
// Regions are charged and mapped in whole pages.
inline constexpr uint64_t kPageBytes = 4096;

// The default control socket: /run/tsd/tsd.sock for root, else $XDG_RUNTIME_DIR/tsd/tsd.sock,
// else /tmp/tsd-$UID/tsd.sock.
std::string DefaultSocketPath();
// The system service's control socket (systemd's RuntimeDirectory=tsd).
inline constexpr char kSystemSocketPath[] = "/run/tsd/tsd.sock";
// Where a client connects: `explicit_path` when not empty, else $TSD_SOCKET when set, else
// DefaultSocketPath(), unless no socket is there and the system service's is: then that one
// (a user's own daemon wins over the node's service).
std::string ResolveSocketPath(const std::string& explicit_path);
// The same choice with its inputs given (testable): `is_socket` says whether a path is a socket.
std::string ChooseSocketPath(const std::string& explicit_path, const char* env,
                             const std::string& user_default, const std::string& system_path,
                             bool (*is_socket)(const std::string&));
// The side socket for a control socket: "x.sock" -> "x.fd.sock", anything else -> "<path>.fd".
std::string SideSocketPath(const std::string& socket_path);
// The lock file that keeps a second daemon off a live socket: "<socket>.lock".
std::string LockFilePath(const std::string& socket_path);

// Checks a job or region name; the error says what is allowed. `what` is "job" or "region".
absl::Status ValidateName(const std::string& what, const std::string& name);

// Sends one datagram on a SOCK_SEQPACKET socket, with `fd` attached as SCM_RIGHTS when >= 0.
// Waits up to `timeout_ms` for room when the peer's queue is full (0: never waits); a peer that
// does not read in that time gets UNAVAILABLE.
absl::Status SendDatagram(int sock, const std::string& bytes, int fd = -1, int timeout_ms = 0);

// One received datagram. `fd` is the first descriptor that came with it (or -1); any others are
// closed. The caller owns `fd`.
struct Datagram {
  std::string bytes;
  int fd = -1;
  bool truncated = false;  // the peer sent more than kMaxSideDatagramBytes
};
// Receives one datagram. The peer closing gives UNAVAILABLE; when `nonblocking` and nothing is
// queued, returns an empty datagram and sets `*would_block`.
absl::StatusOr<Datagram> ReceiveDatagram(int sock, bool nonblocking, bool* would_block = nullptr);

// Human-readable byte counts for messages: "512 MiB", "1.50 GiB", "4096 B".
std::string FormatBytes(uint64_t bytes);

}  // namespace tsd::wire
