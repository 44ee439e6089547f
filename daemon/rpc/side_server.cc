#include "daemon/rpc/side_server.h"

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
#include "spdlog/spdlog.h"

namespace tsd {
namespace {
constexpr size_t kMaxConnections = 8192;
constexpr int kSweepIntervalMs = 100;
}  // namespace

SideServer::~SideServer() {
  Shutdown("tsd is shutting down");
  if (listen_fd_ >= 0) close(listen_fd_);
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
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
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (epoll_fd_ < 0 || wake_fd_ < 0)
    return absl::InternalError(absl::StrCat("epoll/eventfd: ", std::strerror(errno)));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = listen_fd_;
  epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, &ev);
  ev.data.fd = wake_fd_;
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
      const int fd = events[i].data.fd;
      if (fd == listen_fd_) {
        AcceptAll();
        continue;
      }
      if (fd == wake_fd_) continue;
      auto it = conns_.find(fd);
      if (it == conns_.end()) continue;
      if (events[i].events & EPOLLIN) HandleReadable(it->second);
      // A connection may have been closed while reading; look it up again.
      it = conns_.find(fd);
      if (it != conns_.end() && (events[i].events & (EPOLLHUP | EPOLLERR)) &&
          !(events[i].events & EPOLLIN)) {
        CloseConn(fd, "hangup");
      }
    }
    const absl::Time now = absl::Now();
    if (now - last_sweep >= absl::Milliseconds(kSweepIntervalMs)) {
      last_sweep = now;
      registry_.Sweep(now);
      std::vector<int> stale;
      for (const auto& [fd, c] : conns_) {
        if (c.session_id == 0 && now - c.accepted > registry_.options().hello_timeout)
          stale.push_back(fd);
      }
      for (int fd : stale) CloseConn(fd, "no_hello_in_time");
    }
  }
  // Shutting down: tell every connection why, then close it.
  v1::SideReply notice;
  notice.set_code(static_cast<int>(absl::StatusCode::kUnavailable));
  notice.set_message(shutdown_notice_);
  notice.mutable_notice()->set_kind(v1::SideNotice::SHUTDOWN);
  notice.mutable_notice()->set_message(shutdown_notice_);
  std::vector<int> fds;
  for (auto& [fd, c] : conns_) {
    Reply(c, notice);
    fds.push_back(fd);
  }
  for (int fd : fds) CloseConn(fd, "shutdown");
}

void SideServer::AcceptAll() {
  for (;;) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EINTR) continue;
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
    if (conns_.size() >= kMaxConnections) {
      spdlog::warn("event=connection_refused reason=too_many_connections uid={} pid={}", cred.uid,
                   cred.pid);
      close(fd);
      continue;
    }
    Conn c;
    c.fd = fd;
    c.uid = cred.uid;
    c.pid = cred.pid;
    c.accepted = absl::Now();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      close(fd);
      continue;
    }
    conns_.emplace(fd, c);
    open_connections_.store(conns_.size());
  }
}

void SideServer::HandleReadable(Conn& conn) {
  const int fd = conn.fd;
  // Drain what is queued; each datagram is one request.
  for (int budget = 64; budget > 0; --budget) {
    bool would_block = false;
    auto dgram = wire::ReceiveDatagram(fd, /*nonblocking=*/true, &would_block);
    if (!dgram.ok()) {
      CloseConn(fd, "closed_by_peer");
      return;
    }
    if (would_block) return;
    if (dgram->truncated) {
      if (dgram->fd >= 0) close(dgram->fd);
      ReplyError(conn, absl::InvalidArgumentError(absl::StrCat(
                           "side message larger than ", wire::kMaxSideMessageBytes, " bytes")));
      if (conn.session_id == 0) {
        CloseConn(fd, "oversized_message_before_hello");
        return;
      }
      continue;
    }
    if (!HandleMessage(conn, dgram->bytes, dgram->fd)) {
      CloseConn(fd, "protocol_error");
      return;
    }
  }
}

bool SideServer::HandleMessage(Conn& conn, const std::string& bytes, int fd) {
  v1::SideRequest req;
  const bool parsed = !bytes.empty() && req.ParseFromString(bytes);
  // Only state requests carry a descriptor; any other is closed unread, so no client can make the
  // daemon hold descriptors.
  const bool wants_fd = parsed && (req.has_save_state() || req.has_load_state());
  if (fd >= 0 && !wants_fd) {
    close(fd);
    fd = -1;
    spdlog::warn("event=unexpected_fd uid={} pid={} session={}", conn.uid, conn.pid,
                 conn.session_id);
  }
  struct FdCloser {
    int fd;
    ~FdCloser() {
      if (fd >= 0) close(fd);
    }
  } closer{fd};
  if (!parsed || req.kind_case() == v1::SideRequest::KIND_NOT_SET) {
    ReplyError(conn, absl::InvalidArgumentError(absl::StrCat(
                         "side message of ", bytes.size(),
                         " bytes is not a valid tsd.v1.SideRequest (expected hello or get_fd)")));
    spdlog::warn("event=bad_side_message uid={} pid={} session={} bytes={}", conn.uid, conn.pid,
                 conn.session_id, bytes.size());
    return conn.session_id != 0;  // before a hello, one bad message closes the connection
  }
  if (req.has_hello()) {
    if (conn.session_id != 0) {
      ReplyError(conn, absl::FailedPreconditionError(absl::StrCat(
                           "this connection already belongs to session ", conn.session_id)));
      return true;
    }
    const v1::SessionRef& ref = req.hello().session();
    auto result = registry_.CompleteHello(ref.session_id(), ref.token(), conn.uid, conn.pid);
    if (!result.ok()) {
      spdlog::warn("event=hello_refused uid={} pid={} session={} error=\"{}\"", conn.uid, conn.pid,
                   ref.session_id(), std::string(result.status().message()));
      ReplyError(conn, result.status());
      return false;
    }
    conn.session_id = ref.session_id();
    v1::SideReply reply;
    auto* hello = reply.mutable_hello();
    hello->set_job(result->job);
    hello->set_uid(conn.uid);
    hello->set_quota_bytes(result->quota_bytes);
    hello->set_job_created(result->job_created);
    Reply(conn, reply);
    return true;
  }
  if (conn.session_id == 0) {
    ReplyError(conn, absl::FailedPreconditionError("send a hello with your session first"));
    return false;
  }
  if (req.has_save_state() || req.has_load_state()) {
    auto optimizer = registry_.OptimizerOf(conn.session_id);
    if (!optimizer.ok()) {
      ReplyError(conn, optimizer.status());
      return true;
    }
    auto bytes_moved =
        req.has_save_state() ? (*optimizer)->SaveState(fd) : (*optimizer)->LoadState(fd);
    if (!bytes_moved.ok()) {
      ReplyError(conn, bytes_moved.status());
      return true;
    }
    v1::SideReply reply;
    reply.mutable_state()->set_bytes(*bytes_moved);
    Reply(conn, reply);
    return true;
  }
  auto region = registry_.GetFd(conn.session_id, req.get_fd().region_id());
  if (!region.ok()) {
    ReplyError(conn, region.status());
    return true;
  }
  v1::SideReply reply;
  *reply.mutable_fd()->mutable_region() = region->info;
  Reply(conn, reply, region->fd);
  close(region->fd);
  return true;
}

void SideServer::Reply(Conn& conn, const v1::SideReply& reply, int fd) {
  std::string bytes;
  reply.SerializeToString(&bytes);
  if (absl::Status s = wire::SendDatagram(conn.fd, bytes, fd); !s.ok()) {
    spdlog::warn("event=side_reply_failed uid={} pid={} session={} error=\"{}\"", conn.uid,
                 conn.pid, conn.session_id, std::string(s.message()));
  }
}

void SideServer::ReplyError(Conn& conn, const absl::Status& status) {
  v1::SideReply reply;
  reply.set_code(static_cast<int>(status.code()));
  reply.set_message(std::string(status.message()));
  Reply(conn, reply);
}

void SideServer::CloseConn(int fd, const char* why) {
  auto it = conns_.find(fd);
  if (it == conns_.end()) return;
  const Conn c = it->second;
  conns_.erase(it);
  open_connections_.store(conns_.size());
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd, nullptr);
  close(fd);
  if (c.session_id != 0) {
    spdlog::debug("event=side_closed session={} uid={} pid={} reason={}", c.session_id, c.uid,
                  c.pid, why);
    registry_.SessionDisconnected(c.session_id);
  }
}

}  // namespace tsd
