// The SideServer owns the side socket: a SOCK_SEQPACKET Unix socket beside the gRPC socket that
// carries every call of a session. It learns each caller's uid and pid from the kernel
// (SO_PEERCRED), hands out region descriptors (SCM_RIGHTS), and each connection is one session's
// lifeline: its closing is how the daemon learns, at once, that a training process died.
//
// One thread polls: it accepts connections and reads datagrams (putting fragments together).
// Each whole request goes to a small pool of workers (RequestPool), one request at a time per
// connection: while a connection has a request in flight its input is not polled, so requests
// are served in order and a slow one (a large allocation, saving a large state) holds up only its
// own connection. Notices (a shutdown, a session the daemon closed) can come from other threads,
// so each connection has a send mutex. Everything a client sends is untrusted: garbage or
// oversized datagrams get an error reply that says what was wrong, and descriptors sent to the
// daemon are closed unread unless the request is a state request.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "daemon/jobs/registry.h"
#include "daemon/ops/log_budget.h"
#include "daemon/rpc/request_pool.h"
#include "daemon/rpc/side_handler.h"
#include "proto/mutex.h"
#include "proto/side_message.h"

namespace tsd {

class SideServer final {
 public:
  // `workers`: threads that serve requests.
  // `stores` (may be null) serves the store requests.
  explicit SideServer(Registry& registry, int workers = 4, stores::StoreManager* stores = nullptr);
  ~SideServer();
  SideServer(const SideServer&) = delete;
  SideServer& operator=(const SideServer&) = delete;

  // Binds and listens at `path` (mode 0660, group `gid` unless it is -1).
  absl::Status Listen(const std::string& path, gid_t gid);
  // Starts the poll thread.
  void Start();
  // Sends a SHUTDOWN notice saying `notice` to every connection, lets requests in flight finish,
  // closes every connection and stops. Idempotent.
  void Shutdown(const std::string& notice);
  // Number of open connections (for tests and status).
  size_t connections() const { return open_connections_.load(); }

 private:
  // One client connection. `fd`, `uid`, `pid` and `serial` never change; the assembler is the
  // poll thread's; the rest is guarded by `mu`.
  struct Conn {
    int fd = -1;
    uid_t uid = 0;
    pid_t pid = 0;
    uint64_t serial = 0;  // the epoll key: never reused, unlike descriptor numbers
    wire::SideAssembler<v1::SideRequest> assembler{wire::kMaxSideRequestBytes};
    Mutex send_mu;  // one message at a time: a reply's fragments never interleave with a notice
    Mutex mu;
    uint64_t session_id ABSL_GUARDED_BY(mu) = 0;
    bool busy ABSL_GUARDED_BY(mu) = false;     // a worker serves a request of this connection
    bool closing ABSL_GUARDED_BY(mu) = false;  // close once the request in flight is done
    bool closed ABSL_GUARDED_BY(mu) = false;   // fd is closed: never touch it again
    std::string close_reason ABSL_GUARDED_BY(mu);
  };
  using ConnPtr = std::shared_ptr<Conn>;

  void Loop();
  void AcceptAll();
  // Reads what is queued on `c` (poll thread); hands a whole request to a worker.
  void HandleReadable(const ConnPtr& c);
  // Serves one request on a worker, replies, then polls the connection again (or closes it).
  void Serve(const ConnPtr& c, v1::SideRequest request, int fd);
  void Send(Conn& c, const v1::SideReply& reply, int fd = -1);
  void SendError(Conn& c, uint64_t request_id, const absl::Status& status);
  // Polls the connection's input again (EPOLLONESHOT).
  void Rearm(Conn& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // Closes now when no request is in flight, else when it finishes.
  void RequestClose(const ConnPtr& c, const std::string& why);
  // Closes the connection and ends its session. Only when no request is in flight.
  void FinishClose(const ConnPtr& c, const std::string& why);
  // Tells the connections of sessions the registry closed why, and closes them.
  void NotifyClosed(const std::vector<ClosedSession>& closed);

  Registry& registry_;
  SideHandler handler_;
  RequestPool workers_;
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  // A descriptor held in reserve (/dev/null): when accept fails for want of descriptors
  // (EMFILE/ENFILE) it is closed to accept and close the waiting connection, so the client hears
  // at once and the listener does not spin, then taken again.
  int reserve_fd_ = -1;
  std::string path_;
  std::string shutdown_notice_;  // written before stopping_ is set, read by the loop after
  std::atomic<bool> stopping_{false};
  std::atomic<size_t> open_connections_{0};
  // Bytes of half-assembled requests over all connections (bounded, so that many connections
  // sending fragments slowly cannot make the daemon hold unbounded memory).
  std::atomic<size_t> pending_bytes_{0};
  // A client's garbage datagrams each get an error reply, but at most 20 log lines per uid in 10 s.
  LogBudget bad_message_log_{20, absl::Seconds(10)};
  Mutex mu_;  // never held while calling the registry or sending
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 2;  // 0: the listener, 1: the wake-up eventfd
  std::map<uint64_t, ConnPtr> conns_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, ConnPtr> by_session_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, size_t> per_uid_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace tsd
