// The side-socket protocol (version 2) end to end: request ids echoed in order, a client that
// times out closes its connection instead of ever reading a stale reply, a protocol-version
// mismatch refused with which side to upgrade, the shutdown notice, messages larger than a
// datagram, and a slow request (saving a large optimizer state) that stalls nobody else.
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "proto/side_message.h"
#include "proto/tsd.grpc.pb.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

TEST(Protocol, RequestIdsAreEchoedInOrder) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  RawSession raw(d->socket());
  raw.Open("ids");
  // Three requests sent back to back, before reading anything: served one at a time, in order,
  // each reply naming its request.
  v1::SideRequest alloc, list, free_req;
  alloc.set_request_id(1000);
  alloc.mutable_alloc()->set_name("r");
  alloc.mutable_alloc()->set_size_bytes(8 << 20);
  list.set_request_id(7);
  list.mutable_list_regions();
  free_req.set_request_id(123456789012345ull);
  free_req.mutable_free()->set_region_id(999999);
  for (const auto* r : {&alloc, &list, &free_req}) {
    ASSERT_TRUE(wire::SendSideMessage(raw.side_fd(), *r, -1, 1000).ok());
  }
  v1::SideReply a, b, c;
  ASSERT_TRUE(raw.Read(&a, 5000));
  ASSERT_TRUE(raw.Read(&b, 5000));
  ASSERT_TRUE(raw.Read(&c, 5000));
  EXPECT_EQ(a.request_id(), 1000u);
  EXPECT_EQ(a.code(), 0) << a.message();
  EXPECT_TRUE(a.has_alloc());
  EXPECT_EQ(b.request_id(), 7u);
  ASSERT_EQ(b.list_regions().regions_size(), 1) << "the alloc was done before the list";
  EXPECT_EQ(c.request_id(), 123456789012345ull);
  EXPECT_EQ(c.code(), static_cast<int>(absl::StatusCode::kNotFound));
}

TEST(Protocol, ATimedOutRequestClosesTheConnectionAndEndsTheSession) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "512MiB"}});
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("impatient").ok());
  ASSERT_TRUE(c->Alloc("small", 4096).ok());
  // Populating and locking 256 MiB takes tens of milliseconds: far more than 1 ms.
  c->SetRequestTimeout(absl::Milliseconds(1));
  auto slow = c->Alloc("large", 256 << 20);
  ASSERT_FALSE(slow.ok());
  EXPECT_EQ(slow.status().code(), absl::StatusCode::kDeadlineExceeded) << slow.status();
  const std::string msg(slow.status().message());
  EXPECT_THAT(msg, HasSubstr("did not answer request"));
  EXPECT_THAT(msg, HasSubstr("(alloc)"));
  EXPECT_THAT(msg, HasSubstr("closed its connection"));
  EXPECT_FALSE(c->attached());
  // Later calls say why; none of them reads the late reply of the alloc.
  c->SetRequestTimeout(absl::Seconds(10));
  auto later = c->ListRegions();
  ASSERT_FALSE(later.ok());
  EXPECT_EQ(later.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(later.status().message()), HasSubstr("did not answer request"));
  // The daemon sees the connection close and releases the job (its only session), including
  // the region the slow alloc made after the client gave up.
  EXPECT_TRUE(WaitFor(
      [&] {
        auto st = observer->Status();
        return st.ok() && st->jobs == 0 && st->used_bytes == 0;
      },
      5));
  // A fresh attach works.
  ASSERT_TRUE(c->Attach("impatient").ok());
  EXPECT_TRUE(c->Alloc("again", 4096).ok());
}

TEST(Protocol, AVersionMismatchIsRefusedSayingWhichSideToUpgrade) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  RawSession raw(d->socket());
  struct Case {
    uint32_t version;
    const char* says;
  };
  for (const Case& tc : {Case{1, "upgrade the client"}, Case{0, "upgrade the client"},
                         Case{wire::kProtocolVersion + 1, "upgrade tsd"}}) {
    v1::SideReply r = raw.Attach("versioned", 0, tc.version);
    EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
    EXPECT_THAT(r.message(), HasSubstr("client speaks protocol " + std::to_string(tc.version)));
    EXPECT_THAT(r.message(),
                HasSubstr("speaks protocol " + std::to_string(wire::kProtocolVersion)));
    EXPECT_THAT(r.message(), HasSubstr(tc.says));
  }
  // A protocol-1 client attaches over gRPC: told the same.
  auto channel = grpc::CreateChannel("unix:" + d->socket(), grpc::InsecureChannelCredentials());
  auto stub = v1::Tsd::NewStub(channel);
  grpc::ClientContext ctx;
  v1::RetiredRequest req;
  v1::RetiredResponse resp;
  grpc::Status s = stub->Attach(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("client speaks protocol 1"));
  EXPECT_THAT(s.error_message(), HasSubstr("upgrade the client"));
  // Nothing changed, and Status says which protocol tsd speaks.
  auto c = d->Connect();
  auto st = c->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->jobs, 0u);
  EXPECT_EQ(st->sessions, 0u);
  grpc::ClientContext sctx;
  v1::StatusRequest sreq;
  v1::StatusResponse sresp;
  ASSERT_TRUE(stub->Status(&sctx, sreq, &sresp).ok());
  EXPECT_EQ(sresp.protocol_version(), wire::kProtocolVersion);
}

TEST(Protocol, SigtermSendsAShutdownNotice) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  RawSession raw(d->socket());
  raw.Open("noticed");
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("noticed-too").ok());
  EXPECT_FALSE(c->LastNotice().has_value());
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  v1::SideReply notice;
  ASSERT_TRUE(raw.Read(&notice, 2000));
  EXPECT_EQ(notice.request_id(), 0u);
  ASSERT_TRUE(notice.has_notice());
  EXPECT_EQ(notice.notice().kind(), v1::SideNotice::SHUTDOWN);
  EXPECT_THAT(notice.notice().message(), HasSubstr("shutting down"));
  // The client reads it at its next call.
  auto r = c->ListRegions();
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("shutting down"));
  auto n = c->LastNotice();
  ASSERT_TRUE(n.has_value());
  EXPECT_EQ(n->kind, Notice::Kind::kShutdown);
  EXPECT_THAT(n->message, HasSubstr("shutting down"));
}

// A registration of 20,000 buckets and its layout are each larger than one datagram: they travel
// as fragments.
TEST(Protocol, MessagesLargerThanADatagramTravelAsFragments) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("many-buckets").ok());
  OptimizerSpec spec;
  spec.groups = {{}};
  for (uint32_t b = 0; b < 20000; ++b)
    spec.buckets.push_back({0, 100 + b % 7, DType::kF32, DType::kF32});
  auto opt = c->RegisterOptimizer(spec);
  ASSERT_TRUE(opt.ok()) << opt.status();
  ASSERT_EQ((*opt)->num_buckets(), 20000u);
  EXPECT_EQ((*opt)->numel(19999), 100u + 19999 % 7);
  // The layout came back whole: the last bucket's slots lie inside the mapped regions.
  (*opt)->master(19999)[(*opt)->numel(19999) - 1] = 1.5f;
  EXPECT_TRUE(c->ListRegions().ok());
}

// Saving a large optimizer state runs on a worker: meanwhile another client attaches and
// allocates at once, not after the save.
TEST(Protocol, ALargeStateSaveStallsNoOtherClient) {
  auto d = DaemonProcess::Start({.args = {"--pool-size", "1GiB"}});
  ASSERT_TRUE(d);
  auto saver = d->Connect();
  ASSERT_TRUE(saver->Attach("saver").ok());
  OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 48u << 20, DType::kBF16, DType::kBF16}};  // 576 MiB of master and moments
  auto opt = saver->RegisterOptimizer(spec);
  ASSERT_TRUE(opt.ok()) << opt.status();
  const int file = memfd_create("state", MFD_CLOEXEC);
  ASSERT_GE(file, 0);
  std::atomic<bool> saving{false};
  Clock::time_point save_start, save_end;
  absl::StatusOr<uint64_t> saved = 0;
  std::thread t([&] {
    save_start = Clock::now();
    saving = true;
    saved = (*opt)->SaveState(file);
    save_end = Clock::now();
  });
  while (!saving) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto other_start = Clock::now();
  auto other = d->Connect();
  ASSERT_TRUE(other->Attach("bystander").ok());
  ASSERT_TRUE(other->Alloc("quick", 1 << 20).ok());
  const auto other_end = Clock::now();
  t.join();
  close(file);
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_GT(*saved, 576u << 20);
  const double save_s = Seconds(save_start, save_end);
  const double other_s = Seconds(other_start, other_end);
  std::printf("save %.3f s; attach+alloc during it %.4f s\n", save_s, other_s);
  if (save_s < 0.1) GTEST_SKIP() << "the save took only " << save_s << " s: too fast to tell";
  EXPECT_LT(other_end, save_end) << "the bystander waited for the save";
  EXPECT_LT(other_s, save_s / 2);
}

// Connections that never attach hold no pending session and no slot anyone else needs (the old
// protocol's pending attaches could lock every other user out): a client attaches and allocates
// at once beside 300 of them, and they cost the daemon nothing once closed.
TEST(Protocol, IdleConnectionsWithoutAnAttachLockNobodyOut) {
  auto d = DaemonProcess::Start();
  ASSERT_TRUE(d);
  auto observer = d->Connect();
  const int fds_before = d->OpenFds();
  std::vector<std::unique_ptr<RawSession>> idle;
  for (int i = 0; i < 300; ++i) {
    idle.push_back(std::make_unique<RawSession>(d->socket()));
    idle.back()->ConnectSide();
  }
  const auto t0 = Clock::now();
  auto c = d->Connect();
  ASSERT_TRUE(c->Attach("not-locked-out").ok());
  ASSERT_TRUE(c->Alloc("r", 1 << 20).ok());
  EXPECT_LT(Seconds(t0, Clock::now()), 1.0);
  auto st = observer->Status();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->sessions, 1u) << "idle connections are not sessions";
  idle.clear();
  c.reset();
  EXPECT_TRUE(WaitFor([&] { return d->OpenFds() <= fds_before; }, 5))
      << d->OpenFds() << " descriptors now, " << fds_before << " before";
}

// A stand-in daemon whose side socket answers the attach properly and then replies to the next
// request with another request's id, as a confused or hostile tsd might.
class MisnumberingDaemon {
 public:
  explicit MisnumberingDaemon(const std::string& dir) : socket_(dir + "/fake.sock") {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    listen_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string side = wire::SideSocketPath(socket_);
    std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
    EXPECT_EQ(bind(listen_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(listen_, 4), 0);
    thread_ = std::thread([this] { Serve(); });
  }
  ~MisnumberingDaemon() {
    thread_.join();
    close(listen_);
    server_->Shutdown();
  }
  const std::string& socket() const { return socket_; }

 private:
  class Service final : public v1::Tsd::Service {
    grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                        v1::StatusResponse* r) override {
      r->set_protocol_version(wire::kProtocolVersion);
      return grpc::Status::OK;
    }
  };
  void Serve() {
    const int c = accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
    ASSERT_GE(c, 0);
    for (int n = 0; n < 2; ++n) {
      auto d = wire::ReceiveDatagram(c, false);
      ASSERT_TRUE(d.ok());
      v1::SideRequest req;
      ASSERT_TRUE(req.ParseFromString(d->bytes));
      v1::SideReply reply;
      if (req.has_attach()) {
        reply.set_request_id(req.request_id());
        reply.mutable_attach()->set_session_id(1);
        reply.mutable_attach()->set_job(req.attach().job());
        reply.mutable_attach()->set_protocol_version(wire::kProtocolVersion);
      } else {
        reply.set_request_id(req.request_id() + 5);  // the wrong request
        reply.mutable_list_regions();
      }
      ASSERT_TRUE(wire::SendSideMessage(c, reply, -1, 1000).ok());
    }
    // The client hangs up on a misnumbered reply.
    EXPECT_FALSE(wire::ReceiveDatagram(c, false).ok());
    close(c);
  }
  std::string socket_;
  Service service_;
  std::unique_ptr<grpc::Server> server_;
  int listen_ = -1;
  std::thread thread_;
};

TEST(Protocol, AReplyToAnotherRequestIsAProtocolErrorThatEndsTheSession) {
  char dir[] = "/tmp/tsd-misnumber-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  {
    MisnumberingDaemon fake(dir);
    auto c = tsd::Client::Connect(fake.socket());
    ASSERT_TRUE(c.ok()) << c.status();
    ASSERT_TRUE((*c)->Attach("numbered").ok());
    auto r = (*c)->ListRegions();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal);
    EXPECT_THAT(std::string(r.status().message()),
                HasSubstr("tsd answered request 7 while this client waited for request 2"));
    EXPECT_FALSE((*c)->attached());
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tsd::testing
