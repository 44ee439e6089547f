// DaemonProcess runs a real `tsd` as a child process on a socket in a fresh temporary directory,
// for tests that exercise the daemon end to end. It waits until the daemon answers, can stop it
// with a signal and report how it exited, and counts the daemon's open descriptors. A RawSession
// speaks the protocol by hand (gRPC stub plus side socket), so tests can send what a well-behaved
// client never would.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "proto/tsd.grpc.pb.h"
#include "tsd/client.h"

namespace tsd::testing {

struct DaemonOptions {
  std::vector<std::string> args = {"--pool-size", "256MiB"};
  // Starts the daemon without CAP_IPC_LOCK and with this RLIMIT_MEMLOCK (0: leave both alone).
  uint64_t memlock_limit = 0;
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
  // A connected client; fails the test when it cannot connect.
  std::unique_ptr<tsd::Client> Connect() const;

 private:
  DaemonProcess() = default;
  pid_t pid_ = -1;
  std::string dir_;
  std::string socket_;
};

// Runs a shell command; returns its stdout and sets *rc to its exit code.
std::string RunCommand(const std::string& cmd, int* rc = nullptr);

// Polls `pred` every 10 ms for up to `seconds`; true once it holds.
bool WaitFor(const std::function<bool()>& pred, double seconds);

// A session driven by hand.
class RawSession {
 public:
  explicit RawSession(const std::string& socket);
  ~RawSession();
  v1::Tsd::Stub& stub() { return *stub_; }
  // Attach over gRPC only (no hello yet).
  grpc::Status Attach(const std::string& job, uint64_t quota, v1::AttachResponse* out);
  // Opens a side connection (closing any earlier one) and returns its descriptor.
  int ConnectSide();
  // Sends a hello for `ref` on the side connection; returns the reply.
  v1::SideReply Hello(const v1::SessionRef& ref);
  // Sends raw bytes on the side connection and reads one reply; `closed` is set when the daemon
  // closed the connection instead of (or after) replying.
  v1::SideReply SendRaw(const std::string& bytes, bool* closed, int* fd_out = nullptr);
  // Attach and hello in one go (asserts success).
  v1::SessionRef Open(const std::string& job, uint64_t quota = 0);
  int side_fd() const { return side_fd_; }

 private:
  std::string socket_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Tsd::Stub> stub_;
  int side_fd_ = -1;
};

}  // namespace tsd::testing
