// Malformed input, from a hostile or broken client: zero and huge sizes, bad names, unknown ids,
// and garbage, truncated, oversized or descriptor-carrying datagrams on the side socket. Each gets
// a clear error, nothing changes, and a second, well-behaved client keeps working throughout.
#include <sys/socket.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "proto/wire.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;

class Malformed : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = DaemonProcess::Start();
    ASSERT_TRUE(daemon_);
    bystander_ = daemon_->Connect();
    ASSERT_TRUE(bystander_->Attach("bystander", 8 << 20).ok());
    auto r = bystander_->Alloc("steady", 1 << 20);
    ASSERT_TRUE(r.ok());
    region_ = *r;
    static_cast<uint8_t*>(region_->data())[0] = 42;
  }
  // The bystander still works and sees nothing changed.
  void ExpectBystanderFine(uint64_t expected_used) {
    auto st = bystander_->Status();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->used_bytes, expected_used);
    auto again = bystander_->Map("steady");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(static_cast<uint8_t*>((*again)->data())[0], 42);
    auto extra = bystander_->Alloc("probe", 4096);
    ASSERT_TRUE(extra.ok()) << extra.status();
    ASSERT_TRUE(bystander_->Free(*extra).ok());
  }

  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<tsd::Client> bystander_;
  std::shared_ptr<tsd::Region> region_;
};

TEST_F(Malformed, SizesNamesAndIds) {
  auto c = daemon_->Connect();
  ASSERT_TRUE(c->Attach("victim", 16 << 20).ok());
  struct Case {
    std::string name;
    uint64_t bytes;
    absl::StatusCode code;
    std::string says;
  };
  const Case cases[] = {
      {"zero", 0, absl::StatusCode::kInvalidArgument, "0 bytes"},
      {"huge", ~0ull, absl::StatusCode::kResourceExhausted, "more than the whole pool"},
      {"almost-huge", ~0ull - 4095, absl::StatusCode::kResourceExhausted,
       "more than the whole pool"},
      {"", 4096, absl::StatusCode::kInvalidArgument, "name is empty"},
      {std::string(129, 'n'), 4096, absl::StatusCode::kInvalidArgument, "129 bytes long"},
      {"../escape", 4096, absl::StatusCode::kInvalidArgument, "may not start with"},
      {"tab\there", 4096, absl::StatusCode::kInvalidArgument, "0x09"},
      {std::string("nul\0byte", 8), 4096, absl::StatusCode::kInvalidArgument, "0x00"},
  };
  for (const auto& tc : cases) {
    auto r = c->Alloc(tc.name, tc.bytes);
    ASSERT_FALSE(r.ok()) << tc.says;
    EXPECT_EQ(r.status().code(), tc.code) << r.status();
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(tc.says));
  }
  // Bad job names at attach.
  auto other = daemon_->Connect();
  EXPECT_EQ(other->Attach("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Attach(std::string(4096, 'j')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(other->Attach("white space").code(), absl::StatusCode::kInvalidArgument);
  // Unknown ids.
  RawSession raw(daemon_->socket());
  const v1::SessionRef ref = raw.Open("raw-victim");
  v1::FreeRequest free_req;
  *free_req.mutable_session() = ref;
  free_req.set_region_id(region_->id());  // exists, but in another job
  v1::FreeResponse free_resp;
  {
    grpc::ClientContext ctx;
    grpc::Status s = raw.stub().Free(&ctx, free_req, &free_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("does not exist in job 'raw-victim'"));
  }
  free_req.set_region_id(123456789);
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(raw.stub().Free(&ctx, free_req, &free_resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  free_req.mutable_session()->set_session_id(987654321);
  {
    grpc::ClientContext ctx;
    grpc::Status s = raw.stub().Free(&ctx, free_req, &free_resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
    EXPECT_THAT(s.error_message(), HasSubstr("session 987654321 does not exist"));
  }
  v1::SideRequest get;
  get.mutable_get_fd()->set_region_id(region_->id());  // another job's region, by its real id
  int fd = -1;
  v1::SideReply reply = raw.SendRaw(get.SerializeAsString(), nullptr, &fd);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(fd, -1);
  // A duplicate region name.
  ASSERT_TRUE(c->Alloc("twice", 4096).ok());
  EXPECT_EQ(c->Alloc("twice", 4096).status().code(), absl::StatusCode::kAlreadyExists);
  ExpectBystanderFine((1 << 20) + 4096);
}

TEST_F(Malformed, GarbageOnTheSideSocket) {
  RawSession raw(daemon_->socket());
  // Before a hello: one bad datagram gets an error and the connection is closed.
  raw.ConnectSide();
  bool closed = false;
  v1::SideReply r = raw.SendRaw("\xff\xfe garbage \x00\x01", &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("not a valid tsd.v1.SideRequest"));
  EXPECT_TRUE(closed);
  // A truncated hello (the first half of a valid one).
  v1::AttachResponse pending;
  ASSERT_TRUE(raw.Attach("garbage-job", 0, &pending).ok());
  v1::SideRequest hello;
  *hello.mutable_hello()->mutable_session() = pending.session();
  const std::string full = hello.SerializeAsString();
  raw.ConnectSide();
  r = raw.SendRaw(full.substr(0, full.size() / 2), &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_TRUE(closed);
  // An empty datagram, and one larger than the limit.
  raw.ConnectSide();
  r = raw.SendRaw(std::string(), &closed);
  EXPECT_TRUE(
      closed);  // on SOCK_SEQPACKET an empty datagram reads as end-of-stream: the daemon hangs up
  raw.ConnectSide();
  const std::string oversized(wire::kMaxSideMessageBytes + 100, 'A');
  ASSERT_EQ(send(raw.side_fd(), oversized.data(), oversized.size(), 0),
            static_cast<ssize_t>(oversized.size()));
  auto big_reply = wire::ReceiveDatagram(raw.side_fd(), false);
  ASSERT_TRUE(big_reply.ok());
  ASSERT_TRUE(r.ParseFromString(big_reply->bytes));
  EXPECT_THAT(r.message(), HasSubstr("larger than"));
  // After a proper hello, garbage gets an error but the session survives.
  raw.ConnectSide();
  r = raw.Hello(pending.session());
  ASSERT_EQ(r.code(), 0) << r.message();
  r = raw.SendRaw("\x0a\x05junk", &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(closed);
  // Descriptors sent to the daemon are closed, not kept.
  const int fds_before = daemon_->OpenFds();
  for (int i = 0; i < 20; ++i) {
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    v1::SideRequest get;
    get.mutable_get_fd()->set_region_id(424242);
    ASSERT_TRUE(wire::SendDatagram(raw.side_fd(), get.SerializeAsString(), pipefd[0]).ok());
    close(pipefd[0]);
    close(pipefd[1]);
    auto d = wire::ReceiveDatagram(raw.side_fd(), false);
    ASSERT_TRUE(d.ok());
  }
  EXPECT_EQ(daemon_->OpenFds(), fds_before);
  // The session still works for real requests.
  v1::AllocRequest alloc;
  *alloc.mutable_session() = pending.session();
  alloc.set_name("after-garbage");
  alloc.set_size_bytes(8192);
  v1::AllocResponse resp;
  grpc::ClientContext ctx;
  ASSERT_TRUE(raw.stub().Alloc(&ctx, alloc, &resp).ok());
  v1::SideRequest get;
  get.mutable_get_fd()->set_region_id(resp.region().region_id());
  int fd = -1;
  r = raw.SendRaw(get.SerializeAsString(), &closed, &fd);
  EXPECT_EQ(r.code(), 0);
  EXPECT_GE(fd, 0);
  if (fd >= 0) close(fd);
  ExpectBystanderFine((1 << 20) + 8192);
}

}  // namespace
}  // namespace tsd::testing
