// `tsctl checkpoint JOB FILE` against a real daemon: tsd writes the state of a job into a file
// tsctl opened (never a path of its own), tsctl makes it durable and renames it into place; the
// file loads back bit-exactly and a corrupted copy is refused by its checksums. A failed
// checkpoint leaves FILE as it was and no temporary file behind. A trainer that died is kept for
// keep_for and a restarted one resumes its optimizer.
#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kNumel = 4096;

OptimizerSpec Spec() {
  OptimizerSpec spec;
  spec.groups = {GroupHyper{}};
  spec.buckets = {{0, kNumel, DType::kF32, DType::kF32}, {0, kNumel / 2, DType::kF32, DType::kF32}};
  return spec;
}

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> out;
  DIR* d = opendir(dir.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0)
      out.push_back(e->d_name);
  }
  closedir(d);
  return out;
}

// Delivers one gradient to every bucket and waits: one optimizer step.
void Step(Optimizer& opt, float g) {
  for (size_t b = 0; b < opt.num_buckets(); ++b) {
    auto* slot = static_cast<float*>(opt.grad(b));
    for (uint64_t i = 0; i < opt.numel(b); ++i) slot[i] = g * static_cast<float>(i % 7 + 1);
    ASSERT_TRUE(opt.Ready(b).ok());
  }
  ASSERT_TRUE(opt.WaitAll().ok());
}

TEST(CheckpointTest, TsctlWritesAFileThatLoadsBackAndCorruptionIsRefused) {
  auto d = DaemonProcess::Start();
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("ck-job").ok());
  auto opt = c->RegisterOptimizer(Spec());
  ASSERT_TRUE(opt.ok()) << opt.status();
  for (size_t b = 0; b < (*opt)->num_buckets(); ++b)
    for (uint64_t i = 0; i < (*opt)->numel(b); ++i) (*opt)->master(b)[i] = 0.001f * i;
  for (int s = 0; s < 3; ++s) Step(**opt, 0.1f * (s + 1));
  const std::vector<float> masters((*opt)->master(0), (*opt)->master(0) + kNumel);

  const std::string dir = d->dir() + "/ckpt";
  ASSERT_EQ(mkdir(dir.c_str(), 0700), 0);
  const std::string file = dir + "/state.safetensors";
  int rc = -1;
  const std::string out = RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() +
                                         " checkpoint ck-job " + file + " 2>&1",
                                     &rc);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_THAT(out, HasSubstr("checkpoint of job 'ck-job'"));
  EXPECT_THAT(Entries(dir), ::testing::ElementsAre("state.safetensors")) << "no temporary left";

  // Train on, then load the checkpoint: the masters are the checkpoint's again, exactly.
  Step(**opt, 0.5f);
  ASSERT_NE(std::memcmp((*opt)->master(0), masters.data(), kNumel * 4), 0);
  int fd = open(file.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  auto loaded = (*opt)->LoadState(fd);
  close(fd);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(std::memcmp((*opt)->master(0), masters.data(), kNumel * 4), 0);
  EXPECT_EQ((*opt)->steps(0), 3u);

  // A corrupted copy (one byte of bucket 1's exp_avg_sq) is refused and changes nothing.
  const std::string bad = dir + "/bad.safetensors";
  ASSERT_EQ(RunCommand("cp " + file + " " + bad, &rc), "");
  fd = open(bad.c_str(), O_RDWR | O_CLOEXEC);
  const off_t size = lseek(fd, 0, SEEK_END);
  const char flip = 0x5a;
  ASSERT_EQ(pwrite(fd, &flip, 1, size - 8 - 100), 1);
  Step(**opt, 0.25f);
  const std::vector<float> now((*opt)->master(1), (*opt)->master(1) + kNumel / 2);
  auto refused = (*opt)->LoadState(fd);
  close(fd);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("'b1.exp_avg_sq'"));
  EXPECT_EQ(std::memcmp((*opt)->master(1), now.data(), now.size() * 4), 0);
  EXPECT_EQ((*opt)->steps(0), 4u);
}

TEST(CheckpointTest, AFailedCheckpointLeavesTheFileAsItWas) {
  auto d = DaemonProcess::Start();
  const std::string file = d->dir() + "/keep.txt";
  ASSERT_EQ(RunCommand("printf before > " + file), "");
  int rc = -1;
  std::string out = RunCommand(std::string(TSCTL_BINARY) + " --socket " + d->socket() +
                                   " checkpoint no-such-job " + file + " 2>&1",
                               &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("there is no job 'no-such-job'"));
  EXPECT_THAT(out, HasSubstr("was not changed"));
  EXPECT_EQ(RunCommand("cat " + file), "before");
  EXPECT_THAT(Entries(d->dir()), ::testing::Not(::testing::Contains(HasSubstr(".tmp-"))));
  // A job without an optimizer has nothing to checkpoint.
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("bare").ok());
  out = RunCommand(
      std::string(TSCTL_BINARY) + " --socket " + d->socket() + " checkpoint bare " + file + " 2>&1",
      &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("has no optimizer"));
  EXPECT_EQ(RunCommand("cat " + file), "before");
}

TEST(CheckpointTest, AKeptJobIsResumedByARestartedTrainer) {
  auto d = DaemonProcess::Start();
  std::vector<float> masters;
  {
    auto c = d->Connect();
    ASSERT_TRUE(c->Attach("kept-job", 0, JobOptions{.keep_for = absl::Minutes(5)}).ok());
    EXPECT_EQ(c->keep_for(), absl::Minutes(5));
    auto opt = c->RegisterOptimizer(Spec());
    ASSERT_TRUE(opt.ok()) << opt.status();
    for (int s = 0; s < 2; ++s) Step(**opt, 0.3f);
    masters.assign((*opt)->master(0), (*opt)->master(0) + kNumel);
    // The trainer dies: its connection closes without a detach (the test's client cannot be
    // killed, so its side connection is shut under it).
    for (int fd = 3; fd < 1024; ++fd) {
      sockaddr_storage addr{};
      socklen_t len = sizeof(addr);
      if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0 &&
          addr.ss_family == AF_UNIX) {
        int type = 0;
        socklen_t tlen = sizeof(type);
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 && type == SOCK_SEQPACKET)
          shutdown(fd, SHUT_RDWR);
      }
    }
    ASSERT_TRUE(WaitFor(
        [&] {
          auto jobs = c->Jobs();
          return jobs.ok() && jobs->size() == 1 && (*jobs)[0].sessions == 0;
        },
        5));
  }
  auto again = d->Connect();
  auto plain = again->Attach("kept-job");
  EXPECT_EQ(plain.code(), absl::StatusCode::kFailedPrecondition) << plain;
  ASSERT_TRUE(again->Attach("kept-job", 0, JobOptions{.resume = true}).ok());
  EXPECT_TRUE(again->resumed());
  OptimizerSpec wrong = Spec();
  wrong.buckets[1].numel += 1;
  auto refused = again->ResumeOptimizer(wrong, nullptr);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("bucket 1 has 2048 elements"));
  ResumeReport report;
  auto opt = again->ResumeOptimizer(Spec(), &report);
  ASSERT_TRUE(opt.ok()) << opt.status();
  EXPECT_THAT(report.bucket_steps, ::testing::ElementsAre(2u, 2u));
  EXPECT_EQ(std::memcmp((*opt)->master(0), masters.data(), kNumel * 4), 0);
  Step(**opt, 0.3f);
  EXPECT_EQ((*opt)->steps(0), 3u);
}

}  // namespace
}  // namespace tsd::testing
