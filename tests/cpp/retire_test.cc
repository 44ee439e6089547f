// Retiring optimizer buckets (the trainer's GPU share took their optimizer over), through a real
// daemon: the moments' pages really leave the memfds and the pool's count, the other buckets go on
// bit for bit as if nothing happened, a retired bucket's delivery fails the session (not the
// daemon), state files leave retired buckets out, and every bad request is refused changing
// nothing.
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "adamw_reference.h"
#include "attached_optimizer.h"
#include "daemon_process.h"
#include "proto/control_page.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

// Bytes of a region's memfd that hold pages (st_blocks), seen through a mapping the client asks
// for by name (mapping touches nothing).
uint64_t AllocatedBytes(tsd::Client& client, const std::string& region) {
  auto r = client.Map(region);
  EXPECT_TRUE(r.ok()) << r.status();
  if (!r.ok()) return 0;
  struct stat st {};
  EXPECT_EQ(fstat((*r)->fd(), &st), 0);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

uint64_t UsedBytes(tsd::Client& client) {
  auto st = client.Status();
  EXPECT_TRUE(st.ok()) << st.status();
  return st.ok() ? st->used_bytes : 0;
}

// One step over `buckets`, each with gradients from `rng`.
void Step(Optimizer& opt, const std::vector<size_t>& buckets, std::mt19937& rng) {
  for (size_t b : buckets) {
    ASSERT_TRUE(opt.Wait(b).ok());
    auto g = RandomVec(opt.numel(b), rng, 0.1f);
    std::memcpy(opt.grad(b), g.data(), g.size() * 4);
    ASSERT_TRUE(opt.Ready(b).ok());
  }
  ASSERT_TRUE(opt.WaitAll().ok());
}

OptimizerSpec ThreeBuckets() {
  OptimizerSpec spec;
  spec.groups = {{.lr = 1e-3, .weight_decay = 0.01}};
  // Large enough that most of the retired buckets' moment bytes are whole pages.
  spec.buckets = {{0, 300000, DType::kF32, DType::kF32},
                  {0, 1000, DType::kF32, DType::kF32},
                  {0, 500000, DType::kF32, DType::kF32}};
  return spec;
}

TEST(Retire, ReturnsTheMomentsToThePoolAndTheRestGoesOnBitForBit) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB", "--optimizer-threads", "2"}});
  ASSERT_TRUE(d);
  const OptimizerSpec spec = ThreeBuckets();
  auto ref = AttachOptimizer(*d, "reference", spec);
  ASSERT_TRUE(ref.opt);
  const uint64_t base = UsedBytes(*ref.client);
  auto a = AttachOptimizer(*d, "retiring", spec);
  ASSERT_TRUE(a.opt);
  // Each step's gradients, delivered to both jobs (after the retire, to `a` only bucket 1's).
  std::mt19937 rng(5);
  auto step = [&](bool retired) {
    std::vector<std::vector<float>> g;
    for (size_t b = 0; b < 3; ++b) g.push_back(RandomVec(spec.buckets[b].numel, rng, 0.1f));
    for (Optimizer* opt : {a.opt.get(), ref.opt.get()}) {
      for (size_t b = 0; b < 3; ++b) {
        if (opt == a.opt.get() && retired && b != 1) continue;
        ASSERT_TRUE(opt->Wait(b).ok());
        std::memcpy(opt->grad(b), g[b].data(), g[b].size() * 4);
        ASSERT_TRUE(opt->Ready(b).ok());
      }
      ASSERT_TRUE(opt->WaitAll().ok());
    }
  };
  for (int s = 0; s < 2; ++s) step(false);
  const uint64_t used = UsedBytes(*a.client);
  const uint64_t moments = AllocatedBytes(*a.client, "opt/exp_avg");
  ASSERT_GE(moments, 801000u * 4) << "the region is populated up front";

  const std::vector<uint32_t> moved = {0, 2};
  auto r = a.opt->RetireBuckets(moved);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->retired, 2u);
  // Both moments of 800,000 fp32 elements, less the partial pages at each retired span's ends
  // (at most three a region: buckets 0 and 2 sit on either side of bucket 1).
  const uint64_t full = 2ull * 800000 * 4;
  EXPECT_LE(r->released_bytes, full);
  EXPECT_GE(r->released_bytes, full - 6 * 4096);
  EXPECT_EQ(r->released_bytes % 4096, 0u);
  // The pages really left the memfds, and the pool counts them free.
  EXPECT_EQ(AllocatedBytes(*a.client, "opt/exp_avg"), moments - r->released_bytes / 2);
  EXPECT_EQ(AllocatedBytes(*a.client, "opt/exp_avg_sq"), moments - r->released_bytes / 2);
  EXPECT_EQ(UsedBytes(*a.client), used - r->released_bytes);
  EXPECT_TRUE(WaitFor(
      [&] { return d->log().find("event=buckets_retired job=retiring") != std::string::npos; }, 5));

  // A retry changes nothing.
  auto again = a.opt->RetireBuckets(moved);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->released_bytes, 0u);
  EXPECT_EQ(again->retired, 2u);
  EXPECT_EQ(UsedBytes(*a.client), used - r->released_bytes);

  // Bucket 1 goes on exactly as in the job that retired nothing.
  for (int s = 0; s < 3; ++s) step(true);
  EXPECT_EQ(std::vector<float>(a.opt->master(1), a.opt->master(1) + 1000),
            std::vector<float>(ref.opt->master(1), ref.opt->master(1) + 1000));
  EXPECT_EQ(a.opt->steps(1), 5u);
  EXPECT_EQ(a.opt->steps(0), 2u);

  // Retiring bucket 1 as well releases the pages the three shared.
  const std::vector<uint32_t> last = {1};
  auto all = a.opt->RetireBuckets(last);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->retired, 3u);
  EXPECT_GE(all->released_bytes, 2ull * 1000 * 4);
  EXPECT_EQ(UsedBytes(*a.client), used - r->released_bytes - all->released_bytes);

  // Releasing the job returns exactly what it still held: the pool is back where it was.
  ASSERT_TRUE(a.client->Detach().ok());
  EXPECT_TRUE(WaitFor([&] { return UsedBytes(*ref.client) == base; }, 5))
      << UsedBytes(*ref.client) << " used, " << base << " before the job";
}

// bf16 working copies: the masters are tsd's alone (not the parameter slots), so the client
// unpins its mapping of them and the retired buckets' masters go too; with fp32 parameters (the
// test above) the masters are the slots the GPU reads and stay.
TEST(Retire, MastersGoTooWhereTheyAreNotTheParameterSlots) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "256MiB"}});
  ASSERT_TRUE(d);
  OptimizerSpec spec = ThreeBuckets();
  for (auto& b : spec.buckets) b.param_dtype = b.grad_dtype = DType::kBF16;
  spec.moment_dtype = DType::kBF16;
  auto a = AttachOptimizer(*d, "bf16", spec);
  ASSERT_TRUE(a.opt);
  for (size_t b = 0; b < 3; ++b) {
    std::memset(a.opt->grad(b), 0, a.opt->numel(b) * 2);
    ASSERT_TRUE(a.opt->Ready(b).ok());
  }
  ASSERT_TRUE(a.opt->WaitAll().ok());
  const uint64_t masters = AllocatedBytes(*a.client, "opt/master");
  const uint64_t used = UsedBytes(*a.client);
  const std::vector<uint32_t> moved = {2};
  auto r = a.opt->RetireBuckets(moved);
  ASSERT_TRUE(r.ok()) << r.status();
  // 500,000 elements: fp32 master (4 bytes) and two bf16 moments (2 each), less partial pages.
  EXPECT_LE(r->released_bytes, 500000u * 8);
  EXPECT_GE(r->released_bytes, 500000u * 8 - 3 * 2 * 4096);
  const uint64_t master_gone = masters - AllocatedBytes(*a.client, "opt/master");
  EXPECT_GE(master_gone, 500000u * 4 - 2 * 4096);
  EXPECT_LE(master_gone, 500000u * 4);
  EXPECT_EQ(UsedBytes(*a.client), used - r->released_bytes);
  // The gradient and parameter slots stay whole.
  struct stat st {};
  auto params = a.client->Map("opt/params");
  ASSERT_TRUE(params.ok());
  ASSERT_EQ(fstat((*params)->fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_blocks) * 512, (*params)->size());
}

TEST(Retire, StateFilesLeaveRetiredBucketsOut) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = AttachOptimizer(*d, "state", ThreeBuckets());
  ASSERT_TRUE(a.opt);
  std::mt19937 rng(9);
  Step(*a.opt, {0, 1, 2}, rng);
  const int whole = memfd_create("whole", MFD_CLOEXEC), after = memfd_create("after", MFD_CLOEXEC);
  ASSERT_TRUE(a.opt->SaveState(whole).ok());
  const std::vector<uint32_t> moved = {2};
  ASSERT_TRUE(a.opt->RetireBuckets(moved).ok());

  // A whole save is now partial: bucket 2 is not in it.
  auto written = a.opt->SaveState(after);
  ASSERT_TRUE(written.ok()) << written.status();
  std::string file(static_cast<size_t>(*written), '\0');
  ASSERT_EQ(pread(after, file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
  EXPECT_THAT(file, HasSubstr("\"partial\":\"2\""));
  EXPECT_THAT(file, HasSubstr("\"b1.exp_avg\""));
  EXPECT_EQ(file.find("\"b2."), std::string::npos);
  // Naming a retired bucket is refused.
  auto named = a.opt->SaveState(after, moved);
  EXPECT_EQ(named.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(named.status().message()), HasSubstr("bucket 2 was retired"));

  // A whole file of this layout still loads: the live buckets take its state, bucket 2 nothing.
  Step(*a.opt, {0, 1}, rng);
  EXPECT_EQ(a.opt->steps(0), 2u);
  auto loaded = a.opt->LoadState(whole);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(a.opt->steps(0), 1u);
  EXPECT_EQ(a.opt->steps(1), 1u);
  close(whole);
  close(after);
}

TEST(Retire, TsctlCheckpointRefusesAJobWithAGpuShareLeavingTheFileAlone) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto a = AttachOptimizer(*d, "shared", ThreeBuckets());
  ASSERT_TRUE(a.opt);
  std::mt19937 rng(4);
  Step(*a.opt, {0, 1, 2}, rng);
  const std::string file = d->dir() + "/shared.safetensors";
  const std::string tsctl =
      std::string(TSCTL_BINARY) + " --socket " + d->socket() + " checkpoint shared " + file;
  int rc = -1;
  RunCommand(tsctl + " 2>&1", &rc);  // a whole state: written
  ASSERT_EQ(rc, 0);
  const std::string before = RunCommand("xxh64sum " + file + " 2>/dev/null || cksum " + file);

  ASSERT_TRUE(a.opt->RetireBuckets(std::vector<uint32_t>{1}).ok());
  const std::string out = RunCommand(tsctl + " 2>&1", &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("moved the optimizer of 1 of its 3 buckets"));
  EXPECT_THAT(out, HasSubstr("optimizer.state_dict()"));
  EXPECT_THAT(out, HasSubstr("was not changed"));
  EXPECT_EQ(RunCommand("xxh64sum " + file + " 2>/dev/null || cksum " + file), before);
  EXPECT_EQ(RunCommand("ls -A " + d->dir() + " | grep -c tmp-"), "0\n");  // nothing left behind
  // The job goes on.
  Step(*a.opt, {0, 2}, rng);
  EXPECT_EQ(a.opt->steps(0), 2u);
}

TEST(Retire, BadRequestsAreRefusedChangingNothing) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec = ThreeBuckets();
  spec.max_grad_norm = 1.0;
  spec.hold_clipped_updates = true;  // a delivery stays held until Commit()
  auto a = AttachOptimizer(*d, "refusals", spec);
  ASSERT_TRUE(a.opt);
  const uint64_t used = UsedBytes(*a.client);
  const std::vector<uint32_t> out_of_range = {1, 3}, unordered = {2, 0}, twice = {1, 1}, b0 = {0};
  auto r = a.opt->RetireBuckets(out_of_range);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("bucket 3 does not exist"));
  EXPECT_THAT(std::string(a.opt->RetireBuckets(unordered).status().message()),
              HasSubstr("strictly ascending"));
  EXPECT_EQ(a.opt->RetireBuckets(twice).status().code(), absl::StatusCode::kInvalidArgument);

  // Held for the commit: refused until the step is over.
  std::mt19937 rng(1);
  auto g = RandomVec(a.opt->numel(0), rng, 0.1f);
  std::memcpy(a.opt->grad(0), g.data(), g.size() * 4);
  ASSERT_TRUE(a.opt->Ready(0).ok());
  auto held = a.opt->RetireBuckets(b0);
  EXPECT_EQ(held.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(held.status().message()), HasSubstr("held for the step's commit"));
  EXPECT_EQ(UsedBytes(*a.client), used);
  ASSERT_TRUE(a.opt->Commit(absl::Seconds(10)).ok());
  EXPECT_EQ(a.opt->steps(0), 1u);

  // Now it retires, and a delivery for the retired bucket fails this session only.
  ASSERT_TRUE(a.opt->RetireBuckets(b0).ok());
  std::memcpy(a.opt->grad(0), g.data(), g.size() * 4);
  ASSERT_TRUE(a.opt->Ready(0).ok());
  auto refused = a.opt->Commit(absl::Seconds(5));
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("bucket 0 was retired"));
  auto bystander = AttachOptimizer(*d, "bystander", ThreeBuckets());
  ASSERT_TRUE(bystander.opt);
  Step(*bystander.opt, {0, 1, 2}, rng);
  EXPECT_EQ(bystander.opt->steps(2), 1u);
}

TEST(Retire, DataParallelOptimizersKeepEveryBucket) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  OptimizerSpec spec = ThreeBuckets();
  spec.world = 2;
  spec.rank = 0;
  auto a = AttachOptimizer(*d, "ranks", spec);
  ASSERT_TRUE(a.opt);
  const std::vector<uint32_t> b0 = {0};
  auto r = a.opt->RetireBuckets(b0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("data-parallel"));
}

}  // namespace
}  // namespace tsd::testing
