#include "daemon/rpc/control_plane.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "proto/tsd.grpc.pb.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

constexpr auto kProbeInterval = std::chrono::seconds(1);
constexpr auto kProbeDeadline = std::chrono::seconds(2);
constexpr int kFailuresBeforeRestart = 3;
constexpr auto kMaxBackoff = std::chrono::seconds(8);

}  // namespace

absl::Status ControlPlane::BuildLocked() {
  service_ = std::make_unique<TsdService>(registry_, locked_, stores_);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
  builder.RegisterService(service_.get());
  server_ = builder.BuildAndStart();
  if (server_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", socket_path_,
        " (is the path writable and short enough? errno says: ", std::strerror(errno), ")"));
  }
  if (chmod(socket_path_.c_str(), 0660) != 0 ||
      (gid_ != static_cast<gid_t>(-1) && chown(socket_path_.c_str(), -1, gid_) != 0)) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot set mode/group of ", socket_path_, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::Status ControlPlane::Start() {
  {
    MutexLock lock(mu_);
    if (absl::Status s = BuildLocked(); !s.ok()) return s;
  }
  watchdog_ = std::thread([this] { Watch(); });
  return absl::OkStatus();
}

bool ControlPlane::Probe() const {
  // A fresh connection each time (a local subchannel pool): the question is whether the server
  // still accepts, not whether an old connection still works.
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel =
      grpc::CreateCustomChannel("unix:" + socket_path_, grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Tsd::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kProbeDeadline);
  v1::StatusRequest req;
  v1::StatusResponse resp;
  return stub->Status(&ctx, req, &resp).ok();
}

void ControlPlane::Watch() {
  int failures = 0;
  auto backoff = std::chrono::milliseconds(250);
  for (;;) {
    {
      MutexLock lock(mu_);
      if (stopping_) return;
      wake_.WaitFor(mu_, failures == 0 ? std::chrono::milliseconds(kProbeInterval) : backoff);
      if (stopping_) return;
    }
    if (Probe()) {
      if (failures > 0) spdlog::info("event=control_plane_ok after_failures={}", failures);
      failures = 0;
      backoff = std::chrono::milliseconds(250);
      continue;
    }
    ++failures;
    spdlog::warn("event=control_plane_probe_failed failures={} socket={}", failures, socket_path_);
    if (failures < kFailuresBeforeRestart) continue;
    // gRPC's listener has stopped (it does so for good after EMFILE/ENFILE): rebuild the server.
    // Shutdown and Wait run under mu_ so Shutdown() below cannot race a rebuild.
    MutexLock lock(mu_);
    if (stopping_) return;
    if (server_ != nullptr) {
      server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
      server_->Wait();
      server_.reset();
    }
    unlink(socket_path_.c_str());
    if (absl::Status s = BuildLocked(); s.ok()) {
      ++restarts_;
      spdlog::warn("event=control_plane_restarted restarts={} socket={}", restarts_, socket_path_);
      failures = 0;
      backoff = std::chrono::milliseconds(250);
    } else {
      server_.reset();
      spdlog::error("event=control_plane_restart_failed error=\"{}\" retry_in_ms={}",
                    std::string(s.message()), backoff.count());
      backoff = std::min<std::chrono::milliseconds>(backoff * 2, kMaxBackoff);
    }
  }
}

void ControlPlane::Shutdown() {
  {
    MutexLock lock(mu_);
    stopping_ = true;
    wake_.NotifyAll();
  }
  if (watchdog_.joinable()) watchdog_.join();
  MutexLock lock(mu_);
  if (server_ != nullptr) {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
    server_->Wait();
    server_.reset();
    unlink(socket_path_.c_str());
  }
}

int ControlPlane::restarts() const {
  MutexLock lock(mu_);
  return restarts_;
}

}  // namespace tsd
