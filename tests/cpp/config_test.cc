// Sizes, durations, the TOML file and flags: what `tsd` accepts and how it explains what it refuses.
#include "daemon/config.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>

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
    f << "pool_size = \"1GiB\"\nmax_job_quota = \"25%\"\norphan_grace = \"2s\"\nlog_level = \"warn\"\n";
  }
  auto c = Load({"--config", path, "--pool-size", "2GiB", "--socket", "/tmp/x.sock"});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->config.pool_bytes, 2ull << 30);               // flag wins
  EXPECT_EQ(c->config.max_job_quota_bytes, 512ull << 20);    // 25% of the effective pool
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
  EXPECT_NE(c.status().message().find("unknown setting 'pool_sise'"), std::string::npos) << c.status();
  std::remove(path.c_str());
  auto missing = Load({"--config", "/nonexistent/tsd.toml"});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  auto level = Load({"--log-level", "loud", "--pool-size", "1GiB"});
  ASSERT_FALSE(level.ok());
  EXPECT_NE(level.status().message().find("log_level 'loud'"), std::string::npos);
}

}  // namespace
}  // namespace tsd
