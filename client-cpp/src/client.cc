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
#include "client_impl.h"
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
namespace client_detail {

std::string HowToStart(const std::string& path) {
  return absl::StrCat(
      "start it with `tsd --socket ", path,
      "` (or `systemctl start tsd` for the system service), or point TSD_SOCKET at the "
      "socket of a running tsd");
}

}  // namespace client_detail

namespace {

using client_detail::HowToStart;

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

void Region::Unpin() {
  if (data_ != nullptr && cuda_registered_) {
    cuda_host::Unregister(data_);
    cuda_registered_ = false;
  }
}

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
// (Client::Impl, the side connection: client_impl.h)

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
  TSD_RETURN_IF_ERROR(impl_->Unary(&v1::Tsd::Stub::Status, req, &r));
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
  t.speculated_commits = a.speculated_commits();
  t.redone_commits = a.redone_commits();
  t.work_busy_s = a.work_busy_s();
  t.work_busy_share = a.work_busy_share();
}

absl::StatusOr<std::vector<JobStatus>> Client::Jobs() {
  v1::ListJobsRequest req;
  v1::ListJobsResponse r;
  TSD_RETURN_IF_ERROR(impl_->Unary(&v1::Tsd::Stub::ListJobs, req, &r));
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
