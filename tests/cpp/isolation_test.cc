// Isolation between uids and between jobs. Sessions live on side-socket connections where the
// kernel tells tsd the caller's uid, so there is no token to steal: a child process switched to
// another uid tries every way into a job owned by root (attaching by name, a raw connection
// asking for the job and acting anyway, session calls without an attach, reaching for the job's
// region from a session of its own) and all must fail, no descriptor may reach it, and nothing of
// the owner's may change. Switching uid needs root; CI runs as root.
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

constexpr int kNotFound = 5;
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

TEST(Isolation, AnotherUidCannotAttachNorActOnTheJob) {
  if (geteuid() != 0) GTEST_SKIP() << "switching to another uid needs root";
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB", "--socket-group", "nogroup"}});
  ASSERT_TRUE(d);
  auto owner = d->Connect();
  ASSERT_TRUE(owner->Attach("secret-job").ok());
  auto region = owner->Alloc("weights", 1 << 20);
  ASSERT_TRUE(region.ok());
  std::memset((*region)->data(), 0x3C, (*region)->size());
  const std::string cmd = std::string(TSD_TEST_CLIENT) + " intruder " + d->socket() +
                          " secret-job " + std::to_string((*region)->id()) + " 65534 65534";
  int rc = -1;
  const std::string out = RunCommand(cmd, &rc);
  ASSERT_EQ(rc, 0) << out;
  auto kv = ParseLines(out);
  EXPECT_EQ(kv["uid"], "65534") << out;
  EXPECT_EQ(kv["attach"], std::to_string(kPermissionDenied)) << out;
  EXPECT_THAT(kv["attach_message"], HasSubstr("belongs to uid 0"));
  EXPECT_THAT(kv["attach_message"], HasSubstr("uid 65534 may not attach"));
  EXPECT_EQ(kv["raw_attach"], std::to_string(kPermissionDenied)) << out;
  EXPECT_EQ(kv["detach_after_refusal"], "-1") << "a refused attach closes the connection: " << out;
  for (const char* call : {"getfd", "free", "alloc", "detach", "list"}) {
    const std::string name = std::string(call) + "_without_attach";
    EXPECT_EQ(kv[name], std::to_string(kFailedPrecondition)) << name << ": " << out;
    EXPECT_EQ(kv[name + "_again"], "-1") << name << ": the connection must be closed: " << out;
  }
  EXPECT_EQ(kv["own_attach"], "0") << out;
  EXPECT_EQ(kv["own_getfd"], std::to_string(kNotFound)) << out;
  EXPECT_EQ(kv["own_free"], std::to_string(kNotFound)) << out;
  EXPECT_EQ(kv["fds_received"], "0") << out;
  // Nothing of the owner's changed: its job, its session, its bytes.
  auto jobs = *owner->Jobs();
  ASSERT_EQ(jobs.size(), 1u) << "the intruder's own job ended with its connection";
  EXPECT_EQ(jobs[0].name, "secret-job");
  EXPECT_EQ(jobs[0].uid, 0u);
  EXPECT_EQ(jobs[0].sessions, 1u);
  EXPECT_EQ(jobs[0].used_bytes, 1u << 20);
  EXPECT_EQ(jobs[0].regions, 1u);
  auto again = owner->Map("weights");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(static_cast<const uint8_t*>((*again)->data())[12345], 0x3C);
  EXPECT_TRUE(owner->Alloc("still-mine", 4096).ok());
}

TEST(Isolation, ASessionActsOnlyForItsOwnJob) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto owner = d->Connect();
  ASSERT_TRUE(owner->Attach("job-a").ok());
  auto region = owner->Alloc("a-data", 1 << 20);
  ASSERT_TRUE(region.ok());
  RawSession b(d->socket());
  b.Open("job-b");
  // Another job's region, by its real id: not found, no descriptor, nothing freed.
  v1::SideRequest get;
  get.mutable_get_fd()->set_region_id((*region)->id());
  int fd = -1;
  v1::SideReply r = b.Request(get, nullptr, &fd);
  EXPECT_EQ(r.code(), kNotFound);
  EXPECT_THAT(r.message(), HasSubstr("does not exist in job 'job-b'"));
  EXPECT_EQ(fd, -1);
  v1::SideRequest free_req;
  free_req.mutable_free()->set_region_id((*region)->id());
  r = b.Request(free_req);
  EXPECT_EQ(r.code(), kNotFound);
  // A second attach on a connection that already has a session is refused; the session stays.
  v1::SideRequest attach;
  attach.mutable_attach()->set_job("job-a");
  attach.mutable_attach()->set_protocol_version(wire::kProtocolVersion);
  bool closed = true;
  r = b.Request(attach, &closed);
  EXPECT_EQ(r.code(), kFailedPrecondition);
  EXPECT_THAT(r.message(), HasSubstr("already belongs to session"));
  EXPECT_FALSE(closed);
  // Detach ends only b's own session and job.
  v1::SideRequest detach;
  detach.mutable_detach();
  r = b.Request(detach, &closed);
  EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_TRUE(r.detach().job_released());
  EXPECT_TRUE(closed) << "the daemon closes the connection after a detach";
  auto st = owner->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->jobs, 1u);
  EXPECT_EQ(st->sessions, 1u);
  EXPECT_EQ(st->used_bytes, 1u << 20);
}

}  // namespace
}  // namespace tsd::testing
