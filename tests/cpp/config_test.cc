// Sizes, durations, the TOML file and flags: what `tsd` accepts and how it explains what it
// refuses, and that the shipped deploy/tsd.toml documents every setting with its default.
#include "daemon/ops/config.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

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

// deploy/tsd.toml (installed as /etc/tsd/tsd.toml) lists every setting, commented out, with its
// default: uncommented, it must load to exactly what no file at all gives.
TEST(ShippedConfig, ListsEverySettingWithItsDefault) {
  const std::filesystem::path shipped = std::filesystem::path(TSD_SOURCE_DIR) /
                                        "deploy/tsd.toml";  // __FILE__ may be relative (ccache)
  std::ifstream in(shipped);
  ASSERT_TRUE(in.good()) << shipped;
  std::string uncommented, line;
  std::set<std::string> keys;
  while (std::getline(in, line)) {
    // A setting is "# key = value", key in [a-z_]; prose never has " = " after one word.
    const size_t eq = line.find(" = ");
    if (line.rfind("# ", 0) != 0 || eq == std::string::npos || eq <= 2) continue;
    const std::string key = line.substr(2, eq - 2);
    if (key.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") != std::string::npos) continue;
    keys.insert(key);
    uncommented += line.substr(2) + "\n";
  }
  // Every key --print-config shows is in the file.
  auto defaults = Load({});
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  std::istringstream printed(ConfigToToml(defaults->config));
  while (std::getline(printed, line)) {
    if (line.empty() || line[0] == '#') continue;
    const std::string key = line.substr(0, line.find(' '));
    EXPECT_EQ(keys.count(key), 1u) << "deploy/tsd.toml does not document '" << key << "'";
  }
  const std::string path = "/tmp/tsd-config-shipped-" + std::to_string(getpid()) + ".toml";
  {
    std::ofstream f(path);
    f << uncommented;
  }
  auto from_file = Load({"--config", path});
  std::remove(path.c_str());
  ASSERT_TRUE(from_file.ok()) << from_file.status() << "\n" << uncommented;
  const Config& a = from_file->config;
  const Config& b = defaults->config;
  if (getuid() == 0) {
    EXPECT_EQ(a.socket, b.socket);  // the default socket depends on the uid
  }
  EXPECT_EQ(a.socket_group, b.socket_group);
  EXPECT_EQ(a.pool_size, b.pool_size);
  EXPECT_EQ(a.pool_bytes, b.pool_bytes);
  EXPECT_EQ(a.max_job_quota, b.max_job_quota);
  EXPECT_EQ(a.orphan_grace, b.orphan_grace);
  EXPECT_EQ(a.log_level, b.log_level);
  EXPECT_EQ(a.metrics_listen, b.metrics_listen);
  EXPECT_EQ(a.optimizer_threads, b.optimizer_threads);
  EXPECT_EQ(a.pin_optimizer_threads, b.pin_optimizer_threads);
  EXPECT_EQ(a.optimizer_nice, b.optimizer_nice);
  EXPECT_EQ(keys,
            (std::set<std::string>{
                "socket", "socket_group", "pool_size", "max_job_quota", "orphan_grace", "log_level",
                "metrics_listen", "optimizer_threads", "pin_optimizer_threads", "optimizer_nice"}));
}

}  // namespace
}  // namespace tsd
