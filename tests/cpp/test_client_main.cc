// tsd_test_client: a client process for the multi-process tests, started with fork+exec so that no
// gRPC state ever crosses a fork. Modes:
//   alloc-loop SOCKET JOB
//       attach, print "attached", then allocate and write regions without end (the test kills it)
//   intruder SOCKET JOB REGION_ID UID GID
//       drop to UID/GID, then try every way into JOB's memory (REGION_ID is one of its regions);
//       print one "name=code" line each and "fds_received=N"; exit 0
#include <grp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "proto/side_message.h"
#include "proto/tsd.pb.h"
#include "proto/wire.h"
#include "tsd/client.h"
#include "tsd/optimizer.h"

namespace {

int fds_received = 0;

int SideConnect(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string side = tsd::wire::SideSocketPath(path);
  std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    std::printf("side_connect_errno=%d\n", errno);
    close(fd);
    return -1;
  }
  return fd;
}

// Sends a request and returns the reply's code (-1: connection closed without a reply).
int Exchange(int fd, tsd::v1::SideRequest req) {
  static uint64_t next_id = 1;
  req.set_request_id(next_id++);
  if (!tsd::wire::SendSideMessage(fd, req, -1, 5000).ok()) return -1;
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 5000) != 1) return -2;
  auto d = tsd::wire::ReceiveDatagram(fd, false);
  if (!d.ok()) return -1;
  if (d->fd >= 0) {
    ++fds_received;
    close(d->fd);
  }
  tsd::v1::SideReply reply;
  if (!reply.ParseFromString(d->bytes)) return -3;
  if (reply.request_id() != req.request_id()) return -4;
  return reply.code();
}

tsd::v1::SideRequest AttachTo(const std::string& job) {
  tsd::v1::SideRequest req;
  req.mutable_attach()->set_job(job);
  req.mutable_attach()->set_protocol_version(tsd::wire::kProtocolVersion);
  return req;
}

int Intruder(char** argv) {
  const std::string socket = argv[2], job = argv[3];
  const uint64_t region = std::stoull(argv[4]);
  const uid_t uid = static_cast<uid_t>(std::stoul(argv[5]));
  const gid_t gid = static_cast<gid_t>(std::stoul(argv[6]));
  if (setgroups(1, &gid) != 0 || setgid(gid) != 0 || setuid(uid) != 0) {
    std::printf("drop_privileges_failed errno=%d\n", errno);
    return 3;
  }
  std::printf("uid=%u\n", getuid());
  // 1. The ordinary way: attach to the job by name.
  auto client = tsd::Client::Connect(socket);
  if (!client.ok()) {
    std::printf("connect=%d\n", static_cast<int>(client.status().code()));
  } else {
    absl::Status s = (*client)->Attach(job);
    std::printf("attach=%d\n", static_cast<int>(s.code()));
    std::printf("attach_message=%s\n", std::string(s.message()).c_str());
  }
  // 2. A raw side connection asking for the job, then acting on it anyway.
  int fd = SideConnect(socket);
  std::printf("raw_attach=%d\n", fd < 0 ? -1 : Exchange(fd, AttachTo(job)));
  tsd::v1::SideRequest detach;
  detach.mutable_detach();
  std::printf("detach_after_refusal=%d\n", fd < 0 ? -1 : Exchange(fd, detach));
  if (fd >= 0) close(fd);
  // 3. Session calls without any attach: each connection is closed after the first.
  struct Call {
    const char* name;
    tsd::v1::SideRequest req;
  };
  std::vector<Call> calls(5);
  calls[0].name = "getfd_without_attach";
  calls[0].req.mutable_get_fd()->set_region_id(region);
  calls[1].name = "free_without_attach";
  calls[1].req.mutable_free()->set_region_id(region);
  calls[2].name = "alloc_without_attach";
  calls[2].req.mutable_alloc()->set_name("stolen");
  calls[2].req.mutable_alloc()->set_size_bytes(4096);
  calls[3].name = "detach_without_attach";
  calls[3].req.mutable_detach();
  calls[4].name = "list_without_attach";
  calls[4].req.mutable_list_regions();
  for (auto& c : calls) {
    fd = SideConnect(socket);
    std::printf("%s=%d\n", c.name, fd < 0 ? -1 : Exchange(fd, c.req));
    std::printf("%s_again=%d\n", c.name, fd < 0 ? -1 : Exchange(fd, c.req));
    if (fd >= 0) close(fd);
  }
  // 4. A session of its own job, reaching for the other job's region by its real id.
  fd = SideConnect(socket);
  std::printf("own_attach=%d\n", fd < 0 ? -1 : Exchange(fd, AttachTo("intruders-own")));
  std::printf("own_getfd=%d\n", fd < 0 ? -1 : Exchange(fd, calls[0].req));
  std::printf("own_free=%d\n", fd < 0 ? -1 : Exchange(fd, calls[1].req));
  if (fd >= 0) close(fd);
  std::printf("fds_received=%d\n", fds_received);
  return 0;
}

int AllocLoop(char** argv) {
  auto client = tsd::Client::Connect(argv[2]);
  if (!client.ok()) return 3;
  if (!(*client)->Attach(argv[3], 64ull << 20).ok()) return 4;
  std::printf("attached\n");
  std::fflush(stdout);
  std::vector<std::shared_ptr<tsd::Region>> held;
  for (uint64_t i = 0;; ++i) {
    auto r = (*client)->Alloc("r" + std::to_string(i), (1ull << 20) + (i % 7) * 4096);
    if (r.ok()) {
      std::memset((*r)->data(), 0xA5, (*r)->size());
      held.push_back(*r);
    } else {
      for (auto& h : held) (void)(*client)->Free(h);
      held.clear();
    }
  }
}

// Registers a large optimizer and steps it without end (the test kills it mid-update).
int OptimizerLoop(char** argv) {
  auto client = tsd::Client::Connect(argv[2]);
  if (!client.ok()) return 3;
  if (!(*client)->Attach(argv[3]).ok()) return 4;
  tsd::OptimizerSpec spec;
  spec.groups = {{}};
  spec.buckets = {{0, 16u << 20, tsd::DType::kBF16, tsd::DType::kBF16}};
  auto opt = (*client)->RegisterOptimizer(spec);
  if (!opt.ok()) return 5;
  std::printf("registered\n");
  std::fflush(stdout);
  for (;;) {
    if (!(*opt)->Ready(0).ok() || !(*opt)->Wait(0).ok()) return 6;
  }
}

}  // namespace

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "alloc-loop" && argc == 4) return AllocLoop(argv);
  if (mode == "intruder" && argc == 7) return Intruder(argv);
  if (mode == "optimizer-loop" && argc == 4) return OptimizerLoop(argv);
  std::fprintf(
      stderr,
      "usage: tsd_test_client alloc-loop SOCKET JOB | intruder SOCKET JOB REGION_ID UID GID | "
      "optimizer-loop SOCKET JOB\n");
  return 2;
}
