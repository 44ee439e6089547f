#include "daemon/ops/config.h"

#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>

#include <toml++/toml.h>
#include <CLI/CLI.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/ops/settings.h"
#include "daemon/ops/version.h"
#include "proto/status_macros.h"
#include "proto/wire.h"

namespace tsd {
namespace {

constexpr char kDefaultConfigPath[] = "/etc/tsd/tsd.toml";

// Reads the file's settings over `c`. Returns the keys it set.
absl::StatusOr<std::set<std::string>> ReadToml(const std::string& path, Config& c) {
  toml::table table;
  try {
    table = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    std::ostringstream where;
    where << e.source().begin;
    return absl::InvalidArgumentError(absl::StrCat(
        "config file ", path, ": ", std::string(e.description()), " at ", where.str()));
  }
  std::set<std::string> named;
  for (const auto& [key, node] : table) {
    const Setting* setting = FindSetting(absl::string_view(key.str().data(), key.str().size()));
    if (setting == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": unknown setting '",
                                                     std::string(key.str()), "'; known are ",
                                                     SettingKeys()));
    }
    std::optional<std::string> text;
    if (setting->type == SettingType::kBool) {
      if (const auto* b = node.as_boolean()) text = b->get() ? "true" : "false";
    } else if (const auto* i = node.as_integer()) {
      text = std::to_string(i->get());  // e.g. pool_size = 1073741824, orphan_grace = 5
    } else if (const auto* str = node.as_string(); str != nullptr && setting->is_string()) {
      text = str->get();
    }
    if (!text.has_value() || !setting->Set(c, *text).ok()) {
      return absl::InvalidArgumentError(absl::StrCat("config file ", path, ": '", setting->key,
                                                     "' must be ", setting->Expected()));
    }
    named.insert(std::string(setting->key));
  }
  return named;
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

Config::Config() {
  for (const Setting& s : Settings()) {
    // The table's defaults are valid values of their settings (config_test checks each).
    s.Set(*this, s.default_value).IgnoreError();
  }
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
  // One flag per setting, from the table.
  std::vector<CLI::Option*> options;
  for (const Setting& s : Settings()) {
    const std::string help =
        absl::StrCat(s.help, " (default ",
                     !s.default_help.empty()   ? s.default_help
                     : s.default_value.empty() ? absl::string_view("\"\"")
                                               : s.default_value,
                     s.reload == ReloadPolicy::kRestart ? "; a reload cannot change it" : "", ")");
    CLI::Option* o = nullptr;
    if (auto* str = std::get_if<std::string Config::*>(&s.field)) {
      o = app.add_option(std::string(s.flag), flags.**str, help);
    } else if (auto* i = std::get_if<int Config::*>(&s.field)) {
      o = app.add_option(std::string(s.flag), flags.**i, help)
              ->check(CLI::Range(static_cast<int>(s.min), static_cast<int>(s.max)));
    } else {
      o = app.add_flag(std::string(s.flag), flags.*std::get<bool Config::*>(s.field), help);
    }
    if (s.last_flag_wins) o->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    options.push_back(o);
  }
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
  std::set<std::string> named;
  if (!config_path.empty()) {
    if (!std::filesystem::exists(config_path)) {
      return absl::NotFoundError(absl::StrCat("config file ", config_path, " does not exist"));
    }
  } else if (std::filesystem::exists(kDefaultConfigPath)) {
    config_path = kDefaultConfigPath;
  }
  if (!config_path.empty()) {
    TSD_ASSIGN_OR_RETURN(named, ReadToml(config_path, c));
    c.config_path = config_path;
  }
  for (size_t i = 0; i < options.size(); ++i) {
    if (!*options[i]) continue;
    const Setting& s = Settings()[i];
    std::visit([&](auto member) { c.*member = flags.*member; }, s.field);
    named.insert(std::string(s.key));
  }
  c.metrics_listen_set = named.count("metrics_listen") > 0;
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
  auto max_keep = ParseDurationArg(c.max_keep_for);
  if (!max_keep.ok())
    return absl::InvalidArgumentError(absl::StrCat("max_keep_for: ", max_keep.status().message()));
  c.max_keep_for_duration = *max_keep;
  auto store_budget = ParseSize(c.store_budget, c.pool_bytes);
  if (!store_budget.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("store_budget: ", store_budget.status().message()));
  }
  c.store_budget_bytes = std::min(*store_budget, c.pool_bytes);
  auto keep = ParseDurationArg(c.store_keep);
  if (!keep.ok())
    return absl::InvalidArgumentError(absl::StrCat("store_keep: ", keep.status().message()));
  c.store_keep_duration = *keep;
  for (const Setting& s : Settings()) {
    if (s.type != SettingType::kChoice) continue;
    const std::string value = s.Get(c);
    if (std::find(s.choices.begin(), s.choices.end(), value) == s.choices.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(s.key, " '", value, "' is not one of ", absl::StrJoin(s.choices, ", ")));
    }
  }
  for (const Setting& s : Settings()) {
    if (s.type != SettingType::kAddress) continue;
    if (absl::Status v = ValidateListenAddress(s.Get(c)); !v.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(s.key, ": ", v.message()));
    }
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
  toml::table t;
  for (const Setting& s : Settings()) {
    std::visit([&](auto member) { t.insert(std::string(s.key), c.*member); }, s.field);
  }
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
