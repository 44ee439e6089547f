// The SideServer owns the side socket: a SOCK_SEQPACKET Unix socket beside the gRPC socket that
// does what gRPC cannot: it learns each caller's uid and pid from the kernel (SO_PEERCRED) and
// hands out region descriptors (SCM_RIGHTS). Each session keeps one connection open for its
// whole life; the connection closing is how the daemon learns, at once, that a training process
// died.
//
// One thread runs an epoll loop over all connections. It never blocks on a client: replies are
// sent with MSG_DONTWAIT and a client that does not read is dropped. Everything a client sends is
// untrusted: oversized, truncated or garbage datagrams get an error reply, and descriptors sent to
// the daemon are closed unread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/jobs/registry.h"

namespace tsd {

class SideServer final {
 public:
  explicit SideServer(Registry& registry) : registry_(registry) {}
  ~SideServer();
  SideServer(const SideServer&) = delete;
  SideServer& operator=(const SideServer&) = delete;

  // Binds and listens at `path` (mode 0660, group `gid` unless it is -1).
  absl::Status Listen(const std::string& path, gid_t gid);
  // Starts the loop thread.
  void Start();
  // Sends `notice` to every connection, closes them all and stops the loop. Idempotent.
  void Shutdown(const std::string& notice);
  // Number of open connections (for tests and status).
  size_t connections() const { return open_connections_.load(); }

 private:
  struct Conn {
    int fd = -1;
    uid_t uid = 0;
    pid_t pid = 0;
    uint64_t session_id = 0;  // bound after a successful hello
    absl::Time accepted;
  };

  void Loop();
  void AcceptAll();
  void HandleReadable(Conn& conn);
  // Handles one datagram (and owns `fd`, a descriptor that came with it, or -1); returns false
  // when the connection must be closed.
  bool HandleMessage(Conn& conn, const std::string& bytes, int fd);
  void Reply(Conn& conn, const v1::SideReply& reply, int fd = -1);
  void ReplyError(Conn& conn, const absl::Status& status);
  void CloseConn(int fd, const char* why);

  Registry& registry_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::string path_;
  std::string shutdown_notice_;
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_connections_{0};
  std::map<int, Conn> conns_;  // touched by the loop thread only
  std::thread thread_;
};

}  // namespace tsd
