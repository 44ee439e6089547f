#include "tsd/client.h"

#include "tsd/optimizer.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <limits>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "cuda_host.h"
#include "proto/control_page.h"
#include "proto/mutex.h"
#include "proto/side_message.h"
#include "proto/socket_dir.h"
#include "proto/status_convert.h"
#include "proto/status_macros.h"
#include "proto/tsd.grpc.pb.h"
#include "proto/wire.h"

namespace tsd {
namespace {

// Allocations populate and lock memory, registrations allocate several regions: generous.
constexpr absl::Duration kDefaultRequestTimeout = absl::Seconds(120);
// Saving or loading a large optimizer state moves tens of GiB.
constexpr absl::Duration kMinStateTimeout = absl::Hours(1);

std::string HowToStart(const std::string& path) {
  return absl::StrCat(
      "start it with `tsd --socket ", path,
      "` (or `systemctl start tsd` for the system service), or point TSD_SOCKET at the "
      "socket of a running tsd");
}

// A tsd may well be running there: this user may not reach it, and must not be told to start one.
absl::Status NoPermission(const std::string& path) {
  return absl::PermissionDeniedError(absl::StrCat(
      "uid ", geteuid(), " may not use tsd's socket ", path,
      " (permission denied): a tsd may be running there, but only its own uid and members of its "
      "socket group may connect; ask its administrator to add you to that group (socket_group in "
      "tsd.toml), or point TSD_SOCKET at a tsd of your own"));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Region

Region::~Region() { Unmap(); }

void Region::Unmap() {
  if (data_ != nullptr) {
    if (cuda_registered_) cuda_host::Unregister(data_);
    munmap(data_, desc_.size);
    data_ = nullptr;
    cuda_registered_ = false;
  }
  if (fd_ >= 0) {
    close(fd_);
    fd_ = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Client

struct Client::Impl {
  std::string socket_path;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Tsd::Stub> stub;

  mutable Mutex mu;
  bool attached ABSL_GUARDED_BY(mu) = false;
  uint64_t session_id ABSL_GUARDED_BY(mu) = 0;
  std::string job ABSL_GUARDED_BY(mu);
  uint64_t quota_bytes ABSL_GUARDED_BY(mu) = 0;
  absl::Duration keep_for ABSL_GUARDED_BY(mu);
  bool resumed ABSL_GUARDED_BY(mu) = false;
  double orphaned_s ABSL_GUARDED_BY(mu) = 0;
  int side_fd ABSL_GUARDED_BY(mu) = -1;
  uint64_t next_request_id ABSL_GUARDED_BY(mu) = 1;
  wire::SideAssembler<v1::SideReply> assembler ABSL_GUARDED_BY(mu);
  std::optional<Notice> last_notice ABSL_GUARDED_BY(mu);
  // Why the session's connection closed without a Detach (calls fail with it until the next
  // Attach); empty while attached and after a Detach.
  std::string closed_why ABSL_GUARDED_BY(mu);
  absl::StatusCode closed_code ABSL_GUARDED_BY(mu) = absl::StatusCode::kUnavailable;
  absl::Duration request_timeout ABSL_GUARDED_BY(mu) = kDefaultRequestTimeout;

  ~Impl() {
    MutexLock lock(mu);
    if (side_fd >= 0) close(side_fd);
  }

  // Closes the session's connection; `why` is what later calls are told.
  void CloseSide(const std::string& why, absl::StatusCode code = absl::StatusCode::kUnavailable)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    closed_code = code;
    if (side_fd >= 0) close(side_fd);
    side_fd = -1;
    attached = false;
    assembler.Reset();
    closed_why = why;
  }

  // Why calls fail after the connection closed without a Detach.
  absl::Status Closed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return absl::Status(closed_code, closed_why);
  }

  absl::Status NotAttached() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!closed_why.empty()) return Closed();
    return absl::FailedPreconditionError("this client is not attached to a job; attach first");
  }

  std::string ClosedByTsd() const {
    return absl::StrCat("tsd at ", socket_path,
                        " closed this session's connection (the daemon stopped, was killed or "
                        "dropped the session); restart it if needed and attach again");
  }

  // Handles a whole message that is not the reply a call waits for: a notice is kept and ends
  // the session (tsd closes the connection after one); anything else is a protocol error.
  absl::Status Unsolicited(v1::SideReply& m, int fd, uint64_t waiting_for)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (fd >= 0) close(fd);
    if (m.request_id() == 0 && m.has_notice()) {
      Notice n;
      n.kind = m.notice().kind() == v1::SideNotice::SHUTDOWN         ? Notice::Kind::kShutdown
               : m.notice().kind() == v1::SideNotice::SESSION_CLOSED ? Notice::Kind::kSessionClosed
                                                                     : Notice::Kind::kOther;
      n.message = m.notice().message();
      last_notice = n;
      // A session tsd closed (e.g. its optimizer saw a protocol violation) is ABORTED, which
      // the Python package raises as SessionClosed; a shutdown is UNAVAILABLE.
      CloseSide(n.message, n.kind == Notice::Kind::kSessionClosed ? absl::StatusCode::kAborted
                                                                  : absl::StatusCode::kUnavailable);
      return Closed();
    }
    std::string why;
    if (m.request_id() == 0) {
      why = absl::StrCat("tsd could not read a request of this client: ", m.message());
    } else if (waiting_for == 0) {
      why = absl::StrCat("protocol error: tsd sent a reply to request ", m.request_id(),
                         " while no request was in flight");
    } else {
      why = absl::StrCat("protocol error: tsd answered request ", m.request_id(),
                         " while this client waited for request ", waiting_for);
    }
    why += "; the connection was closed, which ended the session: attach again";
    CloseSide(why);
    return absl::InternalError(why);
  }

  // Reads whatever is queued on the connection without waiting: notices, or the end of it.
  void Pump() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (side_fd >= 0) {
      bool would_block = false;
      auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/true, &would_block);
      if (!d.ok()) {
        CloseSide(ClosedByTsd());
        return;
      }
      if (would_block) return;
      uint64_t id = 0;
      auto whole = assembler.Feed(std::move(*d), &id);
      if (!whole.ok()) {
        CloseSide(absl::StrCat("tsd sent a side message this client cannot read (",
                               whole.status().message(), "); the session ended"));
        return;
      }
      if (!*whole) continue;
      const int fd = assembler.TakeFd();
      (void)Unsolicited(assembler.message(), fd, 0);
    }
  }

  // Sends `req` (with `fd`, when >= 0) as the next request of the session and waits for its
  // reply; an error reply becomes its status. The descriptor that came with the reply (or -1)
  // belongs to the caller.
  absl::StatusOr<std::pair<v1::SideReply, int>> Call(v1::SideRequest req, int fd,
                                                     absl::Duration timeout, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (side_fd < 0) return NotAttached();
    Pump();  // a notice that came while idle ends the session before we ask anything
    if (side_fd < 0) return Closed();
    const uint64_t id = next_request_id++;
    req.set_request_id(id);
    const absl::Time deadline = absl::Now() + timeout;
    const int timeout_ms = static_cast<int>(
        std::min<int64_t>(absl::ToInt64Milliseconds(timeout) + 1, std::numeric_limits<int>::max()));
    if (absl::Status s = wire::SendSideMessage(side_fd, req, fd, timeout_ms); !s.ok()) {
      Pump();
      if (side_fd < 0) return Closed();
      CloseSide(absl::StrCat("sending a ", what, " request to tsd failed (", s.message(),
                             "); the session ended: attach again"));
      return Closed();
    }
    for (;;) {
      const absl::Duration left = deadline - absl::Now();
      pollfd p{side_fd, POLLIN, 0};
      const int ready =
          left <= absl::ZeroDuration()
              ? 0
              : poll(&p, 1,
                     static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1,
                                                        std::numeric_limits<int>::max())));
      if (ready < 0 && errno == EINTR) continue;
      if (ready == 0) {
        CloseSide(absl::StrCat(
            "tsd did not answer request ", id, " (", what, ") within ",
            absl::FormatDuration(timeout),
            "; this client closed its connection, which ended the session (tsd releases the job "
            "with its last session): attach again, or raise the timeout"));
        return absl::DeadlineExceededError(closed_why);
      }
      bool would_block = false;
      auto d = wire::ReceiveDatagram(side_fd, /*nonblocking=*/true, &would_block);
      if (!d.ok()) {
        CloseSide(ClosedByTsd());
        return Closed();
      }
      if (would_block) continue;
      uint64_t got = 0;
      auto whole = assembler.Feed(std::move(*d), &got);
      if (!whole.ok()) {
        CloseSide(absl::StrCat("tsd sent a reply this client cannot read (",
                               whole.status().message(),
                               "); is tsd of another version? The session ended"));
        return absl::InternalError(closed_why);
      }
      if (!*whole) continue;
      const int reply_fd = assembler.TakeFd();
      v1::SideReply& m = assembler.message();
      if (m.request_id() != id) return Unsolicited(m, reply_fd, id);
      if (m.code() != 0) {
        if (reply_fd >= 0) close(reply_fd);
        return absl::Status(static_cast<absl::StatusCode>(m.code()), m.message());
      }
      return std::make_pair(std::move(m), reply_fd);
    }
  }

  // Sends `req` (a request that needs no session: checkpoint, list_stores) on a connection of
  // its own, which tsd closes after the reply, and returns the reply as Call does. Only while no
  // session's connection is open; what a dead session's calls are told is kept.
  absl::StatusOr<std::pair<v1::SideReply, int>> CallAlone(v1::SideRequest req, int fd,
                                                          absl::Duration timeout, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (side_fd >= 0) {
      return absl::FailedPreconditionError(
          absl::StrCat(what,
                       " uses a connection of its own: call it on a client that is not "
                       "attached"));
    }
    const int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string side = wire::SideSocketPath(socket_path);
    if (side.size() >= sizeof(addr.sun_path)) {
      close(sock);
      return absl::InvalidArgumentError(absl::StrCat("side socket path '", side, "' is too long"));
    }
    std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
    if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      const int err = errno;
      close(sock);
      return absl::UnavailableError(absl::StrCat("cannot connect to tsd's side socket ", side, ": ",
                                                 std::strerror(err), "; ",
                                                 HowToStart(socket_path)));
    }
    const std::string why = std::move(closed_why);
    const absl::StatusCode code = closed_code;
    side_fd = sock;  // for this one request; closed below whatever happens
    closed_why.clear();
    assembler.Reset();
    auto reply = Call(std::move(req), fd, timeout, what);
    if (side_fd >= 0) close(side_fd);
    side_fd = -1;
    attached = false;
    assembler.Reset();
    closed_why = why;
    closed_code = code;
    return reply;
  }

  absl::StatusOr<v1::SideReply> CallNoFd(v1::SideRequest req, const char* what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    TSD_ASSIGN_OR_RETURN(auto reply, Call(std::move(req), -1, request_timeout, what));
    if (reply.second >= 0) close(reply.second);
    return std::move(reply.first);
  }

  // Frees a region of the session's job in the daemon.
  absl::Status FreeRegion(uint64_t region_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    v1::SideRequest req;
    req.mutable_free()->set_region_id(region_id);
    return CallNoFd(std::move(req), "free").status();
  }

  // Turns a failed gRPC call into an error that says what happened to the daemon.
  absl::Status Explain(const grpc::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE) return wire::FromGrpc(s);
    Pump();
    if (last_notice && !closed_why.empty()) return Closed();
    return absl::UnavailableError(absl::StrCat("tsd at ", socket_path, " is not answering (",
                                               s.error_message(), "); ", HowToStart(socket_path)));
  }
};

Client::Client(std::string socket_path) : socket_path_(std::move(socket_path)), impl_(new Impl) {
  impl_->socket_path = socket_path_;
}

Client::~Client() {
  if (attached()) (void)Detach();
}

void Client::SetRequestTimeout(absl::Duration timeout) {
  MutexLock lock(impl_->mu);
  impl_->request_timeout = timeout;
}

std::optional<Notice> Client::LastNotice() const {
  MutexLock lock(impl_->mu);
  impl_->Pump();  // one that arrived while idle
  return impl_->last_notice;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& socket_path) {
  const std::string path = wire::ResolveSocketPath(socket_path);
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) {
    if (errno == EACCES) return NoPermission(path);
    return absl::UnavailableError(absl::StrCat("no tsd is running at ", path, " (",
                                               std::strerror(errno), "); ", HowToStart(path)));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::UnavailableError(
        absl::StrCat(path, " exists but is not a socket; ", HowToStart(path)));
  }
  TSD_RETURN_IF_ERROR(wire::CheckClientSocketDir(path, geteuid()));
  if (faccessat(AT_FDCWD, path.c_str(), R_OK | W_OK, AT_EACCESS) != 0 && errno == EACCES) {
    return NoPermission(path);
  }
  std::unique_ptr<Client> c(new Client(path));
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  c->impl_->channel =
      grpc::CreateCustomChannel("unix:" + path, grpc::InsecureChannelCredentials(), args);
  c->impl_->stub = v1::Tsd::NewStub(c->impl_->channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusRequest req;
  v1::StatusResponse resp;
  grpc::Status s = c->impl_->stub->Status(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("no tsd is answering at ", path, " (",
                                               s.error_message(), "); ", HowToStart(path)));
  }
  return c;
}

bool Client::attached() const {
  MutexLock lock(impl_->mu);
  return impl_->attached;
}
std::string Client::job() const {
  MutexLock lock(impl_->mu);
  return impl_->job;
}
uint64_t Client::quota_bytes() const {
  MutexLock lock(impl_->mu);
  return impl_->quota_bytes;
}
uint64_t Client::session_id() const {
  MutexLock lock(impl_->mu);
  return impl_->session_id;
}

absl::Status Client::Attach(const std::string& job, uint64_t quota_bytes) {
  return Attach(job, quota_bytes, JobOptions{});
}

absl::Status Client::Attach(const std::string& job, uint64_t quota_bytes,
                            const JobOptions& options) {
  if (options.keep_for < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("keep_for must not be negative");
  }
  MutexLock lock(impl_->mu);
  if (impl_->attached) {
    return absl::FailedPreconditionError(absl::StrCat("this client is already attached to job '",
                                                      impl_->job,
                                                      "'; detach first or use another Client"));
  }
  // The session is this connection: the daemon learns our uid from the kernel here.
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string side = wire::SideSocketPath(socket_path_);
  if (side.size() >= sizeof(addr.sun_path)) {
    close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat("side socket path '", side, "' is too long; use a shorter socket path"));
  }
  std::memcpy(addr.sun_path, side.c_str(), side.size() + 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to tsd's side socket ", side, ": ",
                                               std::strerror(err), "; ", HowToStart(socket_path_)));
  }
  impl_->side_fd = fd;
  impl_->closed_why.clear();
  impl_->assembler.Reset();
  v1::SideRequest req;
  auto* a = req.mutable_attach();
  a->set_job(job);
  a->set_quota_bytes(quota_bytes);
  a->set_protocol_version(wire::kProtocolVersion);
  a->set_client_version(absl::StrCat("tsclient ", TSCLIENT_VERSION));
  a->set_keep_for_ms(static_cast<uint64_t>(absl::ToInt64Milliseconds(options.keep_for)));
  a->set_resume(options.resume);
  auto reply = impl_->CallNoFd(std::move(req), "attach");
  if (!reply.ok()) {
    // A refused attach leaves no session: close the connection, keep nothing.
    if (impl_->side_fd >= 0) close(impl_->side_fd);
    impl_->side_fd = -1;
    impl_->closed_why.clear();
    impl_->assembler.Reset();
    return reply.status();
  }
  impl_->attached = true;
  impl_->session_id = reply->attach().session_id();
  impl_->job = reply->attach().job();
  impl_->quota_bytes = reply->attach().quota_bytes();
  impl_->keep_for = absl::Milliseconds(static_cast<int64_t>(reply->attach().keep_for_ms()));
  impl_->resumed = reply->attach().resumed();
  impl_->orphaned_s = reply->attach().orphaned_s();
  return absl::OkStatus();
}

absl::Status Client::Detach() {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  req.mutable_detach();
  absl::Status result = impl_->CallNoFd(std::move(req), "detach").status();
  // Whatever the daemon said, this session is over here; closing the connection also ends it in
  // the daemon if the request did not arrive.
  impl_->CloseSide("");
  impl_->session_id = 0;
  return result;
}

absl::StatusOr<std::shared_ptr<Region>> Client::FetchAndMap(uint64_t region_id) {
  std::shared_ptr<Region> region;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest req;
    req.mutable_get_fd()->set_region_id(region_id);
    TSD_ASSIGN_OR_RETURN(auto reply,
                         impl_->Call(std::move(req), -1, impl_->request_timeout, "get_fd"));
    const auto& info = reply.first.fd().region();
    if (reply.second < 0) return absl::InternalError("tsd's reply carried no descriptor");
    region.reset(new Region(
        RegionDesc{info.region_id(), info.name(), info.size_bytes(), info.locked()}, reply.second));
  }
  void* p = mmap(nullptr, region->size(), PROT_READ | PROT_WRITE, MAP_SHARED, region->fd(), 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping region '", region->name(), "' (",
                                                     region->size(),
                                                     " bytes) failed: ", std::strerror(errno)));
  }
  region->data_ = p;
  if (cuda_host::CudaHostAvailable()) {
    if (absl::Status s = cuda_host::Register(p, region->size()); !s.ok()) return s;
    region->cuda_registered_ = true;
  }
  return region;
}

absl::StatusOr<std::shared_ptr<Region>> Client::Alloc(const std::string& name, uint64_t bytes) {
  uint64_t region_id = 0;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest req;
    req.mutable_alloc()->set_name(name);
    req.mutable_alloc()->set_size_bytes(bytes);
    TSD_ASSIGN_OR_RETURN(v1::SideReply reply, impl_->CallNoFd(std::move(req), "alloc"));
    region_id = reply.alloc().region().region_id();
  }
  auto region = FetchAndMap(region_id);
  if (!region.ok()) {
    // Do not leave a region behind that this caller never got.
    MutexLock lock(impl_->mu);
    if (impl_->attached) (void)impl_->FreeRegion(region_id);
  }
  return region;
}

absl::StatusOr<std::vector<RegionDesc>> Client::ListRegions() {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  req.mutable_list_regions();
  TSD_ASSIGN_OR_RETURN(v1::SideReply reply, impl_->CallNoFd(std::move(req), "list_regions"));
  std::vector<RegionDesc> out;
  for (const auto& r : reply.list_regions().regions())
    out.push_back({r.region_id(), r.name(), r.size_bytes(), r.locked()});
  return out;
}

absl::StatusOr<std::shared_ptr<Region>> Client::Map(const std::string& name) {
  auto regions = ListRegions();
  if (!regions.ok()) return regions.status();
  for (const auto& r : *regions) {
    if (r.name == name) return FetchAndMap(r.id);
  }
  return absl::NotFoundError(absl::StrCat("job '", job(), "' has no region named '", name,
                                          "' (it has ", regions->size(), " regions)"));
}

absl::Status Client::Free(const std::shared_ptr<Region>& region) {
  if (region == nullptr) return absl::InvalidArgumentError("Free() of a null region");
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  TSD_RETURN_IF_ERROR(impl_->FreeRegion(region->id()));
  region->Unmap();
  return absl::OkStatus();
}

absl::StatusOr<PoolStatus> Client::Status() {
  v1::StatusRequest req;
  v1::StatusResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->Status(&ctx, req, &r);
  if (!s.ok()) {
    MutexLock lock(impl_->mu);
    return impl_->Explain(s);
  }
  return PoolStatus{
      r.version(), r.uptime_s(), r.pool_bytes(),          r.used_bytes(), r.locked(),
      r.jobs(),    r.sessions(), r.max_job_quota_bytes(), r.pid(),        r.protocol_version()};
}

static void DescribeActivity(const v1::JobActivity& a, JobStatus& o) {
  o.has_optimizer = true;
  JobStatus::Activity& t = o.activity;
  t.steps = a.steps();
  t.params = a.params();
  t.params_updated = a.params_updated();
  t.bucket_updates = a.bucket_updates();
  t.steps_per_s = a.steps_per_s();
  t.params_per_s = a.params_per_s();
  t.bucket_update_p50_s = a.bucket_update_p50_s();
  t.bucket_update_p99_s = a.bucket_update_p99_s();
  t.moment_dtype = v1::DType_Name(a.moment_dtype());
  t.client_reports = a.client_reports();
  t.client_step_wait_s = a.client_step_wait_s();
  t.client_h2d_bytes = a.client_h2d_bytes();
  t.client_d2h_bytes = a.client_d2h_bytes();
}

absl::StatusOr<std::vector<JobStatus>> Client::Jobs() {
  v1::ListJobsRequest req;
  v1::ListJobsResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->ListJobs(&ctx, req, &r);
  if (!s.ok()) {
    MutexLock lock(impl_->mu);
    return impl_->Explain(s);
  }
  std::vector<JobStatus> out;
  for (const auto& j : r.jobs()) {
    JobStatus& o = out.emplace_back();
    o.name = j.name();
    o.uid = j.uid();
    o.sessions = j.sessions();
    o.used_bytes = j.used_bytes();
    o.quota_bytes = j.quota_bytes();
    o.regions = j.regions();
    o.numa_node = j.has_numa_node() ? j.numa_node() : -1;
    if (j.has_activity()) DescribeActivity(j.activity(), o);
  }
  return out;
}

// The registration request for `spec`: what RegisterOptimizer sends and PlanOptimizer dry-runs.
static v1::RegisterOptimizerRequest RegistrationRequest(const OptimizerSpec& spec) {
  v1::RegisterOptimizerRequest req;
  for (const auto& g : spec.groups) {
    auto* p = req.add_groups();
    p->set_lr(g.lr);
    p->set_beta1(g.beta1);
    p->set_beta2(g.beta2);
    p->set_eps(g.eps);
    p->set_weight_decay(g.weight_decay);
    p->set_amsgrad(spec.amsgrad);
    p->set_maximize(spec.maximize);
  }
  for (const auto& b : spec.buckets) {
    auto* p = req.add_buckets();
    p->set_group(b.group);
    p->set_numel(b.numel);
    p->set_grad_dtype(static_cast<v1::DType>(b.grad_dtype));
    p->set_param_dtype(static_cast<v1::DType>(b.param_dtype));
  }
  req.set_moment_dtype(static_cast<v1::DType>(spec.moment_dtype));
  req.set_max_grad_norm(spec.max_grad_norm);
  req.set_accumulate(spec.accumulate);
  req.set_seed(spec.seed);
  req.set_rank(spec.rank);
  req.set_world(spec.world);
  req.set_pci_bus_id(spec.pci_bus_id);
  req.set_params_in_master_ok(true);  // Register maps a parameter slot in opt/master when told to
  return req;
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::RegisterOptimizer(const OptimizerSpec& spec) {
  return Register(spec, /*resume=*/false, nullptr);
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::Register(const OptimizerSpec& spec, bool resume,
                                                            ResumeReport* report) {
  v1::RegisterOptimizerRequest req = RegistrationRequest(spec);
  req.set_resume(resume);
  v1::RegisterOptimizerResponse resp;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest side;
    *side.mutable_register_optimizer() = std::move(req);
    TSD_ASSIGN_OR_RETURN(v1::SideReply reply,
                         impl_->CallNoFd(std::move(side), "register_optimizer"));
    resp = std::move(*reply.mutable_register_optimizer());
  }
  std::unique_ptr<Optimizer> opt(new Optimizer);
  opt->client_ = this;
  opt->groups_ = spec.groups.size();
  opt->rank_ = spec.rank;
  opt->world_ = spec.world > 1 ? spec.world : 0;
  opt->isa_ = resp.isa();
  opt->threads_ = resp.threads();
  opt->state_bytes_ = resp.state_bytes();
  for (int b = 0; b < resp.buckets_size(); ++b) {
    Optimizer::Bucket bk;
    bk.numel = spec.buckets[static_cast<size_t>(b)].numel;
    bk.grad_dtype = spec.buckets[static_cast<size_t>(b)].grad_dtype;
    bk.param_dtype = spec.buckets[static_cast<size_t>(b)].param_dtype;
    bk.master_offset = resp.buckets(b).master_offset();
    bk.grad_offset = resp.buckets(b).grad_offset();
    bk.param_offset = resp.buckets(b).param_offset();
    opt->buckets_.push_back(bk);
  }
  const std::pair<const char*, std::shared_ptr<Region>*> maps[] = {{"opt/control", &opt->control_},
                                                                   {"opt/master", &opt->master_},
                                                                   {"opt/grads", &opt->grads_},
                                                                   {"opt/params", &opt->params_}};
  for (const auto& [name, slot] : maps) {
    if (slot == &opt->params_ && resp.params_in_master()) {
      opt->params_ = opt->master_;  // fp32 parameters: their slots are the masters
      continue;
    }
    auto r = Map(name);
    if (!r.ok()) return r.status();
    *slot = *r;
  }
  if (opt->world_ > 1) {
    const auto groups = static_cast<uint32_t>(opt->groups_);
    const auto buckets = static_cast<uint32_t>(opt->buckets_.size());
    if (opt->control_->size() < wire::ControlPageBytes(groups, buckets, opt->world_)) {
      return absl::InternalError(absl::StrCat("tsd's control page (", opt->control_->size(),
                                              " bytes) has no counter for each of ", opt->world_,
                                              " ranks (tsd is older than this client?)"));
    }
    // A rank continues its counter where the page has it (0 for a new job).
    opt->ContinueCommits(wire::ControlView::Of(opt->control_->data(), groups, buckets)
                             .ranks[opt->rank_]
                             .commit.load(std::memory_order_acquire));
  }
  if (resume) {
    if (static_cast<size_t>(resp.resume().bucket_steps_size()) != opt->buckets_.size()) {
      return absl::InternalError("tsd's resume report does not cover every bucket");
    }
    opt->ContinueCommits(resp.resume().committed());
    if (report != nullptr) {
      const v1::ResumeReport& r = resp.resume();
      report->bucket_steps.assign(r.bucket_steps().begin(), r.bucket_steps().end());
      report->committed = r.committed();
      report->rolled_back.assign(r.rolled_back().begin(), r.rolled_back().end());
      report->dropped_partial.assign(r.dropped_partial().begin(), r.dropped_partial().end());
    }
  }
  return opt;
}

absl::StatusOr<OptimizerLayout> Client::PlanOptimizer(const OptimizerSpec& spec) {
  const v1::RegisterOptimizerRequest req = RegistrationRequest(spec);
  v1::PlanOptimizerResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = impl_->stub->PlanOptimizer(&ctx, req, &r);
  if (!s.ok()) {
    MutexLock lock(impl_->mu);
    return impl_->Explain(s);
  }
  if (static_cast<size_t>(r.buckets_size()) != spec.buckets.size()) {
    return absl::InternalError(absl::StrCat("tsd planned ", r.buckets_size(), " buckets for ",
                                            spec.buckets.size(), " (version mismatch?)"));
  }
  OptimizerLayout out;
  for (const auto& b : r.buckets())
    out.buckets.push_back({b.master_offset(), b.grad_offset(), b.param_offset()});
  out.state_bytes = r.state_bytes();
  out.control_bytes = r.control_bytes();
  out.master_bytes = r.master_bytes();
  out.moment_bytes = r.moment_bytes();
  out.grad_bytes = r.grad_bytes();
  out.param_bytes = r.param_bytes();
  out.accum_bytes = r.accum_bytes();
  out.params_in_master = r.params_in_master();
  return out;
}

absl::StatusOr<uint64_t> Client::StateRequest(bool save, int fd) {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  if (save) {
    req.mutable_save_state();
  } else {
    req.mutable_load_state();
  }
  TSD_ASSIGN_OR_RETURN(auto reply, impl_->Call(std::move(req), fd,
                                               std::max(impl_->request_timeout, kMinStateTimeout),
                                               save ? "save_state" : "load_state"));
  if (reply.second >= 0) close(reply.second);
  return reply.first.state().bytes();
}

absl::StatusOr<std::unique_ptr<Optimizer>> Client::ResumeOptimizer(const OptimizerSpec& spec,
                                                                   ResumeReport* report) {
  return Register(spec, /*resume=*/true, report);
}

absl::Duration Client::keep_for() const {
  MutexLock lock(impl_->mu);
  return impl_->keep_for;
}
bool Client::resumed() const {
  MutexLock lock(impl_->mu);
  return impl_->resumed;
}
double Client::orphaned_s() const {
  MutexLock lock(impl_->mu);
  return impl_->orphaned_s;
}

absl::StatusOr<uint64_t> Client::Checkpoint(const std::string& job, int fd) {
  MutexLock lock(impl_->mu);
  v1::SideRequest req;
  req.mutable_checkpoint()->set_job(job);
  auto reply = impl_->CallAlone(std::move(req), fd,
                                std::max(impl_->request_timeout, kMinStateTimeout), "Checkpoint()");
  if (!reply.ok()) return reply.status();
  if (reply->second >= 0) close(reply->second);
  return reply->first.state().bytes();
}

bool Client::DaemonAlive(std::string* why) {
  MutexLock lock(impl_->mu);
  impl_->Pump();
  if (impl_->side_fd < 0) {
    *why = impl_->closed_why.empty() ? "this client is not attached to tsd" : impl_->closed_why;
    return false;
  }
  return true;
}

}  // namespace tsd

// --- Weight stores ---------------------------------------------------------------------------
namespace tsd {
namespace {

StoreStatus FromInfo(const v1::StoreInfo& i) {
  StoreStatus s{i.store_id(), i.source(), i.format(), i.block_size(), i.size_bytes(),
                i.users(),    i.idle_s(), i.digest(), i.tensors(),    i.locked()};
  for (const v1::DeviceCopyInfo& d : i.device_copies()) {
    s.device_copies.push_back({d.gpu_uuid(), d.size_bytes(), d.users(), d.idle_s()});
  }
  return s;
}

}  // namespace

StoreView::~StoreView() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), status_.bytes);
  if (fd_ >= 0) close(fd_);
}

const StoreTensorView* StoreView::Find(const std::string& name) const {
  for (const StoreTensorView& t : tensors_) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<StoreView>> Client::OpenStore(const std::vector<std::string>& files,
                                                             const StoreSpec& spec) {
  std::vector<int> fds;
  struct Closer {
    std::vector<int>& fds;
    ~Closer() {
      for (int fd : fds) close(fd);
    }
  } closer{fds};
  for (const std::string& path : files) {
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::NotFoundError(
          absl::StrCat("cannot open checkpoint file ", path, ": ", std::strerror(errno)));
    }
    fds.push_back(fd);
  }
  return OpenStoreFds(fds, spec);
}

absl::StatusOr<std::shared_ptr<StoreView>> Client::OpenStoreFds(const std::vector<int>& fds,
                                                                const StoreSpec& spec) {
  std::shared_ptr<StoreView> view(new StoreView());
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    // The files, one request each (a side message carries one descriptor), then the open: all
    // under the client's lock, so no other request of this session comes between them.
    for (int fd : fds) {
      v1::SideRequest req;
      req.mutable_store_file();
      TSD_ASSIGN_OR_RETURN(auto reply,
                           impl_->Call(std::move(req), fd, impl_->request_timeout, "store_file"));
      if (reply.second >= 0) close(reply.second);
    }
    v1::SideRequest req;
    auto* open = req.mutable_open_store();
    open->set_format(spec.format);
    open->set_block_size(spec.block_size);
    for (const StoreSpec::Tensor& t : spec.tensors) {
      auto* w = open->add_tensors();
      w->set_name(t.name);
      w->set_quantize(t.quantize);
    }
    // Building a large store takes a while: wait as long as for optimizer state.
    TSD_ASSIGN_OR_RETURN(
        auto reply, impl_->Call(std::move(req), -1,
                                std::max(impl_->request_timeout, kMinStateTimeout), "open_store"));
    view->fd_ = reply.second;
    if (view->fd_ < 0) return absl::InternalError("tsd's open_store reply carried no descriptor");
    const v1::SideOpenStoreReply& r = reply.first.open_store();
    view->status_ = FromInfo(r.store());
    view->built_ = r.built();
    for (const v1::StoreTensor& t : r.tensors()) {
      view->tensors_.push_back(StoreTensorView{
          t.name(), t.dtype(), std::vector<uint64_t>(t.shape().begin(), t.shape().end()),
          t.quantized(), t.offset(), t.bytes(), t.absmax_offset(), t.absmax_count()});
    }
  }
  // The daemon is not trusted either: the table must lie inside the store.
  const uint64_t size = view->status_.bytes;
  for (const StoreTensorView& t : view->tensors_) {
    const bool inside = t.offset <= size && t.bytes <= size - t.offset &&
                        (!t.quantized || (t.absmax_offset <= size &&
                                          t.absmax_count <= (size - t.absmax_offset) / 4));
    if (!inside) {
      return absl::InternalError(absl::StrCat("tsd's table puts tensor '", t.name,
                                              "' outside the store's ", size, " bytes"));
    }
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, view->fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mapping store ", view->id(), " (", size,
                                                     " bytes) failed: ", std::strerror(errno)));
  }
  view->data_ = static_cast<const uint8_t*>(p);
  return view;
}

absl::Status Client::CloseStore(uint64_t store_id) {
  MutexLock lock(impl_->mu);
  if (!impl_->attached) return impl_->NotAttached();
  v1::SideRequest req;
  req.mutable_close_store()->set_store_id(store_id);
  return impl_->CallNoFd(std::move(req), "close_store").status();
}

absl::StatusOr<std::shared_ptr<DeviceStoreView>> Client::OpenDeviceStore(
    uint64_t store_id, const std::string& gpu_uuid) {
  // This process must be able to map it before tsd is asked to make it.
  TSD_RETURN_IF_ERROR(GpuOrdinal(gpu_uuid).status());
  std::pair<v1::SideReply, int> reply;
  {
    MutexLock lock(impl_->mu);
    if (!impl_->attached) return impl_->NotAttached();
    v1::SideRequest req;
    req.mutable_open_device_store()->set_store_id(store_id);
    req.mutable_open_device_store()->set_gpu_uuid(gpu_uuid);
    // The first job on a GPU waits while tsd copies the store there.
    TSD_ASSIGN_OR_RETURN(
        reply, impl_->Call(std::move(req), -1, std::max(impl_->request_timeout, kMinStateTimeout),
                           "open_device_store"));
  }
  struct Closer {
    int fd;
    ~Closer() {
      if (fd >= 0) close(fd);
    }
  } closer{reply.second};
  if (closer.fd < 0)
    return absl::InternalError("tsd's open_device_store reply carried no descriptor");
  const v1::SideOpenDeviceStoreReply& r = reply.first.open_device_store();
  return DeviceStoreView::Map(store_id, r.gpu_uuid(), closer.fd, r.size_bytes(), r.data_bytes());
}

absl::StatusOr<StoreListing> Client::ListStores() {
  // On the side socket, where tsd learns this process's uid: the gRPC ListStores cannot tell who
  // calls and gives the node's totals only.
  std::pair<v1::SideReply, int> reply;
  {
    MutexLock lock(impl_->mu);
    v1::SideRequest req;
    req.mutable_list_stores();
    if (impl_->attached) {
      TSD_ASSIGN_OR_RETURN(reply,
                           impl_->Call(std::move(req), -1, impl_->request_timeout, "list_stores"));
    } else {
      TSD_ASSIGN_OR_RETURN(
          reply, impl_->CallAlone(std::move(req), -1, impl_->request_timeout, "list_stores"));
    }
  }
  if (reply.second >= 0) close(reply.second);
  const v1::ListStoresResponse& r = reply.first.list_stores();
  StoreListing out;
  for (const v1::StoreInfo& i : r.stores()) out.stores.push_back(FromInfo(i));
  out.node_stores = r.store_count();
  out.node_bytes = r.used_bytes();
  out.budget_bytes = r.budget_bytes();
  out.omitted = r.omitted();
  return out;
}

absl::StatusOr<std::vector<StoreStatus>> Client::Stores() {
  TSD_ASSIGN_OR_RETURN(StoreListing listing, ListStores());
  return std::move(listing.stores);
}

}  // namespace tsd
