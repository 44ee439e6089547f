// Defects found when tsd was attacked as a hostile local user would (issue 13): each test
// reproduces the attack against a real tsd binary and checks that it is refused and harms nothing.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

std::string MakeTempDir() {
  char tmpl[] = "/tmp/tsd-hardening-XXXXXX";
  const char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d ? d : "";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A symlink planted at <socket>.lock once made root's tsd truncate the file it pointed to and
// write its pid into it. tsd must refuse the link, say why, and leave the target untouched.
TEST(Hardening, LockFileSymlinkIsNotFollowed) {
  const std::string dir = MakeTempDir();
  const std::string victim = dir + "/victim";
  { std::ofstream(victim) << "root-only secret\n"; }
  const std::string socket = dir + "/tsd.sock";
  ASSERT_EQ(symlink(victim.c_str(), (socket + ".lock").c_str()), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + socket +
                                         " --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("symbolic link"));
  EXPECT_EQ(ReadAll(victim), "root-only secret\n");
  std::system(("rm -rf " + dir).c_str());
}

// A lock file that belongs to another uid (planted before tsd started) is refused by name.
TEST(Hardening, LockFileOwnedByAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give the file to another uid";
  const std::string dir = MakeTempDir();
  const std::string socket = dir + "/tsd.sock";
  const std::string lock = socket + ".lock";
  { std::ofstream(lock) << "12345\n"; }
  ASSERT_EQ(chown(lock.c_str(), 65534, 65534), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + socket +
                                         " --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("owned by uid 65534"));
  EXPECT_EQ(ReadAll(lock), "12345\n");
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace tsd::testing
