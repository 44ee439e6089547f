// The Ledger on its own: quotas and the pool refuse overruns with messages that say what was
// asked, what is free and who holds the rest; stores have a budget of their own, apart from job
// quotas; reservations count at once and commit or return; the pool cannot shrink below what is
// held; and a refusal never changes anything.
#include "daemon/memory/ledger.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace tsd {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1 << 20;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(Ledger, ChargesCountAgainstTheQuotaAndThePool) {
  Ledger ledger(64 * kMiB, 0);
  ASSERT_TRUE(ledger.OpenJob("a", 32 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "x", 8 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "y", 4 * kMiB).ok());
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 12 * kMiB);
  LedgerView v = ledger.View();
  EXPECT_EQ(v.held_bytes, 12 * kMiB);
  EXPECT_EQ(v.free_bytes(), 52 * kMiB);
  ASSERT_EQ(v.accounts.size(), 1u);
  EXPECT_EQ(v.accounts[0].quota_bytes, 32 * kMiB);
  EXPECT_EQ(v.accounts[0].charged_bytes, 12 * kMiB);
  ASSERT_TRUE(ledger.Uncharge(Holder::Job("a"), "x", 8 * kMiB).ok());
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 4 * kMiB);
  EXPECT_EQ(ledger.View().held_bytes, 4 * kMiB);
}

TEST(Ledger, AQuotaOverrunSaysWhatWasAskedWhatIsFreeAndTheJobsBiggestCharges) {
  Ledger ledger(64 * kMiB, 0);
  ASSERT_TRUE(ledger.OpenJob("a", 10 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "weights", 6 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "acts", 2 * kMiB).ok());
  const LedgerView before = ledger.View();
  const absl::Status s = ledger.Charge(Holder::Job("a"), "more", 3 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(s), HasSubstr("'more' (3 MiB) would exceed job 'a''s quota"));
  EXPECT_THAT(Message(s), HasSubstr("it holds 8 MiB of 10 MiB (2 MiB free"));
  EXPECT_THAT(Message(s), HasSubstr("the biggest: 'weights' 6 MiB, 'acts' 2 MiB"));
  EXPECT_EQ(ledger.View(), before);
  // Exactly what is free still fits.
  EXPECT_TRUE(ledger.Charge(Holder::Job("a"), "more", 2 * kMiB).ok());
}

TEST(Ledger, APoolOverrunNamesTheBiggestHolders) {
  Ledger ledger(16 * kMiB, 8 * kMiB);
  for (const char* job : {"a", "b", "c"}) ASSERT_TRUE(ledger.OpenJob(job, 16 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "r", 9 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("b"), "r", 4 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Store("shared"), "w", 1 * kMiB).ok());
  const LedgerView before = ledger.View();
  const absl::Status s = ledger.Charge(Holder::Job("c"), "big", 4 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(s), HasSubstr("'big' (4 MiB) for job 'c' does not fit in the pool"));
  EXPECT_THAT(Message(s), HasSubstr("2 MiB free of 16 MiB"));
  EXPECT_THAT(Message(s), HasSubstr("held by job 'a' 9 MiB, job 'b' 4 MiB, store 'shared' 1 MiB"));
  EXPECT_EQ(ledger.View(), before);
  // A request larger than the whole pool is refused the same way, without overflowing.
  EXPECT_EQ(ledger.Charge(Holder::Job("c"), "huge", UINT64_MAX).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ledger.View(), before);
}

TEST(Ledger, MoreHoldersThanItNamesAreCounted) {
  Ledger ledger(8 * kMiB, 0);
  for (int i = 0; i < 5; ++i) {
    const std::string job = "j" + std::to_string(i);
    ASSERT_TRUE(ledger.OpenJob(job, 8 * kMiB).ok());
    ASSERT_TRUE(ledger.Charge(Holder::Job(job), "r", (i + 1) * 256 * 1024).ok());
  }
  ASSERT_TRUE(ledger.OpenJob("late", 8 * kMiB).ok());
  const absl::Status s = ledger.Charge(Holder::Job("late"), "r", 8 * kMiB);
  EXPECT_THAT(Message(s), HasSubstr("held by job 'j4' 1.25 MiB, job 'j3' 1 MiB, job 'j2' 768 KiB"));
  EXPECT_THAT(Message(s), HasSubstr(", 2 more"));
}

TEST(Ledger, TheStoreBudgetIsApartFromJobQuotas) {
  Ledger ledger(64 * kMiB, 8 * kMiB);
  ASSERT_TRUE(ledger.OpenJob("a", 4 * kMiB).ok());
  // A store's bytes count toward the pool and the store budget, not toward any job's quota.
  ASSERT_TRUE(ledger.Charge(Holder::Store("weights"), "shard0", 6 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "r", 4 * kMiB).ok());  // the whole quota is free
  EXPECT_EQ(ledger.View().store_held_bytes, 6 * kMiB);
  EXPECT_EQ(ledger.View().held_bytes, 10 * kMiB);
  // The budget refuses a store even though the pool has room.
  const LedgerView before = ledger.View();
  const absl::Status s = ledger.Charge(Holder::Store("other"), "x", 3 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(Message(s), HasSubstr("would exceed the store budget: stores hold 6 MiB of 8 MiB"));
  EXPECT_THAT(Message(s), HasSubstr("the biggest: store 'weights' 6 MiB"));
  EXPECT_EQ(ledger.View(), before);
  // A job's quota does not make room for stores, and a full quota does not block one.
  ASSERT_TRUE(ledger.Charge(Holder::Store("other"), "x", 2 * kMiB).ok());
  EXPECT_EQ(ledger.Charge(Holder::Job("a"), "r2", 1).code(), absl::StatusCode::kResourceExhausted);
  // A store's account goes when it is empty.
  ASSERT_TRUE(ledger.Uncharge(Holder::Store("other"), "x", 2 * kMiB).ok());
  EXPECT_EQ(ledger.View().accounts.size(), 2u);  // job 'a' and store 'weights'
  // The budget cannot shrink below what stores hold.
  EXPECT_EQ(ledger.SetStoreBudget(5 * kMiB).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger.View().store_budget_bytes, 8 * kMiB);
  EXPECT_TRUE(ledger.SetStoreBudget(6 * kMiB).ok());
}

TEST(Ledger, ThePoolCannotShrinkBelowWhatIsHeld) {
  Ledger ledger(64 * kMiB, 0);
  ASSERT_TRUE(ledger.OpenJob("a", 64 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "r", 40 * kMiB).ok());
  auto reserved = ledger.Reserve(Holder::Job("a"), "s", 8 * kMiB);
  ASSERT_TRUE(reserved.ok());
  const LedgerView before = ledger.View();
  // Reservations count as held.
  const absl::Status s = ledger.SetPoolBytes(32 * kMiB);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(s), HasSubstr("the new pool of 32 MiB is smaller than the 48 MiB jobs hold "
                                    "now (job 'a' 48 MiB)"));
  EXPECT_EQ(ledger.View(), before);
  EXPECT_EQ(ledger.SetPoolBytes(47 * kMiB).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(ledger.SetPoolBytes(48 * kMiB).ok());
  EXPECT_EQ(ledger.View().pool_bytes, 48 * kMiB);
  EXPECT_EQ(ledger.View().free_bytes(), 0u);
  ASSERT_TRUE(ledger.SetPoolBytes(128 * kMiB).ok());
  EXPECT_EQ(ledger.View().free_bytes(), 80 * kMiB);
}

TEST(Ledger, AReservationCountsAtOnceAndCommitsOrReturns) {
  Ledger ledger(16 * kMiB, 0);
  ASSERT_TRUE(ledger.OpenJob("a", 10 * kMiB).ok());
  {
    auto r = ledger.Reserve(Holder::Job("a"), "opt/master", 6 * kMiB);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->pending());
    EXPECT_EQ(ledger.View().accounts[0].reserved_bytes, 6 * kMiB);
    // A concurrent request cannot take the reserved bytes.
    EXPECT_EQ(ledger.Charge(Holder::Job("a"), "x", 5 * kMiB).code(),
              absl::StatusCode::kResourceExhausted);
  }  // dropped uncommitted: returned
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 0u);
  auto r = ledger.Reserve(Holder::Job("a"), "opt/master", 6 * kMiB);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(ledger.Commit(*r).ok());
  EXPECT_FALSE(r->pending());
  EXPECT_EQ(ledger.Commit(*r).code(), absl::StatusCode::kFailedPrecondition);  // not twice
  const LedgerView v = ledger.View();
  EXPECT_EQ(v.accounts[0].charged_bytes, 6 * kMiB);
  EXPECT_EQ(v.accounts[0].reserved_bytes, 0u);
  // The committed bytes are under the label: they can be returned from it.
  ASSERT_TRUE(ledger.Uncharge(Holder::Job("a"), "opt/master", 6 * kMiB).ok());
  // Cancel returns the bytes; a moved-from reservation does nothing.
  auto c = ledger.Reserve(Holder::Job("a"), "y", 1 * kMiB);
  ASSERT_TRUE(c.ok());
  Reservation moved = std::move(*c);
  EXPECT_FALSE(c->pending());
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 1 * kMiB);
  ledger.Cancel(moved);
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 0u);
}

// Registration rollback: the session died and the job was closed while its memory was being
// allocated. The reservation then commits nothing and nothing stays charged.
TEST(Ledger, ClosingAJobDropsItsChargesAndReservations) {
  Ledger ledger(16 * kMiB, 0);
  ASSERT_TRUE(ledger.OpenJob("a", 10 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "r", 2 * kMiB).ok());
  auto r = ledger.Reserve(Holder::Job("a"), "opt/master", 3 * kMiB);
  ASSERT_TRUE(r.ok());
  auto released = ledger.CloseJob("a");
  ASSERT_TRUE(released.ok());
  EXPECT_EQ(*released, 5 * kMiB);
  EXPECT_EQ(ledger.View().held_bytes, 0u);
  const absl::Status s = ledger.Commit(*r);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(s), HasSubstr("its job was closed"));
  EXPECT_EQ(ledger.View().held_bytes, 0u);
  EXPECT_TRUE(ledger.View().accounts.empty());
  // The job may open again, with a fresh account.
  ASSERT_TRUE(ledger.OpenJob("a", 1 * kMiB).ok());
  EXPECT_EQ(ledger.Held(Holder::Job("a")), 0u);
}

TEST(Ledger, BadRequestsAreRefusedAndChangeNothing) {
  Ledger ledger(16 * kMiB, 4 * kMiB);
  ASSERT_TRUE(ledger.OpenJob("a", 8 * kMiB).ok());
  ASSERT_TRUE(ledger.Charge(Holder::Job("a"), "r", 2 * kMiB).ok());
  const LedgerView before = ledger.View();
  EXPECT_EQ(ledger.OpenJob("a", 1).code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(ledger.OpenJob("", 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.Charge(Holder::Job("nobody"), "r", 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.Reserve(Holder::Job("nobody"), "r", 1).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.Charge(Holder::Job("a"), "r", 0).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ledger.Charge(Holder::Job("a"), "", 1).code(), absl::StatusCode::kInvalidArgument);
  // Returning more than a label holds, or a label it never charged.
  const absl::Status over = ledger.Uncharge(Holder::Job("a"), "r", 3 * kMiB);
  EXPECT_EQ(over.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(Message(over), HasSubstr("cannot return 3 MiB of 'r' for job 'a': it holds 2 MiB"));
  EXPECT_EQ(ledger.Uncharge(Holder::Job("a"), "other", 1).code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger.Uncharge(Holder::Store("none"), "x", 1).code(),
            absl::StatusCode::kFailedPrecondition);
  // A quota below what the job holds.
  EXPECT_EQ(ledger.SetQuota("a", 1 * kMiB).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(ledger.SetQuota("nobody", 1).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.CloseJob("nobody").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ledger.View(), before);
  ASSERT_TRUE(ledger.SetQuota("a", 2 * kMiB).ok());
  EXPECT_EQ(ledger.View().accounts[0].quota_bytes, 2 * kMiB);
}

// Many threads charging and returning at once: the pool is never overcommitted and every byte
// comes back.
TEST(Ledger, ConcurrentChargesNeverOvercommitThePool) {
  constexpr int kThreads = 8, kRounds = 2000;
  Ledger ledger(10 * kMiB, 0);
  for (int t = 0; t < kThreads; ++t)
    ASSERT_TRUE(ledger.OpenJob("j" + std::to_string(t), 4 * kMiB).ok());
  std::atomic<int> refused{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const Holder job = Holder::Job("j" + std::to_string(t));
      for (int i = 0; i < kRounds; ++i) {
        auto r = ledger.Reserve(job, "r", 2 * kMiB);
        if (!r.ok()) {
          refused.fetch_add(1);
          continue;
        }
        EXPECT_LE(ledger.View().held_bytes, 10 * kMiB);
        if (i % 2 == 0) {
          ASSERT_TRUE(ledger.Commit(*r).ok());
          ASSERT_TRUE(ledger.Uncharge(job, "r", 2 * kMiB).ok());
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(ledger.View().held_bytes, 0u);
  // Only 5 reservations of 2 MiB fit the pool at once: 8 threads must sometimes be refused, but
  // (with enough rounds) not always.
  EXPECT_LT(refused.load(), kThreads * kRounds);
}

}  // namespace
}  // namespace tsd
