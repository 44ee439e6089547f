// ControlPlane runs tsd's gRPC server (TsdService on the control socket) and keeps it accepting.
// gRPC's listener stops for good when accept() fails with anything but EAGAIN: once the daemon
// ran out of descriptors (EMFILE/ENFILE), `tsctl` found no tsd answering even after the
// descriptors were back. A watchdog thread therefore calls Status over a fresh connection every
// second; after a few failures in a row it rebuilds the server on the same socket, backing off
// and retrying while it cannot (for as long as descriptors are short), and logs each step.
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "daemon/jobs/registry.h"
#include "daemon/rpc/service.h"
#include "proto/mutex.h"

namespace tsd {

class ControlPlane final {
 public:
  // `stores` may be null (the service then lists none).
  ControlPlane(Registry& registry, bool locked, std::string socket_path, gid_t gid,
               stores::StoreManager* stores = nullptr)
      : registry_(registry),
        locked_(locked),
        socket_path_(std::move(socket_path)),
        gid_(gid),
        stores_(stores) {}
  ~ControlPlane() { Shutdown(); }
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  // Listens on the socket (mode 0660, the socket group) and starts the watchdog.
  absl::Status Start();
  // Stops the watchdog and the server (calls in flight get at most 500 ms) and removes the socket.
  void Shutdown();
  // How many times the watchdog rebuilt the server (tests and logs).
  int restarts() const;

 private:
  absl::Status BuildLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Probe() const;
  void Watch();

  Registry& registry_;
  const bool locked_;
  const std::string socket_path_;
  const gid_t gid_;
  stores::StoreManager* const stores_;
  mutable Mutex mu_;
  CondVar wake_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int restarts_ ABSL_GUARDED_BY(mu_) = 0;
  std::unique_ptr<TsdService> service_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<grpc::Server> server_ ABSL_GUARDED_BY(mu_);
  std::thread watchdog_;
};

}  // namespace tsd
