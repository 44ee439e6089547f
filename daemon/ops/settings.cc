#include "daemon/ops/settings.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace tsd {

const std::vector<Setting>& Settings() {
  using T = SettingType;
  using R = ReloadPolicy;
  static const auto* settings = new std::vector<Setting>{
      {.key = "socket",
       .flag = "--socket",
       .help = "control socket path; the side socket is the same path with .sock replaced by "
               ".fd.sock",
       .type = T::kText,
       .field = &Config::socket,
       .default_value = "",
       .reload = R::kRestart,
       .default_help = "$RUNTIME_DIRECTORY/tsd.sock under systemd, else /run/tsd/tsd.sock as "
                       "root, else $XDG_RUNTIME_DIR/tsd/tsd.sock or /tmp/tsd-$UID/tsd.sock"},
      {.key = "socket_group",
       .flag = "--socket-group",
       .help = "group whose members may connect (sockets 0660, directory 0750)",
       .type = T::kText,
       .field = &Config::socket_group,
       .default_value = "",
       .reload = R::kRestart,
       .default_help = "the daemon's own group"},
      {.key = "pool_size",
       .flag = "--pool-size",
       .help = "host memory the daemon lends: 64GiB, 512MiB or 60% of RAM",
       .type = T::kSize,
       .field = &Config::pool_size,
       .default_value = "50%",
       .reload = R::kLive},
      {.key = "max_job_quota",
       .flag = "--max-job-quota",
       .help = "largest quota one job may hold: a size or a share of the pool",
       .type = T::kSize,
       .field = &Config::max_job_quota,
       .default_value = "100%",
       .reload = R::kLive},
      {.key = "orphan_grace",
       .flag = "--orphan-grace",
       .help = "keep a job's memory this long after its last session died",
       .type = T::kDuration,
       .field = &Config::orphan_grace,
       .default_value = "0s",
       .reload = R::kLive},
      {.key = "max_keep_for",
       .flag = "--max-keep-for",
       .help = "longest a job may ask to be kept after its last session died (wrap(keep_for=))",
       .type = T::kDuration,
       .field = &Config::max_keep_for,
       .default_value = "1h",
       .reload = R::kRestart},
      {.key = "log_level",
       .flag = "--log-level",
       .help = "trace, debug, info, warn, error, critical or off",
       .type = T::kChoice,
       .field = &Config::log_level,
       .default_value = "info",
       .reload = R::kLive,
       .choices = {"trace", "debug", "info", "warn", "error", "critical", "off"}},
      // The last --metrics-listen wins, so a wrapper can turn the endpoint off by default and a
      // caller can still name a port after it.
      {.key = "metrics_listen",
       .flag = "--metrics-listen",
       .help = "serve Prometheus metrics at http://HOST:PORT/metrics (\"\" turns it off)",
       .type = T::kAddress,
       .field = &Config::metrics_listen,
       .default_value = "127.0.0.1:9464",
       .reload = R::kRestart,
       .last_flag_wins = true},
      {.key = "optimizer_threads",
       .flag = "--optimizer-threads",
       .help = "optimizer worker threads (0: every CPU the daemon may use)",
       .type = T::kInt,
       .field = &Config::optimizer_threads,
       .default_value = "0",
       .reload = R::kRestart,
       .min = 0,
       .max = 4096},
      {.key = "pin_optimizer_threads",
       .flag = "--pin-optimizer-threads",
       .help = "pin each optimizer worker to one CPU",
       .type = T::kBool,
       .field = &Config::pin_optimizer_threads,
       .default_value = "false",
       .reload = R::kRestart},
      {.key = "optimizer_nice",
       .flag = "--optimizer-nice",
       .help = "nice value of the optimizer workers, -20..19; above 0 they give way to the "
               "trainers' own threads",
       .type = T::kInt,
       .field = &Config::optimizer_nice,
       .default_value = "10",
       .reload = R::kRestart,
       .min = -20,
       .max = 19},
      {.key = "numa_placement",
       .flag = "--numa-placement",
       .help = "on a host of several NUMA nodes, run a job's optimizer threads and put its "
               "regions on the node of its GPU",
       .type = T::kBool,
       .field = &Config::numa_placement,
       .default_value = "true",
       .reload = R::kRestart},
      {.key = "sysfs_root",
       .flag = "--sysfs-root",
       .help = "where sysfs is mounted: the NUMA nodes and the GPUs' nodes are read under it",
       .type = T::kText,
       .field = &Config::sysfs_root,
       .default_value = "/sys",
       .reload = R::kRestart},
      {.key = "max_regions_per_job",
       .flag = "--max-regions-per-job",
       .help = "most regions one job may hold (each costs tsd a descriptor and a mapping); 0: "
               "derived from the limits at start",
       .type = T::kInt,
       .field = &Config::max_regions_per_job,
       .default_value = "0",
       .reload = R::kRestart,
       .min = 0,
       .max = 1 << 20},
      {.key = "max_regions_per_uid",
       .flag = "--max-regions-per-uid",
       .help = "most regions the jobs of one uid may hold together; 0: derived from the limits "
               "at start",
       .type = T::kInt,
       .field = &Config::max_regions_per_uid,
       .default_value = "0",
       .reload = R::kRestart,
       .min = 0,
       .max = 1 << 20},
      {.key = "metrics_per_job",
       .flag = "--metrics-per-job",
       .help = "export per-job series (job names, owner uids, usage) at /metrics; off, only "
               "aggregates, since any local user may scrape the endpoint",
       .type = T::kBool,
       .field = &Config::metrics_per_job,
       .default_value = "false",
       .reload = R::kRestart},
      {.key = "store_budget",
       .flag = "--store-budget",
       .help = "host memory weight stores may hold together (part of the pool): a size or a share "
               "of the pool",
       .type = T::kSize,
       .field = &Config::store_budget,
       .default_value = "50%",
       .reload = R::kRestart},
      {.key = "store_keep",
       .flag = "--store-keep",
       .help = "keep a weight store this long after its last job stopped using it",
       .type = T::kDuration,
       .field = &Config::store_keep,
       .default_value = "10m",
       .reload = R::kRestart},
      {.key = "gpu_stores",
       .flag = "--gpu-stores",
       .help = "keep device copies of weight stores on the GPUs jobs ask for and share them as "
               "CUDA descriptors (needs the NVIDIA driver and access to /dev/nvidia*)",
       .type = T::kBool,
       .field = &Config::gpu_stores,
       .default_value = "false",
       .reload = R::kRestart},
  };
  return *settings;
}

const Setting* FindSetting(absl::string_view key) {
  for (const Setting& s : Settings()) {
    if (s.key == key) return &s;
  }
  return nullptr;
}

std::string SettingKeys() {
  return absl::StrJoin(Settings(), ", ",
                       [](std::string* out, const Setting& s) { absl::StrAppend(out, s.key); });
}

std::string Setting::Get(const Config& config) const {
  if (const auto* s = std::get_if<std::string Config::*>(&field)) return config.**s;
  if (const auto* i = std::get_if<int Config::*>(&field)) return std::to_string(config.**i);
  return config.*std::get<bool Config::*>(field) ? "true" : "false";
}

std::string Setting::Expected() const {
  switch (type) {
    case SettingType::kInt:
      return absl::StrCat("an integer in [", min, ", ", max, "]");
    case SettingType::kBool:
      return "true or false";
    case SettingType::kChoice:
      return absl::StrCat("one of ", absl::StrJoin(choices, ", "));
    default:
      return "a string";
  }
}

absl::Status Setting::Set(Config& config, absl::string_view text) const {
  if (const auto* s = std::get_if<std::string Config::*>(&field)) {
    config.** s = std::string(text);
    return absl::OkStatus();
  }
  const auto wrong = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "' must be ", Expected(), ", not '", text, "'"));
  };
  if (const auto* i = std::get_if<int Config::*>(&field)) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(text, &v) || v < min || v > max) return wrong();
    config.** i = static_cast<int>(v);
    return absl::OkStatus();
  }
  if (text != "true" && text != "false") return wrong();
  config.*std::get<bool Config::*>(field) = text == "true";
  return absl::OkStatus();
}

}  // namespace tsd
