#include "daemon/ops/config.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <sstream>

#include <toml++/toml.h>
#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/ops/version.h"
#include "proto/wire.h"

namespace tsd {
namespace {

constexpr char kDefaultConfigPath[] = "/etc/tsd/tsd.toml";

absl::Status ReadToml(const std::string& path, Config& c) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(
        "config file ", path, ": ", std::string(e.description()), " at ", where.str()));
  }
  const std::vector<std::pair<const char*, std::string*>> strings = {
      {"socket", &c.socket},
      {"socket_group", &c.socket_group},
      {"pool_size", &c.pool_size},
      {"max_job_quota", &c.max_job_quota},
      {"orphan_grace", &c.orphan_grace},
      {"log_level", &c.log_level},
      {"metrics_listen", &c.metrics_listen},
  };
  struct IntSetting {
    const char* name;
    int* field;
    int64_t lo, hi;
  };
  const std::vector<IntSetting> ints = {
      {"optimizer_threads", &c.optimizer_threads, 0, 4096},
      {"optimizer_nice", &c.optimizer_nice, -20, 19},
  };
  for (const auto& [key, node] : table) {
    const auto int_setting = std::find_if(ints.begin(), ints.end(), [&](const IntSetting& s) {
      return std::string(key.str()) == s.name;
    });
    if (int_setting != ints.end()) {
      const auto* i = node.as_integer();
      if (i == nullptr || i->get() < int_setting->lo || i->get() > int_setting->hi) {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", path, ": '", int_setting->name,
                         "' must be an integer in [", int_setting->lo, ", ", int_setting->hi, "]"));
      }
      *int_setting->field = static_cast<int>(i->get());
      continue;
    }
    if (key.str() == "pin_optimizer_threads") {
      const auto* b = node.as_boolean();
      if (b == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("config file ", path, ": 'pin_optimizer_threads' must be true or false"));
      }
      c.pin_optimizer_threads = b->get();
      continue;
    }
    bool known = false;
    for (const auto& [name, field] : strings) {
      if (std::string(key.str()) != name) continue;
      known = true;
      if (const auto* s = node.as_string()) {
        *field = s->get();
      } else if (const auto* i = node.as_integer()) {
        *field = std::to_string(i->get());  // e.g. pool_size = 1073741824, orphan_grace = 5
      } else {
        return absl::InvalidArgumentError(absl::StrCat(
            "config file ", path, ": '", std::string(key.str()), "' must be a string"));
      }
    }
    if (!known) {
      std::vector<std::string> names;
      for (const auto& [name, field] : strings) names.push_back(name);
      for (const auto& s : ints) names.push_back(s.name);
      names.push_back("pin_optimizer_threads");
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": unknown setting '",
                                                     std::string(key.str()), "'; known are ",
                                                     absl::StrJoin(names, ", ")));
    }
  }
  c.metrics_listen_set = c.metrics_listen_set || table.contains("metrics_listen");
  return absl::OkStatus();
}

// "HOST:PORT" or "[IPv6]:PORT", or empty (off). The host is not resolved here; a name that does
// not resolve fails when the daemon starts listening.
absl::Status ValidateListenAddress(const std::string& address) {
  if (address.empty()) return absl::OkStatus();
  const size_t colon = address.rfind(':');
  const std::string hint =
      "write HOST:PORT, e.g. 127.0.0.1:9464 or [::1]:9464, or \"\" to turn it off";
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "' has no host and port; ", hint));
  }
  const std::string host = address.substr(0, colon);
  if (host.find(':') != std::string::npos && (host.front() != '[' || host.back() != ']')) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "': an IPv6 address goes in brackets; ", hint));
  }
  int port = 0;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' has no valid port (0-65535); ", hint));
  }
  return absl::OkStatus();
}

}  // namespace

std::string DefaultDaemonSocketPath() {
  // systemd sets RUNTIME_DIRECTORY for RuntimeDirectory=tsd (a colon-separated list when the
  // unit names several; the first is ours).
  if (const char* dir = std::getenv("RUNTIME_DIRECTORY"); dir != nullptr && dir[0] == '/') {
    const std::string first = std::string(dir).substr(0, std::string(dir).find(':'));
    return absl::StrCat(first, "/tsd.sock");
  }
  return wire::DefaultSocketPath();
}

uint64_t PhysicalMemoryBytes() {
  struct sysinfo info {};
  if (sysinfo(&info) != 0) return 0;
  return static_cast<uint64_t>(info.totalram) * info.mem_unit;
}

absl::StatusOr<uint64_t> ParseSize(const std::string& text, uint64_t percent_of) {
  std::string t(absl::StripAsciiWhitespace(text));
  const std::string original = t;
  if (t.empty())
    return absl::InvalidArgumentError("size is empty; write e.g. 64GiB, 512MiB or 60%");
  if (t.back() == '%') {
    double pct;
    if (!absl::SimpleAtod(t.substr(0, t.size() - 1), &pct) || pct <= 0 || pct > 100) {
      return absl::InvalidArgumentError(
          absl::StrCat("size '", original, "': a share must be in (0, 100]%"));
    }
    return static_cast<uint64_t>(std::floor(static_cast<double>(percent_of) * pct / 100.0));
  }
  size_t split = 0;
  while (split < t.size() &&
         (std::isdigit(static_cast<unsigned char>(t[split])) || t[split] == '.')) {
    ++split;
  }
  double number;
  if (split == 0 || !absl::SimpleAtod(t.substr(0, split), &number)) {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", original, "' does not start with a number; write e.g. 64GiB"));
  }
  std::string unit = absl::AsciiStrToLower(absl::StripAsciiWhitespace(t.substr(split)));
  double mult;
  if (unit.empty() || unit == "b") {
    mult = 1;
  } else if (unit == "k" || unit == "kib") {
    mult = 1024.0;
  } else if (unit == "m" || unit == "mib") {
    mult = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gib") {
    mult = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tib") {
    mult = 1024.0 * 1024 * 1024 * 1024;
  } else if (unit == "kb") {
    mult = 1e3;
  } else if (unit == "mb") {
    mult = 1e6;
  } else if (unit == "gb") {
    mult = 1e9;
  } else if (unit == "tb") {
    mult = 1e12;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("size '", original, "' has unknown unit '", unit,
                     "'; use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB or %"));
  }
  const double bytes = number * mult;
  if (bytes >= 1.8e19)
    return absl::InvalidArgumentError(absl::StrCat("size '", original, "' is too large"));
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<absl::Duration> ParseDurationArg(const std::string& text) {
  std::string t(absl::StripAsciiWhitespace(text));
  double seconds;
  if (absl::SimpleAtod(t, &seconds)) {
    if (seconds < 0)
      return absl::InvalidArgumentError(absl::StrCat("duration '", t, "' is negative"));
    return absl::Seconds(seconds);
  }
  absl::Duration d;
  if (!absl::ParseDuration(t, &d) || d < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("duration '", t, "' is not valid; write e.g. 0, 5s, 500ms or 2m"));
  }
  return d;
}

absl::StatusOr<LoadedConfig> LoadConfig(int argc, char** argv) {
  LoadedConfig out;
  Config flags;
  CLI::App app{
      "tsd: the TrainStream daemon. Owns locked host memory and lends it to training processes\n"
      "that attach over a local socket (gRPC for control, a side socket for file descriptors).",
      "tsd"};
  app.set_version_flag("--version", std::string("tsd ") + kVersion);
  std::string config_path;
  bool print_config = false;
  app.add_option("--config", config_path,
                 "TOML config file (default /etc/tsd/tsd.toml when it exists); flags override it");
  auto* o_socket = app.add_option("--socket", flags.socket,
                                  "control socket path (default /run/tsd/tsd.sock as root, else "
                                  "$XDG_RUNTIME_DIR/tsd/tsd.sock or /tmp/tsd-$UID/tsd.sock)");
  auto* o_group = app.add_option("--socket-group", flags.socket_group,
                                 "group whose members may connect (sockets 0660, directory 0770)");
  auto* o_pool =
      app.add_option("--pool-size", flags.pool_size,
                     "host memory the daemon lends: 64GiB, 512MiB or 60% of RAM (default 50%)");
  auto* o_quota = app.add_option(
      "--max-job-quota", flags.max_job_quota,
      "largest quota one job may hold: a size or a share of the pool (default 100%)");
  auto* o_grace =
      app.add_option("--orphan-grace", flags.orphan_grace,
                     "keep a job's memory this long after its last session died (default 0s)");
  auto* o_log = app.add_option("--log-level", flags.log_level,
                               "trace, debug, info, warn, error, critical or off (default info)");
  // The last --metrics-listen wins, so a wrapper can turn the endpoint off by default and a
  // caller can still name a port after it.
  auto* o_metrics = app.add_option("--metrics-listen", flags.metrics_listen,
                                   "serve Prometheus metrics at http://HOST:PORT/metrics "
                                   "(default 127.0.0.1:9464; \"\" turns it off)")
                        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  auto* o_threads =
      app.add_option("--optimizer-threads", flags.optimizer_threads,
                     "optimizer worker threads (default 0: every CPU the daemon may use)")
          ->check(CLI::Range(0, 4096));
  auto* o_pin = app.add_flag("--pin-optimizer-threads", flags.pin_optimizer_threads,
                             "pin each optimizer worker to one CPU");
  auto* o_nice = app.add_option("--optimizer-nice", flags.optimizer_nice,
                                "nice value of the optimizer workers, -20..19 (default 10); above "
                                "0 they give way to the trainers' own threads")
                     ->check(CLI::Range(-20, 19));
  app.add_flag("--print-config", print_config,
               "print the effective configuration as TOML and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    out.action = Action::kExit;
    out.exit_code = app.exit(e);
    return out;
  }

  Config c;
  if (!config_path.empty()) {
    if (!std::filesystem::exists(config_path)) {
      return absl::NotFoundError(absl::StrCat("config file ", config_path, " does not exist"));
    }
  } else if (std::filesystem::exists(kDefaultConfigPath)) {
    config_path = kDefaultConfigPath;
  }
  if (!config_path.empty()) {
    if (absl::Status s = ReadToml(config_path, c); !s.ok()) return s;
    c.config_path = config_path;
  }
  if (*o_socket) c.socket = flags.socket;
  if (*o_group) c.socket_group = flags.socket_group;
  if (*o_pool) c.pool_size = flags.pool_size;
  if (*o_quota) c.max_job_quota = flags.max_job_quota;
  if (*o_grace) c.orphan_grace = flags.orphan_grace;
  if (*o_log) c.log_level = flags.log_level;
  if (*o_threads) c.optimizer_threads = flags.optimizer_threads;
  if (*o_pin) c.pin_optimizer_threads = flags.pin_optimizer_threads;
  if (*o_nice) c.optimizer_nice = flags.optimizer_nice;
  if (*o_metrics) {
    c.metrics_listen = flags.metrics_listen;
    c.metrics_listen_set = true;
  }
  c.args.assign(argv, argv + argc);

  if (c.socket.empty()) c.socket = DefaultDaemonSocketPath();
  auto pool = ParseSize(c.pool_size, PhysicalMemoryBytes());
  if (!pool.ok())
    return absl::InvalidArgumentError(absl::StrCat("pool_size: ", pool.status().message()));
  if (*pool < wire::kPageBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("pool_size '", c.pool_size, "' is below one page"));
  }
  c.pool_bytes = *pool / wire::kPageBytes * wire::kPageBytes;
  auto quota = ParseSize(c.max_job_quota, c.pool_bytes);
  if (!quota.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("max_job_quota: ", quota.status().message()));
  }
  c.max_job_quota_bytes = std::min(*quota, c.pool_bytes);
  auto grace = ParseDurationArg(c.orphan_grace);
  if (!grace.ok())
    return absl::InvalidArgumentError(absl::StrCat("orphan_grace: ", grace.status().message()));
  c.orphan_grace_duration = *grace;
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  if (std::find(std::begin(kLevels), std::end(kLevels), c.log_level) == std::end(kLevels)) {
    return absl::InvalidArgumentError(
        absl::StrCat("log_level '", c.log_level,
                     "' is not one of trace, debug, info, warn, error, critical, off"));
  }
  if (absl::Status s = ValidateListenAddress(c.metrics_listen); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("metrics_listen: ", s.message()));
  }
  out.config = c;
  out.action = print_config ? Action::kPrintConfig : Action::kRun;
  return out;
}

absl::StatusOr<LoadedConfig> LoadConfig(const std::vector<std::string>& args) {
  std::vector<std::string> copy = args;
  if (copy.empty()) copy.push_back("tsd");
  std::vector<char*> argv;
  for (auto& a : copy) argv.push_back(a.data());
  return LoadConfig(static_cast<int>(argv.size()), argv.data());
}

std::string ConfigToToml(const Config& c) {
  toml::table t{
      {"socket", c.socket},
      {"socket_group", c.socket_group},
      {"pool_size", c.pool_size},
      {"max_job_quota", c.max_job_quota},
      {"orphan_grace", c.orphan_grace},
      {"log_level", c.log_level},
      {"metrics_listen", c.metrics_listen},
      {"optimizer_threads", c.optimizer_threads},
      {"pin_optimizer_threads", c.pin_optimizer_threads},
      {"optimizer_nice", c.optimizer_nice},
  };
  std::ostringstream os;
  os << "# effective tsd configuration"
     << (c.config_path.empty() ? std::string(" (no config file)") : " from " + c.config_path)
     << "\n"
     << "# pool_size resolves to " << c.pool_bytes << " bytes (" << wire::FormatBytes(c.pool_bytes)
     << "), max_job_quota to " << c.max_job_quota_bytes << " bytes\n"
     << t << "\n";
  return os.str();
}

}  // namespace tsd
