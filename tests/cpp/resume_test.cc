// Kept jobs and resuming (daemon/jobs/keep.cc, daemon/optimizer/resume.cc,
// daemon/optimizer/job_optimizer_resume.cc), in process: keep_for is honoured and then releases
// the job; another uid can neither resume nor checkpoint it; a registration that does not match
// the kept optimizer is refused, naming the difference, and changes nothing; what a dead trainer
// left in flight is settled (deliveries finished, held ones rolled back); a state file's
// checksums are written and a corrupt one is refused, changing nothing.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/jobs/registry.h"
#include "daemon/optimizer/registrar.h"
#include "daemon/optimizer/worker_pool.h"
#include "proto/control_page.h"
#include "proto/futex.h"

namespace tsd {
namespace {

using ::testing::HasSubstr;

constexpr uid_t kOwner = 4242;
constexpr uid_t kOther = 4343;
constexpr int kBuckets = 3;
constexpr uint64_t kNumel = 1000;

// A mapping of one of a job's regions, as a client would have it.
struct Mapped {
  void* data = nullptr;
  size_t bytes = 0;
  ~Mapped() {
    if (data != nullptr) munmap(data, bytes);
  }
};

class ResumeTest : public ::testing::Test {
 protected:
  ResumeTest() : workers_(1, false) {
    RegistryOptions o;
    o.pool_bytes = 256 << 20;
    o.max_job_quota_bytes = 256 << 20;
    o.max_keep_for = absl::Hours(1);
    o.pool = &workers_;
    registry_ = std::make_unique<Registry>(o);
    request_.add_groups()->set_lr(1e-3);
    request_.mutable_groups(0)->set_beta1(0.9);
    request_.mutable_groups(0)->set_beta2(0.999);
    request_.mutable_groups(0)->set_eps(1e-8);
    for (int b = 0; b < kBuckets; ++b) {
      auto* bucket = request_.add_buckets();
      bucket->set_numel(kNumel);
      bucket->set_grad_dtype(v1::F32);
      bucket->set_param_dtype(v1::F32);
    }
  }

  absl::StatusOr<AttachResult> Attach(uid_t uid, AttachOptions extra) {
    return registry_->Attach("kept", 0, uid, 1000, extra);
  }
  uint64_t StartKeptJob(absl::Duration keep_for = absl::Minutes(10)) {
    auto a = Attach(kOwner, {.keep_for = keep_for});
    EXPECT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->keep_for, keep_for);
    return a.ok() ? a->session_id : 0;
  }
  std::vector<v1::JobInfo> Jobs() { return registry_->Jobs(); }

  // Maps region `name` of the session's job.
  void Map(uint64_t session, const std::string& name, Mapped& out) {
    auto regions = registry_->ListRegions(session);
    ASSERT_TRUE(regions.ok()) << regions.status();
    for (const auto& r : *regions) {
      if (r.name() != name) continue;
      auto fd = registry_->GetFd(session, r.region_id());
      ASSERT_TRUE(fd.ok()) << fd.status();
      out.bytes = r.size_bytes();
      out.data = mmap(nullptr, out.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
      close(fd->fd);
      ASSERT_NE(out.data, MAP_FAILED);
      return;
    }
    FAIL() << "no region " << name;
  }
  // Rings bucket b's doorbell as a client does (its gradient slot holds whatever it holds).
  static void Deliver(wire::ControlView page, int b, uint32_t flags) {
    auto& slot = page.buckets[b];
    slot.flags.store(flags, std::memory_order_relaxed);
    slot.ready.store(slot.done.load() + 1, std::memory_order_release);
    page.header->doorbell.fetch_add(1, std::memory_order_release);
    wire::FutexWakeAll(&page.header->doorbell);
  }
  static bool WaitUntil(const std::function<bool()>& pred) {
    for (int i = 0; i < 2000; ++i) {
      if (pred()) return true;
      usleep(1000);
    }
    return false;
  }

  WorkerPool workers_;
  std::unique_ptr<Registry> registry_;
  v1::RegisterOptimizerRequest request_;
};

TEST_F(ResumeTest, KeepForIsHonouredThenTheJobIsReleased) {
  const uint64_t s = StartKeptJob(absl::Milliseconds(300));
  ASSERT_TRUE(registry_->Alloc(s, "data", 1 << 20).ok());
  const uint64_t used = registry_->Snapshot().used_bytes;
  registry_->SessionDisconnected(s);  // the trainer died
  const absl::Time died = absl::Now();
  registry_->Sweep(died + absl::Milliseconds(200));
  ASSERT_EQ(Jobs().size(), 1u) << "kept for keep_for although orphan_grace is 0";
  EXPECT_EQ(Jobs()[0].sessions(), 0u);
  EXPECT_EQ(registry_->Snapshot().used_bytes, used) << "its memory and quota charge stay";
  registry_->Sweep(died + absl::Milliseconds(400));
  EXPECT_EQ(Jobs().size(), 0u);
  EXPECT_EQ(registry_->Snapshot().used_bytes, 0u);
  // A detach releases at once, whatever keep_for says.
  const uint64_t again = StartKeptJob();
  ASSERT_TRUE(registry_->Detach(again).ok());
  EXPECT_EQ(Jobs().size(), 0u);
}

TEST_F(ResumeTest, KeepForAboveTheDaemonsMaximumIsRefused) {
  auto a = Attach(kOwner, {.keep_for = absl::Hours(2)});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(a.status().message()), HasSubstr("max_keep_for (1h)"));
  EXPECT_EQ(Jobs().size(), 0u);
}

TEST_F(ResumeTest, OnlyTheOwnerMayResumeOrCheckpoint) {
  const uint64_t s = StartKeptJob();
  ASSERT_TRUE(Registrar(*registry_).Register(s, request_).ok());
  registry_->SessionDisconnected(s);
  auto other = Attach(kOther, {.resume = true});
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("belongs to uid 4242"));
  auto ck = registry_->OptimizerForCheckpoint("kept", kOther);
  EXPECT_EQ(ck.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(registry_->OptimizerForCheckpoint("kept", kOwner).ok());
  EXPECT_EQ(registry_->OptimizerForCheckpoint("nope", kOwner).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(Jobs()[0].sessions(), 0u) << "the refused attach left no session";
}

TEST_F(ResumeTest, AKeptJobNeedsResumeAndResumeNeedsAJob) {
  auto missing = Attach(kOwner, {.resume = true});
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr("no job 'kept' to resume"));
  const uint64_t s = StartKeptJob();
  ASSERT_TRUE(Registrar(*registry_).Register(s, request_).ok());
  registry_->SessionDisconnected(s);
  auto plain = Attach(kOwner, {});
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plain.status().message()), HasSubstr("resume=True"));
  // A resume that gives up before taking the optimizer over (e.g. its registration did not
  // match) leaves the job kept, even when it detaches.
  auto gave_up = Attach(kOwner, {.resume = true});
  ASSERT_TRUE(gave_up.ok()) << gave_up.status();
  ASSERT_TRUE(registry_->Detach(gave_up->session_id).ok());
  ASSERT_EQ(Jobs().size(), 1u);
  auto resumed = Attach(kOwner, {.resume = true});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_TRUE(resumed->resumed);
  EXPECT_FALSE(resumed->job_created);
  // Once it took the optimizer over, its detach releases the job as any detach does.
  v1::RegisterOptimizerRequest req = request_;
  req.set_resume(true);
  ASSERT_TRUE(Registrar(*registry_).Register(resumed->session_id, req).ok());
  ASSERT_TRUE(registry_->Detach(resumed->session_id).ok());
  EXPECT_EQ(Jobs().size(), 0u);
}

TEST_F(ResumeTest, AMismatchedRegistrationIsRefusedNamingTheDifference) {
  const uint64_t s = StartKeptJob();
  ASSERT_TRUE(Registrar(*registry_).Register(s, request_).ok());
  registry_->SessionDisconnected(s);
  auto resumed = Attach(kOwner, {.resume = true});
  ASSERT_TRUE(resumed.ok());
  const uint64_t used = registry_->Snapshot().used_bytes;
  const uint32_t regions = Jobs()[0].regions();

  struct Case {
    std::function<void(v1::RegisterOptimizerRequest&)> change;
    const char* says;
  } cases[] = {
      {[](auto& r) { r.mutable_buckets(1)->set_numel(kNumel + 1); },
       "bucket 1 has 1000 elements in the kept job, 1001 here"},
      {[](auto& r) { r.add_buckets()->CopyFrom(r.buckets(0)); }, "3 trainable parameters"},
      {[](auto& r) { r.mutable_buckets(2)->set_param_dtype(v1::BF16); },
       "bucket 2 is float32 (gradients float32) in the kept job, bfloat16"},
      {[](auto& r) { r.set_moment_dtype(v1::BF16); }, "moments are float32"},
      {[](auto& r) { r.set_max_grad_norm(1.0); }, "max_grad_norm=0"},
      {[](auto& r) { r.add_groups()->CopyFrom(r.groups(0)); }, "1 parameter groups"},
  };
  for (const auto& c : cases) {
    v1::RegisterOptimizerRequest req = request_;
    c.change(req);
    req.set_resume(true);
    auto r = Registrar(*registry_).Register(resumed->session_id, req);
    ASSERT_FALSE(r.ok()) << c.says;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.says));
    EXPECT_EQ(registry_->Snapshot().used_bytes, used) << "nothing is allocated";
    EXPECT_EQ(Jobs()[0].regions(), regions);
  }
  // Hyperparameters may differ (a scheduler moved them on).
  v1::RegisterOptimizerRequest same = request_;
  same.mutable_groups(0)->set_lr(5e-4);
  same.set_resume(true);
  auto ok = Registrar(*registry_).Register(resumed->session_id, same);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->resume().bucket_steps_size(), kBuckets);
  EXPECT_EQ(registry_->Snapshot().used_bytes, used);
}

TEST_F(ResumeTest, RetiredBucketsMakeAKeptJobUnresumable) {
  const uint64_t s = StartKeptJob();
  ASSERT_TRUE(Registrar(*registry_).Register(s, request_).ok());
  // Another session of the job (same uid) may not retire the trainer's buckets.
  auto second = Attach(kOwner, {});
  ASSERT_TRUE(second.ok()) << second.status();
  const std::vector<uint32_t> two = {2};
  auto other = registry_->RetireBuckets(second->session_id, two);
  EXPECT_EQ(other.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(other.status().message()), HasSubstr("only the session that registered"));
  auto retired = registry_->RetireBuckets(s, two);
  ASSERT_TRUE(retired.ok()) << retired.status();
  EXPECT_EQ(retired->retired, 1u);
  registry_->SessionDisconnected(second->session_id);
  registry_->SessionDisconnected(s);
  // The share's state died with the trainer: the kept optimizer cannot be resumed.
  auto resumed = Attach(kOwner, {.resume = true});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  v1::RegisterOptimizerRequest req = request_;
  req.set_resume(true);
  auto r = Registrar(*registry_).Register(resumed->session_id, req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("retired 1 buckets"));
}

TEST_F(ResumeTest, WorkInFlightIsFinishedAndHeldDeliveriesAreRolledBack) {
  // Without clipping a delivery rung before the death is completed; with clipping the held final
  // deliveries of an uncommitted step are dropped.
  for (const bool clip : {false, true}) {
    SCOPED_TRACE(clip ? "clipping" : "no clipping");
    registry_->ReleaseAll();
    v1::RegisterOptimizerRequest req = request_;
    if (clip) req.set_max_grad_norm(1.0);
    const uint64_t s = StartKeptJob();
    ASSERT_TRUE(Registrar(*registry_).Register(s, req).ok());
    Mapped control, grads;
    Map(s, "opt/control", control);
    Map(s, "opt/grads", grads);
    const wire::ControlView page = wire::ControlView::Of(control.data, 1);
    page.groups[0] = {1e-3, 0.9, 0.999, 1e-8, 0.0};
    std::vector<float> g(kNumel, 0.5f);
    std::memcpy(grads.data, g.data(), kNumel * 4);
    Deliver(page, 0, wire::kDeliveryFirst | wire::kDeliveryFinal);
    Deliver(page, 2, wire::kDeliveryFirst | wire::kDeliveryFinal);
    registry_->SessionDisconnected(s);  // died before step() (no commit)

    auto resumed = Attach(kOwner, {.resume = true});
    ASSERT_TRUE(resumed.ok()) << resumed.status();
    req.set_resume(true);
    auto r = Registrar(*registry_).Register(resumed->session_id, req);
    ASSERT_TRUE(r.ok()) << r.status();
    const v1::ResumeReport& report = r->resume();
    ASSERT_EQ(report.bucket_steps_size(), kBuckets);
    if (clip) {
      EXPECT_THAT(report.bucket_steps(), ::testing::ElementsAre(0u, 0u, 0u));
      EXPECT_THAT(report.rolled_back(), ::testing::ElementsAre(0u, 2u));
    } else {
      EXPECT_THAT(report.bucket_steps(), ::testing::ElementsAre(1u, 0u, 1u));
      EXPECT_EQ(report.rolled_back_size(), 0);
    }
    EXPECT_EQ(report.committed(), 0u);
    // Every bucket is idle: the new trainer can deliver at once, and a commit counts from 0.
    for (int b = 0; b < kBuckets; ++b) {
      EXPECT_EQ(page.buckets[b].ready.load(), page.buckets[b].done.load()) << b;
    }
    Deliver(page, 0, wire::kDeliveryFirst | wire::kDeliveryFinal);
    if (clip) {
      page.header->commit.store(1);
      page.header->doorbell.fetch_add(1);
      wire::FutexWakeAll(&page.header->doorbell);
      EXPECT_TRUE(WaitUntil([&] { return page.header->committed.load() == 1; }));
    }
    EXPECT_TRUE(
        WaitUntil([&] { return page.buckets[0].done.load() == page.buckets[0].ready.load(); }));
    EXPECT_EQ(page.buckets[0].steps.load(), clip ? 1u : 2u);
    auto optimizer = registry_->OptimizerOf(resumed->session_id);
    ASSERT_TRUE(optimizer.ok());
    EXPECT_FALSE((*optimizer)->failed()) << (*optimizer)->failure();
  }
}

TEST_F(ResumeTest, ASpeculatedUpdateWithoutItsCommitIsUndone) {
  // Clipping that did not bite in step 1 makes step 2 speculate: its final deliveries are applied
  // before the commit. The trainer dies before step(): resuming undoes them (to within rounding),
  // so the new trainer starts from step 1's state, and step 2 counts from there.
  const uint64_t s = StartKeptJob();
  v1::RegisterOptimizerRequest req = request_;
  req.set_max_grad_norm(1.0);
  ASSERT_TRUE(Registrar(*registry_).Register(s, req).ok());
  Mapped control, grads, master, exp_avg, exp_avg_sq;
  Map(s, "opt/control", control);
  Map(s, "opt/grads", grads);
  Map(s, "opt/master", master);
  Map(s, "opt/exp_avg", exp_avg);
  Map(s, "opt/exp_avg_sq", exp_avg_sq);
  const wire::ControlView page = wire::ControlView::Of(control.data, 1);
  page.groups[0] = {1e-3, 0.9, 0.999, 1e-8, 0.01};
  const size_t stride = 4032 / 4;  // each bucket's 1000 floats, aligned to 64 bytes
  auto* m = static_cast<float*>(master.data);
  for (size_t i = 0; i < kBuckets * stride; ++i) m[i] = 0.001f * static_cast<float>(i % 977);
  auto* g = static_cast<float*>(grads.data);
  auto commit = [&](uint64_t n) {
    page.header->commit.store(n);
    page.header->doorbell.fetch_add(1);
    wire::FutexWakeAll(&page.header->doorbell);
    return WaitUntil([&] { return page.header->committed.load() == n; });
  };
  for (size_t i = 0; i < kBuckets * stride; ++i) g[i] = 1e-3f * static_cast<float>(i % 13);
  for (int b = 0; b < kBuckets; ++b) Deliver(page, b, wire::kDeliveryFirst | wire::kDeliveryFinal);
  ASSERT_TRUE(commit(1));  // norm about 0.4: the next step speculates
  ASSERT_LT(page.header->last_grad_norm, 0.8);
  auto copy = [](const Mapped& r) {
    const float* f = static_cast<const float*>(r.data);
    return std::vector<float>(f, f + kBuckets * 4032 / 4);
  };
  const std::vector<float> m1 = copy(master), a1 = copy(exp_avg), v1 = copy(exp_avg_sq);
  for (size_t i = 0; i < kBuckets * stride; ++i) g[i] = -2e-3f * static_cast<float>(i % 7);
  Deliver(page, 0, wire::kDeliveryFirst | wire::kDeliveryFinal);
  Deliver(page, 2, wire::kDeliveryFirst | wire::kDeliveryFinal);
  ASSERT_TRUE(WaitUntil([&] { return m[0 * stride + 5] != m1[0 * stride + 5]; }));
  ASSERT_TRUE(WaitUntil([&] { return m[2 * stride + 5] != m1[2 * stride + 5]; }));
  EXPECT_EQ(page.buckets[0].steps.load(), 1u);  // applied, not published
  registry_->SessionDisconnected(s);            // died before step(): no commit

  auto resumed = Attach(kOwner, {.resume = true});
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  req.set_resume(true);
  auto r = Registrar(*registry_).Register(resumed->session_id, req);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(r->resume().bucket_steps(), ::testing::ElementsAre(1u, 1u, 1u));
  EXPECT_THAT(r->resume().rolled_back(), ::testing::ElementsAre(0u, 2u));
  EXPECT_EQ(r->resume().committed(), 1u);
  const std::vector<float> m2 = copy(master), a2 = copy(exp_avg), v2 = copy(exp_avg_sq);
  // The undo's error is a few ulps of what the update added (|1-beta1| |g|, |1-beta2| g^2) or of
  // the moment, whichever is larger.
  double worst_m = 0, worst_a = 0, worst_v = 0;
  for (size_t i = 0; i < m1.size(); ++i) {
    const double g2 = g[i], added_a = 0.1 * std::fabs(g2), added_v = 0.001 * g2 * g2;
    worst_m = std::max(worst_m, std::fabs(static_cast<double>(m2[i]) - m1[i]));
    worst_a =
        std::max(worst_a, std::fabs(static_cast<double>(a2[i]) - a1[i]) /
                              std::max(std::fabs(static_cast<double>(a1[i])) + added_a, 1e-30));
    worst_v =
        std::max(worst_v, std::fabs(static_cast<double>(v2[i]) - v1[i]) /
                              std::max(std::fabs(static_cast<double>(v1[i])) + added_v, 1e-30));
  }
  EXPECT_LE(worst_m, 1e-6);  // the master back within rounding
  EXPECT_LE(worst_a, 1e-6);
  EXPECT_LE(worst_v, 1e-6);
  EXPECT_NE(m2, std::vector<float>(m2.size(), 0.0f));
  // The new trainer's step 2 is every bucket's second.
  for (int b = 0; b < kBuckets; ++b) Deliver(page, b, wire::kDeliveryFirst | wire::kDeliveryFinal);
  ASSERT_TRUE(commit(2));
  for (int b = 0; b < kBuckets; ++b) {
    EXPECT_TRUE(WaitUntil([&] { return page.buckets[b].steps.load() == 2u; })) << b;
  }
  auto optimizer = registry_->OptimizerOf(resumed->session_id);
  ASSERT_TRUE(optimizer.ok());
  EXPECT_FALSE((*optimizer)->failed()) << (*optimizer)->failure();
}

TEST_F(ResumeTest, StateFilesCarryChecksumsAndACorruptOneChangesNothing) {
  const uint64_t s = StartKeptJob();
  ASSERT_TRUE(Registrar(*registry_).Register(s, request_).ok());
  Mapped master;
  Map(s, "opt/master", master);
  for (uint64_t i = 0; i < kNumel; ++i) static_cast<float*>(master.data)[i] = 0.25f * i;
  auto optimizer = registry_->OptimizerForCheckpoint("kept", kOwner);
  ASSERT_TRUE(optimizer.ok());
  const int fd = memfd_create("state", MFD_CLOEXEC);
  auto written = (*optimizer)->SaveState(fd);
  ASSERT_TRUE(written.ok()) << written.status();
  std::string file(*written, '\0');
  ASSERT_EQ(pread(fd, file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
  EXPECT_THAT(file, HasSubstr("\"xxh3_64\":\"b0.master:"));
  // An intact file loads.
  ASSERT_TRUE((*optimizer)->LoadState(fd).ok());
  // One flipped bit in bucket 0's master: refused, naming the tensor; the masters are untouched.
  static_cast<float*>(master.data)[7] = -1.0f;  // what a load would overwrite
  std::string corrupt = file;
  corrupt[corrupt.size() - 8 * kBuckets - 3 * 4 * kNumel * kBuckets + 8] ^= 0x10;
  ASSERT_EQ(pwrite(fd, corrupt.data(), corrupt.size(), 0), static_cast<ssize_t>(corrupt.size()));
  auto loaded = (*optimizer)->LoadState(fd);
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("corrupt: tensor 'b0.master'"));
  EXPECT_EQ(static_cast<float*>(master.data)[7], -1.0f) << "a refused load changes nothing";
  close(fd);
}

}  // namespace
}  // namespace tsd
