// The side request list_stores, through the SideHandler in-process (the uid is what the side
// server would have read with SO_PEERCRED): a uid sees the stores it proved read access to (by
// staging their files and opening them), with the node's totals, in a session or on a
// connection of its own (which then closes); tsd's own uid sees every store; a malformed request
// is refused and a descriptor sent with the request is closed unread.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "checkpoint_file.h"
#include "daemon/jobs/registry.h"
#include "daemon/memory/ledger.h"
#include "daemon/rpc/side_handler.h"
#include "daemon/stores/store_manager.h"
#include "proto/wire.h"

namespace tsd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr uint64_t kMiB = 1 << 20;

// Uids no test process runs as, so none of them is tsd's own.
constexpr uid_t kAlice = 4000001, kBob = 4000002, kCarol = 4000003;

class SideListStores : public ::testing::Test {
 protected:
  SideListStores() : ledger_(64 * kMiB, 16 * kMiB), stores_(ledger_, {}) {
    char tmpl[] = "/tmp/tsd-side-list-XXXXXX";
    dir_ = mkdtemp(tmpl);
    RegistryOptions o;
    o.pool_bytes = 64 * kMiB;
    o.max_job_quota_bytes = 16 * kMiB;
    o.ledger = &ledger_;
    o.on_job_released = [this](const JobRef& job) {
      stores_.UserReleased({job.name, job.instance});
    };
    registry_ = std::make_unique<Registry>(o);
    handler_ = std::make_unique<SideHandler>(*registry_, &stores_);
  }
  ~SideListStores() override { std::filesystem::remove_all(dir_); }

  // A checkpoint of one F32 tensor of `n` elements.
  std::string Write(const std::string& name, size_t n) {
    return testing::WriteF32Checkpoint(dir_ + "/" + name, n);
  }

  SideOutcome Handle(const SideCaller& caller, v1::SideRequest req, int fd = -1) {
    req.set_request_id(next_id_++);
    SideOutcome out = handler_->Handle(caller, req, fd);
    if (out.fd >= 0) close(out.fd);
    out.fd = -1;
    return out;
  }

  // A session of `uid` for a job of its own.
  SideCaller Attach(uid_t uid, const std::string& job) {
    v1::SideRequest req;
    req.mutable_attach()->set_job(job);
    req.mutable_attach()->set_protocol_version(wire::kProtocolVersion);
    SideOutcome out = Handle({uid, getpid(), 0}, req);
    EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
    return {uid, getpid(), out.bound_session};
  }

  // Stages `path` and opens its store on `caller`'s session; the store's id (0: refused).
  uint64_t OpenStore(const SideCaller& caller, const std::string& path) {
    v1::SideRequest stage;
    stage.mutable_store_file();
    SideOutcome out = Handle(caller, stage, open(path.c_str(), O_RDONLY | O_CLOEXEC));
    EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
    v1::SideRequest open_store;
    open_store.mutable_open_store()->set_format("none");
    out = Handle(caller, open_store);
    EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
    return out.reply.code() == 0 ? out.reply.open_store().store().store_id() : 0;
  }

  // list_stores for `caller`; `closes` gets whether the connection is closed afterwards.
  v1::ListStoresResponse List(const SideCaller& caller, bool* closes = nullptr) {
    v1::SideRequest req;
    req.mutable_list_stores();
    SideOutcome out = Handle(caller, req);
    EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
    EXPECT_TRUE(out.reply.has_list_stores());
    if (closes != nullptr) *closes = out.close;
    return out.reply.list_stores();
  }

  static std::vector<uint64_t> Ids(const v1::ListStoresResponse& r) {
    std::vector<uint64_t> ids;
    for (const v1::StoreInfo& s : r.stores()) ids.push_back(s.store_id());
    return ids;
  }

  Ledger ledger_;
  stores::StoreManager stores_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<SideHandler> handler_;
  std::string dir_;
  uint64_t next_id_ = 1;
};

TEST_F(SideListStores, AUidSeesTheStoresItProvedAccessToAndTheNodesTotals) {
  ASSERT_NE(geteuid(), kAlice);
  const SideCaller alice = Attach(kAlice, "alice-job");
  const SideCaller bob = Attach(kBob, "bob-job");
  const std::string alices_file = Write("alice.safetensors", 1024);
  const uint64_t a = OpenStore(alice, alices_file);
  const uint64_t b = OpenStore(bob, Write("bob.safetensors", 4096));
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);

  bool closes = true;
  v1::ListStoresResponse seen = List(alice, &closes);
  EXPECT_FALSE(closes) << "a session's connection stays open";
  EXPECT_THAT(Ids(seen), ElementsAre(a));
  EXPECT_EQ(seen.stores(0).source(), alices_file);
  EXPECT_EQ(seen.stores(0).users(), 1u);
  EXPECT_EQ(seen.stores(0).format(), "none");
  EXPECT_EQ(seen.store_count(), 2u) << "the totals cover bob's store too";
  EXPECT_EQ(seen.used_bytes(), stores_.Totals().bytes);
  EXPECT_EQ(seen.budget_bytes(), 16 * kMiB);
  EXPECT_EQ(seen.omitted(), 0u);
  EXPECT_THAT(Ids(List(bob)), ElementsAre(b));

  // Without a session: the same answer for the connection's uid, then the connection closes.
  seen = List({kAlice, getpid(), 0}, &closes);
  EXPECT_TRUE(closes) << "a sessionless list_stores is its connection's only request";
  EXPECT_THAT(Ids(seen), ElementsAre(a));
  seen = List({kCarol, getpid(), 0});
  EXPECT_THAT(Ids(seen), IsEmpty()) << "a uid that opened nothing sees no store";
  EXPECT_EQ(seen.store_count(), 2u);
  // tsd's own uid sees every store.
  EXPECT_THAT(Ids(List({geteuid(), getpid(), 0})), ElementsAre(a, b));

  // Carol proves she may read alice's file by sending it: from then on she sees that store (and
  // still after her job is gone), never bob's.
  const SideCaller carol = Attach(kCarol, "carol-job");
  EXPECT_EQ(OpenStore(carol, alices_file), a) << "the same store, not a copy";
  v1::SideRequest detach;
  detach.mutable_detach();
  EXPECT_EQ(Handle(carol, detach).reply.code(), 0);
  seen = List({kCarol, getpid(), 0});
  EXPECT_THAT(Ids(seen), ElementsAre(a));
  EXPECT_EQ(seen.stores(0).users(), 1u) << "carol's job left; alice's still uses it";

  // An open refused (nothing staged) proves nothing.
  v1::SideRequest open_store;
  open_store.mutable_open_store()->set_format("none");
  const SideCaller bob2 = Attach(kBob, "bob-job-2");
  const SideOutcome refused = Handle(bob2, open_store);
  EXPECT_EQ(refused.reply.code(), static_cast<int>(absl::StatusCode::kPermissionDenied));
  EXPECT_THAT(Ids(List(bob2)), ElementsAre(b));
}

TEST_F(SideListStores, MalformedRequestsAreRefusedAndDescriptorsClosed) {
  const SideCaller alice = Attach(kAlice, "alice-job");
  ASSERT_NE(OpenStore(alice, Write("alice.safetensors", 1024)), 0u);
  // request_id 0, before an attach: refused, and the connection closes.
  v1::SideRequest req;
  req.mutable_list_stores();
  SideOutcome out = handler_->Handle({kAlice, getpid(), 0}, req, -1);
  EXPECT_EQ(out.reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(out.reply.message(), HasSubstr("request_id 0"));
  EXPECT_FALSE(out.reply.has_list_stores());
  EXPECT_TRUE(out.close);
  // A descriptor sent with a list_stores is closed unread; the answer is the usual one.
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  req.set_request_id(next_id_++);
  out = handler_->Handle(alice, req, p[0]);
  EXPECT_EQ(fcntl(p[0], F_GETFD), -1) << "the daemon kept a descriptor it had no use for";
  close(p[1]);
  EXPECT_EQ(out.fd, -1);
  EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
  EXPECT_EQ(out.reply.list_stores().stores_size(), 1);
  // Unknown fields inside the request (a newer client's) are ignored, not honoured.
  req.set_request_id(next_id_++);
  req.mutable_list_stores()
      ->GetReflection()
      ->MutableUnknownFields(req.mutable_list_stores())
      ->AddVarint(1, kCarol);  // e.g. "list for uid carol"
  out = handler_->Handle({kCarol, getpid(), 0}, req, -1);
  EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
  EXPECT_EQ(out.reply.list_stores().stores_size(), 0)
      << "the uid is the kernel's, not the client's";
}

TEST(SideListStoresWithoutStores, ADaemonWithoutStoresListsNone) {
  Ledger ledger(16 * kMiB, 0);
  RegistryOptions o;
  o.pool_bytes = 16 * kMiB;
  o.max_job_quota_bytes = 16 * kMiB;
  o.ledger = &ledger;
  Registry registry(o);
  SideHandler handler(registry, nullptr);
  v1::SideRequest req;
  req.set_request_id(1);
  req.mutable_list_stores();
  const SideOutcome out = handler.Handle({kAlice, getpid(), 0}, req, -1);
  EXPECT_EQ(out.reply.code(), 0) << out.reply.message();
  EXPECT_TRUE(out.reply.has_list_stores());
  EXPECT_EQ(out.reply.list_stores().stores_size(), 0);
  EXPECT_EQ(out.reply.list_stores().store_count(), 0u);
}

}  // namespace
}  // namespace tsd
