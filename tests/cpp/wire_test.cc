// The protocol conventions both sides share: paths, names and byte formatting.
#include "proto/wire.h"

#include <cstdlib>

#include <gtest/gtest.h>

namespace tsd::wire {
namespace {

TEST(Wire, SocketPaths) {
  EXPECT_EQ(SideSocketPath("/run/tsd/tsd.sock"), "/run/tsd/tsd.fd.sock");
  EXPECT_EQ(SideSocketPath("/tmp/sock"), "/tmp/sock.fd");
  EXPECT_EQ(LockFilePath("/run/tsd/tsd.sock"), "/run/tsd/tsd.sock.lock");
  setenv("TSD_SOCKET", "/tmp/from-env.sock", 1);
  EXPECT_EQ(ResolveSocketPath(""), "/tmp/from-env.sock");
  EXPECT_EQ(ResolveSocketPath("/x.sock"), "/x.sock");
  unsetenv("TSD_SOCKET");
  EXPECT_EQ(ChooseSocketPath("", nullptr, "/u/tsd.sock", "/s/tsd.sock",
                             [](const std::string&) { return false; }),
            "/u/tsd.sock");
}

// A client without TSD_SOCKET uses its own default socket when a daemon is there, else the system
// service's socket when that one is; explicit paths and TSD_SOCKET always win.
TEST(Wire, ClientsFallBackToTheSystemServiceSocket) {
  static std::string present;
  auto is_socket = [](const std::string& p) { return p == present; };
  present = "/s/tsd.sock";
  EXPECT_EQ(ChooseSocketPath("", nullptr, "/u/tsd.sock", "/s/tsd.sock", is_socket), "/s/tsd.sock");
  EXPECT_EQ(ChooseSocketPath("", "", "/u/tsd.sock", "/s/tsd.sock", is_socket), "/s/tsd.sock");
  EXPECT_EQ(ChooseSocketPath("", "/e.sock", "/u/tsd.sock", "/s/tsd.sock", is_socket), "/e.sock");
  EXPECT_EQ(ChooseSocketPath("/x.sock", nullptr, "/u/tsd.sock", "/s/tsd.sock", is_socket),
            "/x.sock");
  present = "/u/tsd.sock";
  EXPECT_EQ(ChooseSocketPath("", nullptr, "/u/tsd.sock", "/s/tsd.sock", is_socket), "/u/tsd.sock");
  present = "";
  EXPECT_EQ(ChooseSocketPath("", nullptr, "/u/tsd.sock", "/s/tsd.sock", is_socket), "/u/tsd.sock");
}

TEST(Wire, Names) {
  EXPECT_TRUE(ValidateName("job", "llama-7b/rank:0_v1.2").ok());
  EXPECT_FALSE(ValidateName("job", "").ok());
  EXPECT_FALSE(ValidateName("job", std::string(129, 'a')).ok());
  EXPECT_TRUE(ValidateName("job", std::string(128, 'a')).ok());
  EXPECT_FALSE(ValidateName("job", "../etc").ok());
  EXPECT_FALSE(ValidateName("job", "/abs").ok());
  EXPECT_FALSE(ValidateName("region", "white space").ok());
  EXPECT_FALSE(ValidateName("region", std::string("nul\0x", 5)).ok());
  auto s = ValidateName("region", "caf\xc3\xa9");
  EXPECT_NE(s.message().find("0xc3"), std::string::npos) << s;
}

TEST(Wire, FormatBytes) {
  EXPECT_EQ(FormatBytes(4096), "4 KiB");
  EXPECT_EQ(FormatBytes(100), "100 B");
  EXPECT_EQ(FormatBytes(3ull << 29), "1.50 GiB");
  EXPECT_EQ(FormatBytes(256ull << 20), "256 MiB");
}

}  // namespace
}  // namespace tsd::wire
