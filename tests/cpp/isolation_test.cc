// Isolation between uids and the secrecy of session tokens. A child process switched to another
// uid tries every way into a job owned by root: attaching by name, presenting a token it stole,
// asking for descriptors without a hello, inventing a token. All must fail and no descriptor may
// reach it. Needs root (to switch uid); CI runs as root.
#include <sys/wait.h>
#include <unistd.h>

#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "daemon_process.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kPermissionDenied = 7;
constexpr int kFailedPrecondition = 9;

std::map<std::string, std::string> ParseLines(const std::string& out) {
  std::map<std::string, std::string> kv;
  size_t pos = 0;
  while (pos < out.size()) {
    size_t nl = out.find('\n', pos);
    if (nl == std::string::npos) nl = out.size();
    const std::string line = out.substr(pos, nl - pos);
    const size_t eq = line.find('=');
    if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    pos = nl + 1;
  }
  return kv;
}

TEST(Isolation, AnotherUidCannotAttachNorObtainDescriptors) {
  if (geteuid() != 0) GTEST_SKIP() << "switching to another uid needs root";
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB", "--socket-group", "nogroup"}});
  ASSERT_TRUE(d);
  auto owner = d->Connect();
  ASSERT_TRUE(owner->Attach("secret-job").ok());
  auto region = owner->Alloc("weights", 1 << 20);
  ASSERT_TRUE(region.ok());
  // A token the intruder steals: a pending attach to the job, not yet bound to any uid.
  RawSession raw(d->socket());
  v1::AttachResponse pending;
  ASSERT_TRUE(raw.Attach("secret-job", 0, &pending).ok());
  const std::string cmd = std::string(TSD_TEST_CLIENT) + " intruder " + d->socket() +
                          " secret-job " + std::to_string(pending.session().session_id()) + " " +
                          absl::BytesToHexString(pending.session().token()) + " 65534 65534";
  int rc = -1;
  const std::string out = RunCommand(cmd, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto kv = ParseLines(out);
  EXPECT_EQ(kv["uid"], "65534") << out;
  EXPECT_EQ(kv["attach"], std::to_string(kPermissionDenied)) << out;
  EXPECT_THAT(kv["attach_message"], HasSubstr("belongs to uid 0"));
  EXPECT_EQ(kv["stolen_hello"], std::to_string(kPermissionDenied)) << out;
  EXPECT_EQ(kv["getfd_without_hello_1"], std::to_string(kFailedPrecondition)) << out;
  EXPECT_EQ(kv["getfd_without_hello_2"], "-1")
      << "the connection must be closed after that: " << out;
  EXPECT_EQ(kv["madeup_hello"], std::to_string(kPermissionDenied)) << out;
  EXPECT_EQ(kv["fds_received"], "0") << out;
  // The job is intact and still only root's.
  auto jobs = *owner->Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].uid, 0u);
  EXPECT_EQ(jobs[0].sessions, 1u);
  EXPECT_EQ(jobs[0].used_bytes, 1u << 20);
}

TEST(Isolation, MadeUpAndReplayedTokensAreRefused) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  RawSession a(d->socket());
  const v1::SessionRef ref = a.Open("token-job");
  // Replaying the token on a second connection.
  RawSession b(d->socket());
  b.ConnectSide();
  bool closed = false;
  v1::SideRequest hello;
  *hello.mutable_hello()->mutable_session() = ref;
  v1::SideReply r = b.SendRaw(hello.SerializeAsString(), &closed);
  EXPECT_EQ(r.code(), kPermissionDenied);
  EXPECT_THAT(r.message(), HasSubstr("already completed its hello"));
  EXPECT_TRUE(closed);
  // A made-up token for a real pending session, and a made-up session id.
  v1::AttachResponse pending;
  ASSERT_TRUE(b.Attach("token-job", 0, &pending).ok());
  v1::SessionRef fake = pending.session();
  fake.set_token(std::string(32, '\0'));
  b.ConnectSide();
  r = b.Hello(fake);
  EXPECT_EQ(r.code(), kPermissionDenied);
  EXPECT_THAT(r.message(), HasSubstr("wrong token"));
  fake.set_session_id(999999);
  b.ConnectSide();
  r = b.Hello(fake);
  EXPECT_EQ(r.code(), kPermissionDenied);
  // gRPC calls with a made-up token are refused too and change nothing.
  v1::AllocRequest alloc;
  *alloc.mutable_session() = ref;
  alloc.mutable_session()->set_token(std::string(32, 'z'));
  alloc.set_name("x");
  alloc.set_size_bytes(4096);
  v1::AllocResponse ignored;
  grpc::ClientContext ctx;
  grpc::Status s = a.stub().Alloc(&ctx, alloc, &ignored);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  // The real pending session still works with its real token.
  b.ConnectSide();
  r = b.Hello(pending.session());
  EXPECT_EQ(r.code(), 0) << r.message();
  auto c = d->Connect();
  EXPECT_EQ(c->Status()->used_bytes, 0u);
  EXPECT_EQ(c->Status()->sessions, 2u);
}

TEST(Isolation, AJobExistsOnlyOnceASessionCompletesItsHello) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  RawSession a(d->socket());
  v1::AttachResponse pending;
  ASSERT_TRUE(a.Attach("never-says-hello", 0, &pending).ok());
  EXPECT_GT(pending.hello_timeout_ms(), 0u);
  auto c = d->Connect();
  EXPECT_EQ(c->Status()->jobs, 0u);  // a job exists only once a session is live
}

}  // namespace
}  // namespace tsd::testing
