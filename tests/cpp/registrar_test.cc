// Optimizer registration is all or nothing: a failure after some of the optimizer's regions were
// allocated, even one caused by the registering session dying half-way, releases every region the
// registration made, so the job's usage is what it was and a later registration succeeds.
#include "daemon/optimizer/registrar.h"

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "daemon/optimizer/job_optimizer.h"
#include "daemon/optimizer/worker_pool.h"

namespace tsd {
namespace {

using ::testing::HasSubstr;

class RegistrarTest : public ::testing::Test {
 protected:
  RegistrarTest() : workers_(1, false) {
    RegistryOptions o;
    o.pool_bytes = 256 << 20;
    o.max_job_quota_bytes = 256 << 20;
    o.pool = &workers_;
    registry_ = std::make_unique<Registry>(o);
    request_.add_groups()->set_lr(1e-3);
    request_.mutable_groups(0)->set_beta1(0.9);
    request_.mutable_groups(0)->set_beta2(0.999);
    request_.mutable_groups(0)->set_eps(1e-8);
    for (int b = 0; b < 3; ++b) {
      auto* bucket = request_.add_buckets();
      bucket->set_numel(100000);
      bucket->set_grad_dtype(v1::F32);
      bucket->set_param_dtype(v1::BF16);  // fp32 parameters would be their masters: no opt/params
    }
    request_.set_accumulate(true);  // seven regions
  }
  uint64_t Attach() {
    auto a = registry_->Attach("job", 0, getuid(), getpid());
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : 0;
  }
  v1::JobInfo Job() {
    auto jobs = registry_->Jobs();
    EXPECT_EQ(jobs.size(), 1u);
    return jobs.empty() ? v1::JobInfo() : jobs[0];
  }

  WorkerPool workers_;
  std::unique_ptr<Registry> registry_;
  v1::RegisterOptimizerRequest request_;
};

TEST_F(RegistrarTest, AFailureAfterSomeRegionsLeavesTheJobAsItWas) {
  const uint64_t session = Attach();
  ASSERT_TRUE(registry_->Alloc(session, "data", 1 << 20).ok());
  const v1::JobInfo before = Job();
  Registrar failing(*registry_, [](size_t allocated) {
    return allocated == 4 ? absl::InternalError("injected after 4 regions") : absl::OkStatus();
  });
  auto r = failing.Register(session, request_);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("injected after 4 regions"));
  EXPECT_EQ(Job().used_bytes(), before.used_bytes());
  EXPECT_EQ(Job().regions(), 1u);
  EXPECT_EQ(registry_->Snapshot().used_bytes, before.used_bytes());
  EXPECT_FALSE(registry_->OptimizerOf(session).ok());
  // Nothing is left behind to block the next registration.
  Registrar registrar(*registry_);
  auto again = registrar.Register(session, request_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(Job().used_bytes(), before.used_bytes() + again->state_bytes());
  EXPECT_EQ(Job().regions(), 8u);
}

// fp32 parameters are their masters bit for bit: no "opt/params" region, each bucket's parameter
// slot is its master (the response says so), and the job is charged that much less.
TEST_F(RegistrarTest, Fp32ParametersAreTheirMastersAndTakeNoRegionOfTheirOwn) {
  const uint64_t session = Attach();
  Registrar registrar(*registry_);
  v1::RegisterOptimizerRequest bf16 = request_;
  bf16.set_params_in_master_ok(true);
  v1::RegisterOptimizerRequest fp32 = request_;
  for (auto& b : *fp32.mutable_buckets()) b.set_param_dtype(v1::F32);
  // A client from before the change does not say it takes the slots in opt/master: it gets them
  // in opt/params, as before.
  auto old_client = JobOptimizer::Plan(fp32, 256 << 20);
  ASSERT_TRUE(old_client.ok()) << old_client.status();
  EXPECT_FALSE(old_client->params_in_master);
  EXPECT_GT(old_client->param_bytes, 0u);
  fp32.set_params_in_master_ok(true);

  auto planned16 = JobOptimizer::Plan(bf16, 256 << 20);
  ASSERT_TRUE(planned16.ok()) << planned16.status();
  EXPECT_FALSE(planned16->params_in_master);
  EXPECT_GT(planned16->param_bytes, 0u);

  auto r = registrar.Register(session, fp32);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->params_in_master());
  for (const auto& b : r->buckets()) EXPECT_EQ(b.param_offset(), b.master_offset());
  EXPECT_EQ(Job().regions(), 6u);  // control, master, exp_avg, exp_avg_sq, grads, accum
  EXPECT_EQ(r->state_bytes(), planned16->total_bytes() - planned16->param_bytes);
  auto regions = registry_->ListRegions(session);
  ASSERT_TRUE(regions.ok()) << regions.status();
  std::vector<std::string> names;
  for (const auto& region : *regions) names.push_back(region.name());
  EXPECT_THAT(names, ::testing::Contains("opt/master"));
  EXPECT_THAT(names, ::testing::Not(::testing::Contains("opt/params")));

  // One bf16 bucket among fp32 ones keeps the parameter slots.
  fp32.mutable_buckets(1)->set_param_dtype(v1::BF16);
  auto mixed = JobOptimizer::Plan(fp32, 256 << 20);
  ASSERT_TRUE(mixed.ok()) << mixed.status();
  EXPECT_FALSE(mixed->params_in_master);
  EXPECT_GT(mixed->param_bytes, 0u);
}

TEST_F(RegistrarTest, TheRegisteringSessionDyingHalfWayLeavesNothingCharged) {
  const uint64_t dying = Attach();
  const uint64_t survivor = Attach();
  const v1::JobInfo before = Job();
  Registrar registrar(*registry_, [&](size_t allocated) {
    if (allocated == 2) registry_->SessionDisconnected(dying);  // killed mid-registration
    return absl::OkStatus();
  });
  auto r = registrar.Register(dying, request_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_EQ(Job().sessions(), 1u);
  EXPECT_EQ(Job().used_bytes(), before.used_bytes())
      << "the dead session's opt/ regions stay charged";
  EXPECT_EQ(Job().regions(), 0u);
  auto again = Registrar(*registry_).Register(survivor, request_);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(registry_->OptimizerOf(survivor).ok());
}

TEST_F(RegistrarTest, TheLastSessionDyingHalfWayReleasesTheJob) {
  const uint64_t only = Attach();
  Registrar registrar(*registry_, [&](size_t allocated) {
    if (allocated == 3) registry_->SessionDisconnected(only);
    return absl::OkStatus();
  });
  EXPECT_FALSE(registrar.Register(only, request_).ok());
  EXPECT_EQ(registry_->Snapshot().jobs, 0u);
  EXPECT_EQ(registry_->Snapshot().used_bytes, 0u);
  // A new job of the same name starts clean.
  const uint64_t next = Attach();
  EXPECT_TRUE(Registrar(*registry_).Register(next, request_).ok());
}

}  // namespace
}  // namespace tsd
