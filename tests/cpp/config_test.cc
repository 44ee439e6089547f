// Sizes, durations, the TOML file and flags: what `tsd` accepts and how it explains what it
// refuses; that the settings table is consistent with the flags, --help, --print-config and the
// reload rules; and that the shipped deploy/tsd.toml and docs/daemon.md document every setting.
#include "daemon/ops/config.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "daemon/jobs/registry.h"
#include "daemon/ops/reload.h"
#include "daemon/ops/settings.h"

namespace tsd {
namespace {

TEST(ParseSize, UnitsAndShares) {
  EXPECT_EQ(*ParseSize("64GiB", 0), 64ull << 30);
  EXPECT_EQ(*ParseSize("512MiB", 0), 512ull << 20);
  EXPECT_EQ(*ParseSize("512 mib", 0), 512ull << 20);
  EXPECT_EQ(*ParseSize("1.5G", 0), 3ull << 29);
  EXPECT_EQ(*ParseSize("2GB", 0), 2000000000ull);
  EXPECT_EQ(*ParseSize("4096", 0), 4096ull);
  EXPECT_EQ(*ParseSize("60%", 1000), 600ull);
}

TEST(ParseSize, RefusalsSayWhatIsAllowed) {
  auto bad_unit = ParseSize("12 parsecs", 0);
  ASSERT_FALSE(bad_unit.ok());
  EXPECT_NE(bad_unit.status().message().find("unknown unit"), std::string::npos);
  EXPECT_FALSE(ParseSize("", 0).ok());
  EXPECT_FALSE(ParseSize("GiB", 0).ok());
  EXPECT_FALSE(ParseSize("150%", 100).ok());
  EXPECT_FALSE(ParseSize("0%", 100).ok());
  EXPECT_FALSE(ParseSize("1e30", 0).ok());
}

TEST(ParseDuration, SecondsAndUnits) {
  EXPECT_EQ(*ParseDurationArg("0"), absl::ZeroDuration());
  EXPECT_EQ(*ParseDurationArg("5"), absl::Seconds(5));
  EXPECT_EQ(*ParseDurationArg("500ms"), absl::Milliseconds(500));
  EXPECT_FALSE(ParseDurationArg("-1").ok());
  EXPECT_FALSE(ParseDurationArg("soon").ok());
}

absl::StatusOr<LoadedConfig> Load(std::vector<std::string> args) {
  args.insert(args.begin(), "tsd");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return LoadConfig(static_cast<int>(argv.size()), argv.data());
}

TEST(LoadConfig, FlagsOverrideTheFile) {
  const std::string path = "/tmp/tsd-config-test-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(path);
    f << "pool_size = \"1GiB\"\nmax_job_quota = \"25%\"\norphan_grace = \"2s\"\nlog_level = "
         "\"warn\"\n";
  }
  auto c = Load({"--config", path, "--pool-size", "2GiB", "--socket", "/tmp/x.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.pool_bytes, 2ull << 30);                   // flag wins
  EXPECT_EQ(c->config.max_job_quota_bytes, 512ull << 20);        // 25% of the effective pool
  EXPECT_EQ(c->config.orphan_grace_duration, absl::Seconds(2));  // from the file
  EXPECT_EQ(c->config.log_level, "warn");
  EXPECT_EQ(c->config.socket, "/tmp/x.sock");
  const std::string toml = ConfigToToml(c->config);
  EXPECT_NE(toml.find("pool_size = '2GiB'"), std::string::npos) << toml;
  std::remove(path.c_str());
}

TEST(LoadConfig, BadFileAndValuesAreNamed) {
  const std::string path = "/tmp/tsd-config-bad-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(path);
    f << "pool_sise = \"1GiB\"\n";
  }
  auto c = Load({"--config", path});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("unknown setting 'pool_sise'"), std::string::npos)
      << c.status();
  std::remove(path.c_str());
  auto missing = Load({"--config", "/nonexistent/tsd.toml"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  auto level = Load({"--log-level", "loud", "--pool-size", "1GiB"});
  ASSERT_FALSE(level.ok());
  EXPECT_NE(level.status().message().find("log_level 'loud'"), std::string::npos);
  {
    std::ofstream f(path);
    f << "optimizer_nice = 25\n";
  }
  auto nice = Load({"--config", path});
  std::remove(path.c_str());
  ASSERT_FALSE(nice.ok());
  EXPECT_NE(nice.status().message().find("'optimizer_nice' must be an integer in [-20, 19]"),
            std::string::npos)
      << nice.status();
}

TEST(LoadConfig, OptimizerNiceFromFileAndFlag) {
  const std::string path = "/tmp/tsd-config-nice-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(path);
    f << "optimizer_nice = 5\n";
  }
  auto file = Load({"--config", path, "--pool-size", "1GiB"});
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->config.optimizer_nice, 5);
  auto flag = Load({"--config", path, "--pool-size", "1GiB", "--optimizer-nice", "12"});
  std::remove(path.c_str());
  ASSERT_TRUE(flag.ok()) << flag.status();
  EXPECT_EQ(flag->config.optimizer_nice, 12);
  EXPECT_NE(ConfigToToml(flag->config).find("optimizer_nice = 12"), std::string::npos);
}

TEST(LoadConfig, MetricsListenDefaultsOffAndTheLastFlagWins) {
  auto c = Load({"--pool-size", "1GiB"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.metrics_listen, "127.0.0.1:9464");
  auto off = Load({"--pool-size", "1GiB", "--metrics-listen", ""});
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_EQ(off->config.metrics_listen, "");
  auto last =
      Load({"--pool-size", "1GiB", "--metrics-listen", "", "--metrics-listen", "[::1]:9100"});
  ASSERT_TRUE(last.ok()) << last.status();
  EXPECT_EQ(last->config.metrics_listen, "[::1]:9100");
  for (const char* bad : {"9464", "127.0.0.1", "127.0.0.1:70000", "::1:9464", "host:port"}) {
    auto b = Load({"--pool-size", "1GiB", "--metrics-listen", bad});
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_NE(b.status().message().find("metrics_listen"), std::string::npos) << b.status();
  }
}

TEST(LoadConfig, KeepsTheCommandLineForAReload) {
  auto c = Load({"--pool-size", "1GiB", "--log-level", "warn"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.args,
            (std::vector<std::string>{"tsd", "--pool-size", "1GiB", "--log-level", "warn"}));
  auto again = LoadConfig(c->config.args);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->config.pool_bytes, c->config.pool_bytes);
  EXPECT_EQ(again->config.log_level, "warn");
}

TEST(LoadConfig, TheSocketDefaultsToSystemdsRuntimeDirectory) {
  setenv("RUNTIME_DIRECTORY", "/run/tsd:/run/other", 1);
  auto c = Load({"--pool-size", "1GiB"});
  unsetenv("RUNTIME_DIRECTORY");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.socket, "/run/tsd/tsd.sock");
  auto flag = Load({"--pool-size", "1GiB", "--socket", "/tmp/elsewhere.sock"});
  EXPECT_EQ(flag->config.socket, "/tmp/elsewhere.sock");
}

// The settings table is consistent: flags are the keys spelled for a command line, defaults are
// valid values that a fresh Config holds, and the reload rules agree with what Reloader applies.
TEST(Settings, TheTableIsConsistent) {
  const Config fresh;
  std::set<std::string> keys;
  for (const Setting& s : Settings()) {
    EXPECT_TRUE(keys.insert(std::string(s.key)).second) << s.key << " is declared twice";
    std::string flag = "--" + std::string(s.key);
    std::replace(flag.begin(), flag.end(), '_', '-');
    EXPECT_EQ(s.flag, flag);
    EXPECT_FALSE(s.help.empty()) << s.key;
    Config c;
    EXPECT_TRUE(s.Set(c, s.default_value).ok()) << s.key;
    EXPECT_EQ(s.Get(fresh), s.default_value) << s.key;
    EXPECT_EQ(FindSetting(s.key), &s);
    if (s.type == SettingType::kInt) {
      EXPECT_LT(s.min, s.max) << s.key;
      EXPECT_FALSE(s.Set(c, std::to_string(s.max + 1)).ok()) << s.key;
      EXPECT_FALSE(s.Set(c, "ten").ok()) << s.key;
    }
    if (s.type == SettingType::kBool) {
      EXPECT_FALSE(s.Set(c, "yes").ok()) << s.key;
    }
  }
  EXPECT_EQ(FindSetting("pool_sise"), nullptr);
  std::set<std::string> live, applied;
  for (const Setting& s : Settings()) {
    if (s.reload == ReloadPolicy::kLive) live.insert(std::string(s.key));
  }
  for (absl::string_view k : Reloader::LiveKeys()) applied.insert(std::string(k));
  EXPECT_EQ(live, applied) << "a setting marked live must be applied by Reloader::Apply";
}

TEST(Settings, HelpListsEveryFlagWithItsDefault) {
  testing::internal::CaptureStdout();
  auto help = Load({"--help"});
  const std::string text = testing::internal::GetCapturedStdout();
  ASSERT_TRUE(help.ok()) << help.status();
  EXPECT_EQ(help->action, Action::kExit);
  EXPECT_EQ(help->exit_code, 0);
  for (const Setting& s : Settings()) {
    EXPECT_NE(text.find(std::string(s.flag)), std::string::npos) << s.flag << "\n" << text;
    if (!s.default_value.empty() && s.default_help.empty()) {
      EXPECT_NE(text.find("(default " + std::string(s.default_value)), std::string::npos)
          << s.key << "\n"
          << text;
    }
  }
}

// Every setting the table marks restart-only is refused by a reload, naming it; a live one is not.
TEST(Reloader, RestartOnlySettingsAreRefusedAndNameTheSetting) {
  RegistryOptions o;
  o.pool_bytes = 64 << 20;
  o.max_job_quota_bytes = 32 << 20;
  Registry registry(o);
  auto current = Load({"--pool-size", "64MiB"});
  ASSERT_TRUE(current.ok()) << current.status();
  Reloader reloader(current->config, registry, /*pool_locked=*/false);
  auto next = Load({"--pool-size", "64MiB", "--optimizer-nice", "5", "--socket-group", "wheel"});
  ASSERT_TRUE(next.ok()) << next.status();
  auto refused = reloader.Apply(next->config);
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("socket_group '' -> 'wheel', optimizer_nice '10' -> "
                                            "'5': cannot change while tsd runs"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(reloader.current().optimizer_nice, 10);
  auto live = Load({"--pool-size", "64MiB", "--orphan-grace", "3s"});
  ASSERT_TRUE(live.ok()) << live.status();
  auto applied = reloader.Apply(live->config);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(*applied, "orphan_grace 0s -> 3s");
}

// The comment lines above each "# key = value" line of deploy/tsd.toml, and the settings it lists.
struct ShippedFile {
  std::map<std::string, std::string> prose;  // key -> its comment block, lines joined by spaces
  std::string uncommented;                   // every "key = value" line, uncommented
};

ShippedFile ReadShipped() {
  ShippedFile out;
  std::ifstream in(std::filesystem::path(TSD_SOURCE_DIR) / "deploy/tsd.toml");
  EXPECT_TRUE(in.good());
  std::string line, block;
  while (std::getline(in, line)) {
    if (line.empty()) {
      block.clear();
      continue;
    }
    // A setting is "# key = value", key in [a-z_]; prose never has " = " after one word.
    const size_t eq = line.find(" = ");
    if (line.rfind("# ", 0) == 0 && eq != std::string::npos && eq > 2) {
      const std::string key = line.substr(2, eq - 2);
      if (key.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") == std::string::npos) {
        EXPECT_EQ(out.prose.count(key), 0u) << "deploy/tsd.toml lists '" << key << "' twice";
        out.prose[key] = block;
        out.uncommented += line.substr(2) + "\n";
        continue;
      }
    }
    block += " " + line.substr(std::min<size_t>(2, line.size()));
  }
  return out;
}

// deploy/tsd.toml (installed as /etc/tsd/tsd.toml) lists every setting of the table and nothing
// else, commented out, with its default: uncommented, it must load to exactly what no file at all
// gives. Its prose says which settings a reload cannot change, as the table does.
TEST(ShippedConfig, ListsEverySettingWithItsDefaultAndReloadRule) {
  const ShippedFile shipped = ReadShipped();
  for (const auto& [key, prose] : shipped.prose) {
    EXPECT_NE(FindSetting(key), nullptr)
        << "deploy/tsd.toml lists '" << key << "', which is not a setting of tsd";
  }
  for (const Setting& s : Settings()) {
    auto it = shipped.prose.find(std::string(s.key));
    if (it == shipped.prose.end()) {
      ADD_FAILURE() << "deploy/tsd.toml does not document '" << s.key << "'";
      continue;
    }
    const bool says_restart = it->second.find("Not changed by a reload") != std::string::npos;
    EXPECT_EQ(says_restart, s.reload == ReloadPolicy::kRestart)
        << "deploy/tsd.toml's prose about '" << s.key << "' and the table's reload policy differ";
  }
  const std::string path = "/tmp/tsd-config-shipped-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(path);
    f << shipped.uncommented;
  }
  auto from_file = Load({"--config", path});
  std::remove(path.c_str());
  ASSERT_TRUE(from_file.ok()) << from_file.status() << "\n" << shipped.uncommented;
  auto defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  for (const Setting& s : Settings()) {
    if (s.key == "socket" && getuid() != 0) continue;  // the default socket depends on the uid
    EXPECT_EQ(s.Get(from_file->config), s.Get(defaults->config)) << s.key;
  }
  EXPECT_EQ(from_file->config.pool_bytes, defaults->config.pool_bytes);
  EXPECT_EQ(from_file->config.max_job_quota_bytes, defaults->config.max_job_quota_bytes);
  // Every key --print-config shows is a setting of the table.
  std::istringstream printed(ConfigToToml(defaults->config));
  std::string line;
  size_t printed_keys = 0;
  while (std::getline(printed, line)) {
    if (line.empty() || line[0] == '#') continue;
    EXPECT_NE(FindSetting(line.substr(0, line.find(' '))), nullptr) << line;
    ++printed_keys;
  }
  EXPECT_EQ(printed_keys, Settings().size());
}

// docs/daemon.md has a row per setting: its key and flag, its default, and its reload policy.
TEST(ShippedConfig, TheDaemonDocsDescribeEverySetting) {
  std::ifstream in(std::filesystem::path(TSD_SOURCE_DIR) / "docs/daemon.md");
  ASSERT_TRUE(in.good());
  std::map<std::string, std::string> rows;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("| `", 0) != 0) continue;
    const size_t end = line.find('`', 3);
    rows[line.substr(3, end - 3)] = line;
  }
  for (const Setting& s : Settings()) {
    auto it = rows.find(std::string(s.key));
    if (it == rows.end()) {
      ADD_FAILURE() << "docs/daemon.md has no row for '" << s.key << "'";
      continue;
    }
    const std::string& row = it->second;
    EXPECT_NE(row.find("(`" + std::string(s.flag) + "`)"), std::string::npos) << row;
    if (!s.default_value.empty()) {
      EXPECT_NE(row.find("| `" + std::string(s.default_value) + "` |"), std::string::npos) << row;
    }
    const std::string policy = s.reload == ReloadPolicy::kLive ? "| live |" : "| restart |";
    EXPECT_NE(row.find(policy), std::string::npos) << row;
  }
}

}  // namespace
}  // namespace tsd
