// The StoreManager in-process, with the clock in the test's hands: keep-warm is measured from the
// last user's departure and Sweep drops only what expired; store_keep 0 drops at once; a released
// job stops using its stores and its staged descriptors are closed; a store is charged to the
// store budget and the pool, never to a job; the metrics endpoint shows the stores' aggregates.
#include "daemon/stores/store_manager.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/jobs/registry.h"
#include "daemon/ops/metrics.h"

namespace tsd::stores {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kMiB = 1 << 20;

class StoreManagerTest : public ::testing::Test {
 protected:
  StoreManagerTest() : ledger_(64 * kMiB, 16 * kMiB) {
    char tmpl[] = "/tmp/tsd-store-test-XXXXXX";
    dir_ = mkdtemp(tmpl);
  }
  ~StoreManagerTest() override { std::filesystem::remove_all(dir_); }

  // A checkpoint of one F32 tensor of `n` elements.
  std::string Write(const std::string& name, size_t n) {
    const std::string path = dir_ + "/" + name;
    const std::string header = "{\"w\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) +
                               "],\"data_offsets\":[0," + std::to_string(4 * n) + "]}}";
    std::string len(8, '\0');
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
    std::ofstream(path, std::ios::binary) << len << header << std::string(4 * n, '\x01');
    return path;
  }
  absl::StatusOr<OpenedStore> Open(StoreManager& m, uint64_t session, const StoreUser& user,
                                   const std::string& path) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_GE(fd, 0);
    if (absl::Status s = m.StageFile(session, user, fd); !s.ok()) return s;
    auto opened = m.Open(session, user, StoreSpec{});
    if (opened.ok()) close(opened->fd);
    return opened;
  }

  Ledger ledger_;
  std::string dir_;
};

TEST_F(StoreManagerTest, KeepWarmCountsFromTheLastUserAndSweepDropsOnlyWhatExpired) {
  StoreManager m(ledger_, {.keep = absl::Hours(1)});
  const StoreUser a{"a", 1}, b{"b", 2};
  auto s = Open(m, 1, a, Write("m.safetensors", 1024));
  ASSERT_TRUE(s.ok()) << s.status();
  ASSERT_TRUE(Open(m, 2, b, dir_ + "/m.safetensors").ok());
  ASSERT_EQ(m.List().size(), 1u);
  EXPECT_EQ(m.List()[0].users, 2u);
  ASSERT_TRUE(m.Close(a, s->status.id).ok());
  const absl::Time one_left = absl::Now();
  m.Sweep(one_left + absl::Hours(2));  // still used by b: never dropped
  ASSERT_EQ(m.List().size(), 1u);
  m.UserReleased(b);
  const absl::Time all_left = absl::Now();
  m.Sweep(all_left + absl::Minutes(59));
  ASSERT_EQ(m.List().size(), 1u) << "dropped before store_keep";
  EXPECT_EQ(m.List()[0].users, 0u);
  m.Sweep(all_left + absl::Minutes(61));
  EXPECT_TRUE(m.List().empty());
  EXPECT_EQ(ledger_.View().held_bytes, 0u);
}

TEST_F(StoreManagerTest, KeepZeroDropsAStoreWhenItsLastUserLeaves) {
  StoreManager m(ledger_, {.keep = absl::ZeroDuration()});
  const StoreUser a{"a", 1};
  auto s = Open(m, 1, a, Write("m.safetensors", 1024));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(ledger_.View().store_held_bytes, s->status.bytes);
  ASSERT_TRUE(m.Close(a, s->status.id).ok());
  EXPECT_TRUE(m.List().empty());
  EXPECT_EQ(ledger_.View().held_bytes, 0u);
  EXPECT_EQ(m.Close(a, s->status.id).code(), absl::StatusCode::kNotFound);
}

TEST_F(StoreManagerTest, AStoreIsChargedToTheStoreBudgetAndThePoolNeverToAJob) {
  ASSERT_TRUE(ledger_.OpenJob("a", 1 * kMiB).ok());  // a quota far below the store's size
  StoreManager m(ledger_, {});
  auto s = Open(m, 1, {"a", 1}, Write("m.safetensors", 1 << 20));  // 4 MiB
  ASSERT_TRUE(s.ok()) << s.status();
  const LedgerView v = ledger_.View();
  EXPECT_EQ(v.store_held_bytes, 4 * kMiB);
  EXPECT_EQ(v.held_bytes, 4 * kMiB);
  EXPECT_EQ(ledger_.Held(Holder::Job("a")), 0u);
  // Larger than the whole budget: refused, naming it, and nothing is left behind.
  auto big = Open(m, 1, {"a", 1}, Write("big.safetensors", 5 << 20));  // 20 MiB
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(big.status().message()), HasSubstr("store budget"));
  EXPECT_EQ(m.List().size(), 1u);
  EXPECT_EQ(ledger_.View().held_bytes, 4 * kMiB);
}

TEST_F(StoreManagerTest, AReleasedJobStopsUsingItsStoresAndItsStagedFilesAreClosed) {
  StoreManager m(ledger_, {.keep = absl::Hours(1)});
  const StoreUser a{"a", 1}, a_again{"a", 2};  // a job re-created under the same name
  auto s = Open(m, 1, a, Write("m.safetensors", 1024));
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(Open(m, 2, a_again, dir_ + "/m.safetensors").ok());
  const int fd = open((dir_ + "/m.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_TRUE(m.StageFile(3, a, fd).ok());
  EXPECT_GE(fcntl(fd, F_GETFD), 0) << "a staged descriptor is kept until used";
  m.UserReleased(a);
  EXPECT_EQ(fcntl(fd, F_GETFD), -1) << "the released job's staged descriptor is still open";
  ASSERT_EQ(m.List().size(), 1u);
  EXPECT_EQ(m.List()[0].users, 1u) << "only the first instance of 'a' was released";
  // An open with nothing staged proves nothing.
  auto none = m.Open(3, a_again, StoreSpec{});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST_F(StoreManagerTest, TheMetricsEndpointShowsTheStoresAggregates) {
  StoreManager m(ledger_, {});
  ASSERT_TRUE(Open(m, 1, {"a", 1}, Write("m.safetensors", 1024)).ok());
  RegistryOptions o;
  o.pool_bytes = 64 * kMiB;
  o.max_job_quota_bytes = 64 * kMiB;
  o.ledger = &ledger_;
  Registry registry(o);
  Metrics metrics(registry);
  metrics.WatchGauges([&m] {
    const StoreTotals t = m.Totals();
    return std::vector<Metrics::NamedGauge>{
        {"tsd_stores", "stores", static_cast<double>(t.stores)},
        {"tsd_store_bytes", "bytes", static_cast<double>(t.bytes)}};
  });
  const std::string text = metrics.Render();
  EXPECT_THAT(text, HasSubstr("tsd_stores 1\n"));
  EXPECT_THAT(text, HasSubstr("tsd_store_bytes 4096\n"));
  // Stores count in the pool's use as the Registry reports it.
  EXPECT_THAT(text, HasSubstr("tsd_pool_used_bytes 4096\n"));
}

}  // namespace
}  // namespace tsd::stores
