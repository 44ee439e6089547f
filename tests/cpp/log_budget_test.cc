// LogBudget: a uid gets `burst` lines a window, the rest are counted and reported with the next
// line written; uids do not share a budget; quiet uids' entries are dropped as the map grows.
#include "daemon/ops/log_budget.h"

#include <gtest/gtest.h>

namespace tsd {
namespace {

TEST(LogBudget, BurstPerWindowThenTheHeldBackCountComesWithTheNextLine) {
  LogBudget budget(3, absl::Seconds(10));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t held = 99;
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(budget.Allow(1000, t0 + absl::Seconds(i), &held));
    EXPECT_EQ(held, 0u);
  }
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(budget.Allow(1000, t0 + absl::Seconds(9), &held));
  // Another uid has its own budget.
  EXPECT_TRUE(budget.Allow(1001, t0 + absl::Seconds(9), &held));
  EXPECT_EQ(held, 0u);
  // A new window: the first line carries the five held back, the next none.
  ASSERT_TRUE(budget.Allow(1000, t0 + absl::Seconds(10), &held));
  EXPECT_EQ(held, 5u);
  ASSERT_TRUE(budget.Allow(1000, t0 + absl::Seconds(11), &held));
  EXPECT_EQ(held, 0u);
}

TEST(LogBudget, QuietUidsAreForgottenButNotTheirHeldBackLines) {
  LogBudget budget(1, absl::Seconds(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  uint64_t held = 0;
  ASSERT_TRUE(budget.Allow(7, t0, &held));
  EXPECT_FALSE(budget.Allow(7, t0, &held));  // uid 7 has a line held back
  for (uid_t uid = 100; uid < 400; ++uid) ASSERT_TRUE(budget.Allow(uid, t0, &held));
  // Later, a new uid: the quiet ones go, uid 7 (a line held back) stays.
  ASSERT_TRUE(budget.Allow(5000, t0 + absl::Seconds(2), &held));
  EXPECT_LE(budget.tracked(), 3u);
  ASSERT_TRUE(budget.Allow(7, t0 + absl::Seconds(2), &held));
  EXPECT_EQ(held, 1u);
}

}  // namespace
}  // namespace tsd
