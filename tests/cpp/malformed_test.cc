// Malformed input, from a hostile or broken client: zero and huge sizes, bad names, unknown ids,
// and garbage, truncated, oversized or descriptor-carrying datagrams on the side socket. Each gets
// a clear error, nothing changes, and a second, well-behaved client keeps working throughout.
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <memory>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "proto/side_message.h"
#include "proto/wire.h"
#include "tsd/optimizer.h"

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

// How many lines of `log` contain `event`.
size_t LinesWith(const std::string& log, const std::string& event) {
  size_t lines = 0;
  for (size_t at = log.find(event); at != std::string::npos; at = log.find(event, at + 1)) ++lines;
  return lines;
}

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
  raw.Open("raw-victim");
  v1::SideRequest free_req;
  free_req.mutable_free()->set_region_id(region_->id());  // exists, but in another job
  v1::SideReply reply = raw.Request(free_req);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_THAT(reply.message(), HasSubstr("does not exist in job 'raw-victim'"));
  free_req.mutable_free()->set_region_id(123456789);
  EXPECT_EQ(raw.Request(free_req).code(), static_cast<int>(absl::StatusCode::kNotFound));
  v1::SideRequest get;
  get.mutable_get_fd()->set_region_id(region_->id());  // another job's region, by its real id
  int fd = -1;
  reply = raw.Request(get, nullptr, &fd);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kNotFound));
  EXPECT_EQ(fd, -1);
  // Requests without a request id or without a kind: refused, the session survives.
  v1::SideRequest unnumbered;
  unnumbered.mutable_list_regions();
  unnumbered.set_request_id(0);
  bool closed = true;
  reply = raw.SendRaw(unnumbered.SerializeAsString(), &closed);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(reply.message(), HasSubstr("request_id 0"));
  EXPECT_FALSE(closed);
  v1::SideRequest empty;
  reply = raw.Request(empty, &closed);
  EXPECT_EQ(reply.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(reply.message(), HasSubstr("names no request"));
  EXPECT_EQ(reply.request_id(), raw.last_request_id());
  EXPECT_FALSE(closed);
  // A duplicate region name.
  ASSERT_TRUE(c->Alloc("twice", 4096).ok());
  EXPECT_EQ(c->Alloc("twice", 4096).status().code(), absl::StatusCode::kAlreadyExists);
  ExpectBystanderFine((1 << 20) + 4096);
}

TEST_F(Malformed, GarbageOnTheSideSocket) {
  RawSession raw(daemon_->socket());
  // Before an attach: one bad datagram gets an error saying what failed, and the connection is
  // closed.
  raw.ConnectSide();
  bool closed = false;
  v1::SideReply r = raw.SendRaw("\xff\xfe garbage \x00\x01", &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("is not a valid tsd.v1.SideRequest"));
  EXPECT_THAT(r.message(), HasSubstr("at byte 0"));
  EXPECT_TRUE(closed);
  // A truncated attach (the first half of a valid one): the message says where it broke off.
  v1::SideRequest attach;
  attach.set_request_id(1);
  attach.mutable_attach()->set_job("garbage-job");
  attach.mutable_attach()->set_protocol_version(wire::kProtocolVersion);
  const std::string full = attach.SerializeAsString();
  raw.ConnectSide();
  r = raw.SendRaw(full.substr(0, full.size() - 3), &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("field 2 (attach)"));
  EXPECT_THAT(r.message(), HasSubstr("remain"));
  EXPECT_EQ(r.request_id(), 1u) << "the id was readable, so the error reply carries it";
  EXPECT_TRUE(closed);
  // A cut-off list_stores (field 25 says 5 bytes, 2 follow): refused naming it, connection closed.
  raw.ConnectSide();
  r = raw.SendRaw(std::string("\x08\x02\xca\x01\x05\x08\x01", 7), &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("field 25 (list_stores)"));
  EXPECT_FALSE(r.has_list_stores());
  EXPECT_TRUE(closed);
  // A well-formed one needs no session: answered, then the connection closes, as it is the
  // connection's only request.
  raw.ConnectSide();
  v1::SideRequest list;
  list.set_request_id(3);
  list.mutable_list_stores();
  r = raw.SendRaw(list.SerializeAsString(), &closed);
  EXPECT_EQ(r.code(), 0) << r.message();
  EXPECT_TRUE(r.has_list_stores());
  EXPECT_EQ(r.request_id(), 3u);
  EXPECT_TRUE(closed);
  // A job name that is not UTF-8, as protobuf strings must be.
  raw.ConnectSide();
  v1::SideRequest latin1 = attach;
  latin1.mutable_attach()->set_job("caf\xe9");
  r = raw.SendRaw(latin1.SerializeAsString(), &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("not valid UTF-8"));
  // An empty datagram, and one larger than the limit.
  raw.ConnectSide();
  r = raw.SendRaw(std::string(), &closed);
  EXPECT_TRUE(
      closed);  // on SOCK_SEQPACKET an empty datagram reads as end-of-stream: the daemon hangs up
  raw.ConnectSide();
  const std::string oversized(wire::kMaxSideDatagramBytes + 100, 'A');
  ASSERT_EQ(send(raw.side_fd(), oversized.data(), oversized.size(), 0),
            static_cast<ssize_t>(oversized.size()));
  auto big_reply = wire::ReceiveDatagram(raw.side_fd(), false);
  ASSERT_TRUE(big_reply.ok());
  ASSERT_TRUE(r.ParseFromString(big_reply->bytes));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("larger than"));
  // After a proper attach, garbage gets an error but the session survives.
  r = raw.Attach("garbage-job");
  ASSERT_EQ(r.code(), 0) << r.message();
  r = raw.SendRaw("\x0a\x05junk", &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("at byte 0"));
  EXPECT_FALSE(closed);
  // A fragment that claims more is coming, then a whole message: refused, session survives.
  v1::SideRequest fragment;
  fragment.set_request_id(77);
  fragment.set_fragment("partial");
  fragment.set_more_fragments(true);
  ASSERT_TRUE(wire::SendDatagram(raw.side_fd(), fragment.SerializeAsString()).ok());
  v1::SideRequest regions;
  regions.mutable_list_regions();
  r = raw.Request(regions, &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("fragments of request 77"));
  EXPECT_FALSE(closed);
  // Descriptors sent to the daemon are closed, not kept.
  const int fds_before = daemon_->OpenFds();
  for (int i = 0; i < 20; ++i) {
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    v1::SideRequest get;
    get.mutable_get_fd()->set_region_id(424242);
    r = raw.Request(get, nullptr, nullptr, pipefd[0]);
    close(pipefd[0]);
    close(pipefd[1]);
    EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kNotFound));
  }
  EXPECT_EQ(daemon_->OpenFds(), fds_before);
  // A state request with a pipe instead of a file: refused with what to do instead.
  {
    int pipefd[2];
    ASSERT_EQ(pipe(pipefd), 0);
    v1::SideRequest save;
    save.mutable_save_state();
    r = raw.Request(save, nullptr, nullptr, pipefd[1]);
    close(pipefd[0]);
    close(pipefd[1]);
    EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_THAT(r.message(), HasSubstr("is a pipe"));
    EXPECT_THAT(r.message(), HasSubstr("regular file or a memfd"));
  }
  // The session still works for real requests.
  v1::SideRequest alloc;
  alloc.mutable_alloc()->set_name("after-garbage");
  alloc.mutable_alloc()->set_size_bytes(8192);
  r = raw.Request(alloc);
  ASSERT_EQ(r.code(), 0) << r.message();
  v1::SideRequest get;
  get.mutable_get_fd()->set_region_id(r.alloc().region().region_id());
  int fd = -1;
  r = raw.Request(get, &closed, &fd);
  EXPECT_EQ(r.code(), 0);
  EXPECT_GE(fd, 0);
  if (fd >= 0) close(fd);
  ExpectBystanderFine((1 << 20) + 8192);
}

// Garbage after an attach costs a client nothing to repeat: every datagram still gets its error
// reply, but tsd logs at most 20 of them per uid in 10 s (LogBudget), so no client can flood the
// log (and with it journald's rate limit, which would drop everyone's lines).
TEST_F(Malformed, GarbageFloodIsAnsweredButItsLogIsBounded) {
  RawSession raw(daemon_->socket());
  v1::SideReply r = raw.Attach("flood-job");
  ASSERT_EQ(r.code(), 0) << r.message();
  for (int i = 0; i < 500; ++i) {  // well within one 10 s window
    r = raw.SendRaw("\x0a\x05junk", nullptr);
    ASSERT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << i;
  }
  const size_t lines = LinesWith(daemon_->log(), "event=bad_side_message");
  EXPECT_GE(lines, 1u);
  EXPECT_LE(lines, 20u) << "500 garbage datagrams made " << lines << " log lines";
  v1::SideRequest regions;
  regions.mutable_list_regions();
  r = raw.Request(regions);
  EXPECT_EQ(r.code(), 0) << r.message();
  ExpectBystanderFine(1 << 20);
}

// The same bound for the other two lines a client can repeat for free: a refused attach (a new
// connection each time) and a descriptor sent with a request that takes none (closed unread).
TEST_F(Malformed, RefusedAttachesAndStrayDescriptorsAreAnsweredButTheirLogIsBounded) {
  RawSession raw(daemon_->socket());
  for (int i = 0; i < 150; ++i) {
    v1::SideReply r = raw.Attach("old-client", 0, wire::kProtocolVersion + 1);
    ASSERT_EQ(r.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << i;
    r = raw.Attach("no/slashes in job names");
    ASSERT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << i;
  }
  const size_t refused = LinesWith(daemon_->log(), "event=attach_refused");
  EXPECT_GE(refused, 1u);
  EXPECT_LE(refused, 20u) << "300 refused attaches made " << refused << " log lines";

  raw.Open("stray-fds");
  const int fds_before = daemon_->OpenFds();
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  v1::SideRequest regions;
  regions.mutable_list_regions();
  for (int i = 0; i < 300; ++i) {
    v1::SideRequest req = regions;
    v1::SideReply r = raw.Request(std::move(req), nullptr, nullptr, pipe_fds[0]);
    ASSERT_EQ(r.code(), 0) << i << ": " << r.message();
  }
  close(pipe_fds[0]);
  close(pipe_fds[1]);
  const size_t stray = LinesWith(daemon_->log(), "event=unexpected_fd");
  EXPECT_GE(stray, 1u);
  EXPECT_LE(stray, 20u) << "300 stray descriptors made " << stray << " log lines";
  // Each was closed unread: the daemon holds no more descriptors than before.
  EXPECT_LE(daemon_->OpenFds(), fds_before);
  ExpectBystanderFine(1 << 20);
}

// Requests too large for one datagram travel in fragments; the daemon bounds what it holds of
// half-sent ones: per request, in all (so slow senders cannot make it hold unbounded memory), and
// not at all before an attach. The bystander is served throughout.
TEST_F(Malformed, HalfSentRequestsAreBounded) {
  auto fragment = [](uint64_t id) {
    v1::SideRequest f;
    f.set_request_id(id);
    f.set_fragment(std::string(wire::kMaxSideDatagramBytes - 64, 'f'));
    f.set_more_fragments(true);
    return f.SerializeAsString();
  };
  // Before an attach: refused and closed.
  RawSession early(daemon_->socket());
  early.ConnectSide();
  bool closed = false;
  v1::SideReply r = early.SendRaw(fragment(1), &closed);
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
  EXPECT_THAT(r.message(), HasSubstr("before SideAttach"));
  EXPECT_TRUE(closed);
  // One request larger than the request limit.
  RawSession big(daemon_->socket());
  big.Open("big-sender");
  const size_t per_request = wire::kMaxSideRequestBytes / (wire::kMaxSideDatagramBytes - 64);
  for (size_t i = 0; i < per_request; ++i) {
    ASSERT_TRUE(wire::SendDatagram(big.side_fd(), fragment(5), -1, 5000).ok());
  }
  ASSERT_TRUE(wire::SendDatagram(big.side_fd(), fragment(5), -1, 5000).ok());
  ASSERT_TRUE(big.Read(&r, 5000));
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(r.message(), HasSubstr("exceeds 4 MiB"));
  EXPECT_EQ(r.request_id(), 5u);
  // Many sessions each holding most of a request: the one that takes the total past 64 MiB is
  // refused. (SIOCOUTQ says when the daemon has read everything a session sent.)
  std::vector<std::unique_ptr<RawSession>> slow;
  int first_refused = -1;
  const size_t each = (per_request - 2) * (wire::kMaxSideDatagramBytes - 64);
  for (int s = 0; s < 20 && first_refused < 0; ++s) {
    slow.push_back(std::make_unique<RawSession>(daemon_->socket()));
    slow.back()->Open("slow-" + std::to_string(s));
    const int fd = slow.back()->side_fd();
    for (size_t i = 0; i + 2 < per_request; ++i) {
      ASSERT_TRUE(wire::SendDatagram(fd, fragment(9), -1, 5000).ok());
    }
    ASSERT_TRUE(WaitFor(
        [&] {
          int unread = -1;
          return ioctl(fd, SIOCOUTQ, &unread) == 0 && unread == 0;
        },
        5));
    v1::SideReply maybe;
    if (slow.back()->Read(&maybe, 50)) {
      EXPECT_EQ(maybe.code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
      EXPECT_THAT(maybe.message(), HasSubstr("half-sent requests from all clients"));
      first_refused = s;
    }
  }
  EXPECT_EQ(first_refused, static_cast<int>((64u << 20) / each))
      << "the session that takes the total past 64 MiB";
  ExpectBystanderFine(1 << 20);
  // Once they go, what they held is released: a fragmented request goes through again.
  slow.clear();
  auto c = daemon_->Connect();
  ASSERT_TRUE(c->Attach("after-the-flood").ok());
  OptimizerSpec spec;
  spec.groups = {{}};
  for (uint32_t b = 0; b < 20000; ++b) spec.buckets.push_back({0, 64, DType::kF32, DType::kF32});
  auto opt = c->RegisterOptimizer(spec);
  EXPECT_TRUE(opt.ok()) << opt.status();
}

}  // namespace
}  // namespace tsd::testing
