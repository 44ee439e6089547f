// The daemon's configuration: one struct, loaded from TOML (/etc/tsd/tsd.toml or --config) and
// overridden by command-line flags. `LoadConfig` is the only place that knows both sources, so
// `--print-config` shows exactly what the daemon runs with.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace tsd {

// The settings' defaults, types, ranges, flags and reload rules are declared once, in
// daemon/ops/settings.cc; a Config starts with every setting at its default.
struct Config {
  Config();

  std::string socket;          // control socket path; empty = the default for this uid
  std::string socket_group;    // group given access to the sockets (mode 0660/0770); empty = ours
  std::string pool_size;       // as given: "64GiB", "512MiB", "60%" (of RAM), or bytes
  std::string max_job_quota;   // as given; a share is of the pool
  std::string orphan_grace;    // how long a job without live sessions keeps its memory
  std::string max_keep_for;    // the longest keep_for a job may ask (daemon/jobs/keep.cc)
  std::string log_level;       // trace, debug, info, warn, error, critical, off
  std::string metrics_listen;  // Prometheus endpoint "host:port"; empty = off
  bool metrics_listen_set = false;     // named by a flag or the file: failing to listen is fatal
  int optimizer_threads = 0;           // optimizer worker threads; 0 = every CPU the daemon may use
  bool pin_optimizer_threads = false;  // pin worker i to the i-th allowed CPU
  // Nice value of the optimizer workers (-20..19). Above 0 they yield the CPU to a trainer's
  // latency-sensitive threads (the one launching CUDA kernels) on the same machine.
  int optimizer_nice = 0;
  // NUMA placement (daemon/memory/numa_topology.h): on with several nodes; read under sysfs_root.
  bool numa_placement = true;
  std::string sysfs_root;
  // Region budgets (daemon/ops/resource_budget.h); 0 = derived from RLIMIT_NOFILE and
  // vm.max_map_count at start.
  int max_regions_per_job = 0;
  bool metrics_per_job = false;  // per-job series at /metrics (else aggregates only)
  int max_regions_per_uid = 0;
  std::string store_budget;  // as given: a size, or a share of the pool
  std::string store_keep;    // how long an unused weight store is kept
  bool gpu_stores = false;   // keep device copies of stores on the GPUs jobs ask for
  std::string config_path;   // the file that was read, or empty
  // The command line LoadConfig parsed (argv[0] first): a reload (SIGHUP) parses it again, so
  // flags keep winning over the file that is re-read.
  std::vector<std::string> args;

  // Resolved values, filled by LoadConfig.
  uint64_t pool_bytes = 0;
  uint64_t max_job_quota_bytes = 0;
  absl::Duration orphan_grace_duration = absl::ZeroDuration();
  absl::Duration max_keep_for_duration = absl::Hours(1);
  uint64_t store_budget_bytes = 0;
  absl::Duration store_keep_duration = absl::ZeroDuration();
};

// What the command line asked for besides the configuration.
enum class Action { kRun, kPrintConfig, kExit };

struct LoadedConfig {
  Config config;
  Action action = Action::kRun;
  int exit_code = 0;  // for Action::kExit (e.g. --help, --version, a bad flag)
};

// Parses argv (CLI11), reads the TOML file, applies flags over it and resolves sizes. A bad flag
// or file gives an error that names it; --help and --version give Action::kExit.
absl::StatusOr<LoadedConfig> LoadConfig(int argc, char** argv);
// The same, from a saved command line (Config::args): what a reload runs.
absl::StatusOr<LoadedConfig> LoadConfig(const std::vector<std::string>& args);

// The socket a daemon uses when none is configured: $RUNTIME_DIRECTORY/tsd.sock when systemd
// gave the service a RuntimeDirectory=, else wire::DefaultSocketPath() (/run/tsd/tsd.sock as
// root, else under $XDG_RUNTIME_DIR or /tmp).
std::string DefaultDaemonSocketPath();

// Renders the effective configuration as TOML (what --print-config prints).
std::string ConfigToToml(const Config& config);

// "64GiB", "512MiB", "1.5GB", "4096", "60%" (of `percent_of`). Units: B, KiB, MiB, GiB, TiB
// (binary) and KB, MB, GB, TB (decimal), case-insensitive; K/M/G/T alone are binary.
absl::StatusOr<uint64_t> ParseSize(const std::string& text, uint64_t percent_of);
// "0", "0s", "500ms", "2s", "1m": a plain number is seconds.
absl::StatusOr<absl::Duration> ParseDurationArg(const std::string& text);
// Total physical memory of this machine in bytes.
uint64_t PhysicalMemoryBytes();

}  // namespace tsd
