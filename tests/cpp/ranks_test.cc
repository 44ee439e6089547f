// Data-parallel ranks sharing a job's optimizer (daemon/jobs/ranks.cc): a second session of the
// job joins the optimizer as another rank instead of being refused; every bad rank, world or
// layout a client sends is refused and changes nothing; a commit is applied once every rank made
// it; a rank whose session dies fails the optimizer for the others.
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/optimizer/registrar.h"
#include "daemon/optimizer/worker_pool.h"
#include "proto/control_page.h"

namespace tsd {
namespace {

using ::testing::HasSubstr;

class RanksTest : public ::testing::Test {
 protected:
  RanksTest() : workers_(1, false) {
    RegistryOptions o;
    o.pool_bytes = 256 << 20;
    o.max_job_quota_bytes = 256 << 20;
    o.pool = &workers_;
    registry_ = std::make_unique<Registry>(o);
    auto* g = request_.add_groups();
    g->set_lr(1e-3);
    g->set_beta1(0.9);
    g->set_beta2(0.999);
    g->set_eps(1e-8);
    for (int b = 0; b < 2; ++b) {
      auto* bucket = request_.add_buckets();
      bucket->set_numel(1000);
      bucket->set_grad_dtype(v1::F32);
      bucket->set_param_dtype(v1::F32);
    }
    request_.set_max_grad_norm(1.0);
  }
  uint64_t Attach(uid_t uid = getuid()) {
    auto a = registry_->Attach("job", 0, uid, getpid());
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : 0;
  }
  // A rank of a kept job (keep_for), or of a restarted group resuming it.
  uint64_t AttachKept(bool resume = false, absl::Duration keep_for = absl::Seconds(60)) {
    AttachOptions o;
    o.keep_for = keep_for;
    o.resume = resume;
    auto a = registry_->Attach("job", 0, getuid(), getpid(), o);
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : 0;
  }
  v1::RegisterOptimizerRequest Resume(uint32_t rank, uint32_t world) const {
    v1::RegisterOptimizerRequest r = Rank(rank, world);
    r.set_resume(true);
    return r;
  }
  // What the side server does every sweep: tells the sessions of a failed optimizer and ends them.
  void SweepLikeTheServer() {
    for (const ClosedSession& c : registry_->Sweep(absl::Now())) {
      registry_->EndSession(c.session_id, ReleaseReason::kOptimizerFailed);
    }
  }
  // One data-parallel step of the two buckets with clipping: each delivered (bucket b by rank b),
  // then each rank's commit. `commits`: how many ranks commit (a rank that dies first does not).
  static void Deliver(wire::ControlView& page, uint64_t delivery) {
    for (int b = 0; b < 2; ++b) {
      page.buckets[b].flags.store(wire::kDeliveryFirst | wire::kDeliveryFinal);
      page.buckets[b].ready.store(delivery, std::memory_order_release);
    }
    page.header->doorbell.fetch_add(1);
  }
  static void Commit(wire::ControlView& page, uint32_t rank, uint64_t commit) {
    page.ranks[rank].commit.store(commit, std::memory_order_release);
    page.header->doorbell.fetch_add(1);
  }
  v1::RegisterOptimizerRequest Rank(uint32_t rank, uint32_t world) const {
    v1::RegisterOptimizerRequest r = request_;
    r.set_rank(rank);
    r.set_world(world);
    return r;
  }
  uint64_t Used() {
    auto jobs = registry_->Jobs();
    return jobs.empty() ? 0 : jobs[0].used_bytes();
  }
  // The job's control page, mapped here as a client maps it.
  wire::ControlView MapControl(uint64_t session) {
    auto regions = registry_->ListRegions(session);
    EXPECT_TRUE(regions.ok());
    for (const auto& r : *regions) {
      if (r.name() != "opt/control") continue;
      auto fd = registry_->GetFd(session, r.region_id());
      EXPECT_TRUE(fd.ok());
      void* p = mmap(nullptr, r.size_bytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd->fd, 0);
      close(fd->fd);
      EXPECT_NE(p, MAP_FAILED);
      mapped_ = {p, r.size_bytes()};
      return wire::ControlView::Of(p, 1, 2);
    }
    ADD_FAILURE() << "no opt/control region";
    return {};
  }
  ~RanksTest() override {
    if (mapped_.first != nullptr) munmap(mapped_.first, mapped_.second);
  }

  WorkerPool workers_;
  std::unique_ptr<Registry> registry_;
  v1::RegisterOptimizerRequest request_;
  std::pair<void*, size_t> mapped_{nullptr, 0};
};

template <typename F>
bool Eventually(F done) {
  for (int i = 0; i < 2000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST_F(RanksTest, TheSecondRankJoinsTheOneOptimizer) {
  const uint64_t r0 = Attach(), r1 = Attach();
  Registrar registrar(*registry_);
  auto first = registrar.Register(r0, Rank(0, 2));
  ASSERT_TRUE(first.ok()) << first.status();
  const uint64_t used = Used();
  EXPECT_EQ(used, first->state_bytes());
  auto second = registrar.Register(r1, Rank(1, 2));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->state_bytes(), first->state_bytes());
  EXPECT_EQ(second->buckets(1).grad_offset(), first->buckets(1).grad_offset());
  EXPECT_EQ(Used(), used);  // one optimizer, not two
  EXPECT_EQ(*registry_->OptimizerOf(r0), *registry_->OptimizerOf(r1));
  EXPECT_EQ((*registry_->OptimizerOf(r0))->plan().world, 2u);
}

TEST_F(RanksTest, BadRanksWorldsAndLayoutsAreRefusedAndChangeNothing) {
  const uint64_t r0 = Attach(), r1 = Attach(), r2 = Attach();
  Registrar registrar(*registry_);
  auto out_of_range = registrar.Register(r0, Rank(2, 2));
  EXPECT_EQ(out_of_range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(out_of_range.status().message()), HasSubstr("out of range"));
  EXPECT_EQ(registrar.Register(r0, Rank(0, 1u << 20)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Used(), 0u);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
  const uint64_t used = Used();

  auto world = registrar.Register(r1, Rank(1, 3));
  EXPECT_EQ(world.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(world.status().message()), HasSubstr("world of 2"));
  auto duplicate = registrar.Register(r1, Rank(0, 2));
  EXPECT_EQ(duplicate.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(duplicate.status().message()), HasSubstr("rank 0"));
  auto twice = registrar.Register(r0, Rank(1, 2));
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  v1::RegisterOptimizerRequest other = Rank(1, 2);
  other.mutable_buckets(1)->set_numel(999);
  auto layout = registrar.Register(r1, other);
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr("bucket 1 has 1000 elements"));
  auto single = registrar.Register(r2, request_);
  EXPECT_EQ(single.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Used(), used);
  // Another uid cannot reach the job at all.
  auto stranger = registry_->Attach("job", 0, getuid() + 1, getpid());
  EXPECT_EQ(stranger.status().code(), absl::StatusCode::kPermissionDenied);
  // The refusals left rank 1 free.
  EXPECT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
  EXPECT_EQ(Used(), used);
}

TEST_F(RanksTest, ACommitIsAppliedOnceEveryRankMadeIt) {
  const uint64_t r0 = Attach(), r1 = Attach();
  Registrar registrar(*registry_);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
  ASSERT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
  wire::ControlView page = MapControl(r0);
  ASSERT_NE(page.header, nullptr);
  EXPECT_EQ(page.header->world, 2u);
  // Rank 0 delivers bucket 0, rank 1 bucket 1 (zero gradients: a step still counts).
  for (int b = 0; b < 2; ++b) {
    page.buckets[b].flags.store(wire::kDeliveryFirst | wire::kDeliveryFinal);
    page.buckets[b].ready.store(1, std::memory_order_release);
  }
  page.header->doorbell.fetch_add(1);
  page.ranks[0].commit.store(1, std::memory_order_release);
  page.header->doorbell.fetch_add(1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(page.header->committed.load(), 0u);  // rank 1 has not committed
  EXPECT_EQ(page.buckets[0].steps.load(), 0u);
  page.ranks[1].commit.store(1, std::memory_order_release);
  page.header->doorbell.fetch_add(1);
  EXPECT_TRUE(Eventually([&] { return page.header->committed.load() == 1; }));
  EXPECT_EQ(page.buckets[0].steps.load(), 1u);
  EXPECT_EQ(page.buckets[1].steps.load(), 1u);
  // A rank's counter that jumps fails the optimizer, naming the rank.
  page.ranks[1].commit.store(5, std::memory_order_release);
  page.header->doorbell.fetch_add(1);
  auto opt = *registry_->OptimizerOf(r0);
  EXPECT_TRUE(Eventually([&] { return opt->failed(); }));
  EXPECT_THAT(opt->failure(), HasSubstr("rank 1's commit counter 5"));
}

TEST_F(RanksTest, ARankThatDiesFailsTheOptimizerForTheOthers) {
  const uint64_t r0 = Attach(), r1 = Attach(), r2 = Attach();
  Registrar registrar(*registry_);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 3)).ok());
  ASSERT_TRUE(registrar.Register(r1, Rank(1, 3)).ok());
  ASSERT_TRUE(registrar.Register(r2, Rank(2, 3)).ok());
  auto opt = *registry_->OptimizerOf(r0);
  ASSERT_TRUE(registry_->Detach(r2).ok());  // a rank that detaches leaves cleanly
  EXPECT_FALSE(opt->failed());
  registry_->SessionDisconnected(r1);
  EXPECT_TRUE(opt->failed());
  EXPECT_THAT(opt->failure(), HasSubstr("rank 1 of job 'job'"));
  // The optimizer cannot be joined any more.
  const uint64_t late = Attach();
  EXPECT_EQ(registrar.Register(late, Rank(1, 3)).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(RanksTest, ALostRankLeavesAKeptJobThatARestartedGroupResumes) {
  const uint64_t r0 = AttachKept(), r1 = AttachKept();
  Registrar registrar(*registry_);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
  ASSERT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
  auto opt = *registry_->OptimizerOf(r0);
  const uint64_t used = Used();
  wire::ControlView page = MapControl(r0);
  ASSERT_NE(page.header, nullptr);
  // Step 1 completes.
  Deliver(page, 1);
  Commit(page, 0, 1);
  Commit(page, 1, 1);
  ASSERT_TRUE(Eventually([&] { return page.header->committed.load() == 1; }));
  // Step 2: both buckets delivered (held for the commit), rank 0 commits, rank 1 dies first.
  Deliver(page, 2);
  Commit(page, 0, 2);
  ASSERT_TRUE(Eventually([&] { return page.buckets[0].ready.load() == 2; }));
  registry_->SessionDisconnected(r1);
  // Rank 0 is told at once (its waits read the page), the job is kept, and resumable.
  EXPECT_TRUE(opt->failed());
  EXPECT_EQ(page.header->failed.load(), 1u);
  EXPECT_THAT(std::string(page.header->error), HasSubstr("rank 1 of job 'job'"));
  EXPECT_THAT(std::string(page.header->error), HasSubstr("resume=True"));
  EXPECT_TRUE(opt->resumable());
  // While rank 0 of the group that lost rank 1 is attached, a restarted group cannot take over.
  const uint64_t early = AttachKept(/*resume=*/true);
  auto busy = registrar.Register(early, Resume(1, 2));
  EXPECT_EQ(busy.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(busy.status().message()), HasSubstr("still attached"));
  ASSERT_TRUE(registry_->Detach(early).ok());
  SweepLikeTheServer();  // closes rank 0's session (its optimizer stopped)
  EXPECT_FALSE(registry_->SessionJob(r0).ok());
  ASSERT_EQ(registry_->Jobs().size(), 1u);  // kept: keep_for
  EXPECT_EQ(page.buckets[0].steps.load(), 1u);
  EXPECT_EQ(page.buckets[1].steps.load(), 1u);

  // The restarted group: both ranks resume, in either order, and get the same report.
  const uint64_t n1 = AttachKept(/*resume=*/true), n0 = AttachKept(/*resume=*/true);
  auto a = registrar.Register(n1, Resume(1, 2));
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = registrar.Register(n0, Resume(0, 2));
  ASSERT_TRUE(b.ok()) << b.status();
  for (const auto* r : {&*a, &*b}) {
    EXPECT_THAT(r->resume().bucket_steps(), ::testing::ElementsAre(1u, 1u));
    EXPECT_EQ(r->resume().committed(), 1u);
    EXPECT_THAT(r->resume().rolled_back(), ::testing::ElementsAre(0u, 1u));  // step 2 undone
    EXPECT_EQ(r->state_bytes(), used);
  }
  EXPECT_EQ(Used(), used);  // nothing allocated
  EXPECT_FALSE(opt->failed());
  EXPECT_EQ(page.header->failed.load(), 0u);
  EXPECT_EQ(page.ranks[0].commit.load(), 1u);  // rank 0's dropped commit is forgotten
  EXPECT_EQ(*registry_->OptimizerOf(n0), opt);
  // A third process cannot take a rank the group holds, nor join without resume.
  const uint64_t extra = AttachKept(/*resume=*/true);
  EXPECT_EQ(registrar.Register(extra, Resume(0, 2)).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(registrar.Register(extra, Rank(0, 2)).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(registry_->Detach(extra).ok());
  // The group redoes step 2: the rolled-back buckets take their next delivery, every rank commits.
  Deliver(page, 3);
  Commit(page, 1, 2);
  Commit(page, 0, 2);
  ASSERT_TRUE(Eventually([&] { return page.header->committed.load() == 2; }));
  EXPECT_EQ(page.buckets[0].steps.load(), 2u);
  EXPECT_EQ(page.buckets[1].steps.load(), 2u);
  SweepLikeTheServer();
  EXPECT_TRUE(registry_->SessionJob(n0).ok());  // the resumed group is not closed by the sweep
  // A rank of the resumed group lost: resumable again.
  registry_->SessionDisconnected(n1);
  EXPECT_TRUE(opt->resumable());
}

TEST_F(RanksTest, AProtocolViolationIsNotResumable) {
  const uint64_t r0 = AttachKept(), r1 = AttachKept();
  Registrar registrar(*registry_);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
  ASSERT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
  auto opt = *registry_->OptimizerOf(r0);
  wire::ControlView page = MapControl(r0);
  ASSERT_NE(page.header, nullptr);
  Commit(page, 1, 7);  // jumps
  ASSERT_TRUE(Eventually([&] { return opt->failed(); }));
  EXPECT_FALSE(opt->resumable());
  registry_->SessionDisconnected(r1);  // a rank lost afterwards does not make it resumable
  EXPECT_FALSE(opt->resumable());
  SweepLikeTheServer();
  ASSERT_EQ(registry_->Jobs().size(), 1u);  // kept (keep_for), to be inspected
  const uint64_t n0 = AttachKept(/*resume=*/true);
  auto resumed = registrar.Register(n0, Resume(0, 2));
  EXPECT_EQ(resumed.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(resumed.status().message()), HasSubstr("cannot be resumed"));
  EXPECT_THAT(std::string(resumed.status().message()), HasSubstr("rank 1's commit counter 7"));
  EXPECT_TRUE(opt->failed());
}

TEST_F(RanksTest, AResumeOfAnotherWorldOrOfAJobNotKeptIsRefused) {
  {
    const uint64_t r0 = Attach(), r1 = Attach();  // no keep_for
    Registrar registrar(*registry_);
    ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
    ASSERT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
    registry_->SessionDisconnected(r1);
    const uint64_t n1 = AttachKept(/*resume=*/true, absl::ZeroDuration());
    auto not_kept = registrar.Register(n1, Resume(1, 2));
    EXPECT_EQ(not_kept.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(not_kept.status().message()), HasSubstr("was not kept"));
    registry_->SessionDisconnected(n1);
    registry_->SessionDisconnected(r0);
    EXPECT_TRUE(registry_->Jobs().empty());  // released with its last rank
    AttachOptions resume;
    resume.resume = true;
    EXPECT_EQ(registry_->Attach("job", 0, getuid(), getpid(), resume).status().code(),
              absl::StatusCode::kNotFound);
  }
  const uint64_t r0 = AttachKept(), r1 = AttachKept();
  Registrar registrar(*registry_);
  ASSERT_TRUE(registrar.Register(r0, Rank(0, 2)).ok());
  ASSERT_TRUE(registrar.Register(r1, Rank(1, 2)).ok());
  registry_->SessionDisconnected(r0);
  registry_->SessionDisconnected(r1);
  ASSERT_EQ(registry_->Jobs().size(), 1u);
  const uint64_t n0 = AttachKept(/*resume=*/true);
  auto three = registrar.Register(n0, Resume(0, 3));
  EXPECT_EQ(three.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(three.status().message()), HasSubstr("world of 2"));
  EXPECT_THAT(std::string(three.status().message()), HasSubstr("world 3"));
  v1::RegisterOptimizerRequest single = request_;
  single.set_resume(true);
  auto one = registrar.Register(n0, single);
  EXPECT_EQ(one.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(one.status().message()), HasSubstr("world of 2 data-parallel ranks"));
  // The refusals changed nothing: the right world resumes.
  auto two = registrar.Register(n0, Resume(0, 2));
  EXPECT_TRUE(two.ok()) << two.status();
}

}  // namespace
}  // namespace tsd
