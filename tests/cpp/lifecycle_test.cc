// How sessions end: clients killed mid-allocation (50 times), orphan grace, detach, SIGTERM with
// clients attached, and a client with no daemon to talk to.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

// Starts `tsd_test_client alloc-loop` and returns once it has attached.
pid_t StartAllocLoop(const std::string& socket, const std::string& job) {
  int out[2];
  if (pipe(out) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(out[1], 1);
    close(out[0]);
    execl(TSD_TEST_CLIENT, TSD_TEST_CLIENT, "alloc-loop", socket.c_str(), job.c_str(), nullptr);
    _exit(127);
  }
  close(out[1]);
  char buf[16] = {};
  const ssize_t n = read(out[0], buf, sizeof(buf) - 1);
  close(out[0]);
  EXPECT_GT(n, 0) << "the client did not attach";
  return pid;
}

bool PoolIsEmpty(tsd::Client& c) {
  auto st = c.Status();
  return st.ok() && st->used_bytes == 0 && st->jobs == 1 &&
         st->sessions == 1;  // the observer's own
}

TEST(Lifecycle, FiftyClientsKilledMidAllocationLeaveNothingBehind) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  ASSERT_TRUE(observer->Attach("observer").ok());
  ASSERT_TRUE(PoolIsEmpty(*observer));
  const int baseline_fds = d->OpenFds();
  std::mt19937 rng(1234);
  int killed_with_memory = 0;
  for (int cycle = 0; cycle < 50; ++cycle) {
    const pid_t pid = StartAllocLoop(d->socket(), "victim-" + std::to_string(cycle % 3));
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(
        std::chrono::microseconds(std::uniform_int_distribution<int>(0, 30000)(rng)));
    killed_with_memory += observer->Status()->used_bytes > 0;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    ASSERT_TRUE(WaitFor([&] { return PoolIsEmpty(*observer); }, 2))
        << "cycle " << cycle << ": used_bytes=" << observer->Status()->used_bytes;
  }
  EXPECT_GT(killed_with_memory, 10) << "most clients should die holding memory";
  // Back to the baseline, or below it (gRPC may close an idle descriptor of its own meanwhile).
  EXPECT_TRUE(WaitFor([&] { return d->OpenFds() <= baseline_fds; }, 5))
      << "descriptors: " << d->OpenFds() << " now, " << baseline_fds << " before";
  EXPECT_TRUE(observer->Alloc("still-works", 1 << 20).ok());
}

TEST(Lifecycle, ADeadClientIsDetectedWithinASecond) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  ASSERT_TRUE(observer->Attach("observer").ok());
  const pid_t pid = StartAllocLoop(d->socket(), "dies");
  ASSERT_TRUE(WaitFor([&] { return observer->Status()->used_bytes > 0; }, 2));
  const auto t0 = std::chrono::steady_clock::now();
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  ASSERT_TRUE(WaitFor([&] { return PoolIsEmpty(*observer); }, 1.0));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 1.0);
  EXPECT_THAT(d->log(), HasSubstr("reason=disconnected"));
}

TEST(Lifecycle, OrphanGraceKeepsTheJobThenReleasesIt) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "256MiB", "--orphan-grace", "1500ms"}});
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  ASSERT_TRUE(observer->Attach("observer").ok());
  const pid_t pid = StartAllocLoop(d->socket(), "orphan");
  ASSERT_TRUE(WaitFor([&] { return observer->Status()->used_bytes > 0; }, 2));
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  auto jobs = *observer->Jobs();
  ASSERT_EQ(jobs.size(), 2u) << "inside the grace period the orphan keeps its memory";
  const auto& orphan = jobs[0].name == "orphan" ? jobs[0] : jobs[1];
  EXPECT_EQ(orphan.sessions, 0u);
  EXPECT_GT(orphan.used_bytes, 0u);
  ASSERT_TRUE(WaitFor([&] { return PoolIsEmpty(*observer); }, 3));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(s, 1.4);
  EXPECT_THAT(d->log(), HasSubstr("reason=orphan_grace_expired"));
}

TEST(Lifecycle, DetachOfTheLastSessionReleasesTheJob) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = d->Connect(), b = d->Connect();
  ASSERT_TRUE(a->Attach("two-ranks").ok());
  ASSERT_TRUE(b->Attach("two-ranks").ok());
  ASSERT_TRUE(a->Alloc("r", 2 << 20).ok());
  ASSERT_TRUE(a->Detach().ok());
  EXPECT_EQ(b->Status()->used_bytes, 2u << 20);  // b still holds the job
  EXPECT_EQ(a->Alloc("x", 4096).status().code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(b->Detach().ok());
  EXPECT_EQ(b->Status()->used_bytes, 0u);
  EXPECT_EQ(b->Status()->jobs, 0u);
}

TEST(Lifecycle, SigtermWithClientsAttached) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = d->Connect(), b = d->Connect();
  ASSERT_TRUE(a->Attach("job-a").ok());
  ASSERT_TRUE(b->Attach("job-b").ok());
  ASSERT_TRUE(a->Alloc("r", 8 << 20).ok());
  ASSERT_TRUE(b->Alloc("r", 8 << 20).ok());
  const std::string socket = d->socket();
  double seconds = 0;
  EXPECT_EQ(d->Stop(SIGTERM, &seconds), 0);
  EXPECT_LT(seconds, 2.0);
  auto r = a->Alloc("after", 4096);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("shutting down"));
  auto m = b->Map("r");
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("shutting down"));
  EXPECT_NE(access(socket.c_str(), F_OK), 0) << "the socket file is removed";
  EXPECT_THAT(d->log(), HasSubstr("event=stopped"));
}

TEST(Lifecycle, NoDaemonSaysWhereItLookedAndHowToStartOne) {
  auto c = tsd::Client::Connect("/tmp/tsd-nowhere-" + std::to_string(getpid()) + "/tsd.sock");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  const std::string msg(c.status().message());
  EXPECT_THAT(msg, HasSubstr("/tmp/tsd-nowhere-"));
  EXPECT_THAT(msg, HasSubstr("tsd --socket"));
  EXPECT_THAT(msg, HasSubstr("TSD_SOCKET"));
}

}  // namespace
}  // namespace tsd::testing
