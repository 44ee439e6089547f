// The region budgets tsd derives from its limits (daemon/ops/resource_budget.h): with every job,
// uid and the node at their budgets, regions (a descriptor and a mapping each) stay below half
// of RLIMIT_NOFILE and of vm.max_map_count.
#include "daemon/ops/resource_budget.h"

#include <sys/resource.h>

#include <gtest/gtest.h>

namespace tsd {
namespace {

TEST(ResourceBudget, RegionsStayBelowHalfOfEitherLimit) {
  for (uint64_t nofile : {128ull, 1024ull, 65536ull, 1ull << 20}) {
    for (uint64_t maps : {1024ull, 65530ull, 262144ull}) {
      const ResourceBudget b = DeriveResourceBudget(nofile, maps, 10, 300, 0, 0);
      if (nofile / 2 > 10 + 32 && maps / 2 > 300 + 512) {
        EXPECT_LE(b.max_regions + 10, nofile / 2) << nofile << " " << maps;
        EXPECT_LE(b.max_regions + 300, maps / 2) << nofile << " " << maps;
      }
      EXPECT_GE(b.max_regions, 1u);
      EXPECT_LE(b.max_regions_per_uid, b.max_regions);
      EXPECT_LE(b.max_regions_per_job, b.max_regions_per_uid);
    }
  }
  // The usual case: a hard limit of 2^20 descriptors, the kernel's default map count.
  const ResourceBudget usual = DeriveResourceBudget(1 << 20, 65530, 10, 300, 0, 0);
  EXPECT_EQ(usual.max_regions, 65530 / 2 - 300 - 512);
  EXPECT_EQ(usual.max_regions_per_uid, usual.max_regions / 4);
  EXPECT_EQ(usual.max_regions_per_job, usual.max_regions_per_uid);
}

TEST(ResourceBudget, ConfiguredBudgetsAreCappedAtTheNodeBudget) {
  const ResourceBudget b = DeriveResourceBudget(1024, 65530, 10, 300, 100000, 50);
  EXPECT_EQ(b.max_regions, 512u - 10 - 32);
  EXPECT_EQ(b.max_regions_per_uid, b.max_regions);
  EXPECT_EQ(b.max_regions_per_job, 50u);
  EXPECT_EQ(DeriveResourceBudget(16, 100, 10, 300, 0, 0).max_regions, 1u);  // never 0
}

TEST(ResourceBudget, MeasuringRaisesTheSoftDescriptorLimit) {
  rlimit before{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  if (before.rlim_max == RLIM_INFINITY) GTEST_SKIP() << "no finite hard limit";
  rlimit lowered = before;
  lowered.rlim_cur = before.rlim_max > 256 ? 256 : before.rlim_max;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &lowered), 0);
  const ResourceBudget b = MeasureResourceBudget(0, 0);
  rlimit after{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &after), 0);
  EXPECT_EQ(after.rlim_cur, before.rlim_max);
  EXPECT_EQ(b.nofile_limit, before.rlim_max);
  EXPECT_GT(b.fds_at_start, 0u);
  EXPECT_GT(b.maps_at_start, 0u);
  setrlimit(RLIMIT_NOFILE, &before);
}

}  // namespace
}  // namespace tsd
