#include "daemon/ops/notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace tsd {

SystemdNotifier SystemdNotifier::FromEnvironment() {
  const char* env = std::getenv("NOTIFY_SOCKET");
  return SystemdNotifier(env == nullptr ? "" : env);
}

absl::Status SystemdNotifier::Notify(const std::string& state) const {
  if (address_.empty()) return absl::OkStatus();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((address_[0] != '/' && address_[0] != '@') || address_.size() > sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NOTIFY_SOCKET '", address_,
                     "' is neither an absolute path nor an abstract '@name' that fits"));
  }
  std::memcpy(addr.sun_path, address_.data(), address_.size());
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address_.size());
  if (address_[0] == '@') {
    addr.sun_path[0] = '\0';  // abstract namespace: no terminating NUL counts
  } else {
    len += 1;
  }
  const int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket(AF_UNIX): ", std::strerror(errno)));
  ssize_t sent;
  do {
    sent = sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
                  len);
  } while (sent < 0 && errno == EINTR);
  const int err = errno;
  close(fd);
  if (sent < 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot notify systemd at ", address_, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

absl::Status SystemdNotifier::Ready(const std::string& status) const {
  return Notify(absl::StrCat("READY=1\nSTATUS=", status, "\nMAINPID=", getpid()));
}

absl::Status SystemdNotifier::Reloading() const {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  const uint64_t usec = static_cast<uint64_t>(now.tv_sec) * 1000000 + now.tv_nsec / 1000;
  return Notify(absl::StrCat("RELOADING=1\nMONOTONIC_USEC=", usec, "\nSTATUS=reloading"));
}

absl::Status SystemdNotifier::Stopping() const {
  return Notify("STOPPING=1\nSTATUS=stopping: releasing every region");
}

absl::Status SystemdNotifier::Status(const std::string& status) const {
  return Notify(absl::StrCat("STATUS=", status));
}

}  // namespace tsd
