// The StoreManager in-process, with the clock in the test's hands: keep-warm is measured from the
// last user's departure and Sweep drops only what expired; store_keep 0 drops at once; a released
// job stops using its stores and its staged descriptors are closed; a store is charged to the
// store budget and the pool, never to a job; the metrics endpoint shows the stores' aggregates; a
// store is listed only to the uids that proved read access to its files, a bounded number of them.
#include "daemon/stores/store_manager.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint_file.h"
#include "daemon/jobs/registry.h"
#include "daemon/ops/metrics.h"

namespace tsd::stores {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::SizeIs;

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
    return testing::WriteF32Checkpoint(dir_ + "/" + name, n);
  }
  absl::StatusOr<OpenedStore> Open(StoreManager& m, uint64_t session, const StoreUser& user,
                                   const std::string& path, uid_t uid = 0,
                                   const StoreSpec& spec = StoreSpec{}) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    EXPECT_GE(fd, 0);
    if (absl::Status s = m.StageFile(session, user, fd); !s.ok()) return s;
    auto opened = m.Open(session, user, spec, uid);
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
  auto none = m.Open(3, a_again, StoreSpec{}, 0);
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

// The ids of `listing`'s stores.
std::vector<uint64_t> Ids(const StoreListing& listing) {
  std::vector<uint64_t> ids;
  for (const StoreStatus& s : listing.stores) ids.push_back(s.id);
  return ids;
}

TEST_F(StoreManagerTest, AStoreIsListedOnlyToTheUidsThatProvedReadAccessToItsFiles) {
  StoreManager m(ledger_, {.keep = absl::Hours(1)});
  auto first = Open(m, 1, {"a", 1}, Write("a.safetensors", 1024), /*uid=*/1000);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Open(m, 2, {"b", 2}, Write("b.safetensors", 2048), /*uid=*/2000);
  ASSERT_TRUE(second.ok()) << second.status();
  const uint64_t a = first->status.id, b = second->status.id;

  StoreListing mine = m.ListFor(1000);
  EXPECT_THAT(Ids(mine), ElementsAre(a));
  EXPECT_EQ(mine.stores[0].source, dir_ + "/a.safetensors");
  EXPECT_EQ(mine.node_stores, 2u) << "the node's count covers the stores not shown";
  EXPECT_EQ(mine.node_bytes, first->status.bytes + second->status.bytes);
  EXPECT_EQ(mine.budget_bytes, 16 * kMiB) << "the ledger's store budget";
  EXPECT_THAT(Ids(m.ListFor(2000)), ElementsAre(b));
  EXPECT_THAT(Ids(m.ListFor(3000)), IsEmpty()) << "a uid that proved nothing sees nothing";
  EXPECT_EQ(m.ListFor(3000).node_stores, 2u);
  EXPECT_THAT(Ids(m.ListFor(std::nullopt)), ElementsAre(a, b)) << "tsd's own view";

  // An open that fails proves nothing: nothing staged, or a spec refused before any lookup.
  EXPECT_FALSE(m.Open(3, {"c", 3}, StoreSpec{}, 3000).ok());
  StoreSpec bad;
  bad.format = StoreFormat::kNf4;
  bad.block_size = 0;
  EXPECT_FALSE(Open(m, 3, {"c", 3}, dir_ + "/a.safetensors", 3000, bad).ok());
  EXPECT_THAT(Ids(m.ListFor(3000)), IsEmpty());

  // Staging the files and opening the store (found, not built) proves access: listed from then
  // on, even after the job stopped using it.
  auto found = Open(m, 4, {"c", 3}, dir_ + "/a.safetensors", 3000);
  ASSERT_TRUE(found.ok()) << found.status();
  EXPECT_FALSE(found->built);
  EXPECT_EQ(found->status.id, a);
  m.UserReleased({"c", 3});
  EXPECT_THAT(Ids(m.ListFor(3000)), ElementsAre(a));
  EXPECT_EQ(m.ListFor(3000).stores[0].users, 1u);

  // A copy of a's checkpoint elsewhere on disk ends up as store a: its prover sees a.
  std::filesystem::copy_file(dir_ + "/a.safetensors", dir_ + "/a-copy.safetensors");
  auto copy = Open(m, 5, {"d", 4}, dir_ + "/a-copy.safetensors", 4000);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(copy->status.id, a);
  EXPECT_THAT(Ids(m.ListFor(4000)), ElementsAre(a));

  // A dropped store is listed to nobody; the remaining one still to its provers.
  m.UserReleased({"a", 1});
  m.UserReleased({"d", 4});
  m.Sweep(absl::Now() + absl::Hours(2));
  EXPECT_THAT(Ids(m.ListFor(1000)), IsEmpty());
  EXPECT_THAT(Ids(m.ListFor(2000)), ElementsAre(b));
  EXPECT_EQ(m.ListFor(1000).node_stores, 1u);
}

TEST_F(StoreManagerTest, AStoreRemembersABoundedNumberOfProversForgettingTheOldestProof) {
  StoreManager m(ledger_, {.keep = absl::Hours(1), .max_provers = 3});
  const std::string path = Write("m.safetensors", 1024);
  uint64_t session = 1;
  auto prove = [&](uid_t uid) {
    auto s = Open(m, session, {"job-" + std::to_string(uid), session}, path, uid);
    ++session;
    EXPECT_TRUE(s.ok()) << s.status();
  };
  prove(1);
  prove(2);
  prove(3);
  prove(1);  // proves again: now the newest, so 2 is the oldest
  prove(4);  // beyond the bound: 2 is forgotten
  EXPECT_THAT(Ids(m.ListFor(1)), SizeIs(1));
  EXPECT_THAT(Ids(m.ListFor(2)), IsEmpty()) << "the oldest proof was forgotten";
  EXPECT_THAT(Ids(m.ListFor(3)), SizeIs(1));
  EXPECT_THAT(Ids(m.ListFor(4)), SizeIs(1));
  EXPECT_EQ(m.List()[0].users, 5u) << "forgetting a prover takes no user off the store";
  // The forgotten uid still opens the store by presenting its files, and is listed again.
  prove(2);
  EXPECT_THAT(Ids(m.ListFor(2)), SizeIs(1));
  EXPECT_THAT(Ids(m.ListFor(3)), IsEmpty());

  // The default bound: 32 uids, then the oldest goes.
  StoreManager d(ledger_, {.keep = absl::Hours(1)});
  const std::string other = Write("other.safetensors", 2048);
  for (uid_t uid = 100; uid < 133; ++uid) {
    auto s = Open(d, session, {"j" + std::to_string(uid), session}, other, uid);
    ++session;
    ASSERT_TRUE(s.ok()) << s.status();
  }
  EXPECT_THAT(Ids(d.ListFor(100)), IsEmpty());
  for (uid_t uid = 101; uid < 133; ++uid) EXPECT_THAT(Ids(d.ListFor(uid)), SizeIs(1)) << uid;
}

}  // namespace
}  // namespace tsd::stores
