// DaemonProcess runs a real `tsd` as a child process on a socket in a fresh temporary directory,
// for tests that exercise the daemon end to end. It waits until the daemon answers, can stop it
// with a signal and report how it exited, and counts the daemon's open descriptors. A RawSession
// speaks the side-socket protocol by hand, so tests can send what a well-behaved client never
// would.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "proto/tsd.pb.h"
#include "proto/wire.h"
#include "tsd/client.h"

namespace tsd::testing {

struct DaemonOptions {
  std::vector<std::string> args = {"--pool-size", "256MiB"};
  // Starts the daemon without CAP_IPC_LOCK and with this RLIMIT_MEMLOCK (0: leave both alone).
  uint64_t memlock_limit = 0;
  // Starts the daemon with this RLIMIT_NOFILE, soft and hard (0: inherit).
  uint64_t nofile_limit = 0;
};

class DaemonProcess {
 public:
  // Starts tsd and waits (up to 10 s) until it answers; fails the test otherwise.
  static std::unique_ptr<DaemonProcess> Start(DaemonOptions options = {});
  ~DaemonProcess();

  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  std::string side_socket() const;
  // The daemon's stderr so far.
  std::string log() const;
  // Sends `sig` and waits for exit; returns the exit code (or 128+signal); `seconds` gets the time
  // from the signal to the exit.
  int Stop(int sig, double* seconds = nullptr);
  bool running() const { return pid_ > 0; }
  // Entries of /proc/<pid>/fd.
  int OpenFds() const;
  // The daemon's peak resident memory so far (VmHWM of /proc/<pid>/status), in KiB; 0 if unread.
  uint64_t PeakRssKib() const;
  // A connected client; fails the test when it cannot connect.
  std::unique_ptr<tsd::Client> Connect() const;

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  std::string dir_;
  std::string socket_;
};

// Expects the daemon's peak RSS (PeakRssKib) to have grown by less than `bound_kib` since
// `before_kib`, printing the growth under `what`. A sanitized build (TSD_SANITIZED) checks nothing:
// the sanitizers' quarantine and shadow memory grow with the heap; the plain build checks.
void ExpectPeakRssGrowthBelow(const DaemonProcess& d, uint64_t before_kib, uint64_t bound_kib,
                              const std::string& what);

// Runs a shell command; returns its stdout and sets *rc to its exit code.
std::string RunCommand(const std::string& cmd, int* rc = nullptr);

// Polls `pred` every 10 ms for up to `seconds`; true once it holds.
bool WaitFor(const std::function<bool()>& pred, double seconds);

// A side connection driven by hand.
class RawSession {
 public:
  explicit RawSession(const std::string& socket);
  ~RawSession();
  // Opens a side connection (closing any earlier one) and returns its descriptor.
  int ConnectSide();
  // Sends `req` (numbered with the next request id when it has none; `send_fd` travels with it)
  // and reads one whole message back; `closed` is set when the daemon closed the connection
  // instead of (or right after) replying. `fd_out` gets a descriptor that came with the reply.
  v1::SideReply Request(v1::SideRequest req, bool* closed = nullptr, int* fd_out = nullptr,
                        int send_fd = -1);
  // Sends raw bytes as one datagram and reads one reply, like Request.
  v1::SideReply SendRaw(const std::string& bytes, bool* closed, int* fd_out = nullptr);
  // Reads the next whole message (waiting up to `timeout_ms`); false when none came.
  bool Read(v1::SideReply* out, int timeout_ms, int* fd_out = nullptr);
  // A new side connection and an attach on it; returns the reply.
  v1::SideReply Attach(const std::string& job, uint64_t quota = 0,
                       uint32_t protocol = wire::kProtocolVersion);
  // Attach, asserting success; returns the session id.
  uint64_t Open(const std::string& job, uint64_t quota = 0);
  int side_fd() const { return side_fd_; }
  uint64_t last_request_id() const { return next_id_ - 1; }

 private:
  std::string socket_;
  int side_fd_ = -1;
  uint64_t next_id_ = 1;
};

}  // namespace tsd::testing
