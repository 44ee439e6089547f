#include "proto/wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tsd::wire {

std::string DefaultSocketPath() {
  const uid_t uid = getuid();
  if (uid == 0) return kSystemSocketPath;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && xdg[0] == '/') {
    return absl::StrCat(xdg, "/tsd/tsd.sock");
  }
  return absl::StrCat("/tmp/tsd-", uid, "/tsd.sock");
}

std::string ChooseSocketPath(const std::string& explicit_path, const char* env,
                             const std::string& user_default, const std::string& system_path,
                             bool (*is_socket)(const std::string&)) {
  if (!explicit_path.empty()) return explicit_path;
  if (env != nullptr && env[0] != '\0') return env;
  if (user_default != system_path && !is_socket(user_default) && is_socket(system_path)) {
    return system_path;
  }
  return user_default;
}

std::string ResolveSocketPath(const std::string& explicit_path) {
  return ChooseSocketPath(explicit_path, std::getenv("TSD_SOCKET"), DefaultSocketPath(),
                          kSystemSocketPath, [](const std::string& path) {
                            struct stat st {};
                            return stat(path.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
                          });
}

std::string SideSocketPath(const std::string& socket_path) {
  const std::string suffix = ".sock";
  if (socket_path.size() > suffix.size() &&
      socket_path.compare(socket_path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return socket_path.substr(0, socket_path.size() - suffix.size()) + ".fd.sock";
  }
  return absl::StrCat(socket_path, ".fd");
}

std::string LockFilePath(const std::string& socket_path) {
  return absl::StrCat(socket_path, ".lock");
}

absl::Status ValidateName(const std::string& what, const std::string& name) {
  if (name.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " name is empty; use 1-", kMaxNameBytes,
                                                   " characters of [A-Za-z0-9._:/-]"));
  }
  if (name.size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " name is ", name.size(), " bytes long; the limit is ", kMaxNameBytes));
  }
  if (name[0] == '/' || name[0] == '.') {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " name '", name, "' may not start with '/' or '.'"));
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(name[i]);
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s name has character 0x%02x at offset %d; allowed are [A-Za-z0-9._:/-]", what, c, i));
    }
  }
  return absl::OkStatus();
}

absl::Status SendDatagram(int sock, const std::string& bytes, int fd, int timeout_ms) {
  if (bytes.size() > kMaxSideDatagramBytes) {
    return absl::InternalError(
        absl::StrCat("side datagram of ", bytes.size(), " bytes exceeds ", kMaxSideDatagramBytes));
  }
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  if (fd >= 0) {
    std::memset(control, 0, sizeof(control));
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &fd, sizeof(int));
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n >= 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    if ((errno == EAGAIN || errno == EWOULDBLOCK) && timeout_ms > 0) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        return absl::UnavailableError(
            absl::StrCat("side socket send failed: the peer read nothing for ", timeout_ms, " ms"));
      }
      // POLLOUT may report room for a smaller datagram than ours: wait in short slices.
      pollfd p{sock, POLLOUT, 0};
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
      if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left + 1, 10))) < 0 && errno != EINTR) {
        return absl::UnavailableError(
            absl::StrCat("side socket poll failed: ", std::strerror(errno)));
      }
      continue;
    }
    return absl::UnavailableError(absl::StrCat("side socket send failed: ", std::strerror(errno)));
  }
}

absl::StatusOr<Datagram> ReceiveDatagram(int sock, bool nonblocking, bool* would_block) {
  if (would_block != nullptr) *would_block = false;
  Datagram out;
  out.bytes.resize(kMaxSideDatagramBytes);
  iovec iov{out.bytes.data(), out.bytes.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 16)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n;
  for (;;) {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0));
    if (n >= 0) break;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (would_block != nullptr) *would_block = true;
      out.bytes.clear();
      return out;
    }
    return absl::UnavailableError(
        absl::StrCat("side socket receive failed: ", std::strerror(errno)));
  }
  // Take every descriptor the peer attached: keep the first, close the rest, so a hostile peer
  // cannot make us leak descriptors.
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
      if (out.fd < 0) {
        out.fd = fd;
      } else {
        close(fd);
      }
    }
  }
  if (n == 0 && (msg.msg_flags & MSG_TRUNC) == 0) {
    if (out.fd >= 0) close(out.fd);
    return absl::UnavailableError("peer closed the side connection");
  }
  out.truncated = (msg.msg_flags & MSG_TRUNC) != 0;
  out.bytes.resize(static_cast<size_t>(n));
  return out;
}

std::string FormatBytes(uint64_t bytes) {
  constexpr uint64_t kKiB = 1024, kMiB = kKiB * 1024, kGiB = kMiB * 1024, kTiB = kGiB * 1024;
  auto fmt = [](uint64_t b, uint64_t unit, const char* name) {
    if (b % unit == 0) return absl::StrFormat("%d %s", b / unit, name);
    return absl::StrFormat("%.2f %s", static_cast<double>(b) / static_cast<double>(unit), name);
  };
  if (bytes >= kTiB) return fmt(bytes, kTiB, "TiB");
  if (bytes >= kGiB) return fmt(bytes, kGiB, "GiB");
  if (bytes >= kMiB) return fmt(bytes, kMiB, "MiB");
  if (bytes >= kKiB) return fmt(bytes, kKiB, "KiB");
  return absl::StrCat(bytes, " B");
}

}  // namespace tsd::wire
