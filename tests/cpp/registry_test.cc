// The Registry charges every region, client's or optimizer's, through the node's Ledger: a
// refusal names the biggest holders (jobs and stores alike), the ledger's books and the
// registry's reports agree, and freeing, releasing a job or shrinking the pool go through it too.
#include "daemon/jobs/registry.h"

#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tsd {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1 << 20;

class RegistryLedgerTest : public ::testing::Test {
 protected:
  RegistryLedgerTest() : ledger_(16 * kMiB, 8 * kMiB) {
    RegistryOptions o;
    o.pool_bytes = 16 * kMiB;
    o.max_job_quota_bytes = 16 * kMiB;
    o.ledger = &ledger_;
    registry_ = std::make_unique<Registry>(o);
  }
  uint64_t Attach(const std::string& job) {
    auto a = registry_->Attach(job, 0, getuid(), getpid());
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->session_id : 0;
  }

  Ledger ledger_;
  std::unique_ptr<Registry> registry_;
};

TEST_F(RegistryLedgerTest, APoolRefusalNamesTheBiggestHolders) {
  const uint64_t a = Attach("train-a");
  const uint64_t b = Attach("train-b");
  ASSERT_TRUE(registry_->Alloc(a, "weights", 9 * kMiB).ok());
  ASSERT_TRUE(registry_->Alloc(b, "acts", 4 * kMiB).ok());
  // A store charged to the same ledger counts against the same pool.
  ASSERT_TRUE(ledger_.Charge(Holder::Store("base"), "data", 1 * kMiB).ok());
  const LedgerView before = ledger_.View();

  auto refused = registry_->Alloc(b, "more", 3 * kMiB);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  const std::string msg(refused.status().message());
  EXPECT_THAT(msg, HasSubstr("'more' (3 MiB) for job 'train-b' does not fit in the pool"));
  EXPECT_THAT(msg, HasSubstr("2 MiB free of 16 MiB"));
  EXPECT_THAT(msg,
              HasSubstr("held by job 'train-a' 9 MiB, job 'train-b' 4 MiB, store 'base' 1 MiB"));
  // The refusal changed nothing, and the name is still free.
  EXPECT_EQ(ledger_.View(), before);
  EXPECT_TRUE(registry_->Alloc(b, "more", 2 * kMiB).ok());
}

TEST_F(RegistryLedgerTest, AQuotaRefusalNamesTheJobsBiggestRegions) {
  auto s = registry_->Attach("small", 6 * kMiB, getuid(), getpid());
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(registry_->Alloc(s->session_id, "big", 4 * kMiB).ok());
  ASSERT_TRUE(registry_->Alloc(s->session_id, "little", 1 * kMiB).ok());
  auto refused = registry_->Alloc(s->session_id, "third", 2 * kMiB);
  ASSERT_FALSE(refused.ok());
  const std::string msg(refused.status().message());
  EXPECT_THAT(msg, HasSubstr("would exceed job 'small''s quota: it holds 5 MiB of 6 MiB"));
  EXPECT_THAT(msg, HasSubstr("the biggest: 'big' 4 MiB, 'little' 1 MiB"));
}

TEST_F(RegistryLedgerTest, TheRegistrysFiguresAreTheLedgers) {
  const uint64_t a = Attach("a");
  auto r = registry_->Alloc(a, "r", 3 * kMiB + 1);  // rounded up to a page
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t rounded = 3 * kMiB + 4096;
  EXPECT_EQ(ledger_.Held(Holder::Job("a")), rounded);
  EXPECT_EQ(registry_->Snapshot().used_bytes, rounded);
  ASSERT_EQ(registry_->Jobs().size(), 1u);
  EXPECT_EQ(registry_->Jobs()[0].used_bytes(), rounded);

  // The pool cannot shrink below what is held; the ledger's refusal names the holder.
  const absl::Status shrink = registry_->Reconfigure(2 * kMiB, 2 * kMiB, absl::ZeroDuration());
  EXPECT_EQ(shrink.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(shrink.message()), HasSubstr("(job 'a' 3.00 MiB)"));
  EXPECT_EQ(ledger_.View().pool_bytes, 16 * kMiB);

  ASSERT_TRUE(registry_->Free(a, r->region_id()).ok());
  EXPECT_EQ(ledger_.Held(Holder::Job("a")), 0u);
  ASSERT_TRUE(registry_->Alloc(a, "again", kMiB).ok());
  ASSERT_TRUE(registry_->Detach(a).ok());  // the job goes, and its account with it
  EXPECT_EQ(ledger_.View().held_bytes, 0u);
  EXPECT_TRUE(ledger_.View().accounts.empty());
}

TEST_F(RegistryLedgerTest, OptimizerStateThatDoesNotFitIsRefusedBeforeAnyRegion) {
  auto s = registry_->Attach("opt", 4 * kMiB, getuid(), getpid());
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(registry_->Alloc(s->session_id, "x", 3 * kMiB).ok());
  auto refused = registry_->PrepareOptimizer(s->session_id, 2 * kMiB);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(refused.status().message()),
              HasSubstr("'optimizer state' (2 MiB) would exceed job 'opt''s quota"));
  EXPECT_EQ(ledger_.Held(Holder::Job("opt")), 3 * kMiB);
}

}  // namespace
}  // namespace tsd
