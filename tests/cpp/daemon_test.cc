// End-to-end behaviour of one tsd: shared regions, quotas and the pool, seals, zeroing, status
// and tsctl, and how it refuses a second instance. Every test runs a real daemon process.
#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "daemon_process.h"
#include "tsd/client.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

TEST(Daemon, TwoSessionsOfOneJobShareARegion) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = d->Connect(), b = d->Connect();
  ASSERT_TRUE(a->Attach("shared-job", 64 << 20).ok());
  ASSERT_TRUE(b->Attach("shared-job").ok());
  EXPECT_EQ(b->quota_bytes(), 64u << 20);  // the existing job's quota
  auto ra = a->Alloc("buf", 3 << 20);
  ASSERT_TRUE(ra.ok()) << ra.status();
  auto rb = b->Map("buf");
  ASSERT_TRUE(rb.ok()) << rb.status();
  ASSERT_EQ((*ra)->size(), (*rb)->size());
  EXPECT_NE((*ra)->data(), (*rb)->data());  // two mappings of the same pages
  auto* wa = static_cast<uint32_t*>((*ra)->data());
  const auto* wb = static_cast<const uint32_t*>((*rb)->data());
  for (size_t i = 0; i < (*ra)->size() / 4; ++i) wa[i] = static_cast<uint32_t>(i * 2654435761u);
  size_t mismatches = 0;
  for (size_t i = 0; i < (*rb)->size() / 4; ++i)
    mismatches += wb[i] != static_cast<uint32_t>(i * 2654435761u);
  EXPECT_EQ(mismatches, 0u);
  // And the other way round.
  static_cast<uint32_t*>((*rb)->data())[7] = 0xDEADBEEF;
  EXPECT_EQ(wa[7], 0xDEADBEEFu);
  auto st = a->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->used_bytes, 3u << 20);
  EXPECT_EQ(st->sessions, 2u);
  EXPECT_EQ(st->jobs, 1u);
}

TEST(Daemon, QuotaOverrunFailsWithNumbersAndChangesNothing) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("quota-job", 16 << 20).ok());
  ASSERT_TRUE(c->Alloc("a", 10 << 20).ok());
  const auto before = *c->Status();
  auto over = c->Alloc("b", 8 << 20);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(over.status().message());
  EXPECT_THAT(msg, HasSubstr("8 MiB"));
  EXPECT_THAT(msg, HasSubstr("10 MiB of 16 MiB"));
  EXPECT_THAT(msg, HasSubstr("6 MiB free"));
  EXPECT_THAT(msg, HasSubstr("quota"));
  const auto after = *c->Status();
  EXPECT_EQ(after.used_bytes, before.used_bytes);
  auto jobs = *c->Jobs();
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0].used_bytes, 10u << 20);
  EXPECT_EQ(jobs[0].regions, 1u);
  // The name of the failed region is still free to use.
  EXPECT_TRUE(c->Alloc("b", 6 << 20).ok());
}

TEST(Daemon, PoolOverrunNamesTheHolders) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}});
  ASSERT_TRUE(d);
  auto big = d->Connect(), small = d->Connect();
  ASSERT_TRUE(big->Attach("big-holder").ok());
  ASSERT_TRUE(small->Attach("latecomer").ok());
  ASSERT_TRUE(big->Alloc("a", 48 << 20).ok());
  auto over = small->Alloc("b", 32 << 20);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(over.status().message());
  EXPECT_THAT(msg, HasSubstr("16 MiB free of 64 MiB"));
  EXPECT_THAT(msg, HasSubstr("held by job 'big-holder' 48 MiB"));
  EXPECT_EQ(small->Status()->used_bytes, 48u << 20);
  auto whole = small->Alloc("c", 65 << 20);
  ASSERT_FALSE(whole.ok());
  EXPECT_THAT(std::string(whole.status().message()), HasSubstr("more than the whole pool"));
  EXPECT_TRUE(small->Alloc("d", 16 << 20).ok());  // exactly what is left
}

TEST(Daemon, ClientCannotResizeOrUnsealARegion) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("seal-job").ok());
  auto r = c->Alloc("sealed", 1 << 20);
  ASSERT_TRUE(r.ok());
  const int fd = (*r)->fd();
  const int seals = fcntl(fd, F_GET_SEALS);
  EXPECT_EQ(seals & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  errno = 0;
  EXPECT_NE(ftruncate(fd, 4096), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(ftruncate(fd, 64 << 20), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(fallocate(fd, 0, 0, 8 << 20), 0);  // growing through fallocate
  EXPECT_EQ(errno, EPERM);
  EXPECT_NE(fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE), 0);  // F_SEAL_SEAL forbids new seals
  EXPECT_EQ(errno, EPERM);
  // A fresh descriptor from the daemon still has the full size, and the daemon is unharmed.
  auto again = c->Map("sealed");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->size(), 1u << 20);
  std::memset((*again)->data(), 1, (*again)->size());
  EXPECT_TRUE(c->Status().ok());
}

TEST(Daemon, FreedMemoryComesBackZeroed) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("zero-job").ok());
  auto r = c->Alloc("dirty", 4 << 20);
  ASSERT_TRUE(r.ok());
  // Keep a mapping of our own past the free: the daemon punches the pages out regardless.
  const int keep = dup((*r)->fd());
  void* stale = mmap(nullptr, 4 << 20, PROT_READ | PROT_WRITE, MAP_SHARED, keep, 0);
  ASSERT_NE(stale, MAP_FAILED);
  std::memset((*r)->data(), 0x5A, (*r)->size());
  ASSERT_TRUE(c->Free(*r).ok());
  EXPECT_EQ((*r)->data(), nullptr);
  EXPECT_EQ(c->Status()->used_bytes, 0u);
  const auto* old = static_cast<const uint8_t*>(stale);
  size_t nonzero = 0;
  for (size_t i = 0; i < (4u << 20); ++i) nonzero += old[i] != 0;
  EXPECT_EQ(nonzero, 0u) << "freed pages must not keep the job's data";
  munmap(stale, 4 << 20);
  close(keep);
  auto fresh = c->Alloc("fresh", 4 << 20);
  ASSERT_TRUE(fresh.ok());
  const auto* p = static_cast<const uint8_t*>((*fresh)->data());
  for (size_t i = 0; i < (*fresh)->size(); ++i) nonzero += p[i] != 0;
  EXPECT_EQ(nonzero, 0u);
}

TEST(Daemon, TsctlReportsStatusAndJobsAsJson) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("tsctl-job", 32 << 20).ok());
  ASSERT_TRUE(c->Alloc("x", 5 << 20).ok());
  int rc = -1;
  auto status = nlohmann::json::parse(
      RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() + " status --json", &rc));
  EXPECT_EQ(rc, 0);
  std::set<std::string> keys;
  for (auto& [k, v] : status.items()) keys.insert(k);
  EXPECT_EQ(keys, (std::set<std::string>{"version", "uptime", "pool_bytes", "used_bytes", "locked",
                                         "jobs", "sessions"}));
  EXPECT_EQ(status["pool_bytes"], 256ull << 20);
  EXPECT_EQ(status["used_bytes"], 5ull << 20);
  EXPECT_EQ(status["jobs"], 1);
  EXPECT_EQ(status["sessions"], 1);
  EXPECT_EQ(status["locked"], true);
  auto jobs = nlohmann::json::parse(
      RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() + " jobs --json", &rc));
  EXPECT_EQ(rc, 0);
  ASSERT_EQ(jobs.size(), 1u);
  keys.clear();
  for (auto& [k, v] : jobs[0].items()) keys.insert(k);
  EXPECT_EQ(keys, (std::set<std::string>{"name", "uid", "sessions", "used_bytes", "quota_bytes",
                                         "numa_node", "activity"}));
  EXPECT_TRUE(jobs[0]["activity"].is_null());   // no optimizer (activity_test.cc has one)
  EXPECT_TRUE(jobs[0]["numa_node"].is_null());  // not placed (numa_daemon_test.cc places one)
  EXPECT_EQ(jobs[0]["name"], "tsctl-job");
  EXPECT_EQ(jobs[0]["uid"], getuid());
  EXPECT_EQ(jobs[0]["used_bytes"], 5ull << 20);
  EXPECT_EQ(jobs[0]["quota_bytes"], 32ull << 20);
  // Without a daemon, tsctl says where it looked and how to start one.
  const std::string out = RunCommand(
      std::string(TSCTL_BINARY) + " --socket /tmp/no-such-dir/tsd.sock status 2>&1", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(out, HasSubstr("/tmp/no-such-dir/tsd.sock"));
  EXPECT_THAT(out, HasSubstr("tsd --socket"));
}

TEST(Daemon, QuotaIsCappedByMaxJobQuota) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "256MiB", "--max-job-quota", "25%"}});
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("greedy", 1ull << 40).ok());
  EXPECT_EQ(c->quota_bytes(), 64u << 20);
  auto over = c->Alloc("too-much", 65 << 20);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(Daemon, ASecondDaemonOnALiveSocketRefusesAndAStaleSocketIsReplaced) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  int rc = -1;
  const std::string out = RunCommand(
      std::string(TSD_BINARY) + " --socket " + d->socket() + " --pool-size 64MiB 2>&1", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("another tsd (pid " + std::to_string(d->pid()) + ")"));
  EXPECT_TRUE(d->Connect()->Status().ok());  // the first one is untouched
  // Kill it hard: the socket file stays behind, stale; a new daemon replaces it.
  const std::string socket = d->socket();
  EXPECT_EQ(d->Stop(SIGKILL), 128 + SIGKILL);
  ASSERT_EQ(access(socket.c_str(), F_OK), 0) << "SIGKILL leaves the socket file";
  FILE* p = popen(
      (std::string(TSD_BINARY) + " --socket " + socket + " --pool-size 64MiB 2>&1").c_str(), "r");
  ASSERT_TRUE(WaitFor([&] { return tsd::Client::Connect(socket).ok(); }, 10));
  auto c = tsd::Client::Connect(socket);
  ASSERT_TRUE(c.ok());
  const uint32_t pid = (*c)->Status()->pid;
  kill(static_cast<pid_t>(pid), SIGTERM);
  pclose(p);
}

TEST(Daemon, LowMemlockLimitLeavesThePoolUnlockedAndSaysSo) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "64MiB"}, .memlock_limit = 1 << 20});
  ASSERT_TRUE(d);
  auto c = d->Connect();
  auto st = c->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_FALSE(st->locked);
  EXPECT_THAT(d->log(), HasSubstr("RLIMIT_MEMLOCK"));
  EXPECT_THAT(d->log(), HasSubstr("LimitMEMLOCK=infinity"));
  ASSERT_TRUE(c->Attach("unlocked").ok());
  auto r = c->Alloc("big", 16 << 20);  // larger than the limit: still served, unlocked
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE((*r)->locked());
}

}  // namespace
}  // namespace tsd::testing
