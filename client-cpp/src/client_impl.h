// The side connection of a Client (Client::Impl), shared by the files that implement Client's
// calls: client.cc (connection, attach, regions, queries), client_optimizer.cc (optimizer
// registration and state) and client_stores.cc (weight stores). Internal to libtsclient.
//
// Client::Impl is one session's connection to tsd's side socket and what the client knows of it:
// requests go out one at a time under `mu`, each waits for its own reply, and anything else tsd
// sends (a notice that ends the session, a reply nobody waits for) closes the connection with a
// reason that every later call is told.
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "proto/mutex.h"
#include "proto/side_message.h"
#include "proto/socket_dir.h"
#include "proto/status_convert.h"
#include "proto/status_macros.h"
#include "proto/tsd.grpc.pb.h"
#include "proto/wire.h"
#include "tsd/client.h"

namespace tsd {
namespace client_detail {

// Allocations populate and lock memory, registrations allocate several regions: generous.
inline constexpr absl::Duration kDefaultRequestTimeout = absl::Seconds(120);
// Saving or loading a large optimizer state moves tens of GiB.
inline constexpr absl::Duration kMinStateTimeout = absl::Hours(1);

// What to tell a user whose tsd at `path` is not there (client.cc).
std::string HowToStart(const std::string& path);

}  // namespace client_detail

struct Client::Impl {
  std::string socket_path;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Tsd::Stub> stub;

  mutable Mutex mu;
  bool attached ABSL_GUARDED_BY(mu) = false;
  uint64_t session_id ABSL_GUARDED_BY(mu) = 0;
  std::string job ABSL_GUARDED_BY(mu);
  uint64_t quota_bytes ABSL_GUARDED_BY(mu) = 0;
  absl::Duration keep_for ABSL_GUARDED_BY(mu);
  bool resumed ABSL_GUARDED_BY(mu) = false;
  double orphaned_s ABSL_GUARDED_BY(mu) = 0;
  int side_fd ABSL_GUARDED_BY(mu) = -1;
  uint64_t next_request_id ABSL_GUARDED_BY(mu) = 1;
  wire::SideAssembler<v1::SideReply> assembler ABSL_GUARDED_BY(mu);
  std::optional<Notice> last_notice ABSL_GUARDED_BY(mu);
  // Why the session's connection closed without a Detach (calls fail with it until the next
  // Attach); empty while attached and after a Detach.
  std::string closed_why ABSL_GUARDED_BY(mu);
  absl::StatusCode closed_code ABSL_GUARDED_BY(mu) = absl::StatusCode::kUnavailable;
  absl::Duration request_timeout ABSL_GUARDED_BY(mu) = client_detail::kDefaultRequestTimeout;

  ~Impl() {
    MutexLock lock(mu);
    if (side_fd >= 0) close(side_fd);
  }

  // Closes the session's connection; `why` is what later calls are told.
  void CloseSide(const std::string& why, absl::StatusCode code = absl::StatusCode::kUnavailable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    closed_code = code;
    if (side_fd >= 0) close(side_fd);
    side_fd = -1;
    attached = false;
    assembler.Reset();
    closed_why = why;
  }

  // Why calls fail after the connection closed without a Detach.
  absl::Status Closed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return absl::Status(closed_code, closed_why);
  }

  absl::Status NotAttached() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!closed_why.empty()) return Closed();
    return absl::FailedPreconditionError("this client is not attached to a job; attach first");
  }

  std::string ClosedByTsd() const {
    return absl::StrCat("tsd at ", socket_path,
                        " closed this session's connection (the daemon stopped, was killed or "
                        "dropped the session); restart it if needed and attach again");
  }

  // Handles a whole message that is not the reply a call waits for: a notice is kept and ends
  // the session (tsd closes the connection after one); anything else is a protocol error.
  absl::Status Unsolicited(v1::SideReply& m, int fd, uint64_t waiting_for)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (fd >= 0) close(fd);
    if (m.request_id() == 0 && m.has_notice()) {
      Notice n;
      n.kind = m.notice().kind() == v1::SideNotice::SHUTDOWN         ? Notice::Kind::kShutdown
               : m.notice().kind() == v1::SideNotice::SESSION_CLOSED ? Notice::Kind::kSessionClosed
                                                                     : Notice::Kind::kOther;
      n.message = m.notice().message();
      last_notice = n;
      // A session tsd closed (e.g. its optimizer saw a protocol violation) is ABORTED, which
      // the Python package raises as SessionClosed; a shutdown is UNAVAILABLE.
      CloseSide(n.message, n.kind == Notice::Kind::kSessionClosed ? absl::StatusCode::kAborted
                                                                  : absl::StatusCode::kUnavailable);
      return Closed();
    }
    std::string why;
    if (m.request_id() == 0) {
      why = absl::StrCat("tsd could not read a request of this client: ", m.message());
    } else if (waiting_for == 0) {
      why = absl::StrCat("protocol error: tsd sent a reply to request ", m.request_id(),
                         " while no request was in flight");
    } else {
      why = absl::StrCat("protocol error: tsd answered request ", m.request_id(),
                         " while this client waited for request ", waiting_for);
    }
    why += "; the connection was closed, which ended the session: attach again";
    CloseSide(why);
    return absl::InternalError(why);
  }

  // Reads whatever is queued on the connection without waiting: notices, or the end of it.
  void Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (side_fd >= 0) {
      bool would_block = false;
      auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/true, &would_block);
      if (!d.ok()) {
        CloseSide(ClosedByTsd());
        return;
      }
      if (would_block) return;
      uint64_t id = 0;
      auto whole = assembler.Feed(std::move(*d), &id);
      if (!whole.ok()) {
        CloseSide(absl::StrCat("tsd sent a side message this client cannot read (",
                               whole.status().message(), "); the session ended"));
        return;
      }
      if (!*whole) continue;
      const int fd = assembler.TakeFd();
      (void)Unsolicited(assembler.message(), fd, 0);
    }
  }

  // Sends `req` (with `fd`, when >= 0) as the next request of the session and waits for its
  // reply; an error reply becomes its status. The descriptor that came with the reply (or -1)
  // belongs to the caller.
  absl::StatusOr<std::pair<v1::SideReply, int>> Call(v1::SideRequest req, int fd,
                                                     absl::Duration timeout, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (side_fd < 0) return NotAttached();
    Pump();  // a notice that came while idle ends the session before we ask anything
    if (side_fd < 0) return Closed();
    const uint64_t id = next_request_id++;
    req.set_request_id(id);
    const absl::Time deadline = absl::Now() + timeout;
    const int timeout_ms = static_cast<int>(
        std::min<int64_t>(absl::ToInt64Milliseconds(timeout) + 1, std::numeric_limits<int>::max()));
    if (absl::Status s = wire::SendSideMessage(side_fd, req, fd, timeout_ms); !s.ok()) {
      Pump();
      if (side_fd < 0) return Closed();
      CloseSide(absl::StrCat("sending a ", what, " request to tsd failed (", s.message(),
                             "); the session ended: attach again"));
      return Closed();
    }
    for (;;) {
      const absl::Duration left = deadline - absl::Now();
      pollfd p{side_fd, POLLIN, 0};
      const int ready =
          left <= absl::ZeroDuration()
              ? 0
              : poll(&p, 1,
                     static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1,
                                                        std::numeric_limits<int>::max())));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        CloseSide(absl::StrCat(
            "tsd did not answer request ", id, " (", what, ") within ",
            absl::FormatDuration(timeout),
            "; this client closed its connection, which ended the session (tsd releases the job "
            "with its last session): attach again, or raise the timeout"));
        return absl::DeadlineExceededError(closed_why);
      }
      bool would_block = false;
      auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/true, &would_block);
      if (!d.ok()) {
        CloseSide(ClosedByTsd());
        return Closed();
      }
      if (would_block) continue;
      uint64_t got = 0;
      auto whole = assembler.Feed(std::move(*d), &got);
      if (!whole.ok()) {
        CloseSide(absl::StrCat("tsd sent a reply this client cannot read (",
                               whole.status().message(),
                               "); is tsd of another version? The session ended"));
        return absl::InternalError(closed_why);
      }
      if (!*whole) continue;
      const int reply_fd = assembler.TakeFd();
      v1::SideReply& m = assembler.message();
      if (m.request_id() != id) return Unsolicited(m, reply_fd, id);
      if (m.code() != 0) {
        if (reply_fd >= 0) close(reply_fd);
        return absl::Status(static_cast<absl::StatusCode>(m.code()), m.message());
      }
      return std::make_pair(std::move(m), reply_fd);
    }
  }

  // Sends `req` (a request that needs no session: checkpoint, list_stores) on a connection of
  // its own, which tsd closes after the reply, and returns the reply as Call does. Only while no
  // session's connection is open; what a dead session's calls are told is kept.
  absl::StatusOr<std::pair<v1::SideReply, int>> CallAlone(v1::SideRequest req, int fd,
                                                          absl::Duration timeout, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (side_fd >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what,
                       " uses a connection of its own: call it on a client that is not "
                       "attached"));
    }
    const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string side = wire::SideSocketPath(socket_path);
    if (side.size() >= sizeof(addr.sun_path)) {
      close(sock);
      return absl::InvalidArgumentError(absl::StrCat("side socket path '", side, "' is too long"));
    }
    std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
    if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const int err = errno;
      close(sock);
      return absl::UnavailableError(absl::StrCat("cannot connect to tsd's side socket ", side, ": ",
                                                 std::strerror(err), "; ",
                                                 client_detail::HowToStart(socket_path)));
    }
    const std::string why = std::move(closed_why);
    const absl::StatusCode code = closed_code;
    side_fd = sock;  // for this one request; closed below whatever happens
    closed_why.clear();
    assembler.Reset();
    auto reply = Call(std::move(req), fd, timeout, what);
    if (side_fd >= 0) close(side_fd);
    side_fd = -1;
    attached = false;
    assembler.Reset();
    closed_why = why;
    closed_code = code;
    return reply;
  }

  absl::StatusOr<v1::SideReply> CallNoFd(v1::SideRequest req, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    TSD_ASSIGN_OR_RETURN(auto reply, Call(std::move(req), -1, request_timeout, what));
    if (reply.second >= 0) close(reply.second);
    return std::move(reply.first);
  }

  // Frees a region of the session's job in the daemon.
  absl::Status FreeRegion(uint64_t region_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::SideRequest req;
    req.mutable_free()->set_region_id(region_id);
    return CallNoFd(std::move(req), "free").status();
  }

  // Turns a failed gRPC call into an error that says what happened to the daemon.
  absl::Status Explain(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return wire::FromGrpc(s);
    Pump();
    if (last_notice && !closed_why.empty()) return Closed();
    return absl::UnavailableError(absl::StrCat("tsd at ", socket_path, " is not answering (",
                                               s.error_message(), "); ",
                                               client_detail::HowToStart(socket_path)));
  }

  // A unary call on tsd's public gRPC service (Status, ListJobs, PlanOptimizer) with a 10 s
  // deadline; a failure is explained as Explain() does. `mu` is taken only for that.
  template <typename Request, typename Response>
  absl::Status Unary(grpc::Status (v1::Tsd::Stub::*method)(grpc::ClientContext*, const Request&,
                                                           Response*),
                     const Request& req, Response* resp) ABSL_LOCKS_EXCLUDED(mu) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const grpc::Status s = (stub.get()->*method)(&ctx, req, resp);
    if (s.ok()) return absl::OkStatus();
    MutexLock lock(mu);
    return Explain(s);
  }
};

}  // namespace tsd
