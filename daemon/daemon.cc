#include "daemon/daemon.h"

#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "daemon/instance_lock.h"
#include "daemon/memlock.h"
#include "daemon/registry.h"
#include "daemon/service.h"
#include "daemon/side_server.h"
#include "daemon/version.h"
#include "proto/wire.h"
#include "spdlog/spdlog.h"

namespace tsd {
namespace {

absl::StatusOr<gid_t> LookupGroup(const std::string& name) {
  if (name.empty()) return static_cast<gid_t>(-1);
  std::vector<char> buf(16384);
  group g{};
  group* out = nullptr;
  if (getgrnam_r(name.c_str(), &g, buf.data(), buf.size(), &out) != 0 || out == nullptr) {
    return absl::NotFoundError(absl::StrCat("socket_group '", name, "' does not exist on this host"));
  }
  return out->gr_gid;
}

// Creates the socket's directory when missing, mode 0770 with the socket group. A directory
// that already exists is left as it is (it may be /tmp or a systemd RuntimeDirectory).
absl::Status PrepareSocketDir(const std::string& socket_path, gid_t gid) {
  const std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty() || std::filesystem::exists(dir)) return absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create socket directory ", dir.string(), ": ",
                                                    ec.message(), "; pick another --socket or run as root"));
  }
  if (chmod(dir.c_str(), 0770) != 0 || (gid != static_cast<gid_t>(-1) && chown(dir.c_str(), -1, gid) != 0)) {
    return absl::PermissionDeniedError(absl::StrCat("cannot set mode/group of ", dir.string(), ": ",
                                                    std::strerror(errno)));
  }
  return absl::OkStatus();
}

int Fail(const absl::Status& s) {
  spdlog::critical("event=start_failed error=\"{}\"", std::string(s.message()));
  return 1;
}

}  // namespace

int RunDaemon(const Config& config) {
  // Signals are taken by sigwait in this thread only: block them before any thread starts.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  const std::string& socket_path = config.socket;
  auto gid = LookupGroup(config.socket_group);
  if (!gid.ok()) return Fail(gid.status());
  if (absl::Status s = PrepareSocketDir(socket_path, *gid); !s.ok()) return Fail(s);
  auto lock = InstanceLock::Acquire(socket_path);
  if (!lock.ok()) return Fail(lock.status());
  if (std::filesystem::exists(socket_path)) {
    spdlog::info("event=stale_socket_replaced path={}", socket_path);
    unlink(socket_path.c_str());
  }

  const MemlockProbe memlock = ProbeMemlock(config.pool_bytes);
  if (!memlock.can_lock) spdlog::warn("event=pool_not_locked reason=\"{}\"", memlock.reason);

  RegistryOptions options;
  options.pool_bytes = config.pool_bytes;
  options.max_job_quota_bytes = config.max_job_quota_bytes;
  options.lock_memory = memlock.can_lock;
  options.orphan_grace = config.orphan_grace_duration;
  Registry registry(options);

  const std::string side_path = wire::SideSocketPath(socket_path);
  SideServer side(registry);
  if (absl::Status s = side.Listen(side_path, *gid); !s.ok()) return Fail(s);

  TsdService service(registry, side_path, memlock.can_lock);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + socket_path, grpc::InsecureServerCredentials());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    return Fail(absl::UnavailableError(absl::StrCat("cannot listen on ", socket_path,
                                                    " (is the path writable and short enough?)")));
  }
  if (chmod(socket_path.c_str(), 0660) != 0 ||
      (*gid != static_cast<gid_t>(-1) && chown(socket_path.c_str(), -1, *gid) != 0)) {
    return Fail(absl::PermissionDeniedError(absl::StrCat("cannot set mode/group of ", socket_path, ": ",
                                                         std::strerror(errno))));
  }
  side.Start();
  spdlog::info("event=ready version={} socket={} side_socket={} pool_bytes={} max_job_quota_bytes={} "
               "locked={} orphan_grace={} pid={}",
               kVersion, socket_path, side_path, config.pool_bytes, config.max_job_quota_bytes,
               memlock.can_lock, absl::FormatDuration(config.orphan_grace_duration), getpid());

  for (;;) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      spdlog::warn("event=sighup_ignored reason=\"live reload is not supported yet; restart tsd\"");
      continue;
    }
    spdlog::info("event=stopping signal={}", strsignal(sig));
    break;
  }
  // Stop taking calls (in-flight ones get at most 500 ms), tell clients, release everything.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  side.Shutdown(absl::StrCat("tsd (pid ", getpid(), ") is shutting down: every region was released; "
                             "restart tsd and attach again"));
  registry.ReleaseAll();
  server->Wait();
  unlink(socket_path.c_str());
  spdlog::info("event=stopped");
  return 0;
}

}  // namespace tsd
