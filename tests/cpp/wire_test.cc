// The protocol conventions both sides share: paths, names, byte formatting, and the framing of
// side messages (fragments, limits, and errors that say what failed to parse).
#include "proto/wire.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <random>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "proto/side_message.h"

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

// A socket pair standing in for a side connection.
struct Pair {
  int fds[2] = {-1, -1};
  Pair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds), 0); }
  ~Pair() {
    close(fds[0]);
    close(fds[1]);
  }
};

TEST(SideMessage, ALargeMessageTravelsAsFragmentsAndComesBackWhole) {
  Pair p;
  v1::SideReply big;
  big.set_request_id(42);
  for (int i = 0; i < 2500; ++i) {
    auto* r = big.mutable_list_regions()->add_regions();
    r->set_region_id(static_cast<uint64_t>(i) + 1);
    r->set_name("region-with-a-long-name-" + std::to_string(i));
    r->set_size_bytes(4096u * static_cast<uint64_t>(i));
  }
  ASSERT_GT(big.ByteSizeLong(), kMaxSideDatagramBytes);
  int fd = dup(0);
  ASSERT_TRUE(SendSideMessage(p.fds[0], big, fd, 1000).ok());
  close(fd);
  SideAssembler<v1::SideReply> in;
  int datagrams = 0;
  for (;;) {
    auto d = ReceiveDatagram(p.fds[1], false);
    ASSERT_TRUE(d.ok());
    ++datagrams;
    uint64_t id = 0;
    auto whole = in.Feed(std::move(*d), &id);
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(id, 42u);
    if (*whole) break;
  }
  EXPECT_GT(datagrams, 1);
  EXPECT_EQ(in.message().SerializeAsString(), big.SerializeAsString());
  const int got = in.TakeFd();
  EXPECT_GE(got, 0) << "the descriptor travels with the first fragment";
  close(got);
}

TEST(SideMessage, FragmentsThatDoNotAddUpAreRefused) {
  SideAssembler<v1::SideRequest> in;
  auto feed = [&](const v1::SideRequest& m, uint64_t* id) {
    Datagram d;
    d.bytes = m.SerializeAsString();
    return in.Feed(std::move(d), id);
  };
  uint64_t id = 0;
  v1::SideRequest a;
  a.set_request_id(5);
  a.set_fragment("abc");
  a.set_more_fragments(true);
  ASSERT_FALSE(*feed(a, &id));
  v1::SideRequest b = a;
  b.set_request_id(6);
  auto mixed = feed(b, &id);
  ASSERT_FALSE(mixed.ok());
  EXPECT_THAT(std::string(mixed.status().message()), ::testing::HasSubstr("request 5"));
  // The pieces of a message past the limit.
  v1::SideRequest piece;
  piece.set_request_id(9);
  piece.set_fragment(std::string(kMaxSideDatagramBytes - 64, 'x'));
  piece.set_more_fragments(true);
  absl::StatusOr<bool> r = false;
  size_t fed = 0;
  while (r.ok() && fed <= kMaxSideMessageBytes) {
    r = feed(piece, &id);
    fed += piece.fragment().size();
  }
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), ::testing::HasSubstr("exceeds 16 MiB"));
  // Fragments that put together do not parse say so.
  v1::SideRequest last;
  last.set_request_id(10);
  last.set_fragment("\x12\x40short");  // field 2 (attach), 64 bytes long, 5 present
  auto bad = feed(last, &id);
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()),
              ::testing::HasSubstr("field 2 (attach) says it is 64 bytes long but only 5 remain"));
}

TEST(SideMessage, ParseFailuresSayWhereAndWhy) {
  const std::string type = "tsd.v1.SideRequest";
  EXPECT_THAT(ExplainParseFailure("\x08", type), ::testing::HasSubstr("varint of field 1"));
  EXPECT_THAT(ExplainParseFailure("\x08\x01\x0f", type),
              ::testing::HasSubstr("at byte 2: field 1 (request_id) has wire type 7"));
  // In a nested message: the alloc's name is not UTF-8.
  const std::string nested = "\x12\x02\xc3\x28";  // name: 2 bytes, not UTF-8
  const std::string bytes = std::string("\x32") + static_cast<char>(nested.size()) + nested;
  EXPECT_THAT(ExplainParseFailure(bytes, type),
              ::testing::HasSubstr("in field 6 (alloc) (tsd.v1.AllocRequest): at byte 2: field 2 "
                                   "(name) is not valid UTF-8"));
}

// Random and mutated datagrams never crash the reader; every refusal says something.
TEST(SideMessage, RandomAndMutatedDatagramsAreRefusedWithAReason) {
  std::mt19937 rng(7);
  v1::SideRequest valid;
  valid.set_request_id(3);
  valid.mutable_register_optimizer()->add_groups()->set_lr(1e-3);
  valid.mutable_register_optimizer()->add_buckets()->set_numel(10);
  const std::string seed = valid.SerializeAsString();
  int refused = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string bytes;
    if (i % 2 == 0) {
      bytes.resize(std::uniform_int_distribution<size_t>(1, 64)(rng));
      for (char& c : bytes) c = static_cast<char>(rng());
    } else {
      bytes = seed;
      for (int k = 0; k < 3; ++k) bytes[rng() % bytes.size()] = static_cast<char>(rng());
      bytes.resize(std::uniform_int_distribution<size_t>(1, bytes.size())(rng));
    }
    SideAssembler<v1::SideRequest> in;
    Datagram d;
    d.bytes = bytes;
    uint64_t id = 0;
    auto r = in.Feed(std::move(d), &id);
    if (!r.ok()) {
      ++refused;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_GT(r.status().message().size(), 40u) << r.status();
    }
  }
  EXPECT_GT(refused, 1000);
}

}  // namespace
}  // namespace tsd::wire
