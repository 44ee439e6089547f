// SystemdNotifier speaks systemd's readiness protocol (sd_notify(3)) by hand: a unit with
// Type=notify starts the daemon with NOTIFY_SOCKET naming an AF_UNIX datagram socket, and the
// daemon sends newline-separated assignments to it: READY=1 once it accepts calls, RELOADING=1
// and READY=1 around a reload, STOPPING=1 when it begins to shut down, STATUS=... for
// `systemctl status`. Without NOTIFY_SOCKET (not run by systemd) every call does nothing.
//
// Written by hand rather than with libsystemd: the protocol is one sendto(), and the daemon
// then runs unchanged where libsystemd is absent (containers, tests).
#pragma once

#include <string>

#include "absl/status/status.h"

namespace tsd {

class SystemdNotifier final {
 public:
  // Reads NOTIFY_SOCKET: an absolute path, or an abstract name written with a leading '@'.
  static SystemdNotifier FromEnvironment();
  // Notifies the socket at `address` (same syntax); empty disables.
  explicit SystemdNotifier(std::string address) : address_(std::move(address)) {}

  bool enabled() const { return !address_.empty(); }
  // Sends `state` ("READY=1\nSTATUS=serving") as one datagram. OK when disabled; an error when
  // the socket is unusable (the caller logs it: systemd then times the service out).
  absl::Status Notify(const std::string& state) const;

  // The messages the daemon sends, in one place.
  absl::Status Ready(const std::string& status) const;
  absl::Status Reloading() const;  // carries MONOTONIC_USEC, as systemd 253+ asks
  absl::Status Stopping() const;
  absl::Status Status(const std::string& status) const;

 private:
  std::string address_;
};

}  // namespace tsd
