#include "daemon/daemon.h"

#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/jobs/registry.h"
#include "daemon/memory/cpu_affinity.h"
#include "daemon/memory/memlock.h"
#include "daemon/memory/numa_topology.h"
#include "daemon/ops/instance_lock.h"
#include "daemon/ops/metrics.h"
#include "daemon/ops/notify.h"
#include "daemon/ops/reload.h"
#include "daemon/ops/resource_budget.h"
#include "daemon/ops/version.h"
#include "daemon/optimizer/worker_pool.h"
#include "daemon/rpc/control_plane.h"
#include "daemon/rpc/side_server.h"
#include "daemon/stores/store_manager.h"
#include "proto/socket_dir.h"
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
    return absl::NotFoundError(
        absl::StrCat("socket_group '", name, "' does not exist on this host"));
  }
  return out->gr_gid;
}

// Creates the socket's directory when missing, mode 0750 with the socket group: its members may
// enter it and connect (the sockets are 0660) but not delete, replace or plant anything there. A
// directory that already exists (a systemd RuntimeDirectory, or one made by hand) must be one only
// tsd's uid controls (wire::CheckDaemonSocketDir): another user could otherwise replace the
// sockets.
absl::Status PrepareSocketDir(const std::string& socket_path, gid_t gid) {
  std::filesystem::path dir = std::filesystem::path(socket_path).parent_path();
  if (dir.empty()) dir = ".";
  const gid_t trusted_gid = gid != static_cast<gid_t>(-1) ? gid : getegid();
  std::error_code exists_ec;
  if (std::filesystem::exists(std::filesystem::symlink_status(dir, exists_ec))) {
    return wire::CheckDaemonSocketDir(dir.string(), geteuid(), trusted_gid);
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create socket directory ", dir.string(),
                                                    ": ", ec.message(),
                                                    "; pick another --socket or run as root"));
  }
  if (chmod(dir.c_str(), 0750) != 0 ||
      (gid != static_cast<gid_t>(-1) && chown(dir.c_str(), -1, gid) != 0)) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot set mode/group of ", dir.string(), ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

int Fail(const absl::Status& s, const SystemdNotifier& notifier) {
  spdlog::critical("event=start_failed error=\"{}\"", std::string(s.message()));
  (void)notifier.Status(absl::StrCat("failed to start: ", s.message()));
  return 1;
}

void LogNotifyError(const absl::Status& s) {
  if (!s.ok()) spdlog::warn("event=notify_failed error=\"{}\"", std::string(s.message()));
}

// SIGHUP: reload the configuration, all or nothing, and tell systemd how it went.
void Reload(Reloader& reloader, const SystemdNotifier& notifier) {
  LogNotifyError(notifier.Reloading());
  spdlog::info("event=reload_requested config={}",
               reloader.current().config_path.empty() ? "(none)" : reloader.current().config_path);
  auto changes = reloader.Reload();
  if (changes.ok()) {
    spdlog::info("event=reloaded changes=\"{}\"", *changes);
    LogNotifyError(notifier.Ready(absl::StrCat("serving; reloaded: ", *changes)));
  } else {
    spdlog::error("event=reload_refused error=\"{}\"", std::string(changes.status().message()));
    LogNotifyError(
        notifier.Ready(absl::StrCat("serving; reload refused: ", changes.status().message())));
  }
}

// The host's NUMA nodes, each with the CPUs this daemon may run on, when placement is on and the
// host has two nodes or more with such CPUs; else nothing (logged either way).
std::optional<NumaTopology> LoadPlacementTopology(const Config& config) {
  if (!config.numa_placement) {
    spdlog::info("event=numa placement=off reason=\"numa_placement is false\"");
    return std::nullopt;
  }
  auto topology = NumaTopology::Load(config.sysfs_root);
  if (!topology.ok()) {
    spdlog::warn("event=numa placement=off reason=\"{}\"",
                 std::string(topology.status().message()));
    return std::nullopt;
  }
  // A CPU the kernel does not list as ours (none, if it does not say) leaves its node.
  const std::vector<int> allowed = AllowedCpus();
  std::vector<NumaNode> nodes;
  int with_cpus = 0;
  for (NumaNode node : topology->nodes()) {
    std::erase_if(node.cpus,
                  [&](int c) { return !std::binary_search(allowed.begin(), allowed.end(), c); });
    with_cpus += node.cpus.empty() ? 0 : 1;
    nodes.push_back(std::move(node));
  }
  const NumaTopology usable = NumaTopology::FromNodes(config.sysfs_root, std::move(nodes));
  if (with_cpus < 2) {
    spdlog::info(
        "event=numa placement=off nodes={} reason=\"fewer than two nodes with CPUs this "
        "daemon may use\"",
        usable.Describe());
    return std::nullopt;
  }
  spdlog::info("event=numa placement=on nodes=\"{}\" sysfs_root={}", usable.Describe(),
               config.sysfs_root);
  return usable;
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

  const SystemdNotifier notifier = SystemdNotifier::FromEnvironment();
  auto Fail = [&notifier](const absl::Status& s) { return ::tsd::Fail(s, notifier); };
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

  // Made before the Registry, whose optimizers record into it; it serves only once everything
  // else is up (below), and stops before the Registry goes.
  Metrics metrics(config.metrics_per_job);
  RegistryOptions options;
  options.pool_bytes = config.pool_bytes;
  options.max_job_quota_bytes = config.max_job_quota_bytes;
  options.lock_memory = memlock.can_lock;
  options.orphan_grace = config.orphan_grace_duration;
  options.max_keep_for = config.max_keep_for_duration;
  // Descriptors and mappings: raise the soft descriptor limit, then budget regions below half of
  // each limit so the control plane keeps a reserve.
  const ResourceBudget budget =
      MeasureResourceBudget(static_cast<uint64_t>(config.max_regions_per_uid),
                            static_cast<uint64_t>(config.max_regions_per_job));
  spdlog::info("event=region_budget {}", budget.Describe());
  if (!budget.raise_error.empty()) {
    spdlog::warn("event=nofile_not_raised error=\"{}\" nofile_limit={}", budget.raise_error,
                 budget.nofile_limit);
  }
  options.max_regions = budget.max_regions;
  options.max_regions_per_uid = budget.max_regions_per_uid;
  options.max_regions_per_job = budget.max_regions_per_job;
  int threads = config.optimizer_threads;
  if (threads == 0) threads = AllowedCpuCount();
  // NUMA: with several nodes the workers are split by node (each node's CPUs the daemon may use)
  // and jobs are placed on their GPU's node; with one node, or none known, nothing changes.
  const std::optional<NumaTopology> numa = LoadPlacementTopology(config);
  WorkerPool pool(threads, config.pin_optimizer_threads, config.optimizer_nice,
                  numa ? numa->nodes() : std::vector<NumaNode>{});
  options.numa = numa ? &*numa : nullptr;
  options.pool = &pool;
  options.isa = kernels::BestIsa();
  spdlog::info("event=optimizer_engine threads={} pinned={} nice={} isa={}", pool.threads(),
               config.pin_optimizer_threads, config.optimizer_nice, kernels::IsaName(options.isa));
  if (pool.nice_errno() != 0) {
    spdlog::warn(
        "event=optimizer_nice_failed nice={} error=\"{}\" the workers run at the daemon's own "
        "priority; a negative nice needs CAP_SYS_NICE (systemd: AmbientCapabilities=CAP_SYS_NICE)",
        config.optimizer_nice, std::strerror(pool.nice_errno()));
  }
  options.metrics = &metrics;
  // The node's one book of bytes: jobs' regions, optimizer state and stores are charged to it.
  Ledger ledger(config.pool_bytes, config.store_budget_bytes);
  options.ledger = &ledger;
  // The weight stores outlive the Registry, which tells them of every job it releases.
  stores::StoreManager stores(ledger, {.keep = config.store_keep_duration,
                                       .lock_memory = memlock.can_lock,
                                       .isa = kernels::BestIsa(),
                                       .gpu_stores = config.gpu_stores});
  if (config.gpu_stores) {
    spdlog::info(
        "event=gpu_stores_on the CUDA driver is loaded when a job first asks for a "
        "device copy");
  }
  options.on_job_released = [&stores](const JobRef& job) {
    stores.UserReleased({job.name, job.instance});
  };
  options.make_room = [&stores](uint64_t bytes) { return stores.MakeRoom(bytes); };
  Registry registry(options);
  metrics.WatchRegistry(registry);
  metrics.WatchGauges([&stores] {
    const stores::StoreTotals t = stores.Totals();
    return std::vector<Metrics::NamedGauge>{
        {"tsd_stores", "Weight stores held (complete ones)", static_cast<double>(t.stores)},
        {"tsd_store_bytes", "Bytes the weight stores hold", static_cast<double>(t.bytes)},
        {"tsd_store_users", "Jobs using a weight store, summed over stores",
         static_cast<double>(t.users)},
        {"tsd_store_budget_bytes", "The weight stores' budget in bytes",
         static_cast<double>(t.budget_bytes)},
        {"tsd_store_device_bytes", "Device memory of the stores' copies on GPUs (gpu_stores)",
         static_cast<double>(t.device_bytes)},
        {"tsd_store_evictions", "Unused weight stores evicted for room since the daemon started",
         static_cast<double>(t.evictions)}};
  });
  Reloader reloader(config, registry, memlock.can_lock);

  const std::string side_path = wire::SideSocketPath(socket_path);
  SideServer side(registry, 4, &stores);
  if (absl::Status s = side.Listen(side_path, *gid); !s.ok()) return Fail(s);

  ControlPlane control(registry, memlock.can_lock, socket_path, *gid, &stores);
  if (absl::Status s = control.Start(); !s.ok()) return Fail(s);
  side.Start();
  std::string metrics_at = "off";
  if (!config.metrics_listen.empty()) {
    if (absl::Status s = metrics.Listen(config.metrics_listen); s.ok()) {
      metrics_at = absl::StrCat(config.metrics_listen, " (port ", metrics.port(), ")");
    } else if (config.metrics_listen_set) {
      return Fail(s);  // asked for by name: a misconfiguration to fix
    } else {
      // The default address, taken (e.g. by another tsd on this host): serve without metrics.
      spdlog::warn("event=metrics_off error=\"{}\"", std::string(s.message()));
      metrics_at = "off (the default address is taken)";
    }
  }
  spdlog::info(
      "event=ready version={} socket={} side_socket={} pool_bytes={} max_job_quota_bytes={} "
      "locked={} orphan_grace={} metrics={} pid={}",
      kVersion, socket_path, side_path, config.pool_bytes, config.max_job_quota_bytes,
      memlock.can_lock, absl::FormatDuration(config.orphan_grace_duration), metrics_at, getpid());
  // Both sockets listen and the gRPC server runs: calls are accepted from now on.
  LogNotifyError(notifier.Ready(
      absl::StrCat("serving ", wire::FormatBytes(config.pool_bytes), " on ", socket_path)));

  for (;;) {
    int sig = 0;
    if (sigwait(&signals, &sig) != 0) continue;
    if (sig == SIGHUP) {
      Reload(reloader, notifier);
      continue;
    }
    spdlog::info("event=stopping signal={}", strsignal(sig));
    LogNotifyError(notifier.Stopping());
    break;
  }
  // The metrics server takes up to 2 s to stop: let it do so beside the rest.
  std::thread stop_metrics([&metrics] { metrics.StopServing(); });
  // Stop taking calls (in-flight ones get at most 500 ms), tell clients, release everything.
  control.Shutdown();
  side.Shutdown(absl::StrCat("tsd (pid ", getpid(),
                             ") is shutting down: every region was released; "
                             "restart tsd and attach again"));
  registry.ReleaseAll();
  stop_metrics.join();
  spdlog::info("event=stopped");
  return 0;
}

}  // namespace tsd
