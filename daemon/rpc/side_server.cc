#include "daemon/rpc/side_server.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {
constexpr size_t kMaxConnections = 8192;
// One uid may hold this many connections, so no uid can take every slot from the others.
constexpr size_t kMaxConnectionsPerUid = 1024;
constexpr int kSweepIntervalMs = 100;
// Half-assembled requests of all connections together may hold at most this much.
constexpr size_t kMaxPendingBytes = 64ull << 20;
// How long a reply waits for a client that does not read before the connection is given up.
constexpr int kSendTimeoutMs = 5000;
constexpr uint64_t kListenKey = 0;
constexpr uint64_t kWakeKey = 1;
constexpr uint32_t kConnEvents = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
}  // namespace

SideServer::SideServer(Registry& registry, int workers, stores::StoreManager* stores)
    : registry_(registry), handler_(registry, stores), workers_(workers) {}

SideServer::~SideServer() {
  Shutdown("tsd is shutting down");
  workers_.Stop();
  if (listen_fd_ >= 0) close(listen_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  if (reserve_fd_ >= 0) close(reserve_fd_);
}

absl::Status SideServer::Listen(const std::string& path, gid_t gid) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("side socket path '", path, "' is longer than ",
                                                   sizeof(addr.sun_path) - 1,
                                                   " bytes; use a shorter --socket"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  listen_fd_ = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (listen_fd_ < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  unlink(path.c_str());
  if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot bind side socket ", path, ": ", std::strerror(errno)));
  }
  if (chmod(path.c_str(), 0660) != 0 ||
      (gid != static_cast<gid_t>(-1) && chown(path.c_str(), -1, gid) != 0)) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot set mode/group of ", path, ": ", std::strerror(errno)));
  }
  if (listen(listen_fd_, 512) != 0)
    return absl::InternalError(absl::StrCat("listen: ", std::strerror(errno)));
  path_ = path;
  reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0)
    return absl::InternalError(absl::StrCat("epoll/eventfd: ", std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kListenKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.u64 = kWakeKey;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  return absl::OkStatus();
}

void SideServer::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void SideServer::Shutdown(const std::string& notice) {
  if (!thread_.joinable()) return;
  shutdown_notice_ = notice;
  stopping_.store(true);
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
  thread_.join();
  if (!path_.empty()) unlink(path_.c_str());
}

void SideServer::Loop() {
  std::vector<epoll_event> events(256);
  absl::Time last_sweep = absl::Now();
  while (!stopping_.load()) {
    const int n =
        epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), kSweepIntervalMs);
    if (n < 0 && errno != EINTR) {
      spdlog::error("event=epoll_failed error=\"{}\"", std::strerror(errno));
      break;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t key = events[i].data.u64;
      if (key == kListenKey) {
        AcceptAll();
        continue;
      }
      if (key == kWakeKey) continue;
      ConnPtr c;
      {
        MutexLock lock(mu_);
        auto it = conns_.find(key);
        if (it == conns_.end()) continue;
        c = it->second;
      }
      if (events[i].events & EPOLLIN) {
        HandleReadable(c);
      } else if (events[i].events & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
        FinishClose(c, "hangup");
      } else {
        MutexLock lock(c->mu);
        Rearm(*c);
      }
    }
    const absl::Time now = absl::Now();
    if (now - last_sweep >= absl::Milliseconds(kSweepIntervalMs)) {
      last_sweep = now;
      NotifyClosed(registry_.Sweep(now));
    }
  }
  // Shutting down: tell every connection why, let requests in flight finish, close everything.
  v1::SideReply notice;
  notice.set_code(static_cast<int>(absl::StatusCode::kUnavailable));
  notice.set_message(shutdown_notice_);
  notice.mutable_notice()->set_kind(v1::SideNotice::SHUTDOWN);
  notice.mutable_notice()->set_message(shutdown_notice_);
  std::vector<ConnPtr> all;
  {
    MutexLock lock(mu_);
    for (auto& [key, c] : conns_) all.push_back(c);
  }
  for (const ConnPtr& c : all) {
    Send(*c, notice);
    RequestClose(c, "shutdown");
  }
  workers_.Stop();  // a busy connection is closed by its worker when its request is done
}

void SideServer::AcceptAll() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR) continue;
      if ((errno == EMFILE || errno == ENFILE) && reserve_fd_ >= 0) {
        // Out of descriptors: use the reserve to take the connection off the queue and close it
        // (the client sees the connection closed instead of waiting), then take the reserve back.
        spdlog::warn("event=accept_out_of_descriptors error=\"{}\" connection refused",
                     std::strerror(errno));
        close(reserve_fd_);
        const int refused = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (refused >= 0) close(refused);
        reserve_fd_ = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (refused >= 0) continue;
        return;
      }
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        spdlog::warn("event=accept_failed error=\"{}\"", std::strerror(errno));
      }
      return;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      spdlog::warn("event=peercred_failed error=\"{}\"", std::strerror(errno));
      close(fd);
      continue;
    }
    auto c = std::make_shared<Conn>();
    c->fd = fd;
    c->uid = cred.uid;
    c->pid = cred.pid;
    MutexLock lock(mu_);
    size_t& mine = per_uid_[cred.uid];
    if (conns_.size() >= kMaxConnections || mine >= kMaxConnectionsPerUid) {
      spdlog::warn(
          "event=connection_refused reason={} uid={} pid={}",
          conns_.size() >= kMaxConnections ? "too_many_connections" : "too_many_connections_of_uid",
          cred.uid, cred.pid);
      if (mine == 0) per_uid_.erase(cred.uid);
      close(fd);
      continue;
    }
    c->serial = next_serial_++;
    epoll_event ev{};
    ev.events = kConnEvents;
    ev.data.u64 = c->serial;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      if (mine == 0) per_uid_.erase(cred.uid);
      close(fd);
      continue;
    }
    ++mine;
    conns_.emplace(c->serial, c);
    open_connections_.store(conns_.size());
  }
}

void SideServer::HandleReadable(const ConnPtr& c) {
  for (int budget = 64; budget > 0; --budget) {
    bool would_block = false;
    auto dgram = wire::ReceiveDatagram(c->fd, /*nonblocking=*/true, &would_block);
    if (!dgram.ok()) {
      FinishClose(c, "closed_by_peer");
      return;
    }
    if (would_block) break;
    uint64_t request_id = 0;
    const size_t pending_before = c->assembler.pending_bytes();
    auto whole = c->assembler.Feed(std::move(*dgram), &request_id);
    const size_t pending_after = c->assembler.pending_bytes();
    pending_bytes_ += pending_after;
    pending_bytes_ -= pending_before;
    if (whole.ok() && !*whole) {
      bool attached;
      {
        MutexLock lock(c->mu);
        attached = c->session_id != 0;
      }
      absl::Status refused;
      if (!attached) {
        refused = absl::FailedPreconditionError(
            "a fragmented request before SideAttach; the attach fits one datagram, and only "
            "requests of a session may travel in fragments");
      } else if (pending_bytes_.load() > kMaxPendingBytes) {
        refused = absl::ResourceExhaustedError(absl::StrCat(
            "tsd holds ", wire::FormatBytes(kMaxPendingBytes),
            " of half-sent requests from all clients, its limit; send the request again shortly"));
      }
      if (!refused.ok()) {
        pending_bytes_ -= pending_after;
        c->assembler.Reset();
        whole = refused;
      }
    }
    if (!whole.ok()) {
      uint64_t session_id;
      {
        MutexLock lock(c->mu);
        session_id = c->session_id;
      }
      bad_message_log_.Warn(
          c->uid,
          "event=bad_side_message uid={} pid={} session={} error=\"{}\" earlier_not_logged={}",
          c->uid, c->pid, session_id, std::string(whole.status().message()));
      SendError(*c, request_id, whole.status());
      if (session_id == 0) {  // before an attach, one bad message closes the connection
        FinishClose(c, "bad_message_before_attach");
        return;
      }
      continue;
    }
    if (!*whole) continue;  // more fragments to come
    const int fd = c->assembler.TakeFd();
    {
      MutexLock lock(c->mu);
      c->busy = true;
    }
    ConnPtr keep = c;
    v1::SideRequest request = std::move(c->assembler.message());
    if (!workers_.Submit([this, keep, request = std::move(request), fd]() mutable {
          Serve(keep, std::move(request), fd);
        })) {
      if (fd >= 0) close(fd);
      {
        MutexLock lock(c->mu);
        c->busy = false;
      }
      FinishClose(c, "stopping");
    }
    return;  // the worker polls this connection again when the request is done
  }
  MutexLock lock(c->mu);
  Rearm(*c);
}

void SideServer::Serve(const ConnPtr& c, v1::SideRequest request, int fd) {
  SideCaller caller;
  caller.uid = c->uid;
  caller.pid = c->pid;
  {
    MutexLock lock(c->mu);
    caller.session_id = c->session_id;
  }
  SideOutcome out = handler_.Handle(caller, request, fd);
  if (out.bound_session != 0) {
    {
      MutexLock lock(c->mu);
      c->session_id = out.bound_session;
    }
    MutexLock lock(mu_);
    by_session_[out.bound_session] = c;
  }
  Send(*c, out.reply, out.fd);
  if (out.fd >= 0) close(out.fd);
  std::string close_why;
  {
    MutexLock lock(c->mu);
    c->busy = false;
    if (c->closing) {
      close_why = c->close_reason;
    } else if (out.close) {
      close_why = out.close_reason;
    } else {
      Rearm(*c);
    }
  }
  if (!close_why.empty()) FinishClose(c, close_why);
}

void SideServer::Send(Conn& c, const v1::SideReply& reply, int fd) {
  MutexLock send(c.send_mu);
  {
    MutexLock lock(c.mu);
    if (c.closed) return;
  }
  if (absl::Status s = wire::SendSideMessage(c.fd, reply, fd, kSendTimeoutMs); !s.ok()) {
    spdlog::warn("event=side_reply_failed uid={} pid={} error=\"{}\"", c.uid, c.pid,
                 std::string(s.message()));
  }
}

void SideServer::SendError(Conn& c, uint64_t request_id, const absl::Status& status) {
  v1::SideReply reply;
  reply.set_request_id(request_id);
  reply.set_code(static_cast<int>(status.code()));
  reply.set_message(std::string(status.message()));
  Send(c, reply);
}

void SideServer::Rearm(Conn& c) {
  if (c.closed) return;
  epoll_event ev{};
  ev.events = kConnEvents;
  ev.data.u64 = c.serial;
  epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, c.fd, &ev);
}

void SideServer::RequestClose(const ConnPtr& c, const std::string& why) {
  {
    MutexLock lock(c->mu);
    if (c->busy) {
      c->closing = true;
      c->close_reason = why;
      return;
    }
  }
  FinishClose(c, why);
}

void SideServer::FinishClose(const ConnPtr& c, const std::string& why) {
  uint64_t session_id = 0;
  {
    MutexLock send(c->send_mu);  // no send is under way on this descriptor
    MutexLock lock(c->mu);
    if (c->closed) return;
    c->closed = true;
    session_id = c->session_id;
    epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, c->fd, nullptr);
    close(c->fd);
  }
  pending_bytes_ -= c->assembler.pending_bytes();
  c->assembler.Reset();
  {
    MutexLock lock(mu_);
    conns_.erase(c->serial);
    if (session_id != 0) by_session_.erase(session_id);
    auto it = per_uid_.find(c->uid);
    if (it != per_uid_.end() && --it->second == 0) per_uid_.erase(it);
    open_connections_.store(conns_.size());
  }
  if (session_id != 0) {
    spdlog::debug("event=side_closed session={} uid={} pid={} reason={}", session_id, c->uid,
                  c->pid, why);
    registry_.SessionDisconnected(session_id);
  }
}

void SideServer::NotifyClosed(const std::vector<ClosedSession>& closed) {
  for (const ClosedSession& cs : closed) {
    ConnPtr c;
    {
      MutexLock lock(mu_);
      auto it = by_session_.find(cs.session_id);
      if (it != by_session_.end()) c = it->second;
    }
    if (c == nullptr) {  // its connection is closing already
      registry_.EndSession(cs.session_id, ReleaseReason::kOptimizerFailed);
      continue;
    }
    v1::SideReply notice;
    notice.set_code(static_cast<int>(absl::StatusCode::kAborted));
    notice.set_message(cs.reason);
    notice.mutable_notice()->set_kind(v1::SideNotice::SESSION_CLOSED);
    notice.mutable_notice()->set_message(cs.reason);
    Send(*c, notice);  // first, so the client reads why before any request of it fails
    spdlog::info("event=session_closed_notice session={} uid={} pid={} reason=\"{}\"",
                 cs.session_id, c->uid, c->pid, cs.reason);
    registry_.EndSession(cs.session_id, ReleaseReason::kOptimizerFailed);
    RequestClose(c, "optimizer_failed");
  }
}

}  // namespace tsd
